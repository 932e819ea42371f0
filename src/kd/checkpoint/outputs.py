"""One run per ``output_dir``: the lock, what counts as another run's outputs, moving them aside.

A run's outputs are ``final/``, ``best/``, ``step_*/``, ``metrics.jsonl`` and ``config.yaml``. Rank
0 holds an OS file lock (``fcntl.flock`` on ``output_dir/.kd.lock``) from before its first write to
its end, so a second run on the same folder is refused instead of mixing metric rows and overwriting
``final/``. The OS drops the lock when the process ends however it ends (``kill -9`` included); a
clean release also removes the file, and a file left by a killed run is harmless (only the lock
counts, not the file).

A fresh run into a folder holding another run's outputs is refused unless asked to move them aside
(``overwrite_output_dir``): they go into ``output_dir/previous_<time>/``, nothing is deleted. A
resumed run continues from the newest complete step checkpoint (:func:`kd.checkpoint.resume_point.find_resume`).

A run's steps here, in order: :func:`check_not_in_use` and :func:`kd.checkpoint.resume_point.find_resume` before any weight
loads (they write nothing), :func:`claim_output_dir` (the lock, then moving aside), then
:func:`open_metrics` once the models are loaded.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kd.checkpoint.layout import (
    BEST_DIRNAME,
    CONFIG_SNAPSHOT_FILE,
    FINAL_DIRNAME,
    MARKER_FILE,
)
from kd.checkpoint.store import (
    recover_interrupted_saves,
)
from kd.errors import KDUserError, brief
from kd.metrics import JsonlWriter, trim_jsonl

logger = logging.getLogger("kd")

LOCK_FILE = ".kd.lock"
METRICS_FILE = "metrics.jsonl"
# The run's resolved config at the top of output_dir (the same name as in checkpoint folders).
CONFIG_FILE = CONFIG_SNAPSHOT_FILE
PREVIOUS_PREFIX = "previous_"
STEP_GLOB = "step_*"

# flock is not supported here (some network file systems): run without the lock, with a warning.
_NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@dataclass(frozen=True)
class LockHolder:
    """The run that holds an output_dir's lock, as it recorded itself (fields None if unknown)."""

    pid: int | None
    host: str | None
    started: str | None

    def describe(self) -> str:
        """``pid 123, started at 2025-01-31 12:00:00`` (the host too when it is another one)."""
        pid = "pid ?" if self.pid is None else f"pid {self.pid}"
        if self.host and self.host != socket.gethostname():
            pid += f" on {self.host}"
        return f"{pid}, started at {self.started or '?'}"


