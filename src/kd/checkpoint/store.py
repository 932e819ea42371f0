"""Atomic step checkpoints: write a folder so a kill never leaves it half-written, keep the last n,
find the newest intact one.

A save writes into ``.tmp_<name>_<pid>/``, fsyncs every file and the folder, writes the marker
(``kd_checkpoint.json``) last, renames the folder into place and fsyncs ``output_dir``; so a
``kill -9`` at any moment leaves either the old set of checkpoints or the old set plus the new one,
never a half-written folder that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kd
from kd.checkpoint.layout import (
    CONFIG_SNAPSHOT_FILE,
    FINAL_DIRNAME,
    MARKER_FILE,
    RECIPE_STATE_FILE,
    step_dirname,
)
from kd.checkpoint.recipe_state import check_weights_only, encode_tensor_subclasses
from kd.checkpoint.resume import config_hash
from kd.errors import KDUserError
from kd.fileio import fsync_path, pid_alive, sha256_file

logger = logging.getLogger("kd")

STEP_DIR_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp_"
# A complete folder that a save moved aside to replace it (put back if the save was killed).
_OLD_RE = re.compile(r"^\.tmp_old_(.+)_\d+$")
# Files up to this size get a sha256 in the marker (configs, tokenizer, tiny models); larger
# weight files only a size, because hashing many GB at every save and resume is too slow.
_HASH_LIMIT_BYTES = 16 * 2**20
_IO_ERROR_HINTS = (
    "no space left",
    "disk quota",
    "os error",
    "file write failed",
    "input/output error",
    "read-only file system",
)


def _write_text_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _describe_files(folder: Path) -> dict[str, dict[str, Any]]:
    """{relative name: {"size", "sha256" (small files and recipe_state.pt only)}}."""
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        name = p.relative_to(folder).as_posix()
        entry: dict[str, Any] = {"size": p.stat().st_size}
        if name == RECIPE_STATE_FILE or entry["size"] <= _HASH_LIMIT_BYTES:
            entry["sha256"] = sha256_file(p)
        files[name] = entry
    return files


def _stale_tmp(output_dir: Path) -> list[Path]:
    """``.tmp_*`` folders left by killed saves (not those of another live process)."""
    stale = []
    for p in sorted(output_dir.glob(_TMP_PREFIX + "*")):
        m = re.search(r"_(\d+)$", p.name)
        pid = int(m.group(1)) if m else None
        if pid is not None and pid != os.getpid() and pid_alive(pid):
            continue
        stale.append(p)
    return stale


def recover_interrupted_saves(output_dir: Path) -> list[Path]:
    """Put back the folders that a killed save had moved aside to replace them.

    A save over an existing folder (``final/`` of a resumed run, a step saved again) renames the
    old folder to ``.tmp_old_<name>_<pid>`` and the new one into place; a kill between the two
    renames leaves neither under ``<name>``, so the old one (complete) goes back.

    Returns:
        The folders restored.
    """
    restored = []
    for p in _stale_tmp(Path(output_dir)):
        m = _OLD_RE.match(p.name)
        if m is None or not (p / MARKER_FILE).is_file():
            continue
        target = p.parent / m.group(1)
        if not target.exists():
            os.rename(p, target)
            logger.warning("restored %s, moved aside by an interrupted save", target)
            restored.append(target)
    return restored


def _remove_stale_tmp(output_dir: Path) -> None:
    """Remove ``.tmp_*`` folders left by killed saves, after putting back what they replaced."""
    recover_interrupted_saves(output_dir)
    for p in _stale_tmp(output_dir):
        logger.info("removing %s left by an interrupted save", p)
        shutil.rmtree(p, ignore_errors=True)


def _discard(folder: Path) -> None:
    """Delete a checkpoint folder so that a kill midway never leaves it looking complete."""
    doomed = folder.parent / f"{_TMP_PREFIX}del_{folder.name}_{os.getpid()}"
    os.rename(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _is_io_error(e: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError):
            return True
        if any(h in str(cur).lower() for h in _IO_ERROR_HINTS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _kept(output_dir: Path) -> str:
    """What a failed save left in place, for its error message."""
    steps = [p for _, p in step_dirs(output_dir) if (p / MARKER_FILE).exists()]
    if not steps:
        return "no earlier checkpoint was touched"
    return (
        f"the earlier checkpoints are kept; the newest, {steps[-1].name}, resumes with "
        "resume_from_checkpoint=true"
    )


def step_dirs(output_dir: Path) -> list[tuple[int, Path]]:
    out = []
    for p in output_dir.iterdir() if output_dir.is_dir() else ():
        m = STEP_DIR_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _prune(output_dir: Path, keep_last_n: int, just_written: Path) -> None:
    complete = [p for _, p in step_dirs(output_dir) if (p / MARKER_FILE).exists()]
    keep = set(complete[-keep_last_n:]) | {just_written}
    if just_written not in complete[-keep_last_n:]:
        logger.warning(
            "%s holds step checkpoints newer than %s from another run; they are kept, and "
            "resume_from_checkpoint would pick the newest step",
            output_dir,
            just_written.name,
        )
    for p in complete:
        if p not in keep:
            _discard(p)


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    epoch: int,
    write_model: Callable[[Path], None],
    recipe_state: dict[str, Any] | None,
    config_yaml: str,
    keep_last_n: int,
    name: str | None = None,
    marker_extra: dict[str, Any] | None = None,
) -> Path:
    """Atomically write ``output_dir/step_<step>/`` (or ``output_dir/final/`` when recipe_state is None).

    Args:
        output_dir: the run's output folder (created if missing).
        step: optimizer steps done so far (recorded in the marker; names step folders).
        epoch: the epoch the next step belongs to (recorded in the marker).
        write_model: called with the temporary folder; writes the HF files (e.g. a closure over
            :func:`save_hf_model`).
        recipe_state: optimizer, lr_scheduler, dataloader, rng, counters: plain tensors, dicts,
            lists, numbers and strings only. None writes the ``final/`` folder.
        config_yaml: the resolved config, saved as ``config.yaml``; the marker records its
            :func:`kd.checkpoint.config_hash`, which resuming checks.
        keep_last_n: complete step folders kept; older ones are removed after the new one is in
            place (``final/`` is never counted or removed).
        name: the folder's name instead (``best``; with ``recipe_state`` None): replaced
            atomically at each save, never counted or removed.
        marker_extra: more entries of the marker (``best``'s metric and value).

    Returns:
        The final folder.

    Raises:
        KDUserError: the disk is full or another OS error stopped the write; the temporary folder is
            removed and every existing checkpoint is left as it was.
    """
    output_dir = Path(output_dir)
    resume_hash = config_hash(config_yaml)
    if name is None:
        name = FINAL_DIRNAME if recipe_state is None else step_dirname(step)
    final = output_dir / name
    tmp = output_dir / f"{_TMP_PREFIX}{name}_{os.getpid()}"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(output_dir)
        tmp.mkdir()
        write_model(tmp)
        if recipe_state is not None:
            recipe_state = encode_tensor_subclasses(recipe_state)
            check_weights_only(recipe_state)
            with open(tmp / RECIPE_STATE_FILE, "wb") as f:
                torch.save(recipe_state, f)
                f.flush()
                os.fsync(f.fileno())
        _write_text_synced(tmp / CONFIG_SNAPSHOT_FILE, config_yaml)
        for p in tmp.rglob("*"):
            # write_model's files (safetensors, copies) are not fsynced by their writers.
            fsync_path(p)
        marker = {
            "step": int(step),
            "epoch": int(epoch),
            "files": _describe_files(tmp),
            "config_hash": resume_hash,
            "kd_version": kd.__version__,
            **(marker_extra or {}),
        }
        # The marker goes last: a folder is complete iff it has one, and everything it lists is
        # already on disk.
        _write_text_synced(tmp / MARKER_FILE, json.dumps(marker, indent=2, sort_keys=True) + "\n")
        fsync_path(tmp)
        if final.exists():
            # Same step saved again (or a second final/): move the old one aside, then replace.
            old = output_dir / f"{_TMP_PREFIX}old_{name}_{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_path(output_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, KDUserError) and _is_io_error(e):
            reason = " ".join(str(e).split())  # torch's messages span lines
            raise KDUserError(
                f"output_dir: could not write checkpoint {final}: {reason}; free disk space under "
                f"{output_dir} or set output_dir to a disk with room ({_kept(output_dir)})"
            ) from e
        raise
    if recipe_state is not None:
        try:
            _prune(output_dir, keep_last_n, final)
        except OSError as e:  # the new checkpoint is safe; a failed cleanup must not stop training
            logger.warning("could not remove old checkpoints in %s: %s", output_dir, e)
    logger.info("saved checkpoint %s", final)
    return final
