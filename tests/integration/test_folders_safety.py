"""Nothing in a model or tokenizer folder runs, and kd reads only regular files inside it.

A folder whose ``config.json`` or ``tokenizer_config.json`` carries an ``auto_map`` next to a
planted ``custom.py`` (which writes a marker file when imported) is refused by every command
that loads a folder, through every config key and flag, while "y" is answered on stdin and on a
pseudo-terminal (transformers' "Do you wish to run the custom code? [y/N]" prompt). Links out of a
folder, ``..`` in a sharded index, a named pipe as the weights, a truncated safetensors file and
integer weights are refused by ``kd validate`` with one line. docs/security.md lists the cases.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kd import cli
from kd.testing import hf_tokenizer_node, write_hf_tokenizer, write_tiny_model, write_tokenizer
from tests.conftest import STUDENT, TEACHER, make_config, tiny_model, write_config, write_data

YES = "y\n" * 200
REFUSAL = (
    "kd never runs a model's or tokenizer's own code: use a model that transformers supports "
    "natively, or remove auto_map if the folder needs none"
)


def _planted_code(marker: Path) -> str:
    """A module that writes ``marker`` when imported, with the classes its auto_map names."""
    return (
        f"open({str(marker)!r}, 'w').write('planted code ran')\n"
        "from transformers import PretrainedConfig, PreTrainedTokenizerFast\n"
        "class CustomConfig(PretrainedConfig):\n"
        "    model_type = 'kd_planted'\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n"
    )


def plant(source: Path, dest: Path, file: str, marker: Path) -> Path:
    """A copy of ``source`` whose ``file`` asks for ``custom.py`` (planted): a model type or a
    tokenizer class transformers does not know, so it would ask to run the folder's code."""
    shutil.copytree(source, dest)
    (dest / "custom.py").write_text(_planted_code(marker))
    data = json.loads((dest / file).read_text())
    if file == "config.json":
        data.update(model_type="kd_planted", auto_map={"AutoConfig": "custom.CustomConfig"})
    else:
        data.update(
            tokenizer_class="CustomTokenizer",
            auto_map={"AutoTokenizer": ["custom.CustomTokenizer", "custom.CustomTokenizer"]},
        )
    (dest / file).write_text(json.dumps(data))
    return dest


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Tiny Hugging Face folders: ``tok`` (a tokenizer), ``student`` and ``teacher`` (models with
    the tokenizer's files), ``train.jsonl``; ``evil_model`` (config.json asks for custom.py),
    ``evil_tok`` (a tokenizer folder whose tokenizer_config.json asks for it) and
    ``evil_model_tok`` (a model folder whose tokenizer asks for it). The planted code writes
    ``marker``."""
    root = tmp_path_factory.mktemp("folders")
    tok = write_hf_tokenizer(root / "tok")
    for name, spec, seed in (("student", STUDENT, 1), ("teacher", TEACHER, 2)):
        folder = write_tiny_model(root / name, tiny_model(spec), seed=seed, writer="transformers")
        for item in tok.iterdir():
            shutil.copyfile(item, folder / item.name)
    write_data(root / "train.jsonl", 16, seed=3)
    marker = root / "marker"
    plant(root / "student", root / "evil_model", "config.json", marker)
    plant(tok, root / "evil_tok", "tokenizer_config.json", marker)
    plant(root / "student", root / "evil_model_tok", "tokenizer_config.json", marker)
    return root


def hf_run_config(root: Path, out: Path, **folders: str) -> dict[str, Any]:
    """A transformers-backend config of ``root``'s folders (``student``, ``teacher``, ``tok``
    overridable by name)."""
    names = {"student": "student", "teacher": "teacher", "tok": "tok", **folders}
    assets = {
        "tokenizer": root / names["tok"],
        "student": root / names["student"],
        "teacher": root / names["teacher"],
        "data": root / "train.jsonl",
    }
    cfg = make_config(assets, out, max_steps_per_epoch=1)
    cfg["tokenizer"] = hf_tokenizer_node(assets["tokenizer"], 64)
    cfg["model"] = {"_component_": "kd.hf.causal_lm", "path": str(assets["student"])}
    cfg["teacher_model"] = {"_component_": "kd.hf.causal_lm", "path": str(assets["teacher"])}
    del cfg["checkpointer"], cfg["teacher_checkpointer"]
    return cfg


def kd(*argv: str, stdin: str = YES, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kd.cli", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def one_error(stderr: str) -> str:
    """The one ``kd: error:`` line of a refusal (and no traceback)."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("kd: error: ")]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def test_planted_code_runs_when_transformers_is_trusted(root, tmp_path):
    """The plant is live: transformers trusting the folder runs custom.py (so the tests below
    can fail), whereas kd's loads (trust_remote_code=False) refuse it."""
    from transformers import AutoConfig, AutoTokenizer

    marker = tmp_path / "ran"
    for file, loader in (("config.json", AutoConfig), ("tokenizer_config.json", AutoTokenizer)):
        folder = plant(root / "student", tmp_path / file, file, marker)
        if file == "tokenizer_config.json":
            (folder / "config.json").unlink()  # the tokenizer alone, as in a tokenizer folder
        with pytest.raises(ValueError, match="custom code"):
            loader.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
        assert not marker.exists()
        with contextlib.suppress(Exception):  # the planted tokenizer class lacks real files
            loader.from_pretrained(str(folder), local_files_only=True, trust_remote_code=True)
        assert marker.exists()
        marker.unlink()