class OutputDirLock:
    """This process's exclusive hold on an output_dir (from :func:`lock_output_dir`).

    Attributes:
        path: the lock file.
        held: whether the lock is still held (False after :meth:`release`, or when the file
            system does not support locks).
    """

    def __init__(self, path: Path, fd: int | None):
        self.path = path
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent).

        The file is removed while the lock is still held, and only if it is still ours: a run
        waiting on the old file notices that it was replaced (:func:`lock_output_dir`).
        """
        if self._fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass  # already gone, or the folder is unreadable: the lock is dropped below anyway
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> LockHolder:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict):
        info = {}
    pid = info.get("pid")
    host, started = info.get("host"), info.get("started")
    return LockHolder(
        pid=pid if isinstance(pid, int) else None,
        host=host if isinstance(host, str) else None,
        started=started if isinstance(started, str) else None,
    )


def _cannot_write(output_dir: Path, e: OSError) -> KDUserError:
    return KDUserError(
        f"output_dir: cannot write to {output_dir} ({e.strerror or e}); "
        "set output_dir to a writable folder with free space"
    )


def in_use_message(output_dir: Path, holder: LockHolder) -> str:
    """The one line that refuses a second run on ``output_dir``."""
    return (
        f"output_dir: {output_dir} is in use by another kd run ({holder.describe()}); "
        "wait for it or choose another output_dir"
    )


def lock_holder(output_dir: Path) -> LockHolder | None:
    """The run holding ``output_dir``'s lock, or None when it is free. Creates and writes nothing.

    A probe: it takes a shared lock for an instant, so a run starting at that very moment retries
    (see ``wait_s`` of :func:`lock_output_dir`).
    """
    try:
        fd = os.open(Path(output_dir) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file (or an unreadable folder, which the run itself reports)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        except OSError:
            return None  # no locking on this file system
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def check_not_in_use(output_dir: Path) -> None:
    """Raise if another run holds ``output_dir`` (the probe of :func:`lock_holder`).

    Raises:
        KDUserError: one line naming output_dir, the holder's pid and start time, and the fix.
    """
    holder = lock_holder(output_dir)
    if holder is not None:
        raise KDUserError(in_use_message(output_dir, holder))


def lock_output_dir(output_dir: Path, *, wait_s: float = 1.0) -> OutputDirLock:
    """Take ``output_dir`` for this process until :meth:`OutputDirLock.release` (or its end).

    Creates the folder if needed and ``output_dir/.kd.lock`` holding this process's pid, host and
    start time, which a refused run prints. ``wait_s`` absorbs the instant probes of
    :func:`lock_holder` (by ``kd validate`` or another run's checks); a run holds the lock for
    hours, so a lock still taken after it is another run.

    Raises:
        KDUserError: another run holds the lock, or the folder cannot be written.
    """
    output_dir = Path(output_dir)
    path = output_dir / LOCK_FILE
    deadline = time.monotonic() + wait_s
    while True:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _cannot_write(output_dir, e) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise KDUserError(in_use_message(output_dir, holder)) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKING:
                raise
            logger.warning(
                "output_dir: %s does not support file locks (%s); two runs into it are not "
                "prevented",
                output_dir,
                e.strerror or e,
            )
            return OutputDirLock(path, None)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed the file between our open and flock: again
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return OutputDirLock(path, fd)


def run_outputs(output_dir: Path) -> list[Path]:
    """The outputs of a run present in ``output_dir``: ``final/``, ``best/``, ``step_*/``,
    ``metrics.jsonl``, ``config.yaml`` (sorted; ``previous_*/``, the lock and temporary folders do
    not count)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [output_dir / n for n in (FINAL_DIRNAME, BEST_DIRNAME, METRICS_FILE, CONFIG_FILE)]
    found = [p for p in found if p.exists()]
    found += [p for p in output_dir.glob(STEP_GLOB) if p.is_dir()]
    return sorted(found)


def has_complete_step(output_dir: Path) -> bool:
    """Whether a ``step_*`` folder has its completeness marker (a cheap check: no hashing)."""
    return any((p / MARKER_FILE).is_file() for p in Path(output_dir).glob(STEP_GLOB))


def _names(paths: list[Path], limit: int = 4) -> str:
    names = [p.name + ("/" if p.is_dir() else "") for p in paths]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_fresh_output_dir(output_dir: Path, *, overwrite: bool) -> list[Path]:
    """Refuse a fresh run into a folder holding another run's outputs, unless ``overwrite``.

    Args:
        output_dir: the run's output folder.
        overwrite: ``overwrite_output_dir``: the outputs may be moved aside (:func:`move_aside`).

    Returns:
        The outputs found (to move aside; empty when the folder holds none).

    Raises:
        KDUserError: outputs found and not ``overwrite``; one line naming output_dir, what it
            holds, and the ways out (resume when a step checkpoint is complete, another folder,
            ``overwrite_output_dir=true``).
    """
    found = run_outputs(output_dir)
    if not found or overwrite:
        return found
    resume = (
        "set resume_from_checkpoint=true to continue it, "
        if has_complete_step(output_dir)
        else "(it has no complete step checkpoint to resume from) "
    )
    raise KDUserError(
        f"output_dir: {output_dir} holds the outputs of another run ({_names(found)}); {resume}"
        f"choose another output_dir, or set overwrite_output_dir=true to move them into "
        f"{Path(output_dir) / PREVIOUS_PREFIX}<time>/"
    )


def move_aside(output_dir: Path, paths: list[Path]) -> Path:
    """Move ``paths`` (outputs inside ``output_dir``) into a new ``output_dir/previous_<time>/``.

    Renames only (same file system, nothing copied or deleted); the folder is fsynced so the move
    survives a crash. Call it while holding the lock.

    Returns:
        The folder they are now in.
    """
    output_dir = Path(output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = output_dir / f"{PREVIOUS_PREFIX}{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = output_dir / f"{PREVIOUS_PREFIX}{stamp}_{n}"
    try:
        dest.mkdir()
        for p in paths:
            os.rename(p, dest / p.name)
        for folder in (dest, output_dir):
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except OSError as e:
        raise KDUserError(
            f"overwrite_output_dir: cannot move the earlier outputs in {output_dir} into {dest} "
            f"({e.strerror or e}); move or remove them yourself, or choose another output_dir"
        ) from e
    return dest


def claim_output_dir(output_dir: Path, *, resume: bool, overwrite: bool) -> OutputDirLock:
    """Lock ``output_dir`` for this run before anything is written, then, under the lock (so no
    other run can interleave), put back what a killed save moved aside, check the folder again and
    move another run's outputs aside when ``overwrite`` asks to.

    Args:
        output_dir: the run's output folder.
        resume: ``resume_from_checkpoint`` (a resumed run moves nothing).
        overwrite: ``overwrite_output_dir``.

    Returns:
        The lock; released here if anything after taking it fails.

    Raises:
        KDUserError: another run holds the folder, it cannot be written, a fresh run meets another
            run's outputs without ``overwrite``, or they cannot be moved.
    """
    lock = lock_output_dir(output_dir)
    try:
        recover_interrupted_saves(output_dir)
        if not resume:
            found = check_fresh_output_dir(output_dir, overwrite=overwrite)
            if found:
                dest = move_aside(output_dir, found)
                logger.warning(
                    "overwrite_output_dir: moved the earlier outputs in %s (%s) into %s",
                    output_dir,
                    ", ".join(p.name for p in found),
                    dest,
                )
    except BaseException:
        lock.release()
        raise
    return lock


def make_checkpointer_output_dir(folder: str | None, *, key: str, run_dir: Path) -> None:
    """Create the folder torchtune's checkpointer creates when it is built (its ``output_dir``,
    usually the run's), so a folder that cannot be made is blamed on that key, not on the
    checkpoint files.

    Args:
        folder: the checkpointer's ``output_dir`` (nothing is done unless a non-empty string).
        key: the checkpointer key (``checkpointer``, ``teacher_checkpointer``).
        run_dir: the run's ``output_dir``: when it (or a folder above it) is the one that cannot
            be created, the error names ``output_dir`` instead of ``<key>.output_dir``.

    Raises:
        KDUserError: the folder cannot be created.
    """
    if not isinstance(folder, str) or not folder:
        return
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        # The run's own folder (or one above it) failing is output_dir's problem.
        failed = Path(e.filename).absolute() if e.filename else path.absolute()
        run_dir = Path(run_dir).absolute()
        ours = failed == run_dir or failed in run_dir.parents
        name = "output_dir" if ours else f"{key}.output_dir"
        raise KDUserError(
            f"{name}: cannot create {path} ({e.strerror or brief(e)}); set {name} to a "
            "writable folder with free space"
        ) from e


def open_metrics(output_dir: Path, *, config_yaml: str, resume_step: int | None) -> JsonlWriter:
    """Write the run's ``config.yaml`` and open ``metrics.jsonl`` for appending.

    Args:
        output_dir: the run's output folder (created if needed).
        config_yaml: the run's resolved config.
        resume_step: the step a resumed run continues after: the rows of later steps (logged
            before the run stopped) are dropped, as those steps run again. None for a fresh run.

    Raises:
        KDUserError: the folder cannot be written.
    """
    output_dir = Path(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / CONFIG_FILE).write_text(config_yaml)
        if resume_step is not None:
            trim_jsonl(output_dir / METRICS_FILE, resume_step)
        return JsonlWriter(output_dir / METRICS_FILE)
    except OSError as e:
        raise _cannot_write(output_dir, e) from e


def write_metrics_row(metrics: JsonlWriter, row: dict[str, Any], *, output_dir: Path) -> None:
    """Append one step's ``row`` to the run's ``metrics.jsonl`` (:func:`open_metrics`).

    Raises:
        KDUserError: the write failed (disk full, quota): one line naming the row's ``step``, the
            file and the fix; the file keeps only whole rows.
    """
    try:
        metrics.write(row)
    except OSError as e:
        then = (
            "(the earlier rows and checkpoints are kept; resume_from_checkpoint=true continues)"
            if has_complete_step(output_dir)
            else "(no step checkpoint was saved yet, so nothing resumes: rerun with "
            "overwrite_output_dir=true once there is room)"
        )
        raise KDUserError(
            f"output_dir: cannot write the step {row['step']} row of "
            f"{metrics.path} ({e.strerror or brief(e)}); free disk space under "
            f"{output_dir} or set output_dir to a disk with room {then}"
        ) from e
