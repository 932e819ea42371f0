"""Bad input: every case of docs/errors.md exits 2 with a `kd: error:` line that names the key or file
and the fix, prints no traceback, and leaves what was saved before untouched.

Most cases run in-process through ``kd.cli.main`` (fast); two run ``python -m kd.cli`` to show that
nothing but the error line reaches the terminal.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_config, read_metrics, write_config
from safetensors.torch import load_file

import kd.checkpoint
import kd.train
from kd import checkpoint, cli

RUN = ["run", "kd_single_device"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run far faster on one intra-op thread than on threads sharing busy cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class MaskedDataset(torch.utils.data.Dataset):
    """A dataset whose every label is masked (a user component, so it needs trust)."""

    def __init__(self, tokenizer: Any, n: int = 16):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"tokens": [1, 2, 3, 4, 5], "labels": [-100] * 5}


class RowFailsLater(torch.utils.data.Dataset):
    """Fine for the first ``good_reads`` reads, then every row raises (a bad row met mid-run)."""

    def __init__(self, tokenizer: Any, n: int = 32, good_reads: int = 48):
        self.n, self.good_reads, self.reads = n, good_reads, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        self.reads += 1
        if self.reads > self.good_reads:
            raise KeyError("output")
        return {"tokens": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5]}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def write_json(path: Path, rows: Any) -> str:
    path.write_text(json.dumps(rows) if not isinstance(rows, str) else rows)
    return str(path)


# ---------------------------------------------------------------------------------------------
# The table. Each case gets (assets, tmp_path, cfg) and returns the argv after `kd` plus what
# the error must contain; `cfg` is a valid config dict (output_dir holds a file from "before")
# that the case may edit; it is written to tmp_path/cfg.yaml after the case returns.
# ---------------------------------------------------------------------------------------------

Case = Callable[[dict, Path, dict], tuple[list[str], str]]


def _run(*overrides: str) -> list[str]:
    return [*RUN, "--config", "{cfg}", *overrides]


def malformed_yaml(assets, tmp, cfg):
    bad = tmp / "bad.yaml"
    bad.write_text("output_dir: /tmp/x\nmodel: [unclosed\nseed: 1\n")
    return [*RUN, "--config", str(bad)], "malformed YAML"


def missing_config_file(assets, tmp, cfg):
    return [*RUN, "--config", str(tmp / "nope.yaml")], "nope.yaml: no such file"


def config_not_a_mapping(assets, tmp, cfg):
    bad = tmp / "list.yaml"
    bad.write_text("- a\n- b\n")
    return [*RUN, "--config", str(bad)], "top level is a list"


def unknown_key(assets, tmp, cfg):
    cfg["kd_ration"] = cfg.pop("kd_ratio")
    return _run(), "kd_ration: unknown key; did you mean kd_ratio?"


def missing_required_key(assets, tmp, cfg):
    del cfg["dataset"]
    return _run(), "dataset: required key is missing"


def wrong_type(assets, tmp, cfg):
    cfg["batch_size"] = "four"
    return _run(), "batch_size: 'four' is not an integer"


def override_without_value(assets, tmp, cfg):
    return _run("batch_size"), "override 'batch_size': expected key=value or ~key"


def override_empty_value(assets, tmp, cfg):
    return _run("batch_size="), "no value after '='"


def override_bad_key(assets, tmp, cfg):
    return _run("optimizer..lr=1"), "is not a config key"


def delete_absent_key(assets, tmp, cfg):
    return _run("~kd_ration"), "no key kd_ration"


def unresolvable_interpolation(assets, tmp, cfg):
    return _run("seed=${nope}"), "seed: interpolation cannot be resolved"


def kd_ratio_out_of_range(assets, tmp, cfg):
    return _run("kd_ratio=1.5"), "kd_ratio: 1.5 is outside [0, 1]"


def temperature_not_positive(assets, tmp, cfg):
    return _run("temperature=0"), "temperature: 0 must be greater than 0"


def batch_size_below_1(assets, tmp, cfg):
    return _run("batch_size=0"), "batch_size: 0 is below the minimum 1"


def accumulation_below_1(assets, tmp, cfg):
    return _run("gradient_accumulation_steps=0"), "gradient_accumulation_steps: 0 is below"


def bad_choice(assets, tmp, cfg):
    return _run("dtype=fp8"), "dtype: 'fp8' is not allowed"


def bad_device(assets, tmp, cfg):
    return _run("device=tpu"), "device: 'tpu' is not a device"


def cuda_not_available(assets, tmp, cfg):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    return _run("device=cuda"), "device: cuda is not available"


def unknown_component(assets, tmp, cfg):
    return _run("optimizer._component_=torch.optim.AdamWW"), "did you mean torch.optim.AdamW?"


def unknown_component_argument(assets, tmp, cfg):
    return _run("optimizer.lrr=0.1"), "optimizer.lrr: not an argument of torch.optim.AdamW"


def bad_component_argument_value(assets, tmp, cfg):
    return _run("optimizer.lr=-1"), "optimizer: torch.optim.AdamW failed (ValueError"


def component_outside_allow_list(assets, tmp, cfg):
    cfg["metric_logger"] = {"_component_": "os.system", "command": f"touch {tmp / 'pwned'}"}
    return _run(), "metric_logger._component_: os.system is not something metric_logger may build"


def missing_data_file(assets, tmp, cfg):
    cfg["dataset"]["data_files"] = str(tmp / "nope.json")
    return _run(), "dataset.data_files:"


def missing_checkpoint_dir(assets, tmp, cfg):
    cfg["checkpointer"]["checkpoint_dir"] = str(tmp / "nope")
    return _run(), "checkpointer.checkpoint_dir:"


def missing_checkpoint_file(assets, tmp, cfg):
    cfg["teacher_checkpointer"]["checkpoint_files"] = ["model-00001.safetensors"]
    return _run(), "teacher_checkpointer.checkpoint_files[0]:"


def truncated_checkpoint_file(assets, tmp, cfg):
    student = tmp / "student"
    student.mkdir()
    for p in assets["student"].iterdir():
        data = p.read_bytes()
        (student / p.name).write_bytes(data[:2000] if p.suffix == ".safetensors" else data)
    cfg["checkpointer"]["checkpoint_dir"] = str(student)
    return _run(), "checkpointer: cannot load the weights in"


def checkpoint_of_another_model(assets, tmp, cfg):
    return _run("model.num_layers=3"), "checkpointer: the checkpoint does not match the model"


def wrong_model_type(assets, tmp, cfg):
    return _run("checkpointer.model_type=QWEN9"), "checkpointer.model_type: 'QWEN9' is not a"


def model_type_of_another_family(assets, tmp, cfg):
    return _run("checkpointer.model_type=LLAMA3"), "checkpointer.model_type: LLAMA3 converts"


def missing_tokenizer_file(assets, tmp, cfg):
    cfg["tokenizer"]["merges_file"] = str(tmp / "merges.txt")
    return _run(), "tokenizer.merges_file:"


def corrupt_tokenizer_file(assets, tmp, cfg):
    cfg["tokenizer"]["path"] = write_json(tmp / "vocab.json", "{not json")
    return _run(), "tokenizer: torchtune.models.qwen2_5.qwen2_5_tokenizer failed"


def tokenizer_ids_beyond_student_vocab(assets, tmp, cfg):
    return _run("model.vocab_size=200"), "tokenizer: emits ids up to 277 but the student"


def tokenizer_ids_beyond_teacher_vocab(assets, tmp, cfg):
    return _run("teacher_model.vocab_size=200"), "the teacher (teacher_model) has only 200"


def teacher_of_another_family(assets, tmp, cfg):
    cfg["teacher_model"] = {
        "_component_": "torchtune.models.llama3.llama3",
        "vocab_size": 320,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "embed_dim": 48,
        "intermediate_dim": 96,
        "max_seq_len": 256,
    }
    cfg["teacher_checkpointer"]["model_type"] = "LLAMA3"
    return _run(), "teacher_model._component_: torchtune.models.llama3.llama3 is a llama3 teacher"


def tokenizer_of_another_family(assets, tmp, cfg):
    return (
        _run(
            "tokenizer._component_=torchtune.models.llama3.llama3_tokenizer",
            "~tokenizer.merges_file",
        ),
        "tokenizer._component_: torchtune.models.llama3.llama3_tokenizer is a llama3 tokenizer",
    )


def empty_dataset(assets, tmp, cfg):
    cfg["dataset"]["data_files"] = write_json(tmp / "empty.json", [])
    return _run(), "empty.json has no examples; point dataset.data_files at a file with examples"


def malformed_data_file(assets, tmp, cfg):
    cfg["dataset"]["data_files"] = write_json(tmp / "bad.json", '[{"input": "1+1", ')
    return _run(), "dataset: torchtune.datasets.instruct_dataset failed (DatasetGenerationError"


def fewer_examples_than_a_batch(assets, tmp, cfg):
    rows = [{"input": "1+1", "output": "2"}] * 3
    cfg["dataset"]["data_files"] = write_json(tmp / "three.json", rows)
    return _run(), "dataset: 3 examples is fewer than one batch"


def data_without_the_expected_columns(assets, tmp, cfg):
    rows = [{"question": "1+1", "answer": "2"}] * 8
    cfg["dataset"]["data_files"] = write_json(tmp / "columns.json", rows)
    return _run(), "dataset: example 0 cannot be read (KeyError: 'input')"


def every_example_longer_than_max_seq_len(assets, tmp, cfg):
    rows = [{"input": "1+" * 60, "output": "2"}] * 8  # prompts of ~140 tokens, max_seq_len 64
    cfg["dataset"]["data_files"] = write_json(tmp / "long.json", rows)
    return _run(), "tokenizer.max_seq_len: every example checked (8 of 8) is at least 64 tokens"


def every_label_masked(assets, tmp, cfg):
    cfg["dataset"] = {"_component_": f"{__name__}.MaskedDataset"}
    cfg["trust_remote_components"] = True
    return _run(), "dataset: every label is masked in the 16 examples checked"


def accumulation_longer_than_an_epoch(assets, tmp, cfg):
    return _run("gradient_accumulation_steps=100"), "gradient_accumulation_steps: 100 micro"


def memory_budget_exceeded(assets, tmp, cfg):
    return _run("memory.budget_gib=0.01", "memory.check=error"), "memory: the plan needs"


def output_dir_not_writable(assets, tmp, cfg):
    # Running as root, permissions do not stop writes; a path under a regular file always fails.
    (tmp / "a_file").write_text("")
    return _run(f"output_dir={tmp / 'a_file' / 'run'}"), "output_dir:"


def unknown_recipe(assets, tmp, cfg):
    return ["run", "kd_singel_device", "--config", "{cfg}"], "did you mean kd_single_device?"


def missing_config_option(assets, tmp, cfg):
    return [*RUN, "batch_size=2"], "missing --config"


def torchrun_options_on_single_device(assets, tmp, cfg):
    return (
        ["run", "--nproc_per_node", "2", *RUN[1:], "--config", "{cfg}"],
        "kd_single_device runs on one device and cannot take torchrun options",
    )


CASES: list[Case] = [
    malformed_yaml,
    missing_config_file,
    config_not_a_mapping,
    unknown_key,
    missing_required_key,
    wrong_type,
    override_without_value,
    override_empty_value,
    override_bad_key,
    delete_absent_key,
    unresolvable_interpolation,
    kd_ratio_out_of_range,
    temperature_not_positive,
    batch_size_below_1,
    accumulation_below_1,
    bad_choice,
    bad_device,
    cuda_not_available,
    unknown_component,
    unknown_component_argument,
    bad_component_argument_value,
    component_outside_allow_list,
    missing_data_file,
    missing_checkpoint_dir,
    missing_checkpoint_file,
    truncated_checkpoint_file,
    checkpoint_of_another_model,
    wrong_model_type,
    model_type_of_another_family,
    missing_tokenizer_file,
    corrupt_tokenizer_file,
    tokenizer_ids_beyond_student_vocab,
    tokenizer_ids_beyond_teacher_vocab,
    teacher_of_another_family,
    tokenizer_of_another_family,
    empty_dataset,
    malformed_data_file,
    fewer_examples_than_a_batch,
    data_without_the_expected_columns,
    every_example_longer_than_max_seq_len,
    every_label_masked,
    accumulation_longer_than_an_epoch,
    memory_budget_exceeded,
    output_dir_not_writable,
    unknown_recipe,
    missing_config_option,
    torchrun_options_on_single_device,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_exits_2_with_one_clear_line(case: Case, assets, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("saved before")
    cfg = make_config(assets, out)
    argv, needle = case(assets, tmp_path, cfg)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    assets_before = {
        name: snapshot(p) if p.is_dir() else p.read_bytes() for name, p in assets.items()
    }

    code = cli.main([a.replace("{cfg}", str(config)) for a in argv])

    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("kd: error: ")]
    assert errors, err
    assert any(needle in line for line in errors), errors
    first = errors[0]
    # One line that names the key or file, then the fix after a ';' (the memory table ends with
    # its fixes; a missing config file points to `kd ls`).
    assert ";" in first or case in (memory_budget_exceeded, missing_config_file), first
    assert snapshot(out) == {"notes.txt": b"saved before"}
    assert not (tmp_path / "pwned").exists()
    assert {
        name: snapshot(p) if p.is_dir() else p.read_bytes() for name, p in assets.items()
    } == assets_before


def test_table_in_docs_lists_every_case():
    doc = (Path(__file__).parents[2] / "docs" / "errors.md").read_text()
    missing = [c.__name__ for c in CASES if f"`{c.__name__}`" not in doc]
    assert not missing


# ---------------------------------------------------------------------------------------------
# Failures during training
# ---------------------------------------------------------------------------------------------


def _nan_at_step(monkeypatch, step: int, accumulation: int) -> None:
    """The first micro-batch of optimizer step ``step`` gets a NaN loss (so NaN gradients)."""
    original = kd.train.compute_loss
    calls = {"n": 0}

    def compute_loss(*args, **kwargs):
        calls["n"] += 1
        loss, ce, kd_term = original(*args, **kwargs)
        if calls["n"] == (step - 1) * accumulation + 1:
            loss = loss * float("nan")
        return loss, ce, kd_term

    monkeypatch.setattr(kd.train, "compute_loss", compute_loss)


def test_non_finite_loss_stops_naming_the_step_and_keeps_checkpoints(
    assets, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    cfg = make_config(assets, out, max_steps_per_epoch=4, save_every_n_steps=1, keep_last_n=4)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    _nan_at_step(monkeypatch, 3, accumulation=cfg["gradient_accumulation_steps"])
    assert cli.main([*RUN, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (error,) = [line for line in err.splitlines() if line.startswith("kd: error:")]
    assert error.startswith("kd: error: step 3: non-finite loss (nan)")
    latest = checkpoint.find_latest_checkpoint(out)
    assert latest == out / "step_000002"
    assert f"the last good checkpoint is {latest}" in error
    assert not (out / "step_000003").exists() and not (out / "final").exists()
    assert all(t.isfinite().all() for t in checkpoint.load_hf_weights(latest).values())
    assert checkpoint.load_recipe_state(latest)["global_step"] == 2


def test_max_bad_steps_skips_non_finite_steps(assets, tmp_path, caplog, monkeypatch):
    out = tmp_path / "run"
    cfg = make_config(
        assets, out, max_steps_per_epoch=4, save_every_n_steps=1, keep_last_n=4, max_bad_steps=1
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    _nan_at_step(monkeypatch, 3, accumulation=cfg["gradient_accumulation_steps"])
    assert cli.main([*RUN, "--config", str(config)]) == 0
    assert "step 3: non-finite loss (nan)" in caplog.text and "step skipped" in caplog.text
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["loss"] != rows[2]["loss"]  # NaN
    # The skipped step leaves the weights as they were; the next step trains again.
    w2, w3, w4 = (load_file(out / f"step_00000{s}" / "model.safetensors") for s in (2, 3, 4))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)
    assert not all(torch.equal(w3[k], w4[k]) for k in w3)
    assert all(t.isfinite().all() for t in load_file(out / "final" / "model.safetensors").values())


def test_disk_full_while_saving_keeps_previous_checkpoint(assets, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    cfg = make_config(assets, out, max_steps_per_epoch=3, save_every_n_steps=1)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    original = kd.checkpoint.hf_folder.save_file
    calls = {"n": 0}

    def save_file(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:  # the save of step 2: half a file, then the disk is full
            Path(filename).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(tensors, filename, metadata=metadata)

    monkeypatch.setattr(kd.checkpoint.hf_folder, "save_file", save_file)
    assert cli.main([*RUN, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (error,) = [line for line in err.splitlines() if line.startswith("kd: error:")]
    assert "could not write checkpoint" in error and "No space left on device" in error
    assert "free disk space" in error
    assert checkpoint.find_latest_checkpoint(out) == out / "step_000001"
    assert checkpoint.load_recipe_state(out / "step_000001")["global_step"] == 1
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step_", ".tmp"))) == [
        "step_000001"
    ]


def test_bad_row_during_training_names_the_step(assets, tmp_path, capsys):
    out = tmp_path / "run"
    # 32 reads by the setup check, 8 per step (batch 4 x accumulation 2): step 3 meets the bad row.
    cfg = make_config(assets, out, max_steps_per_epoch=4, save_every_n_steps=1, shuffle=False)
    cfg["dataset"] = {"_component_": f"{__name__}.RowFailsLater"}
    cfg["trust_remote_components"] = True
    config = write_config(tmp_path / "cfg.yaml", cfg)
    assert cli.main([*RUN, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (error,) = [line for line in err.splitlines() if line.startswith("kd: error:")]
    assert error.startswith("kd: error: dataset: reading the batches of step 3 failed (KeyError")
    assert checkpoint.find_latest_checkpoint(out) == out / "step_000002"


# ---------------------------------------------------------------------------------------------
# Through the terminal: nothing but the error line
# ---------------------------------------------------------------------------------------------


def _kd(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kd.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_refused_component_runs_nothing_subprocess(assets, tmp_path):
    pwned = tmp_path / "pwned"
    cfg = make_config(assets, tmp_path / "run")
    cfg["metric_logger"] = {"_component_": "os.system", "command": f"touch {pwned}"}
    proc = _kd(*RUN, "--config", str(write_config(tmp_path / "cfg.yaml", cfg)))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "kd: error: metric_logger._component_: os.system is not something metric_logger may build "
        "(allowed: kd.metrics.StdoutLogger, kd.metrics.WandBLogger or a "
        "torchtune.training.metric_logging logger); set trust_remote_components: true only if you "
        "trust whoever wrote this config"
    ]
    assert not pwned.exists() and not (tmp_path / "run").exists()


def test_error_inside_the_recipe_subprocess(assets, tmp_path):
    """An error found after the dataset is built (torch, torchtune and the models' shapes loaded)."""
    cfg = make_config(assets, tmp_path / "run")
    rows = [{"input": "1+" * 60, "output": "2"}] * 8
    cfg["dataset"]["data_files"] = write_json(tmp_path / "long.json", rows)
    proc = _kd(*RUN, "--config", str(write_config(tmp_path / "cfg.yaml", cfg)))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kd: error:")]
    assert errors == [
        "kd: error: tokenizer.max_seq_len: every example checked (8 of 8) is at least 64 tokens, "
        "so truncation removed every response token; raise tokenizer.max_seq_len or shorten the "
        "prompts"
    ]
    assert not (tmp_path / "run").exists()
