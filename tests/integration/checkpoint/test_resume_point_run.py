"""Exact resume and signals, through the paths a user takes.

The reference is one uninterrupted run (CPU, fp32, shuffling, gradient accumulation, AdamW, warmup +
cosine schedule, two epochs). Every interrupted-and-resumed run must end with ``final/`` weights
bit-identical to it (``torch.equal``) and the same metric rows.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kd import checkpoint, cli
from tests.conftest import UNTIMED, make_config, read_metrics, sigterm_at_step, write_config

# One intra-op thread (tests/conftest.py): the same float reductions in every run.
pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = ["run", "kd_single_device"]
# Fields that depend on wall time or memory, not on the trajectory.


def trajectory_config(assets: dict, out: Path, **top) -> dict:
    """8 optimizer steps over 2 epochs; every knob that carries state across a resume is on."""
    base = dict(
        shuffle=True,
        batch_size=4,
        gradient_accumulation_steps=2,
        epochs=2,
        max_steps_per_epoch=4,
        save_every_n_steps=2,
        keep_last_n=2,
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-3, "weight_decay": 0.01},
        lr_scheduler={
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 2,
        },
        metric_logger={"_component_": "kd.metrics.StdoutLogger"},
    )
    base.update(top)
    return make_config(assets, out, **base)


def run_cli(config: Path, *overrides: str) -> int:
    return cli.main([*RECIPE, "--config", str(config), *overrides])


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def assert_bit_identical(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def metric_rows(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in UNTIMED} for r in read_metrics(out)]


def assert_same_metrics(a: Path, b: Path) -> None:
    ra, rb = metric_rows(a), metric_rows(b)
    # The resumed run trims the rows a killed run logged after its checkpoint: one row per step.
    assert [r["step"] for r in rb] == list(range(1, len(rb) + 1))
    assert ra == rb


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def subprocess_env() -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def start_cli(config: Path, log: Path, *overrides: str) -> subprocess.Popen:
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "kd.cli", *RECIPE, "--config", str(config), *overrides],
            stdout=out,
            stderr=err,
            env=subprocess_env(),
        )


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the event"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory) -> Path:
    """The uninterrupted run (in-process); its output folder."""
    root = tmp_path_factory.mktemp("reference")
    out = root / "run"
    config = write_config(root / "cfg.yaml", trajectory_config(assets, out))
    assert run_cli(config) == 0
    assert (out / "final" / "model.safetensors").exists()
    return out


# ---------------------------------------------------------------------------------------------
# kill -9 and SIGTERM through the command line
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kill_9_after_checkpoint_then_resume_is_bit_identical(assets, reference, tmp_path):
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", trajectory_config(assets, out))
    marker = out / checkpoint.step_dirname(2) / checkpoint.MARKER_FILE
    proc = start_cli(config, tmp_path / "killed")
    try:
        wait_for(marker.exists, proc)
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "final").exists()
    resumed_from = checkpoint.read_checkpoint_marker(checkpoint.find_latest_checkpoint(out))
    assert resumed_from["step"] < 8

    proc = start_cli(config, tmp_path / "resumed", "resume_from_checkpoint=true")
    assert proc.wait(timeout=300) == 0, (tmp_path / "resumed.err").read_text()[-2000:]
    assert "Traceback" not in (tmp_path / "resumed.err").read_text()
    assert_bit_identical(reference, out)
    assert_same_metrics(reference, out)


@pytest.mark.slow
def test_sigterm_saves_prints_resume_command_and_exits_0(assets, reference, tmp_path):
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", trajectory_config(assets, out))
    metrics = out / "metrics.jsonl"
    proc = start_cli(config, tmp_path / "stopped")
    try:
        wait_for(lambda: metrics.exists() and metrics.read_text().strip() != "", proc)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    stderr = (tmp_path / "stopped.err").read_text()
    assert code == 0, stderr[-2000:]
    assert "Traceback" not in stderr
    latest = checkpoint.find_latest_checkpoint(out)
    assert latest is not None and not (out / "final").exists()
    step = checkpoint.read_checkpoint_marker(latest)["step"]
    assert step == read_metrics(out)[-1]["step"] < 8
    assert f"stopped after step {step}" in stderr
    assert stderr.count(f"saved checkpoint {latest}") == 1  # once, not again in the hint
    hint = (
        f"to resume from {latest}, run: kd run kd_single_device --config {config} "
        "resume_from_checkpoint=True"
    )
    assert hint in stderr

    # The printed command, run as printed, finishes the run where the uninterrupted one ends.
    assert run_cli(config, "resume_from_checkpoint=True") == 0
    assert_bit_identical(reference, out)
    assert_same_metrics(reference, out)


# ---------------------------------------------------------------------------------------------
# In-process interruptions (a real SIGTERM to this process), full and LoRA students
# ---------------------------------------------------------------------------------------------


def test_sigterm_mid_epoch_then_resume_is_bit_identical(assets, reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", trajectory_config(assets, out))
    with monkeypatch.context() as m:
        sigterm_at_step(m, 3)  # mid epoch 0; the resumed run crosses into epoch 1
        assert run_cli(config) == 0
    assert checkpoint.read_checkpoint_marker(checkpoint.find_latest_checkpoint(out))["step"] == 3
    assert not (out / "final").exists()
    assert run_cli(config, "resume_from_checkpoint=true") == 0
    assert_bit_identical(reference, out)
    assert_same_metrics(reference, out)


def test_lora_with_seed_null_resumes_bit_identical(assets, tmp_path, monkeypatch):
    """LoRA restores adapters and their optimizer state; ``seed: null`` adopts the saved seed."""
    out = tmp_path / "run"
    config = write_config(
        tmp_path / "cfg.yaml", trajectory_config(assets, out, lora=True, seed=None)
    )
    with monkeypatch.context() as m:
        sigterm_at_step(m, 5)
        assert run_cli(config) == 0
    latest = checkpoint.find_latest_checkpoint(out)
    seed = yaml.safe_load(checkpoint.load_checkpoint_config(latest))["seed"]
    assert isinstance(seed, int)
    assert run_cli(config, "resume_from_checkpoint=true") == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["seed"] == seed

    ref = tmp_path / "ref"
    ref_config = write_config(
        tmp_path / "ref.yaml", trajectory_config(assets, ref, lora=True, seed=seed)
    )
    assert run_cli(ref_config) == 0
    assert_bit_identical(ref, out)
    assert_same_metrics(ref, out)
    adapter_a = load_file(ref / "final" / "adapter" / "adapter_model.safetensors")
    adapter_b = load_file(out / "final" / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(adapter_a[k], adapter_b[k]) for k in adapter_a)


def test_adamw8bit_state_resumes_bit_identical(assets, tmp_path, monkeypatch):
    """torchao's quantized optimizer states (a tensor subclass) survive a weights_only checkpoint."""
    optimizer = {"_component_": "torchao.optim.AdamW8bit", "lr": 2e-3}
    ref = tmp_path / "ref"
    ref_config = write_config(
        tmp_path / "ref.yaml", trajectory_config(assets, ref, optimizer=optimizer)
    )
    assert run_cli(ref_config) == 0
    out = tmp_path / "run"
    config = write_config(
        tmp_path / "cfg.yaml", trajectory_config(assets, out, optimizer=optimizer)
    )
    with monkeypatch.context() as m:
        sigterm_at_step(m, 3)
        assert run_cli(config) == 0
    assert run_cli(config, "resume_from_checkpoint=true") == 0
    assert_bit_identical(ref, out)
    assert_same_metrics(ref, out)