def _argv(command: str, root: Path, tmp: Path) -> tuple[list[str], str]:
    """The argv of one refused command and the start of its error line."""
    evil_model = root / "evil_model"
    if command.startswith("init"):
        flag = command.split("/")[1]
        folders = {"--teacher": root / "teacher", "--student": root / "student"}
        folders[flag] = evil_model
        argv = ["init", "--data", str(root / "train.jsonl"), "--device", "cpu"]
        argv += ["--output-dir", str(tmp / "out"), "--config-out", str(tmp / "kd.yaml")]
        argv += [item for flag_, path in folders.items() for item in (flag_, str(path))]
        return argv, f"kd: error: {flag}: {evil_model / 'config.json'} asks to run code"
    if command.startswith("generate"):
        folder = root / command.split("/")[1]
        file = "config.json" if folder.name == "evil_model" else "tokenizer_config.json"
        argv = ["generate", "--model", str(folder), "--prompt", "1+1="]
        return argv, f"kd: error: --model: {folder / file} asks to run code"
    verb, key = command.split("/")
    cfg = hf_run_config(root, tmp / "out")
    if key in ("model", "teacher_model"):
        cfg[key]["path"] = str(evil_model)
        expected = f"{key}.path: {evil_model / 'config.json'}"
    elif key == "tokenizer":
        cfg["tokenizer"]["path"] = str(root / "evil_tok")
        expected = f"tokenizer.path: {root / 'evil_tok' / 'tokenizer_config.json'}"
    else:  # dataset.model_transform: kd.hf.tokenizer
        cfg["dataset"]["model_transform"] = hf_tokenizer_node(root / "evil_tok", 64)
        expected = f"dataset.model_transform.path: {root / 'evil_tok' / 'tokenizer_config.json'}"
    config = str(write_config(tmp / "kd.yaml", cfg))
    argv = ["run", "kd", "--config", config] if verb == "run" else [verb, "--config", config]
    return argv, f"kd: error: {expected} asks to run code"


COMMANDS = (
    "validate/model",
    "validate/teacher_model",
    "validate/tokenizer",
    "validate/dataset.model_transform",
    "plan/model",
    "plan/tokenizer",
    "run/model",
    "run/teacher_model",
    "run/tokenizer",
    "init/--teacher",
    "init/--student",
    "generate/evil_model",
    "generate/evil_model_tok",
)


@pytest.mark.parametrize("command", COMMANDS)
def test_planted_code_never_runs_whatever_stdin_says(root, tmp_path, command):
    argv, expected = _argv(command, root, tmp_path)
    proc = kd(*argv)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_error(proc.stderr)
    assert line.startswith(expected), line
    assert line.endswith(REFUSAL), line
    assert "[y/N]" not in proc.stdout + proc.stderr
    assert not (root / "marker").exists()


def _under_a_terminal(argv: list[str], timeout: float = 300) -> tuple[int, str]:
    """Run kd with a pseudo-terminal as stdin, stdout and stderr, typing "y" on it as any prompt
    would be answered; returns the exit status and everything kd wrote."""
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kd.cli", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    output = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            os.write(master, b"y\n")
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the terminal closed: kd exited
                    break
                if not chunk:
                    break
                output += chunk
            elif proc.poll() is not None:
                break
        status = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return status, output.decode("utf-8", "replace")


@pytest.mark.parametrize("command", ["validate/model", "generate/evil_model"])
def test_planted_code_never_runs_under_a_terminal_answering_y(root, tmp_path, command):
    argv, expected = _argv(command, root, tmp_path)
    status, output = _under_a_terminal(argv)
    assert status == 2, output[-3000:]
    assert expected in output and REFUSAL in output, output[-3000:]
    assert "[y/N]" not in output and "Traceback" not in output, output[-3000:]
    assert not (root / "marker").exists()


# ------------------------------------------------------------------ only regular files inside
def _copy(root: Path, tmp: Path, name: str = "student") -> Path:
    return Path(shutil.copytree(root / name, tmp / name))


