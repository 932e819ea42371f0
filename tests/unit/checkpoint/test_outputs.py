"""kd.checkpoint.outputs: the output_dir lock, what counts as another run's outputs, moving them aside; and
kd.checkpoint.recover_interrupted_saves (a save killed between its two renames)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kd import checkpoint
from kd.checkpoint import outputs, resume_point
from kd.errors import KDUserError


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_lock_is_exclusive_records_the_holder_and_is_removed_on_release(tmp_path: Path) -> None:
    out = tmp_path / "new" / "run"
    assert outputs.lock_holder(out) is None
    lock = outputs.lock_output_dir(out)  # creates the folder
    assert lock.held
    info = json.loads((out / outputs.LOCK_FILE).read_text())
    assert info["pid"] == os.getpid()
    holder = outputs.lock_holder(out)
    assert holder is not None and holder.pid == os.getpid()
    # flock locks belong to an open file: a second open in this process conflicts like a process.
    with pytest.raises(KDUserError) as e:
        outputs.lock_output_dir(out, wait_s=0.1)
    assert str(e.value) == (
        f"output_dir: {out} is in use by another kd run (pid {os.getpid()}, started at "
        f"{info['started']}); wait for it or choose another output_dir"
    )
    with pytest.raises(KDUserError, match="is in use by another kd run"):
        outputs.check_not_in_use(out)
    lock.release()
    lock.release()  # idempotent
    assert not lock.held and not (out / outputs.LOCK_FILE).exists()
    assert outputs.lock_holder(out) is None
    outputs.check_not_in_use(out)
    with outputs.lock_output_dir(out) as again:
        assert again.held
    assert list(out.iterdir()) == []


def test_lock_left_by_a_killed_process_is_free(tmp_path: Path) -> None:
    out = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import os, sys
        from kd.checkpoint import outputs
        outputs.lock_output_dir({str(out)!r})
        print("locked", flush=True)
        sys.stdin.read()
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout.readline().strip() == b"locked"
        holder = outputs.lock_holder(out)
        assert holder is not None and holder.pid == proc.pid
        with pytest.raises(KDUserError, match=f"pid {proc.pid}, started at "):
            outputs.lock_output_dir(out, wait_s=0.1)
        proc.kill()
        proc.wait()
    finally:
        proc.kill()
        proc.wait()
    # The file stays behind (kill -9), the lock does not.
    assert (out / outputs.LOCK_FILE).exists()
    assert outputs.lock_holder(out) is None
    lock = outputs.lock_output_dir(out, wait_s=0)
    assert json.loads((out / outputs.LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_run_outputs_and_fresh_run_refusal(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert outputs.run_outputs(out) == []
    assert outputs.check_fresh_output_dir(out, overwrite=False) == []
    out.mkdir()
    for name in ("notes.txt", outputs.LOCK_FILE):
        (out / name).write_text("x")
    (out / "previous_20250101-000000").mkdir()
    (out / ".tmp_step_000002_1").mkdir()
    assert outputs.check_fresh_output_dir(out, overwrite=False) == []  # nothing of a run

    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(KDUserError) as e:
        outputs.check_fresh_output_dir(out, overwrite=False)
    message = str(e.value)
    assert message.startswith(f"output_dir: {out} holds the outputs of another run (")
    assert "config.yaml, metrics.jsonl" in message
    assert "no complete step checkpoint" in message and "resume_from_checkpoint" not in message
    assert "choose another output_dir" in message and "overwrite_output_dir=true" in message

    (out / "step_000002").mkdir()  # incomplete: no marker
    assert not outputs.has_complete_step(out)
    (out / "step_000002" / checkpoint.MARKER_FILE).write_text("{}")
    (out / "final").mkdir()
    assert outputs.has_complete_step(out)
    with pytest.raises(KDUserError, match="set resume_from_checkpoint=true to continue it"):
        outputs.check_fresh_output_dir(out, overwrite=False)
    found = outputs.check_fresh_output_dir(out, overwrite=True)
    assert [p.name for p in found] == ["config.yaml", "final", "metrics.jsonl", "step_000002"]


def test_move_aside_renames_and_keeps_everything(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"weights")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("mine")
    before = _files(out)
    dest = outputs.move_aside(out, outputs.run_outputs(out))
    assert dest.parent == out and dest.name.startswith(outputs.PREVIOUS_PREFIX)
    assert outputs.run_outputs(out) == []
    after = _files(out)
    assert after["notes.txt"] == b"mine"
    moved = {k.split("/", 1)[1]: v for k, v in after.items() if k.startswith(dest.name)}
    assert moved == {k: v for k, v in before.items() if k != "notes.txt"}
    # A second move in the same second gets a folder of its own.
    (out / "metrics.jsonl").write_text("again\n")
    second = outputs.move_aside(out, outputs.run_outputs(out))
    assert second != dest and (second / "metrics.jsonl").read_text() == "again\n"


def test_recover_interrupted_saves_puts_back_the_replaced_folder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Killed between "final -> .tmp_old_final_<pid>" and ".tmp_final_<pid> -> final".
    old = out / ".tmp_old_final_999999999"
    old.mkdir(parents=True)
    (old / checkpoint.MARKER_FILE).write_text("{}")
    (out / ".tmp_final_999999999").mkdir()
    (out / ".tmp_del_step_000002_999999999").mkdir()  # a pruned folder: never put back
    partial = out / ".tmp_old_step_000004_999999999"
    partial.mkdir()  # no marker: not a complete folder
    assert checkpoint.recover_interrupted_saves(out) == [out / "final"]
    assert (out / "final" / checkpoint.MARKER_FILE).exists()
    assert not (out / "step_000002").exists() and not (out / "step_000004").exists()


def _step(out: Path, step: int, config_yaml: str = "seed: 7\nlr: 0.1\n") -> Path:
    return checkpoint.save_checkpoint(
        out,
        step,
        epoch=0,
        write_model=lambda d: (d / "model.safetensors").write_bytes(b"weights"),
        recipe_state={"global_step": step},
        config_yaml=config_yaml,
        keep_last_n=3,
    )


def test_find_resume_fresh_runs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert resume_point.find_resume(out, resume=False, overwrite=False) is None
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(KDUserError, match="holds the outputs of another run"):
        resume_point.find_resume(out, resume=False, overwrite=False)
    # Moving them aside waits for the lock (claim_output_dir): nothing moves here.
    assert resume_point.find_resume(out, resume=False, overwrite=True) is None
    assert (out / "metrics.jsonl").exists()


def test_find_resume_without_a_complete_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(KDUserError) as e:
        resume_point.find_resume(out, resume=True, overwrite=False)
    assert str(e.value) == (
        f"resume_from_checkpoint: no complete checkpoint under {out}; "
        "set resume_from_checkpoint=false to start fresh"
    )
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(KDUserError) as e:
        resume_point.find_resume(out, resume=True, overwrite=False)
    assert str(e.value).endswith(
        "start fresh with overwrite_output_dir=true (the earlier outputs are moved aside)"
    )
    (out / "step_000002").mkdir()  # no marker: incomplete
    with pytest.raises(KDUserError) as e:
        resume_point.find_resume(out, resume=True, overwrite=False)
    assert str(e.value) == (
        f"resume_from_checkpoint: every step checkpoint under {out} is incomplete or damaged "
        "(the warnings above say why); set output_dir to a new folder to start fresh"
    )


def test_find_resume_returns_the_newest_checkpoint_and_its_snapshot(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _step(out, 2)
    newest = _step(out, 4, config_yaml="seed: 9\n")
    found = resume_point.find_resume(out, resume=True, overwrite=False)
    assert found == resume_point.ResumePoint(newest, "seed: 9\n", 9)
    _step(out, 6, config_yaml="seed: null\n")
    assert resume_point.find_resume(out, resume=True, overwrite=False).seed is None
    not_a_mapping = _step(out, 8, config_yaml="- a list\n")
    with pytest.raises(KDUserError) as e:
        resume_point.find_resume(out, resume=True, overwrite=False)
    assert str(e.value) == (
        f"{not_a_mapping / 'config.yaml'}: not a readable config snapshot (ValueError: a "
        "ListConfig, not a mapping); delete step_000008 to resume from an older checkpoint"
    )


def test_claim_output_dir_moves_another_runs_outputs_aside_under_the_lock(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(KDUserError, match="holds the outputs of another run"):
        outputs.claim_output_dir(out, resume=False, overwrite=False)
    assert outputs.lock_holder(out) is None and not (out / outputs.LOCK_FILE).exists()
    with outputs.claim_output_dir(out, resume=True, overwrite=False) as lock:
        assert lock.held and (out / "metrics.jsonl").exists()  # a resumed run moves nothing
    with outputs.claim_output_dir(out, resume=False, overwrite=True) as lock:
        assert lock.held and outputs.run_outputs(out) == []
        (moved,) = out.glob(f"{outputs.PREVIOUS_PREFIX}*")
        assert (moved / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_make_checkpointer_output_dir_blames_the_right_key(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    outputs.make_checkpointer_output_dir(None, key="checkpointer", run_dir=run_dir)
    outputs.make_checkpointer_output_dir("", key="checkpointer", run_dir=run_dir)
    assert not run_dir.exists()
    outputs.make_checkpointer_output_dir(str(run_dir / "tt"), key="checkpointer", run_dir=run_dir)
    assert (run_dir / "tt").is_dir()
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(KDUserError) as e:
        outputs.make_checkpointer_output_dir(
            str(blocker / "tt"), key="teacher_checkpointer", run_dir=run_dir
        )
    assert str(e.value) == (
        f"teacher_checkpointer.output_dir: cannot create {blocker / 'tt'} (Not a directory); "
        "set teacher_checkpointer.output_dir to a writable folder with free space"
    )
    # The run's own folder (or one above it) failing is output_dir's problem.
    for run_dir in (blocker / "tt", blocker / "tt" / "run"):
        with pytest.raises(KDUserError) as e:
            outputs.make_checkpointer_output_dir(
                str(blocker / "tt"), key="checkpointer", run_dir=run_dir
            )
        assert str(e.value).startswith(f"output_dir: cannot create {blocker / 'tt'} (Not a ")


def test_open_metrics_writes_the_config_and_trims_a_resumed_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    writer = outputs.open_metrics(out, config_yaml="seed: 1\n", resume_step=None)
    for step in (1, 2, 3):
        outputs.write_metrics_row(writer, {"step": step}, output_dir=out)
    writer.close()
    assert (out / outputs.CONFIG_FILE).read_text() == "seed: 1\n"
    writer = outputs.open_metrics(out, config_yaml="seed: 2\n", resume_step=2)
    outputs.write_metrics_row(writer, {"step": 3, "loss": 1.0}, output_dir=out)
    writer.close()
    rows = [json.loads(line) for line in (out / outputs.METRICS_FILE).read_text().splitlines()]
    assert rows == [{"step": 1}, {"step": 2}, {"step": 3, "loss": 1.0}]
    assert (out / outputs.CONFIG_FILE).read_text() == "seed: 2\n"
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(KDUserError) as e:
        outputs.open_metrics(blocker / "run", config_yaml="", resume_step=None)
    assert str(e.value) == (
        f"output_dir: cannot write to {blocker / 'run'} (Not a directory); "
        "set output_dir to a writable folder with free space"
    )


def test_write_metrics_row_on_a_full_disk(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "run"
    writer = outputs.open_metrics(out, config_yaml="", resume_step=None)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    # With a complete step checkpoint, resume continues (a marker is what makes one complete).
    (out / "step_000004").mkdir()
    (out / "step_000004" / checkpoint.MARKER_FILE).write_text("{}")
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(KDUserError) as e:
        outputs.write_metrics_row(writer, {"step": 5}, output_dir=out)
    assert str(e.value) == (
        f"output_dir: cannot write the step 5 row of {out / 'metrics.jsonl'} (No space left on "
        f"device); free disk space under {out} or set output_dir to a disk with room (the earlier "
        "rows and checkpoints are kept; resume_from_checkpoint=true continues)"
    )


def test_full_disk_before_the_first_checkpoint_offers_no_resume(tmp_path, monkeypatch) -> None:
    """Issue 23: at step 1 nothing resumes; the message says how to start over instead."""
    out = tmp_path / "run"
    writer = outputs.open_metrics(out, config_yaml="", resume_step=None)

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(KDUserError) as e:
        outputs.write_metrics_row(writer, {"step": 1}, output_dir=out)
    assert "resume_from_checkpoint" not in str(e.value)
    assert str(e.value).endswith(
        "(no step checkpoint was saved yet, so nothing resumes: rerun with "
        "overwrite_output_dir=true once there is room)"
    )
