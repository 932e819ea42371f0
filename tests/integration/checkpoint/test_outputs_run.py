"""No finished run is lost: one run per output_dir (an OS lock), a fresh run never writes over
another run's outputs (resume, another folder, or overwrite_output_dir moving them aside), the
final save survives SIGTERM and kill -9, and ``output_dir: ""`` is refused.

Through the command line; the runs that must hold a lock or be killed are subprocesses."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kd.runtime.checkpoints
from kd import checkpoint, cli
from kd.checkpoint import outputs
from tests.conftest import make_config, read_metrics, write_config

RUN = ["run", "kd_single_device"]


def run_config(assets: dict, out: Path, **top) -> dict:
    """3 optimizer steps, a step checkpoint at the last one (so the run can be resumed)."""
    return make_config(assets, out, **{"save_every_n_steps": 3, **top})


def tree_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under folder (the lock file aside), by relative path."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != outputs.LOCK_FILE
    }


def errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("kd: error:")]


def subprocess_env() -> dict[str, str]:
    src = str(Path(kd.checkpoint.__file__).parents[2])
    path = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def wait_for(predicate, proc: subprocess.Popen, err: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}): {err.read_text()[-2000:]}")
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.01)


def assert_final_complete(out: Path) -> dict[str, torch.Tensor]:
    """final/ is complete (marker, every listed file at its size) and its weights load."""
    final = out / checkpoint.FINAL_DIRNAME
    marker = checkpoint.read_checkpoint_marker(final)
    for name, entry in marker["files"].items():
        assert (final / name).stat().st_size == entry["size"], name
    weights = load_file(final / checkpoint.MODEL_FILE)
    assert weights and all(t.isfinite().all() for t in weights.values())
    return weights


@pytest.fixture(scope="module")
def finished(assets, tmp_path_factory) -> Path:
    """A finished run's output folder (final/, step_000003/, metrics.jsonl, config.yaml)."""
    root = tmp_path_factory.mktemp("finished")
    out = root / "run"
    config = write_config(root / "cfg.yaml", run_config(assets, out))
    assert cli.main([*RUN, "--config", str(config)]) == 0
    assert not (out / outputs.LOCK_FILE).exists()  # released and removed at the end
    return out


# ---------------------------------------------------------------------------------------------
# A fresh run into another run's outputs
# ---------------------------------------------------------------------------------------------


def test_second_fresh_run_is_refused_and_touches_nothing(assets, finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = tree_hashes(out)
    config = write_config(tmp_path / "cfg.yaml", run_config(assets, out, kd_ratio=0.25))
    for command in ("run", "validate"):
        argv = [*RUN, "--config", str(config)] if command == "run" else ["validate", "--config"]
        if command == "validate":
            argv.append(str(config))
        assert cli.main(argv) == 2
        (error,) = errors(capsys)
        assert error.startswith(f"kd: error: output_dir: {out} holds the outputs of another run")
        assert "final/" in error and "metrics.jsonl" in error
        assert "set resume_from_checkpoint=true to continue it" in error
        assert "choose another output_dir" in error and "overwrite_output_dir=true" in error
        assert tree_hashes(out) == before
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in finished.iterdir())


def test_overwrite_moves_the_old_outputs_aside(assets, finished, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = tree_hashes(out)
    config = write_config(
        tmp_path / "cfg.yaml", run_config(assets, out, kd_ratio=0.25, overwrite_output_dir=True)
    )
    # kd validate checks, and moves nothing.
    assert cli.main(["validate", "--config", str(config)]) == 0
    assert tree_hashes(out) == before

    assert cli.main([*RUN, "--config", str(config)]) == 0
    (previous,) = out.glob(f"{outputs.PREVIOUS_PREFIX}*")
    moved = [r for r in caplog.messages if r.startswith("overwrite_output_dir: moved")]
    assert moved == [
        f"overwrite_output_dir: moved the earlier outputs in {out} "
        f"(config.yaml, final, metrics.jsonl, step_000003) into {previous}"
    ]
    after = tree_hashes(out)
    assert {k.split("/", 1)[1]: v for k, v in after.items() if k.startswith(previous.name)} == (
        before
    )
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]  # the new run's rows only
    assert "kd_ratio: 0.25" in (out / "config.yaml").read_text()
    new, old = assert_final_complete(out), load_file(previous / "final" / checkpoint.MODEL_FILE)
    assert not all(torch.equal(new[k], old[k]) for k in new)
    assert not (out / outputs.LOCK_FILE).exists()


