"""`kd eval`: lm-evaluation-harness scores model folders side by side.

The numbers are checked against an independent computation with transformers (each choice's
log-likelihood; the model's own greedy completions), a LoRA adapter-only folder scores as its
merged folder, and the user's task files are refused, in one line naming the key and the file,
whenever they would run code, read outside their folder or hold bad data: before any model loads.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from kd.cli import main
from kd.testing import (
    TOKENIZER_VOCAB_SIZE,
    TinyModel,
    write_hf_tokenizer,
    write_jsonl,
    write_tiny_model,
)

pytest.importorskip("lm_eval")

SHAPE = TinyModel(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=32,
    intermediate_dim=64,
    max_seq_len=256,
)
MC_PROMPT = "Question: {question}\nAnswer:"


def _with_tokenizer(folder: Path, tokenizer: Path) -> Path:
    for item in tokenizer.iterdir():
        shutil.copyfile(item, folder / item.name)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two tiny Qwen2 folders with the tokenizer, and a LoRA adapter on the first: ``adapter``
    (adapter files + tokenizer) and ``merged`` (its merged weights)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("eval_models")
    tokenizer = write_hf_tokenizer(root / "tokenizer")
    out = {}
    for name, seed in (("student", 7), ("teacher", 8)):
        folder = write_tiny_model(
            root / name, SHAPE, seed=seed, writer="transformers", perturb=0.05
        )
        out[name] = _with_tokenizer(folder, tokenizer)
    base = AutoModelForCausalLM.from_pretrained(out["student"], local_files_only=True)
    torch.manual_seed(3)
    config = LoraConfig(
        r=4,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(root / "adapter")
    out["adapter"] = _with_tokenizer(root / "adapter", tokenizer)
    peft_model.merge_and_unload().save_pretrained(root / "merged")
    out["merged"] = _with_tokenizer(root / "merged", tokenizer)
    return out


def mc_rows(n: int = 12) -> list[dict]:
    return [
        {"question": f"{a}+{a}=", "choices": [str(2 * a), str(2 * a + 1), "x"], "answer": a % 3}
        for a in range(n)
    ]


def write_mc_task(folder: Path, **extra: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "mc.jsonl", mc_rows())
    lines = [
        "task: arith_mc",
        "type: multiple_choice",
        "data: mc.jsonl",
        f"prompt: {json.dumps(MC_PROMPT)}",
    ]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    (folder / "mc.yaml").write_text("\n".join(lines) + "\n")
    return folder


def choice_accuracy(folder: Path, rows: list[dict]) -> float:
    """The share of rows whose right choice has the highest log-likelihood, by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    right = 0
    for row in rows:
        context = MC_PROMPT.format(question=row["question"])
        scores = []
        for choice in row["choices"]:
            whole = tokenizer(context + " " + choice, add_special_tokens=False)["input_ids"]
            n_context = len(tokenizer(context, add_special_tokens=False)["input_ids"])
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
            scores.append(sum(logits[i - 1, whole[i]].item() for i in range(n_context, len(whole))))
        right += int(max(range(len(scores)), key=scores.__getitem__) == row["answer"])
    return right / len(rows)


