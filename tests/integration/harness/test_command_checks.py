"""`kd eval` checks what would fail late before any weight loads: an ``--output`` it cannot write
(the scores of every model would be lost at the end) and, with ``--chat``, a tokenizer without a
chat template or with one that fails (lm-eval's traceback at the first prompt). A write that
fails at the end keeps the old results file and leaves no partial one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import kd.generate
from kd.cli import main
from kd.errors import KDUserError
from kd.harness.evaluate import FinalEvaluation
from kd.testing import TOKENIZER_VOCAB_SIZE, TinyModel, write_hf_tokenizer, write_jsonl

pytest.importorskip("lm_eval")


def _tasks(folder: Path) -> Path:
    folder.mkdir(parents=True)
    write_jsonl(folder / "mc.jsonl", [{"question": "1+1=", "choices": ["2", "3"], "answer": 0}])
    (folder / "mc.yaml").write_text("task: mc\ntype: multiple_choice\ndata: mc.jsonl\n")
    return folder


def _model(folder: Path, chat_template: str | None) -> Path:
    """A tiny model folder (its weights are never read here), the tokenizer with
    ``chat_template`` (None: none)."""
    from kd.testing import write_tiny_model

    shape = TinyModel(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        embed_dim=16,
        intermediate_dim=32,
        max_seq_len=64,
    )
    write_tiny_model(folder, shape, seed=0, writer="transformers")
    tokenizer = write_hf_tokenizer(folder.parent / f"{folder.name}_tokenizer")
    for item in tokenizer.iterdir():
        shutil.copyfile(item, folder / item.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def no_weights(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded before the check")

    monkeypatch.setattr(kd.generate, "load_model", refuse)


def _one_line(capsys, *argv: str) -> str:
    capsys.readouterr()  # what writing the models printed
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_an_output_under_a_file_is_refused_first(tmp_path, capsys, no_weights):
    tasks = _tasks(tmp_path / "tasks")
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "sub" / "eval.json"
    err = _one_line(capsys, "--model", str(tmp_path), "--tasks", str(tasks), "--output", str(out))
    assert err == (
        f"kd: error: --output: cannot write {out}: {tmp_path / 'file'} is a file, not a folder; "
        "choose a path you can write to\n"
    )
    assert (tmp_path / "file").read_text() == "x"


def test_an_output_folder_that_refuses_files_is_refused_first(
    tmp_path, capsys, monkeypatch, no_weights
):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    tasks = _tasks(tmp_path / "tasks")
    out = tmp_path / "new" / "eval.json"
    err = _one_line(capsys, "--model", str(tmp_path), "--tasks", str(tasks), "--output", str(out))
    assert err.startswith(f"kd: error: --output: cannot write {out} (PermissionError"), err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (None, "has no chat_template (tokenizer_config.json or chat_template.jinja); drop --chat"),
        ("{{ raise_exception('no system turn') }}", "stopped with its own error"),
    ],
)
def test_chat_without_a_working_template_is_one_line(
    tmp_path, capsys, no_weights, template, message
):
    tasks = _tasks(tmp_path / "tasks")
    good = _model(tmp_path / "good", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    bad = _model(tmp_path / "bad", template)
    out = tmp_path / "e.json"
    argv = ["--model", str(good), "--model", str(bad), "--tasks", str(tasks), "--output", str(out)]
    err = _one_line(capsys, *argv, "--chat")
    assert err.startswith("kd: error: --chat: the ") and str(bad) in err and message in err, err
    assert not out.exists()


def test_the_eval_blocks_chat_names_its_key(tmp_path, no_weights):
    tasks = _tasks(tmp_path / "tasks")
    final = _model(tmp_path / "final", None)
    settings = SimpleNamespace(
        tasks=[str(tasks)], limit=None, batch_size=8, num_fewshot=None, chat=True
    )
    with pytest.raises(KDUserError, match=r"^eval.chat: .* set eval.chat=false"):
        FinalEvaluation(settings, device="cpu").run(final, output_dir=tmp_path)
    assert not (tmp_path / "eval.json").exists()


def test_a_failed_write_keeps_the_old_results_and_leaves_no_partial_file(tmp_path, monkeypatch):
    import os

    from kd.harness.evaluate import write_json

    out = tmp_path / "eval.json"
    out.write_text('{"old": true}\n')

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(KDUserError, match=r"^--output: cannot write .*No space left"):
        write_json(out, {"new": True})
    assert out.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "", "--tasks", "T"], "--model: '' names no folder"),
        (["--model", "student=", "--tasks", "T"], "--model: 'student=' names no folder"),
        (["--model", "M", "--tasks", ""], "--tasks: an empty value"),
    ],
)
def test_an_empty_model_or_task_is_refused_not_read_as_the_current_folder(
    tmp_path, capsys, monkeypatch, no_weights, argv, message
):
    # An unset shell variable (--model "$DIR") must not evaluate whatever the current folder is.
    model = _model(tmp_path / "m", chat_template=None)
    tasks = _tasks(tmp_path / "tasks")
    monkeypatch.chdir(model)
    argv = [{"T": str(tasks), "M": str(model)}.get(a, a) for a in argv]
    err = _one_line(capsys, *argv, "--output", str(tmp_path / "e.json"))
    assert err.startswith(f"kd: error: {message}"), err
