"""kd.outputs: the output_dir lock, what counts as another run's outputs, moving them aside; and
kd.checkpoint.recover_interrupted_saves (a save killed between its two renames)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kd import checkpoint, outputs
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
        from kd import outputs
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