def test_resume_skips_corrupt_newest_checkpoint(assets, reference, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "final")
    newest = checkpoint.find_latest_checkpoint(out)
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # torn write
    config = write_config(tmp_path / "cfg.yaml", trajectory_config(assets, out))
    assert run_cli(config, "resume_from_checkpoint=true") == 0
    assert f"skipping checkpoint {newest}" in caplog.text
    assert_bit_identical(reference, out)


# ---------------------------------------------------------------------------------------------
# Resume mistakes: exit 2, one line naming the key, nothing written
# ---------------------------------------------------------------------------------------------


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("kd: error:")]


def test_resume_with_changed_config_names_the_key(assets, reference, tmp_path, capsys):
    before = snapshot(reference)
    config = write_config(
        tmp_path / "cfg.yaml", trajectory_config(assets, reference, kd_ratio=0.25)
    )
    assert run_cli(config, "resume_from_checkpoint=true") == 2
    errors = _errors(capsys)
    assert any(e.startswith("kd: error: kd_ratio: 0.5 in the checkpoint, 0.25 now") for e in errors)
    assert any("resume_from_checkpoint" in e for e in errors)
    assert snapshot(reference) == before


def test_resume_with_changed_max_steps_per_epoch_mid_epoch(assets, reference, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    config = write_config(tmp_path / "cfg.yaml", trajectory_config(assets, out))
    shutil.rmtree(out / checkpoint.step_dirname(8))  # newest is now step 6: epoch 1, 2 steps in
    before = snapshot(out)
    assert run_cli(config, "resume_from_checkpoint=true", "max_steps_per_epoch=8") == 2
    (error,) = _errors(capsys)
    assert error.startswith("kd: error: max_steps_per_epoch:")
    assert snapshot(out) == before


def test_resume_without_checkpoint(assets, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    config = write_config(tmp_path / "cfg.yaml", trajectory_config(assets, out))
    assert run_cli(config, "resume_from_checkpoint=true") == 2
    (error,) = _errors(capsys)
    assert "resume_from_checkpoint: no complete checkpoint under" in error
    assert snapshot(out) == {"notes.txt": b"kept"}


def test_fresh_run_into_folder_with_checkpoints(assets, reference, tmp_path, capsys):
    before = snapshot(reference)
    config = write_config(tmp_path / "cfg.yaml", trajectory_config(assets, reference))
    assert run_cli(config) == 2
    (error,) = _errors(capsys)
    assert error.startswith("kd: error: output_dir:") and "resume_from_checkpoint=true" in error
    assert snapshot(reference) == before


def test_sgd_without_state_resumes_bit_identical(assets, tmp_path, monkeypatch):
    """An optimizer with no per-parameter state (SGD without momentum) resumes too: only its
    groups' settings are restored."""
    sgd = {"_component_": "torch.optim.SGD", "lr": 0.05}
    ref = tmp_path / "ref"
    assert (
        run_cli(write_config(tmp_path / "ref.yaml", trajectory_config(assets, ref, optimizer=sgd)))
        == 0
    )
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", trajectory_config(assets, out, optimizer=sgd))
    with monkeypatch.context() as m:
        sigterm_at_step(m, 3)
        assert run_cli(config) == 0
    assert run_cli(config, "resume_from_checkpoint=true") == 0
    assert_bit_identical(ref, out)
    assert_same_metrics(ref, out)


# ---------------------------------------------------------------------------------------------
# Resume says what changed (issue 23 item 9)
# ---------------------------------------------------------------------------------------------
def test_resume_of_a_finished_run_says_already_complete(assets, reference, tmp_path, capsys):
    """resume_from_checkpoint=true on a finished run: one line, exit 0, no step trained, final/
    and metrics.jsonl untouched (byte for byte, mtimes too)."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    config = write_config(tmp_path / "cfg.yaml", trajectory_config(assets, out))
    before = snapshot(out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert run_cli(config, "resume_from_checkpoint=true") == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "kd: error" not in captured.err
    (line,) = [x for x in captured.err.splitlines() if "already complete" in x]
    assert f"the run in {out} is already complete" in line and "step 8" in line
    assert "step " not in captured.out  # no metric row: nothing trained
    assert snapshot(out) == before
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes


def test_resume_of_a_finished_run_with_seed_null_says_already_complete(assets, tmp_path, capsys):
    """``seed: null`` resumes as the seed the run drew: a finished run says it is complete
    (exit 0, nothing written), not that the seed differs."""
    out = tmp_path / "run"
    config = write_config(
        tmp_path / "cfg.yaml", trajectory_config(assets, out, seed=None, epochs=1)
    )
    assert run_cli(config) == 0
    seed = yaml.safe_load((out / "final" / "config.yaml").read_text())["seed"]
    assert isinstance(seed, int)
    before = snapshot(out)
    capsys.readouterr()
    assert run_cli(config, "resume_from_checkpoint=true") == 0
    err = capsys.readouterr().err
    assert "kd: error" not in err, err
    (line,) = [x for x in err.splitlines() if "already complete" in x]
    assert f"the run in {out} is already complete" in line and "step 4" in line
    assert snapshot(out) == before
    # A set seed other than the run's is still a change.
    assert run_cli(config, "resume_from_checkpoint=true", f"seed={seed + 1}") == 2
    assert any(
        e.startswith(f"kd: error: seed: {seed} in the checkpoint, {seed + 1} now")
        for e in _errors(capsys)
    )


def test_resume_with_another_teacher_says_so_in_the_users_terms(
    assets, reference, tmp_path, capsys
):
    """The teacher changed (a ``teachers:`` member in place of teacher_model): one line per
    teacher key, in YAML terms (null, not set), not a line per leaf of each node."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    cfg = trajectory_config(assets, out)
    member = {
        "name": "a",
        "teacher_model": cfg.pop("teacher_model"),
        "teacher_checkpointer": cfg.pop("teacher_checkpointer"),
    }
    cfg["teachers"] = {"members": [member]}
    before = snapshot(out)
    assert run_cli(write_config(tmp_path / "cfg.yaml", cfg), "resume_from_checkpoint=true") == 2
    errors = _errors(capsys)
    assert errors[:3] == [
        "kd: error: teacher_checkpointer: {_component_: "
        "torchtune.training.FullModelHFCheckpointer, ...} in the checkpoint, not set now",
        "kd: error: teacher_model: {_component_: torchtune.models.qwen2.qwen2, ...} in the "
        "checkpoint, not set now",
        errors[2],
    ]
    assert errors[2].startswith("kd: error: teachers: null in the checkpoint, {combine: weights")
    assert len(errors) == 4 and "resume_from_checkpoint:" in errors[3]
    assert not any("None" in e or "unset" in e for e in errors), errors
    assert snapshot(out) == before


def test_resume_with_more_epochs_and_a_cosine_schedule_is_refused(
    assets, reference, tmp_path, capsys
):
    """epochs 2 -> 3 stretches the cosine over 12 steps: the lr of step 9 would jump."""
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    config = write_config(tmp_path / "cfg.yaml", trajectory_config(assets, out))
    before = snapshot(out)
    assert run_cli(config, "resume_from_checkpoint=true", "epochs=3") == 2
    (error,) = _errors(capsys)
    assert error.startswith(
        "kd: error: epochs: the schedule jumps on resume (epochs 2 -> 3: 8 -> 12"
    )
    assert "resume with epochs=2, or start a new run" in error
    assert snapshot(out) == before


def test_resume_with_more_epochs_and_a_constant_lr_continues(assets, tmp_path, capsys):
    """Without a scheduler the schedule stays continuous: one line says what changed, and the
    run trains epoch 3 from step 8 to 12."""
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", trajectory_config(assets, out, lr_scheduler=None))
    assert run_cli(config) == 0
    capsys.readouterr()
    assert run_cli(config, "resume_from_checkpoint=true", "epochs=3") == 0
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "resume_from_checkpoint: epochs" in x]
    assert "epochs 2 -> 3: 8 -> 12 steps, continuing from step 8" in line
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 13))
    assert checkpoint.read_checkpoint_marker(out / "final")["step"] == 12