def greedy(folder: Path, prompt: str, max_new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def run_eval(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_side_by_side_matches_transformers(models, tmp_path, capsys):
    tasks = write_mc_task(tmp_path / "tasks")
    # A generation task whose references are the student's own greedy answers on even rows.
    words = {p: greedy(models["student"], p, 6).split() for p in (f"{a}*{a}=" for a in range(20))}
    prompts = [p for p, w in words.items() if w][:6]  # answers with a word to extract
    assert len(prompts) == 6
    first_word = [words[p][0] for p in prompts]
    refs = [w if i % 2 == 0 else "no-such-answer" for i, w in enumerate(first_word)]
    write_jsonl(
        tasks / "gen.jsonl",
        [{"question": p, "answer": r} for p, r in zip(prompts, refs, strict=True)],
    )
    (tasks / "gen.yaml").write_text(
        'task: own_words\ntype: generate\ndata: gen.jsonl\nextract: "(\\\\S+)"\nmax_new_tokens: 6\n'
        'until: ["\\n\\n"]\n'
    )
    output = tmp_path / "out" / "eval.json"
    code, out, err = run_eval(
        capsys,
        "--model", f"student={models['student']}",
        "--model", f"teacher={models['teacher']}",
        "--tasks", str(tasks),
        "--output", str(output),
    )  # fmt: skip
    assert code == 0, err
    payload = json.loads(output.read_text())
    assert [m["name"] for m in payload["models"]] == ["student", "teacher"]
    acc = payload["results"]["arith_mc"]["acc"]
    n = len(mc_rows())
    for name in ("student", "teacher"):
        want = choice_accuracy(models[name], mc_rows())
        assert acc[name]["value"] == pytest.approx(want)
        # the standard error of a mean of 0/1 scores (sample standard deviation / sqrt(n))
        assert acc[name]["stderr"] == pytest.approx(math.sqrt(want * (1 - want) / (n - 1)))
    assert acc["student"]["value"] != acc["teacher"]["value"]  # the columns are not one model
    exact = payload["results"]["own_words"]["exact_match"]["student"]["value"]
    assert exact == pytest.approx(0.5)
    header, *rows = out.splitlines()[:4]
    assert header.split() == ["task", "metric", "student", "teacher"]
    assert any(r.split()[:2] == ["arith_mc", "acc"] and "±" in r for r in rows)
    assert f"wrote {output}" in out


def test_nothing_but_progress_and_the_table_outside_a_git_repository(
    models, tmp_path, capfd, monkeypatch
):
    """lm-eval asked git for the current folder's commit (``fatal: not a git repository`` from
    git itself, once per model) and warned that it was handed a loaded model: noise that read as
    a failure on every ``kd eval`` run from a plain folder."""
    tasks = write_mc_task(tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)  # a folder outside any git repository
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    code = main(["eval", "--model", str(models["student"]), "--tasks", str(tasks)])
    out, err = capfd.readouterr()  # what git wrote to the file descriptor too
    assert code == 0, err
    assert "fatal" not in err and "`pretrained` model kwarg" not in err, err
    assert "already-initialized model" not in err, err
    assert "wrote eval.json" in out


def test_lora_adapter_scores_as_its_merged_folder(models, tmp_path, capsys):
    tasks = write_mc_task(tmp_path / "tasks")
    output = tmp_path / "eval.json"
    code, _, err = run_eval(
        capsys,
        "--model", f"adapter={models['adapter']}",
        "--model", f"merged={models['merged']}",
        "--model", f"base={models['student']}",
        "--tasks", str(tasks),
        "--output", str(output),
    )  # fmt: skip
    assert code == 0, err
    acc = json.loads(output.read_text())["results"]["arith_mc"]["acc"]
    assert acc["adapter"] == acc["merged"]
    assert acc["merged"]["value"] == pytest.approx(choice_accuracy(models["merged"], mc_rows()))


def test_output_is_kept_without_force(models, tmp_path, capsys):
    tasks = write_mc_task(tmp_path / "tasks")
    output = tmp_path / "eval.json"
    output.write_text("old results\n")
    code, _, err = run_eval(
        capsys, "--model", str(models["student"]), "--tasks", str(tasks), "--output", str(output)
    )
    assert code == 2
    assert err.splitlines() == [
        f"kd: error: --output: {output} already exists; pass --force to overwrite it"
    ]
    assert output.read_text() == "old results\n"


MARKER = "ran.txt"
# Python next to a planted task file: importing it writes the marker.
PLANTED_PY = f"from pathlib import Path\nPath(__file__).with_name({MARKER!r}).write_text('x')\n\ndef f(*a):\n    return a\n"


def _planted(folder: Path, body: str) -> Path:
    """A task folder whose mc.yaml is ``body`` (plus utils.py that writes the marker)."""
    write_mc_task(folder)
    (folder / "utils.py").write_text(PLANTED_PY)
    (folder / "mc.yaml").write_text(body)
    return folder


BASE = "task: arith_mc\ntype: multiple_choice\ndata: mc.jsonl\n"
# (case, the task file, what the error line names)
PLANTED = [
    ("function_tag", BASE + "doc_to_text: !function utils.f\n", ["doc_to_text", "!function"]),
    (
        "function_in_list",
        BASE + "metric_list:\n  - metric: !function utils.f\n",
        ["metric", "!function"],
    ),
    ("class", "task: t\nclass: !function utils.f\n", ["class", "!function"]),
    (
        "python_tag",
        BASE + "prompt: !!python/object/apply:os.system ['touch ran.txt']\n",
        ["prompt", "python/object"],
    ),
    ("process_docs", BASE + "process_docs: utils.f\n", ["process_docs", "Python code"]),
    ("process_results", BASE + "process_results: utils.f\n", ["process_results", "Python code"]),
    ("include", "include: other.yaml\n" + BASE, ["include", "another YAML file"]),
    (
        "jinja_key",
        BASE + "doc_to_text: \"{{ cycler.__init__.__globals__.os.system('touch ran.txt') }}\"\n",
        ["doc_to_text", "Jinja"],
    ),
    ("jinja_prompt", BASE + 'prompt: "{{ cycler.__init__.__globals__ }}"\n', ["prompt", "brace"]),
    ("attribute_prompt", BASE + 'prompt: "{question.__class__}"\n', ["prompt", "plain field name"]),
    ("jinja_word_prompt", BASE + 'prompt: "{self}"\n', ["prompt", "Jinja word"]),
    ("jinja_word_field", BASE + "choices: loop\n", ["choices", "Jinja word"]),
    ("dataset_path", BASE + "dataset_path: ./loader.py\n", ["dataset_path", "loading script"]),
    ("unknown_key", BASE + "num_shots: 3\n", ["num_shots", "unknown key"]),
    (
        "data_outside",
        "task: arith_mc\ntype: multiple_choice\ndata: ../mc.jsonl\n",
        ["data", "outside"],
    ),
]


@pytest.mark.parametrize("body,named", [c[1:] for c in PLANTED], ids=[c[0] for c in PLANTED])
def test_planted_task_files_are_refused_before_anything_runs(tmp_path, capsys, body, named):
    folder = _planted(tmp_path / "tasks", body)
    write_jsonl(tmp_path / "mc.jsonl", mc_rows())  # for data_outside: a real file, outside
    (folder / "other.yaml").write_text("process_docs: !function utils.f\n")  # no task: key
    assert_refused_before_running(
        capsys, tmp_path, folder, named, [folder / "mc.yaml", folder / "other.yaml"]
    )


def assert_refused_before_running(
    capsys, tmp_path: Path, folder: Path, named: list[str], task_files: list[Path]
) -> None:
    """``kd eval`` on the task folder (no model folder: the task files are checked first)
    answers one line naming each of ``named`` (and, unless it is about the data, one of
    ``task_files``), exit 2, with nothing planted run and no output written."""
    code, _, err = run_eval(
        capsys,
        "--model",
        str(tmp_path / "no-model"),
        "--tasks",
        str(folder),
        "--output",
        str(tmp_path / "e.json"),
    )
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kd: error: "), err
    for word in named:
        assert word in lines[0], lines[0]
    if named[0] != "data":
        assert any(str(f) in lines[0] for f in task_files), lines[0]
    assert not (folder / MARKER).exists() and not Path(MARKER).exists()
    assert not (tmp_path / "e.json").exists()


def test_links_out_of_the_task_folder_are_refused(tmp_path, capsys):
    outside = write_mc_task(tmp_path / "elsewhere")
    folder = tmp_path / "tasks"
    folder.mkdir()
    os.symlink(outside / "mc.yaml", folder / "mc.yaml")
    code, _, err = run_eval(
        capsys,
        "--model",
        str(tmp_path),
        "--tasks",
        str(folder),
        "--output",
        str(tmp_path / "e.json"),
    )
    assert code == 2 and "outside" in err and str(folder / "mc.yaml") in err
    (folder / "mc.yaml").unlink()
    shutil.copyfile(outside / "mc.yaml", folder / "mc.yaml")
    os.symlink(outside / "mc.jsonl", folder / "mc.jsonl")
    code, _, err = run_eval(
        capsys,
        "--model",
        str(tmp_path),
        "--tasks",
        str(folder),
        "--output",
        str(tmp_path / "e.json"),
    )
    assert code == 2 and err.startswith("kd: error: data: ") and "outside" in err, err


BAD_ROWS = [
    (
        "answer_range",
        {"question": "q", "choices": ["a", "b"], "answer": 2},
        "answer 2 is not an index",
    ),
    ("answer_text", {"question": "q", "choices": ["a", "b"], "answer": "a"}, "must be the index"),
    ("one_choice", {"question": "q", "choices": ["a"], "answer": 0}, "at least two"),
    ("missing", {"choices": ["a", "b"], "answer": 0}, "has no question"),
]


@pytest.mark.parametrize("row,message", [c[1:] for c in BAD_ROWS], ids=[c[0] for c in BAD_ROWS])
def test_bad_rows_are_one_line_with_the_line_number(tmp_path, capsys, row, message):
    folder = write_mc_task(tmp_path / "tasks")
    write_jsonl(folder / "mc.jsonl", [*mc_rows(2), row])
    code, _, err = run_eval(
        capsys,
        "--model",
        str(tmp_path),
        "--tasks",
        str(folder),
        "--output",
        str(tmp_path / "e.json"),
    )
    assert code == 2
    assert err.startswith(f"kd: error: data: {folder / 'mc.jsonl'} line 3") and message in err, err
    assert len(err.splitlines()) == 1


def test_model_mistakes_are_one_line(models, tmp_path, capsys):
    tasks = write_mc_task(tmp_path / "tasks")
    out = str(tmp_path / "e.json")
    cases = [
        (["--model", str(tmp_path / "none")], "--model: "),
        (
            ["--model", str(models["student"]), "--model", str(models["student"])],
            "two models are named student",
        ),
        (["--model", str(tasks)], "has no config.json"),
        (
            ["--model", str(models["student"]), "--device", "tpu"],
            "--device: 'tpu' is not cpu or cuda",
        ),
        (["--model", str(models["student"]), "--limit", "0"], "--limit: 0 evaluates nothing"),
        (["--model", f"{'a' * 65}={models['student']}"], "use at most 64 letters"),
        (["--model", f"a b={models['student']}"], "use at most 64 letters"),
    ]
    for model_args, message in cases:
        code, _, err = run_eval(capsys, *model_args, "--tasks", str(tasks), "--output", out)
        assert code == 2 and len(err.splitlines()) == 1 and message in err, err


@pytest.mark.slow
def test_lm_eval_task_names(models, tmp_path, capsys):
    """A name lm-eval does not know gets its closest; a known task without local data is refused
    before any model loads (lm-eval's whole task index is read: slow)."""
    out = str(tmp_path / "e.json")
    code, _, err = run_eval(
        capsys, "--model", str(models["student"]), "--tasks", "hellaswagg", "--output", out
    )
    assert code == 2 and "did you mean hellaswag?" in err, err
    code, _, err = run_eval(
        capsys, "--model", str(tmp_path / "none"), "--tasks", "arc_easy", "--output", out
    )
    assert code == 2 and "cannot read its data" in err and len(err.splitlines()) == 1, err


def test_eval_block_scores_final_at_the_end_of_training(assets, tmp_path, capsys):
    """`eval:` in a run config: final/ scored by lm-eval after training; the same numbers in the
    table, output_dir/eval.json and the last metrics.jsonl row; final/ scores as `kd eval` says."""
    from tests.conftest import make_config, read_metrics, write_config

    tasks = write_mc_task(tmp_path / "tasks")
    out = tmp_path / "run"
    cfg = make_config(assets, out, max_steps_per_epoch=2, eval={"tasks": [str(tasks)], "limit": 6})
    assert (
        main(["run", "kd_single_device", "--config", str(write_config(tmp_path / "c.yaml", cfg))])
        == 0
    )
    printed = capsys.readouterr().out
    payload = json.loads((out / "eval.json").read_text())
    acc = payload["results"]["arith_mc"]["acc"]["final"]
    assert payload["models"] == [{"name": "final", "path": str(out / "final")}]
    last = read_metrics(out)[-1]
    assert last["step"] == 2
    assert last["eval/arith_mc/acc"] == acc["value"]
    assert last["eval/arith_mc/acc_stderr"] == acc["stderr"]
    assert any(line.split()[:2] == ["arith_mc", "acc"] for line in printed.splitlines())
    code, _, err = run_eval(
        capsys,
        "--model",
        str(out / "final"),
        "--tasks",
        str(tasks),
        "--limit",
        "6",
        "--output",
        str(tmp_path / "again.json"),
    )
    assert code == 0, err
    again = json.loads((tmp_path / "again.json").read_text())["results"]["arith_mc"]["acc"]
    assert again["run/final"] == acc


def test_eval_block_refuses_a_planted_task_file_before_any_weight(assets, tmp_path, capsys):
    from tests.conftest import make_config, write_config

    folder = _planted(tmp_path / "tasks", BASE + "process_docs: !function utils.f\n")
    out = tmp_path / "run"
    cfg = make_config(assets, out, eval={"tasks": [str(folder)]})
    path = str(write_config(tmp_path / "c.yaml", cfg))
    for command in (["validate", "--config", path], ["run", "kd_single_device", "--config", path]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if "error" in line] == [
            f"kd: error: process_docs: {folder / 'mc.yaml'} uses the YAML tag !function, which "
            "would make lm-eval run Python; kd runs nothing from a task file: describe the task "
            "with kd's keys (docs/eval.md)"
        ], err
        assert not (folder / MARKER).exists()
        assert not out.exists()  # nothing written: the check comes before output_dir is taken


def test_eval_block_scores_a_lora_students_merged_weights(assets, tmp_path, capsys):
    """A LoRA run's final/ (merged weights, the adapter in final/adapter/) scores as transformers
    scores those merged weights: the adapter is not applied a second time."""
    from tests.conftest import make_config, write_config

    tasks = write_mc_task(tmp_path / "tasks")
    out = tmp_path / "run"
    cfg = make_config(assets, out, lora=True, max_steps_per_epoch=2, eval={"tasks": [str(tasks)]})
    cfg["optimizer"]["lr"] = 0.05  # the adapter moves the weights enough to change some answers
    assert (
        main(["run", "kd_single_device", "--config", str(write_config(tmp_path / "c.yaml", cfg))])
        == 0
    )
    assert (out / "final" / "adapter" / "adapter_config.json").is_file()
    acc = json.loads((out / "eval.json").read_text())["results"]["arith_mc"]["acc"]["final"]
    assert acc["value"] == pytest.approx(choice_accuracy(out / "final", mc_rows()))


def test_eval_block_chat_is_checked_before_training(assets, tmp_path, capsys):
    """``eval.chat`` with a student whose tokenizer has no chat template: refused by ``kd
    validate`` and by ``kd run`` before anything is written, not after hours of training."""
    import shutil

    from tests.conftest import make_config, tokenizer_node, write_config

    tasks = write_mc_task(tmp_path / "tasks")
    out = tmp_path / "run"
    cfg = make_config(assets, out, eval={"tasks": [str(tasks)], "chat": True})
    path = str(write_config(tmp_path / "c.yaml", cfg))
    assert main(["validate", "--config", path]) == 0  # the tokenizer's template renders
    plain = shutil.copytree(assets["tokenizer"], tmp_path / "tokenizer")
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    cfg["tokenizer"] = tokenizer_node(plain, cfg["tokenizer"]["max_seq_len"])
    path = str(write_config(tmp_path / "c.yaml", cfg))
    capsys.readouterr()
    for command in (["validate", "--config", path], ["run", "kd_single_device", "--config", path]):
        assert main(command) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and err[0].startswith("kd: error: eval.chat: "), err
        assert "set eval.chat=false" in err[0], err
        assert not out.exists()
