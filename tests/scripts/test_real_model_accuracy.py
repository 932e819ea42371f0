"""scripts/real_model_accuracy.py: its generated task (splits, answers, extraction pattern) is what
kd's task reader accepts and what the study claims, and its doc section comes from the JSON."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from kd.harness.tasks import read_task_folder

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "real_model_accuracy.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("real_model_accuracy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_splits_are_disjoint_correct_and_deterministic(study) -> None:
    splits = study.problems(study.SIZES)
    assert {k: len(v) for k, v in splits.items()} == study.SIZES
    held_out = {r["question"] for s in ("dev", "test") for r in splits[s]}
    assert len(held_out) == study.SIZES["dev"] + study.SIZES["test"]
    assert not held_out & {r["question"] for r in splits["teacher_train"]}
    assert splits["train"] == splits["teacher_train"][: study.SIZES["train"]]
    for rows in splits.values():
        for row in rows:
            a, b = map(int, re.fullmatch(r"(\d\d)\+(\d\d)=", row["question"]).groups())
            assert row["answer"] == str(a + b)
            assert study.extract(row["worked"]) == row["answer"]
    assert study.problems(study.SIZES) == splits
    assert study.problems(study.SIZES, seed=1) != splits


@pytest.mark.parametrize(
    ("a", "b", "worked"),
    [(47, 38, "7+8=15,4+3+1=8,85"), (21, 34, "1+4=5,2+3=5,55"), (97, 38, "7+8=15,9+3+1=13,135")],
)
def test_worked_answers(study, a: int, b: int, worked: str) -> None:
    assert study.worked(a, b) == worked


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("7+8=15,4+3+1=8,85", "85"), ("85", "85"), ("7+8=15,4+3+1=8,", None), ("no", None)],
)
def test_extraction_takes_the_integer_that_ends_the_completion(
    study, completion: str, expected
) -> None:
    assert study.extract(completion) == expected


def test_task_folders_pass_kd_task_reader(study, tmp_path: Path) -> None:
    paths = study.write_data(tmp_path, study.SMOKE_SIZES)
    for split in ("dev", "test"):
        (spec,) = read_task_folder(paths[f"tasks_{split}"])
        assert spec.name == f"add2_{split}"
        rows = [json.loads(x) for x in (paths[f"tasks_{split}"] / f"add2_{split}.jsonl").open()]
        assert len(rows) == study.SMOKE_SIZES[split]
    train = [json.loads(x) for x in paths["train"].open()]
    assert set(train[0]) == {"input", "output"}  # kd init's input/output (instruct) format


def _results(ce: float, kd: float, teacher: float) -> dict:
    score = lambda v: {"value": v, "stderr": 0.01}  # noqa: E731
    run = lambda name, mode, v: {  # noqa: E731
        "round": 1,
        "setting": {
            "name": name,
            "mode": mode,
            "lr": 3e-4,
            "epochs": 3,
            "kd_ratio": 0.5 if mode != "ce" else 0.0,
            "temperature": 1.0,
            "divergence": "forward_kl",
        },
        "steps": 57,
        "wall_s": 1.0,
        "dev": score(v),
    }
    return {
        "date": "2026-11-27",
        "command": "python scripts/real_model_accuracy.py",
        "task": {
            "skill": "two-digit addition",
            "example": {"question": "47+38=", "answer": "85", "worked": "7+8=15,4+3+1=8,85"},
            "prompt": "<|im_start|>{question}",
            "extract": r"(-?[0-9]+)$",
            "sizes": {"teacher_train": 10, "train": 5, "dev": 2, "test": 2},
            "seed": 0,
        },
        "student_layers": list(range(20)),
        "batch_size": 16,
        "teacher": {
            "setting": {"name": "teacher", "lr": 2e-4, "epochs": 1},
            "steps": 9,
            "dev": score(teacher),
        },
        "untrained_student": {"dev": score(0.0)},
        "runs": [run("ce a", "ce", ce), run("kd a", "kd", kd)],
        "best": {"ce": "ce a", "kd": "kd a"},
        "test": {
            "teacher": score(teacher),
            "untrained student": score(0.0),
            "ce a": score(ce),
            "kd a": score(kd),
        },
    }


@pytest.mark.parametrize(("kd", "closed", "verdict"), [(0.7, 60, "Goal reached"), (0.5, 20, "not")])
def test_doc_section_from_results(study, tmp_path: Path, kd: float, closed: int, verdict) -> None:
    results = _results(ce=0.4, kd=kd, teacher=0.9)
    assert study.gap_closed(results)["kd"] == pytest.approx((kd - 0.4) / 0.5)
    doc = tmp_path / "real_model.md"
    doc.write_text("# kept\n\nearlier text\n")
    study.write_doc(results, doc)
    study.write_doc(results, doc)  # the section is replaced, not appended twice
    text = doc.read_text()
    assert text.startswith("# kept\n\nearlier text\n")
    assert text.count(study.DOC_BEGIN) == 1 == text.count(study.DOC_END)
    assert f"**{closed}%**" in text and verdict in text
    assert f"| 57 | {100 * kd:.1f}% ± 1.0 |" in text
    # the rounds side by side: labelled rows, teacher, CE, the best KD mode, the share closed
    assert (
        f"| 1 | 5 | 90.0% ± 1.0 | 40.0% ± 1.0 | off-policy KD: {100 * kd:.1f}% ± 1.0 | {closed}% |"
        in text
    )


def test_students_drop_a_late_block_and_keep_the_last_layers(study) -> None:
    for name, drop in (("block", "19-28"), ("block6", "22-27"), ("block8", "20-27")):
        layers = list(study.STUDENTS[name])
        assert layers == sorted(set(layers)) and layers[-1] == study.N_LAYERS - 1
        assert study.dropped(layers) == drop


def test_curve_run_validates_on_dev_and_keeps_each_epoch(study, tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    paths = study.write_data(tmp_path, study.SMOKE_SIZES)  # 8 train rows: 2 steps of 4 an epoch
    base = tmp_path / "base.yaml"
    base.write_text(
        "output_dir: x\nteacher_model: {a: 1}\nteacher_checkpointer: {b: 2}\n"
        "dataset: {_component_: torchtune.datasets.instruct_dataset, source: json, "
        "data_files: t.jsonl, split: train}\n"
    )
    setting = study.Setting("probe", "ce", 3e-4, 3, student="block6", curve=True)
    out = tmp_path / "runs" / "probe"
    cfg = OmegaConf.load(
        study.run_config(base, setting, out, paths["train"], 4, None, paths["dev_rows"])
    )
    assert cfg.validation.every_n_steps == cfg.save_every_n_steps == 2
    assert cfg.keep_last_n == 3 and cfg.epochs == 3
    assert cfg.validation.dataset.data_files == str(paths["dev_rows"])
    assert cfg.dataset.data_files == str(paths["train"])
    assert cfg.teacher_model is None  # CE only: no teacher loaded
    dev = [json.loads(x) for x in paths["dev_rows"].open()]
    assert len(dev) == study.SMOKE_SIZES["dev"] and set(dev[0]) == {"input", "output"}
    plain = study.Setting("plain", "ce", 3e-4, 3)
    cfg = OmegaConf.load(study.run_config(base, plain, out, paths["train"], 4, None))
    assert "validation" not in cfg
    # A long curve run (36 epochs) saves and validates every 6 epochs (disk: ~1.3 GB a
    # checkpoint), on its own labelled rows (the first 4 of the teacher's).
    long = study.Setting("long", "ce", 3e-4, 36, student="block6", curve=True, rows=4)
    rows = study.train_rows(paths, long)
    assert rows.read_text().splitlines() == paths["teacher_train"].read_text().splitlines()[:4]
    cfg = OmegaConf.load(study.run_config(base, long, out, rows, 4, None, paths["dev_rows"]))
    assert cfg.validation.every_n_steps == cfg.save_every_n_steps == 6  # 1 step an epoch
    assert cfg.keep_last_n == 6
    assert cfg.dataset.data_files == str(rows)


def test_results_file_keeps_round_one_and_the_doc_puts_the_newest_round_first(
    study, tmp_path: Path
) -> None:
    round1 = _results(ce=0.015, kd=0.028, teacher=0.99)  # round 1's file: one round, top level
    round2 = {**_results(ce=0.4, kd=0.8, teacher=0.9), "round": 2, "why": "less damage"}
    round2["runs"][0]["setting"]["student"] = "block6"
    round2["untrained_student"] = {}  # round 2 does not score the untrained student
    del round2["test"]["untrained student"]
    merged = study.merge_round(round1, round2)
    assert [r["round"] for r in merged["rounds"]] == [1, 2]
    assert merged["rounds"][0]["test"] == round1["test"]
    again = study.merge_round(merged, {**round2, "why": "rerun"})
    assert [r["why"] for r in again["rounds"][1:]] == ["rerun"]  # replaced, not appended
    text = study.doc_section(merged)
    assert text.index("### Round 2") < text.index("### Round 1")
    assert "**Result**: **Goal reached in round 2**: off-policy KD closes 80%" in text
    assert "**Goal not reached in round 1**" in text
    assert "| ce a | drop 22-27 | ce |" in text
    round2_text = text[text.index("### Round 2") : text.index("### Round 1")]
    assert "dev not scored before training" in round2_text
    assert "| untrained student |" not in round2_text
    in_progress = study.merge_round(round1, {**round2, "test": {}})
    assert "**Result**: **Round 2 in progress**" in study.doc_section(in_progress)


def test_finished_only_lists_an_unfinished_run_with_its_last_step(study, tmp_path: Path) -> None:
    setting = study.Setting("r2 block6: kd 6ep", "kd", 3e-4, 6, 0.5, 2.0, student="block6")
    out = tmp_path / "runs" / study.slug(setting.name)
    assert not study.finished(tmp_path, setting) and study.last_step(tmp_path, setting) == 0
    out.mkdir(parents=True)
    rows = [{"step": 1, "loss": 3.0}, {"step": 19, "val_ce_loss": 0.3}, {"step": 40, "loss": 1.0}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert study.last_step(tmp_path, setting) == 40
    (out / "final").mkdir()
    assert not study.finished(tmp_path, setting)  # no wall time yet: train() would rerun it
    (out / "study_time.json").write_text('{"wall_s": 1.0, "resumed": false}')
    assert study.finished(tmp_path, setting)
    rnd = {**_results(ce=0.4, kd=0.5, teacher=0.9), "round": 2}
    rnd["task"] = {**rnd["task"], "sizes": study.SIZES}
    rnd["unfinished"] = [{"round": 2, "setting": asdict(setting), "steps": 40}]
    text = "\n".join(study.round_section(rnd))
    assert "| r2 block6: kd 6ep | drop 22-27 | kd | 0.5 | 2.0 | forward_kl | 0.0003 | 6 | " in text
    assert "| 40 of 108 | not finished | - |" in text  # 300 rows at 16: 18 steps an epoch


@pytest.mark.parametrize(("last", "state"), [(0.72, "still rising: not plateaued"), (0.53, "flat")])
def test_round_section_compares_same_length_and_says_whether_ce_plateaued(
    study, last: float, state: str
) -> None:
    rnd = {**_results(ce=0.4, kd=0.8, teacher=0.9), "round": 2}
    ce_run = rnd["runs"][0]
    ce_run["dev"] = {"value": last, "stderr": 0.03}
    ce_run["curve"] = [{"step": 38, "dev": {"value": 0.17, "stderr": 0.03}}]
    ce_run["curve"].append({"step": 76, "dev": {"value": 0.515, "stderr": 0.035}})
    ce_run["val"] = [{"step": 19, "val_ce_loss": 0.349}, {"step": 38, "val_ce_loss": 0.186}]
    text = "\n".join(study.round_section(rnd))
    assert f"step 76: 51.5% ± 3.5; step 57: {100 * last:.1f}% ± 3.0" in text
    assert "validation CE by step: 19: 0.349, 38: 0.186" in text
    assert state in text
    share = round(100 * (0.8 - last) / (0.9 - last))
    assert f"kd a: 80.0% ± 1.0 against CE's {100 * last:.1f}% ± 3.0, **{share}%**" in text


def test_unlabelled_prompts_are_reported_beside_the_goal_never_as_it(study, tmp_path) -> None:
    """A run with unlabelled prompts (``+prompts``) is its own mode: best of its kind on dev, its
    share of the gap said beside the verdict, never the goal's result or the rounds table's."""
    results = {**_results(ce=0.4, kd=0.5, teacher=0.9), "round": 6}
    extra = {**results["runs"][1], "dev": {"value": 0.85, "stderr": 0.01}}
    extra["setting"] = {**extra["setting"], "name": "seq p", "mode": "seq_kd", "prompts": 7}
    results["runs"].append(extra)
    results["best"] = study.best_per_mode(
        [{**r, "setting": {**r["setting"], "student": "block"}} for r in results["runs"]], "block"
    )
    assert results["best"]["seq_kd+prompts"]["setting"]["name"] == "seq p"
    results["best"] = {mode: run["setting"]["name"] for mode, run in results["best"].items()}
    results["test"]["seq p"] = {"value": 0.85, "stderr": 0.01}
    line = study.verdict(results)
    assert line.startswith("**Goal not reached") and "off-policy KD, closes 20%" in line
    assert "Beyond the issue's protocol, with the teacher also answering unlabelled" in line
    assert line.endswith("the gap closed is: sequence-level KD 90%.")
    table = "\n".join(study.rounds_table([results]))
    assert "off-policy KD: 50.0% ± 1.0 | 20% |" in table and "unlabelled" not in table
    assert "| seq p | drop 19-28 | seq_kd+prompts |" in "\n".join(study.round_section(results))


def test_unlabelled_prompts_keep_no_label(study, tmp_path) -> None:
    """``rows`` labelled rows as they are, then ``prompts`` questions whose answer is the
    placeholder: the labels of those rows never reach the student's file."""
    teacher = tmp_path / "data" / "teacher_train.jsonl"
    teacher.parent.mkdir()
    rows = [{"input": f"{i}+1=", "output": f"worked {i}"} for i in range(6)]
    teacher.write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = {"train": tmp_path / "data" / "train.jsonl", "teacher_train": teacher}
    setting = study.Setting("s", "seq_kd", 3e-4, 1, rows=2, prompts=3)
    assert setting.kind == "seq_kd+prompts"
    out = [json.loads(x) for x in study.train_rows(paths, setting).read_text().splitlines()]
    assert out[:2] == rows[:2]
    assert out[2:] == [{"input": r["input"], "output": study.PLACEHOLDER} for r in rows[2:5]]
    with pytest.raises(ValueError, match="7 rows > the teacher's 6"):
        study.train_rows(paths, study.Setting("t", "gkd", 1e-4, 1, rows=2, prompts=5))


