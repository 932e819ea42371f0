"""Where a run starts: the one module that finds the point a run resumes from.

Before any weight is read (``preload``), :func:`resume_point` says whether ``output_dir``'s run is
already finished (:func:`completed_run`: ``final/`` complete, same schedule), or which step folder
a resumed run continues from (:func:`find_resume`: the newest complete, intact ``step_*`` folder,
:func:`find_latest_checkpoint`, and its config snapshot), or that a fresh run may start there
(:func:`kd.checkpoint.outputs.check_fresh_output_dir`). The checks of what may change on resume are
:mod:`kd.checkpoint.resume`'s; writing step folders is :mod:`kd.checkpoint.store`'s.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kd.checkpoint.layout import (
    CONFIG_SNAPSHOT_FILE,
    FINAL_DIRNAME,
    MARKER_FILE,
    MODEL_FILE,
    MODEL_INDEX_FILE,
    RECIPE_STATE_FILE,
    load_checkpoint_config,
)
from kd.checkpoint.outputs import STEP_GLOB, check_fresh_output_dir, check_not_in_use, run_outputs
from kd.checkpoint.resume import check_resume_compatible, schedule_of
from kd.checkpoint.store import STEP_DIR_RE, step_dirs
from kd.errors import KDUserError, brief
from kd.fileio import sha256_file

logger = logging.getLogger("kd")

__all__ = [
    "ResumePoint",
    "completed_run",
    "final_step",
    "find_latest_checkpoint",
    "find_resume",
    "newest_step_folder",
    "resume_point",
    "with_saved_seed",
]


def _read_marker(ckpt: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """The step and file table of a checkpoint's marker.

    Raises:
        OSError, ValueError: the marker cannot be read or is not kd's marker.
    """
    marker = json.loads((ckpt / MARKER_FILE).read_text(encoding="utf-8"))
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        raise ValueError("not a kd marker (no table of files)")
    counters = [marker.get("step"), marker.get("epoch")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counters):
        raise ValueError(f"step and epoch are not counts ({counters[0]!r}, {counters[1]!r})")
    files = marker["files"]
    for name, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"the entry of {name!r} has no size")
        if not isinstance(entry.get("sha256") or "", str):
            raise ValueError(f"the sha256 of {name!r} is not a string")
        path = Path(name)
        if path.is_absolute() or ".." in path.parts or not path.parts:
            raise ValueError(f"{name!r} lies outside the folder")
    return counters[0], files


def _problem_with(ckpt: Path) -> str | None:
    """Why a step folder cannot be resumed from, or None if it is complete and intact."""
    if not (ckpt / MARKER_FILE).exists():
        return f"no {MARKER_FILE} (the save did not finish)"
    try:
        step, files = _read_marker(ckpt)
    except (OSError, ValueError) as e:
        return f"{MARKER_FILE} is unreadable ({type(e).__name__}: {e})"
    m = STEP_DIR_RE.match(ckpt.name)
    if m and int(m.group(1)) != step:
        return f"{MARKER_FILE} says step {step}, the folder is step {int(m.group(1))}"
    for required in (RECIPE_STATE_FILE, CONFIG_SNAPSHOT_FILE):
        if required not in files:
            return f"{MARKER_FILE} lists no {required}"
    if MODEL_FILE not in files and MODEL_INDEX_FILE not in files:
        return f"{MARKER_FILE} lists no {MODEL_FILE}"
    for name, entry in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        actual, size = path.stat().st_size, entry["size"]
        if actual != size:
            return f"{name} has {actual} bytes, {size} expected (truncated or overwritten)"
    for name, entry in files.items():
        expected = entry.get("sha256")
        if expected is not None and sha256_file(ckpt / name) != expected:
            return f"{name} does not match its sha256 (corrupt)"
    return None


def final_step(output_dir: Path) -> int | None:
    """The step of ``output_dir/final/`` when it is complete (its marker readable, every file it
    lists in place with its size, the config snapshot and the model among them), else None.
    Sizes only: a finished run's weights are not hashed again to say it is finished."""
    final = Path(output_dir) / FINAL_DIRNAME
    try:
        step, files = _read_marker(final)
    except (OSError, ValueError):
        return None
    if CONFIG_SNAPSHOT_FILE not in files or not {MODEL_FILE, MODEL_INDEX_FILE} & set(files):
        return None
    for name, entry in files.items():
        path = final / name
        if not path.is_file() or path.stat().st_size != entry["size"]:
            return None
    return step


def newest_step_folder(output_dir: Path) -> int | None:
    """The step of the newest ``step_*`` folder (complete or not), or None."""
    steps = step_dirs(Path(output_dir))
    return steps[-1][0] if steps else None


def find_latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete, intact ``step_*`` folder in output_dir, or None.

    Incomplete or corrupt folders newer than it are skipped with a warning on the ``kd`` logger
    naming the folder and the reason.
    """
    for _, ckpt in reversed(step_dirs(Path(output_dir))):
        problem = _problem_with(ckpt)
        if problem is None:
            return ckpt
        logger.warning("skipping checkpoint %s: %s", ckpt, problem)
    return None


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resumed run continues from.

    Attributes:
        checkpoint: the newest complete ``step_*`` folder.
        config_yaml: its config snapshot (``config.yaml``), a YAML mapping.
        seed: the snapshot's ``seed`` when it is an integer, else None.
    """

    checkpoint: Path
    config_yaml: str
    seed: int | None