def test_resume_with_a_moved_identical_model_folder(assets, tmp_path, capsys):
    """The student, teacher and tokenizer folders moved (same files): the resume is accepted, as
    the message promises (paths may change), and says so; a moved folder whose config.json
    differs from the checkpoint's copy is refused, naming the key."""
    here = {k: tmp_path / "a" / v.name for k, v in assets.items()}
    for key, src in assets.items():
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, here[key])
    out = tmp_path / "run"
    cfg = trajectory_config(here, out, epochs=1)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    assert run_cli(config) == 0
    shutil.rmtree(out / "final")
    shutil.rmtree(out / checkpoint.step_dirname(4))  # newest: step 2
    (tmp_path / "a").rename(tmp_path / "b")
    moved = {k: tmp_path / "b" / v.name for k, v in assets.items()}
    config = write_config(tmp_path / "moved.yaml", trajectory_config(moved, out, epochs=1))
    capsys.readouterr()
    assert run_cli(config, "resume_from_checkpoint=true") == 0
    err = capsys.readouterr().err
    assert "kd: error" not in err
    assert f"checkpointer.checkpoint_dir moved from {here['student']} to {moved['student']}" in err
    assert checkpoint.read_checkpoint_marker(out / "final")["step"] == 4
    # Another student config in the moved folder: not the same model.
    shutil.rmtree(out / "final")
    shutil.rmtree(out / checkpoint.step_dirname(4))
    (tmp_path / "b").rename(tmp_path / "c")
    other = {k: tmp_path / "c" / v.name for k, v in assets.items()}
    hf_config = other["student"] / "config.json"
    hf_config.write_text(hf_config.read_text().replace("{", '{"note": "edited",', 1))
    config = write_config(tmp_path / "other.yaml", trajectory_config(other, out, epochs=1))
    assert run_cli(config, "resume_from_checkpoint=true") == 2
    errors = _errors(capsys)
    assert any(e.startswith("kd: error: checkpointer.checkpoint_dir: ") for e in errors), errors