def test_a_run_starts_from_another_runs_final_or_step_checkpoint(study, tmp_path: Path) -> None:
    """``start`` reads the named run's ``final/``, ``start_step`` its step checkpoint; a run
    that has not written it is refused before any training."""
    from omegaconf import OmegaConf

    paths = study.write_data(tmp_path, study.SMOKE_SIZES)
    base = tmp_path / "base.yaml"
    base.write_text(
        "output_dir: x\ncheckpointer: {checkpoint_dir: s}\n"
        "teacher_model: {a: 1}\nteacher_checkpointer: {b: 2}\n"
        "dataset: {_component_: torchtune.datasets.instruct_dataset, source: json, "
        "data_files: t.jsonl, split: train}\n"
    )
    ce = tmp_path / "runs" / "ce_a"
    for folder in ("final", "step_000084"):
        (ce / folder).mkdir(parents=True)
        (ce / folder / "model.safetensors").write_bytes(b"")
    out = tmp_path / "runs" / "g"
    for step, folder in ((None, "final"), (84, "step_000084")):
        setting = study.Setting("g", "gkd", 1e-4, 1, 1.0, start="ce a", start_step=step)
        cfg = OmegaConf.load(study.run_config(base, setting, out, paths["train"], 4, None))
        assert cfg.checkpointer.checkpoint_dir == str(ce / folder)
    late = study.Setting("g", "gkd", 1e-4, 1, 1.0, start="ce a", start_step=42)
    with pytest.raises(ValueError, match="step_000042, which is not finished"):
        study.run_config(base, late, out, paths["train"], 4, None)


@pytest.mark.parametrize(
    ("kd", "noise"), [(0.66, "by 0.3 standard errors"), (0.75, None)], ids=["hair", "clear"]
)
def test_a_goal_reached_within_the_noise_says_so(study, kd: float, noise: str | None) -> None:
    """Reached by less than two standard errors of the pick's test score above the 50% line (CE
    only 31.5%, teacher 99.0%: the line is 65.25%), the verdict says by how much; clearly above
    it, it says nothing more."""
    results = {**_results(ce=0.315, kd=kd, teacher=0.99), "round": 11}
    results["test"]["kd a"]["stderr"] = 0.024
    line = study.verdict(results)
    assert line.startswith("**Goal reached in round")
    if noise is None:
        assert "standard errors" not in line
    else:
        assert noise in line and "against the line's 65.25%): within the noise of 2 test" in line