def test_restart_after_crash_before_first_checkpoint_is_refused(assets, finished, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("metrics.jsonl", "config.yaml"):  # what a run writes before its first save
        shutil.copyfile(finished / name, out / name)
    before = tree_hashes(out)
    config = write_config(tmp_path / "cfg.yaml", run_config(assets, out))
    assert cli.main([*RUN, "--config", str(config)]) == 2
    (error,) = errors(capsys)
    assert error.startswith(f"kd: error: output_dir: {out} holds the outputs of another run")
    assert "no complete step checkpoint" in error and "overwrite_output_dir=true" in error
    assert cli.main([*RUN, "--config", str(config), "resume_from_checkpoint=true"]) == 2
    (error,) = errors(capsys)
    assert error.startswith("kd: error: resume_from_checkpoint: no complete checkpoint under")
    assert "overwrite_output_dir=true" in error
    assert tree_hashes(out) == before


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_output_dir_is_a_config_error(assets, tmp_path, capsys, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    cfg = run_config(assets, tmp_path / "unused")
    cfg["output_dir"] = value
    config = write_config(tmp_path / "cfg.yaml", cfg)
    assert cli.main([*RUN, "--config", str(config)]) == 2
    (error,) = errors(capsys)
    assert error.startswith("kd: error: output_dir: is empty; set output_dir to the folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]


def test_overwrite_with_resume_is_a_config_error(assets, tmp_path, capsys):
    cfg = run_config(assets, tmp_path / "run", overwrite_output_dir=True)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    assert cli.main([*RUN, "--config", str(config), "resume_from_checkpoint=true"]) == 2
    (error,) = errors(capsys)
    assert error.startswith("kd: error: overwrite_output_dir: true moves aside the checkpoints")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# Two runs at once
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # a subprocess run: ~10 s idle, ~25 s on busy cores
def test_second_concurrent_run_is_refused_and_the_first_completes(assets, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = run_config(assets, out, max_steps_per_epoch=6, save_every_n_steps=2)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    err = tmp_path / "first.err"
    with open(err, "w") as stderr:
        first = subprocess.Popen(
            [sys.executable, "-m", "kd.cli", *RUN, "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=subprocess_env(),
        )
    try:
        wait_for(
            lambda: (h := outputs.lock_holder(out)) is not None and h.pid == first.pid, first, err
        )
        # Paused, the first run holds the lock for the whole life of the second, however busy
        # the machine is, and writes nothing meanwhile: any change would be the second's.
        first.send_signal(signal.SIGSTOP)
        before = tree_hashes(out)
        for extra in ([], ["resume_from_checkpoint=true"]):
            assert cli.main([*RUN, "--config", str(config), *extra]) == 2
            (error,) = errors(capsys)
            assert error.startswith(
                f"kd: error: output_dir: {out} is in use by another kd run (pid {first.pid}, "
                "started at "
            )
            assert error.endswith("; wait for it or choose another output_dir")
        assert cli.main(["validate", "--config", str(config)]) == 2
        assert "is in use by another kd run" in errors(capsys)[0]
        assert tree_hashes(out) == before
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0, err.read_text()[-2000:]
    finally:
        first.send_signal(signal.SIGCONT)
        first.kill()
        first.wait()
    assert "Traceback" not in err.read_text()
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert_final_complete(out)
    assert not (out / outputs.LOCK_FILE).exists()


# ---------------------------------------------------------------------------------------------
# Signals and kill -9 during the final save
# ---------------------------------------------------------------------------------------------


class _UnhandledSignal(Exception):
    pass


def test_sigterm_during_final_save_completes_it_and_exits_0(
    assets, finished, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", run_config(assets, out))
    original = kd.checkpoint.hf_folder.save_hf_model
    sent = []

    def save_then_signal(dest, *args, **kwargs):
        if Path(dest).name.startswith(".tmp_final"):
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, mid-save
            sent.append(dest)
            for _ in range(1000):  # the handler runs between bytecodes of this thread
                pass
        return original(dest, *args, **kwargs)

    def unhandled(signum, frame):
        raise _UnhandledSignal  # instead of killing pytest when kd does not handle it

    monkeypatch.setattr(kd.checkpoint.hf_folder, "save_hf_model", save_then_signal)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        code = cli.main([*RUN, "--config", str(config)])
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert sent and code == 0, err[-2000:]
    assert "Traceback" not in err
    assert "received SIGTERM: finishing the final save" in err
    final = out / checkpoint.FINAL_DIRNAME
    assert (
        f"kd: received SIGTERM at the end of training; saved {final} (the run is complete)" in err
    )
    weights = assert_final_complete(out)
    reference = load_file(finished / "final" / checkpoint.MODEL_FILE)
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
    assert not list(out.glob(".tmp_*"))


_KILLED_IN_FINAL_SAVE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import kd.checkpoint.hf_folder as hf_folder
    from kd import cli

    original = hf_folder.save_hf_model

    def slow_final_save(dest, *args, **kwargs):
        original(dest, *args, **kwargs)
        if Path(dest).name.startswith(".tmp_final"):
            Path(sys.argv[1]).write_text(str(dest))  # the weights are written, the marker is not
            time.sleep(300)

    hf_folder.save_hf_model = slow_final_save
    sys.exit(cli.main(sys.argv[2:]))
    """
)


@pytest.mark.slow  # a subprocess run: ~10 s idle, ~25 s on busy cores
def test_kill_9_during_final_save_leaves_no_final_then_resume_completes(assets, finished, tmp_path):
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", run_config(assets, out))
    flag, err = tmp_path / "in_final_save", tmp_path / "killed.err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_IN_FINAL_SAVE, str(flag), *RUN, "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=subprocess_env(),
        )
    try:
        wait_for(flag.exists, proc, err)
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "final").exists()  # never a partial final/
    (tmp,) = out.glob(".tmp_final_*")
    assert (tmp / checkpoint.MODEL_FILE).exists() and not (tmp / checkpoint.MARKER_FILE).exists()
    assert (out / outputs.LOCK_FILE).exists() and outputs.lock_holder(out) is None

    # The next run (resume: all steps are done) writes final/ and removes the temporary folder.
    assert cli.main([*RUN, "--config", str(config), "resume_from_checkpoint=true"]) == 0
    assert not list(out.glob(".tmp_*")) and not (out / outputs.LOCK_FILE).exists()
    weights = assert_final_complete(out)
    reference = load_file(finished / "final" / checkpoint.MODEL_FILE)
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