def find_resume(output_dir: Path, *, resume: bool, overwrite: bool) -> ResumePoint | None:
    """What a run finds in ``output_dir`` before it loads a weight (reads only, writes nothing).

    A fresh run (not ``resume``) is refused when the folder holds another run's outputs, unless
    ``overwrite`` (:func:`check_fresh_output_dir`; they are moved aside by
    :func:`claim_output_dir`, once the run holds the lock). A resumed run gets the newest complete
    step checkpoint and its readable config snapshot.

    Args:
        output_dir: the run's output folder.
        resume: ``resume_from_checkpoint``.
        overwrite: ``overwrite_output_dir``.

    Returns:
        None for a fresh run, else the checkpoint to resume from.

    Raises:
        KDUserError: a fresh run into another run's outputs; a resumed run with every step
            checkpoint damaged, with none at all, or with a config snapshot that is not a
            readable YAML mapping.
    """
    if not resume:
        check_fresh_output_dir(output_dir, overwrite=overwrite)
        return None
    found = find_latest_checkpoint(output_dir)
    if found is None and any(Path(output_dir).glob(STEP_GLOB)):
        raise KDUserError(
            f"resume_from_checkpoint: every step checkpoint under {output_dir} is "
            "incomplete or damaged (the warnings above say why); set output_dir to a new "
            "folder to start fresh"
        )
    if found is None:
        fresh = "set resume_from_checkpoint=false to start fresh"
        if run_outputs(output_dir):
            fresh += " with overwrite_output_dir=true (the earlier outputs are moved aside)"
        raise KDUserError(
            f"resume_from_checkpoint: no complete checkpoint under {output_dir}; {fresh}"
        )
    try:
        saved = load_checkpoint_config(found)
        saved_cfg = OmegaConf.create(saved)
        if not isinstance(saved_cfg, DictConfig):
            raise ValueError(f"a {type(saved_cfg).__name__}, not a mapping")
        seed = saved_cfg.get("seed")
    except Exception as e:  # noqa: BLE001 - OSError, UnicodeDecodeError, YAML errors
        raise KDUserError(
            f"{found / CONFIG_SNAPSHOT_FILE}: not a readable config snapshot "
            f"({brief(e)}); delete {found.name} to resume from an older checkpoint"
        ) from e
    return ResumePoint(found, saved, seed if isinstance(seed, int) else None)


def with_saved_seed(run: Any, seed: Any) -> Any:
    """``run`` resuming a run whose snapshot holds ``seed``: with ``seed: null`` (a fresh seed per
    process) it takes the seed the resumed run drew; a set seed stays (compared on resume)."""
    return run.with_seed(seed) if run.seed is None and isinstance(seed, int) else run


def completed_run(output_dir: Path, *, run: Any) -> Path | None:
    """``output_dir/final/`` when the run ``run`` resumes has already finished, else None.

    Finished: ``final/`` is complete (:func:`kd.checkpoint.store.final_step`), no step folder is
    newer than it, and its config snapshot asks for the same schedule (``epochs``,
    ``max_steps_per_epoch``; a run resumed with more epochs trains on). ``seed: null`` is the
    finished run's seed (:func:`with_saved_seed`). Said in one line on the ``kd`` logger; nothing
    is read beyond the markers and snapshots, nothing written.

    Raises:
        KDUserError: the config differs from the finished run's in a key that must match.
    """
    step = final_step(output_dir)
    if step is None:
        return None
    newest = newest_step_folder(output_dir)
    if newest is not None and newest > step:
        return None  # final/ of an earlier run; this run's steps went further
    final = Path(output_dir) / FINAL_DIRNAME
    try:
        saved = load_checkpoint_config(final)
        same_schedule = schedule_of(saved) == schedule_of(run.yaml)
        seed = OmegaConf.create(saved).get("seed")
    except Exception:  # noqa: BLE001 - an unreadable snapshot: let the resume path report it
        return None
    if not same_schedule:
        return None
    check_resume_compatible(saved, with_saved_seed(run, seed).yaml, checkpoint=final)
    logger.info(
        "resume_from_checkpoint: the run in %s is already complete (%s, step %d); nothing to "
        "train. To train further, raise epochs; to start over, set "
        "resume_from_checkpoint=false with overwrite_output_dir=true",
        output_dir,
        final,
        step,
    )
    return final


def resume_point(output_dir: Path, run: Any) -> tuple[Any, ResumePoint | None] | None:
    """Where a run starts: ``(run, checkpoint)`` with the checkpoint to resume from (None: a
    fresh run), or None when the run to resume has already finished (``final/`` complete:
    :func:`completed_run` says so). output_dir must not be in use by another run; a resumed
    run's config must be compatible with the checkpoint's, and with ``seed: null`` it takes the
    resumed run's seed.

    Args:
        output_dir: the run's folder.
        run: the :class:`kd.config.run.RunConfig`.
    """
    check_not_in_use(output_dir)
    ckpt = run.checkpoint
    if ckpt.resume and completed_run(output_dir, run=run):
        return None
    found = find_resume(output_dir, resume=ckpt.resume, overwrite=ckpt.overwrite)
    if found is not None:
        run = with_saved_seed(run, found.seed)
        check_resume_compatible(found.config_yaml, run.yaml, checkpoint=found.checkpoint)
    return run, found