def _validate_line(cfg: dict[str, Any], tmp: Path, capsys) -> str:
    config = write_config(tmp / "kd.yaml", cfg)
    assert cli.main(["validate", "--config", str(config)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kd: error: ")]
    assert len(err) == 1, err
    return err[0]


def test_tokenizer_file_linked_out_of_the_model_folder_refused(root, tmp_path, capsys):
    """merges.txt -> ../secret in the student's folder would be copied into final/ and every
    step_*/: kd validate refuses the folder instead."""
    student = _copy(root, tmp_path)
    (tmp_path / "secret").write_text("not a tokenizer file\n")
    os.symlink("../secret", student / "merges.txt")
    line = _validate_line(
        hf_run_config(root, tmp_path / "out", student=str(student)), tmp_path, capsys
    )
    assert line == (
        f"kd: error: model.path: {student / 'merges.txt'} leads to {tmp_path / 'secret'}, "
        f"outside {student}; kd reads only files inside the folder: copy the real file into it"
    )


def test_torchtune_tokenizer_file_linked_out_refused(root, tmp_path, capsys):
    """A torchtune tokenizer's merges_file linking out of its folder (the torchtune backend)."""
    tok = write_tokenizer(tmp_path / "tok")
    shutil.move(tok / "merges.txt", tmp_path / "merges.txt")
    os.symlink("../merges.txt", tok / "merges.txt")
    assets = {
        "tokenizer": tok,
        "student": root / "student",
        "teacher": root / "teacher",
        "data": root / "train.jsonl",
    }
    line = _validate_line(make_config(assets, tmp_path / "out"), tmp_path, capsys)
    assert line.startswith("kd: error: tokenizer.")
    assert f"{tok / 'merges.txt'} leads to {tmp_path / 'merges.txt'}, outside {tok}" in line


def test_sharded_index_naming_a_file_outside_refused(root, tmp_path, capsys):
    student = _copy(root, tmp_path)
    (tmp_path / "outside").mkdir()
    shard = "model-00001-of-00001.safetensors"
    names = load_file(student / "model.safetensors").keys()
    shutil.move(student / "model.safetensors", tmp_path / "outside" / shard)
    index = student / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: f"../outside/{shard}" for n in names}}))
    line = _validate_line(
        hf_run_config(root, tmp_path / "out", student=str(student)), tmp_path, capsys
    )
    assert line == (
        f"kd: error: model.path: {index} names '../outside/{shard}' in its weight_map, outside "
        f"{student}; kd reads weights only from inside the folder: restore the index from the "
        "model's source"
    )


@pytest.mark.parametrize("backend", ["transformers", "torchtune"])
def test_named_pipe_as_the_weights_refused_without_blocking(root, tmp_path, backend):
    """Reading a FIFO blocks until someone writes to it: kd must never open one."""
    student = _copy(root, tmp_path)
    (student / "model.safetensors").unlink()
    os.mkfifo(student / "model.safetensors")
    if backend == "transformers":
        cfg, key = hf_run_config(root, tmp_path / "out", student=str(student)), "model.path"
    else:
        assets = {"tokenizer": root / "tok", "student": student, "teacher": root / "teacher"}
        cfg = make_config({**assets, "data": root / "train.jsonl"}, tmp_path / "out")
        cfg["tokenizer"] = hf_tokenizer_node(root / "tok", 64)
        key = "checkpointer.checkpoint_dir"
    config = write_config(tmp_path / "kd.yaml", cfg)
    proc = kd("validate", "--config", str(config), stdin="", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_error(proc.stderr) == (
        f"kd: error: {key}: {student / 'model.safetensors'} is a named pipe (FIFO), not a "
        "regular file; replace it with the real file from the model's source"
    )


@pytest.mark.parametrize("backend", ["transformers", "torchtune"])
def test_truncated_safetensors_refused_by_validate(root, tmp_path, capsys, backend):
    """Tensor offsets past the end of the file: kd validate says which file to re-download."""
    student = _copy(root, tmp_path)
    weights = student / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    if backend == "transformers":
        cfg, key = hf_run_config(root, tmp_path / "out", student=str(student)), "model"
    else:
        assets = {"tokenizer": root / "tok", "student": student, "teacher": root / "teacher"}
        cfg = make_config({**assets, "data": root / "train.jsonl"}, tmp_path / "out")
        cfg["tokenizer"] = hf_tokenizer_node(root / "tok", 64)
        key = "checkpointer"
    line = _validate_line(cfg, tmp_path, capsys)
    prefix = f"kd: error: {key}: cannot load the weights in {student} (model.safetensors is "
    assert line.startswith(prefix + "truncated: tensor "), line
    assert line.endswith("); re-download the truncated or damaged file")


def test_integer_weights_of_the_student_refused(root, tmp_path, capsys):
    """Integers in place of a floating weight would be cast and trained silently."""
    student = _copy(root, tmp_path)
    weights = student / "model.safetensors"
    state = load_file(weights)
    name = "model.layers.0.mlp.gate_proj.weight"
    state[name] = (state[name] * 100).to(torch.int8)
    save_file(state, str(weights), metadata={"format": "pt"})
    line = _validate_line(
        hf_run_config(root, tmp_path / "out", student=str(student)), tmp_path, capsys
    )
    assert line == (
        f"kd: error: model: cannot load the weights in {student} (model.safetensors stores the "
        f"weight {name} as integers (I8), which would be cast into the floating parameters as "
        "raw numbers); use the model's unquantized (float16, bfloat16 or float32) safetensors"
    )


def test_sound_folders_validate(root, tmp_path):
    """The same folders without the plants pass (the refusals above are about the plants)."""
    config = write_config(tmp_path / "kd.yaml", hf_run_config(root, tmp_path / "out"))
    assert cli.main(["validate", "--config", str(config)]) == 0
