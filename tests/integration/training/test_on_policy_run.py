"""On-policy distillation (``on_policy:``) through ``kd run`` on the tiny assets: lmbda 0 is the
off-policy run, lmbda 1 trains on the student's samples (full and LoRA students), seq_kd on the
teacher's, an interrupted run resumes bit-identically, and the mistakes exit 2 with one line."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kd.rollouts.sampling
from kd import checkpoint, cli, models
from tests.conftest import UNTIMED, make_config, read_metrics, sigterm_at_step, write_config

# One intra-op thread (tests/conftest.py): the same float reductions in every run.
pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = ["run", "kd"]
ON_POLICY_ONLY = {
    "time_generate_s",
    "generate_tokens_per_second",
    "sampled_batches_student",
    "sampled_tokens_student",
    "sampled_batches_teacher",
    "sampled_tokens_teacher",
}


def on_policy(**kw) -> dict:
    node = {"lmbda": 0.5, "max_new_tokens": 8, "temperature": 1.0, "top_p": 0.95, "seq_kd": False}
    node.update(kw)
    return node


def run(tmp_path: Path, name: str, assets: dict, *overrides: str, **top) -> Path:
    out = tmp_path / name
    config = write_config(tmp_path / f"{name}.yaml", make_config(assets, out, **top))
    assert cli.main([*RECIPE, "--config", str(config), *overrides]) == 0
    return out


def sampling_vocabs(monkeypatch) -> list[int]:
    """The vocabulary size of each model that samples (student 288, teacher 320), in order."""
    seen: list[int] = []
    original = kd.rollouts.sampling.rollout

    def spy(model, *args, **kwargs):
        seen.append(models.vocab_size(model))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(kd.rollouts.sampling, "rollout", spy)
    return seen


def trajectory(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in UNTIMED} for r in read_metrics(out)]


def assert_bit_identical(a: Path, b: Path) -> None:
    wa = load_file(a / "final" / "model.safetensors")
    wb = load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


# ---------------------------------------------------------------------------------------------
# What each setting trains on
# ---------------------------------------------------------------------------------------------


def test_lmbda_0_is_the_off_policy_run(assets, tmp_path):
    """lmbda 0 without seq_kd never samples: the same losses step by step and the same weights,
    bit for bit, as on_policy null."""
    off = run(tmp_path, "off", assets, max_steps_per_epoch=2)
    on = run(tmp_path, "on", assets, max_steps_per_epoch=2, on_policy=on_policy(lmbda=0.0))
    rows_off, rows_on = trajectory(off), trajectory(on)
    assert all(r["sampled_batches_student"] == r["sampled_batches_teacher"] == 0 for r in rows_on)
    assert [{k: v for k, v in r.items() if k not in ON_POLICY_ONLY} for r in rows_on] == rows_off
    assert_bit_identical(off, on)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_lmbda_1_trains_on_the_students_samples(assets, tmp_path, monkeypatch, lora, caplog):
    vocabs = sampling_vocabs(monkeypatch)
    with caplog.at_level("INFO", logger="kd"):
        out = run(
            tmp_path,
            "run",
            assets,
            lora=lora,
            max_steps_per_epoch=2,
            on_policy=on_policy(lmbda=1.0),
        )
    # The run says once where a step's time goes (issue 42: minutes without a word).
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("on_policy: ")]
    assert said == [
        "on_policy: the student samples up to 8 tokens per prompt (4 prompts a micro-batch); "
        "sampling takes most of a step (metrics.jsonl: time_generate_s)"
    ]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert vocabs == [288] * 4  # the student, every micro-batch
    for r in rows:
        # Every micro-batch (2 per step) samples; the loss covers exactly the sampled tokens.
        assert r["sampled_batches_student"] == 2
        assert r["sampled_batches_teacher"] == r["sampled_tokens_teacher"] == 0
        assert r["num_tokens"] == r["sampled_tokens_student"]
        assert 0 < r["num_tokens"] <= 2 * 4 * 8  # micro-batches x rows x max_new_tokens
        assert math.isfinite(r["kd_loss"]) and r["kd_loss"] > 0
        assert math.isfinite(r["loss"]) and math.isfinite(r["ce_loss"])
        assert r["time_generate_s"] > 0 and r["generate_tokens_per_second"] > 0
        assert r["time_teacher_s"] > 0 and r["time_student_s"] > 0
    assert (out / "final" / "model.safetensors").exists()
    if lora:
        assert (out / "final" / "adapter" / "adapter_model.safetensors").exists()


def test_seq_kd_with_lmbda_0_trains_on_the_teachers_samples(assets, tmp_path, monkeypatch):
    vocabs = sampling_vocabs(monkeypatch)
    out = run(
        tmp_path,
        "run",
        assets,
        max_steps_per_epoch=2,
        on_policy=on_policy(lmbda=0.0, seq_kd=True, temperature=0.0),
    )
    assert vocabs == [320] * 4  # the teacher, every micro-batch
    for r in read_metrics(out):
        assert r["sampled_batches_teacher"] == 2
        assert r["sampled_batches_student"] == r["sampled_tokens_student"] == 0
        assert r["num_tokens"] == r["sampled_tokens_teacher"] > 0
        assert math.isfinite(r["kd_loss"])


# ---------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------


def resume_config(**top) -> dict:
    """6 steps over 2 epochs, shuffled; half the micro-batches sample (temperature 1)."""
    base = dict(
        shuffle=True,
        epochs=2,
        max_steps_per_epoch=3,
        save_every_n_steps=2,
        keep_last_n=3,
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-3, "weight_decay": 0.01},
        on_policy=on_policy(lmbda=0.5, temperature=1.0, top_p=1.0),
        metric_logger={"_component_": "kd.metrics.StdoutLogger"},
    )
    base.update(top)
    return base


def test_interrupted_run_resumes_bit_identically(assets, tmp_path, monkeypatch):
    reference = run(tmp_path, "reference", assets, **resume_config())
    rows = read_metrics(reference)
    sampled = [r["sampled_batches_student"] for r in rows]
    # lmbda 0.5 over 12 micro-batches: both kinds occur (the coins are seeded: always the same).
    assert 0 < sum(sampled) < 2 * len(rows)

    out = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", make_config(assets, out, **resume_config()))
    with monkeypatch.context() as m:
        sigterm_at_step(m, 4)  # one step into epoch 1; steps 2 and 4 saved
        assert cli.main([*RECIPE, "--config", str(config)]) == 0
    assert not (out / "final").exists()
    assert checkpoint.read_checkpoint_marker(checkpoint.find_latest_checkpoint(out))["step"] == 4
    assert cli.main([*RECIPE, "--config", str(config), "resume_from_checkpoint=true"]) == 0
    assert trajectory(out) == trajectory(reference)
    assert_bit_identical(reference, out)


# ---------------------------------------------------------------------------------------------
# Mistakes: exit 2, one line, through `kd validate` and `kd run`
# ---------------------------------------------------------------------------------------------


def _teacher_logits(cfg: dict, tmp: Path) -> str:
    cfg["on_policy"] = on_policy()
    cfg["teacher_logits"] = {"path": str(tmp / "store"), "k": 8}
    return "kd: error: on_policy: needs the online teacher"


def _no_teacher(cfg: dict, tmp: Path) -> str:
    cfg["on_policy"] = on_policy()
    cfg.update(teacher_model=None, teacher_checkpointer=None, kd_ratio=0.0)
    return "kd: error: on_policy: needs a teacher to score the completions"


def _no_room(cfg: dict, tmp: Path) -> str:
    cfg["on_policy"] = on_policy(max_new_tokens=64)  # tokenizer.max_seq_len is 64
    return "kd: error: on_policy.max_new_tokens: 64 leaves no room for a prompt"


def _train_on_input(cfg: dict, tmp: Path) -> str:
    cfg["on_policy"] = on_policy()
    cfg["dataset"]["train_on_input"] = True
    return "kd: error: dataset: row 0 has no prompt (every token is labelled)"


def _lmbda_out_of_range(cfg: dict, tmp: Path) -> str:
    cfg["on_policy"] = on_policy(lmbda=1.5)
    return "kd: error: on_policy.lmbda: 1.5 is outside [0, 1]"


MISTAKES = [_teacher_logits, _no_teacher, _no_room, _train_on_input, _lmbda_out_of_range]


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.__name__.strip("_") for m in MISTAKES])
def test_mistakes_exit_2_with_one_line(assets, tmp_path, mistake, command):
    out = tmp_path / "run"
    cfg = make_config(assets, out)
    start = mistake(cfg, tmp_path)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    argv = ["validate", "--config", str(config)]
    if command == "run":
        argv = [*RECIPE, "--config", str(config)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    text = err.getvalue()
    assert code == 2, text
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if line.startswith("kd: error:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith(start), errors
    assert ";" in errors[0]  # the fix follows
    assert not out.exists()
