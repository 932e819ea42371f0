"""Whether a run may resume from a checkpoint: the config keys that must match, and their hash.

Each schema key says whether it may change on resume (``kd.config.schema.Key.resume``): keys that
change the training trajectory must match the checkpoint's ``config.yaml``; paths, logging,
saving and memory knobs may change (a resumed job may land on a GPU with less memory, or train
for longer). Keys inside component nodes are not schema keys and must match, except the output
paths of checkpointer nodes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from kd.checkpoint.layout import CONFIG_SNAPSHOT_FILE, HF_CONFIG_FILE, read_checkpoint_marker
from kd.config import schema
from kd.errors import KDUserError, one_line

logger = logging.getLogger("kd")

# Leaves inside checkpointer nodes that name where to write, not what to train.
_CHECKPOINTER_OUTPUT_LEAVES = frozenset(
    {"output_dir", "recipe_checkpoint", "resume_from_checkpoint"}
)


def _may_change(parts: list[str]) -> bool:
    """Whether the dotted config key ``parts`` may differ from the checkpoint's on resume."""
    top = schema.TOP_LEVEL.get(parts[0])
    if top is not None and top.resume == schema.MAY_CHANGE:
        return True  # the whole node or section
    section = schema.SECTIONS.get(parts[0], {})
    if len(parts) > 1 and parts[1] in section:
        return section[parts[1]].resume == schema.MAY_CHANGE
    return (
        len(parts) == 2
        and parts[0].endswith("checkpointer")
        and parts[1] in _CHECKPOINTER_OUTPUT_LEAVES
    )


def _must_match(cfg_yaml: str) -> dict[str, Any]:
    """The flattened dotted keys of a config that must match on resume, with their values."""
    container = OmegaConf.to_container(OmegaConf.create(cfg_yaml), resolve=False)
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            flat[prefix] = node

    walk(container if isinstance(container, dict) else {}, "")
    return {key: value for key, value in flat.items() if not _may_change(key.split("."))}


def config_hash(cfg_yaml: str) -> str:
    """sha256 (hex) of the config keys that must match on resume (the others are ignored).

    Args:
        cfg_yaml: a resolved config as YAML.
    """
    canonical = json.dumps(_must_match(cfg_yaml), sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _saved_config_hash(ckpt: Path) -> str | None:
    """The ``config_hash`` recorded in a checkpoint's marker, or None (none there, or unreadable)."""
    try:
        marker = read_checkpoint_marker(ckpt)
    except (OSError, ValueError):
        return None
    value = marker.get("config_hash") if isinstance(marker, dict) else None
    return value if isinstance(value, str) else None


# Files up to this size are compared by content when a path moved (configs, tokenizers).
_HASHED_BYTES = 16 << 20


# Keys whose folder's config.json or tokenizer files every student checkpoint holds a copy of.
_COPIED_INTO_CHECKPOINTS = frozenset({"checkpointer", "model", "tokenizer"})


def _identity(path: Path) -> Any:
    """What a file or folder holds, for telling a moved copy from another one: a file's size
    (and sha256 when small); a folder's regular files by name with the same."""
    from kd.fileio import sha256_file

    def one(p: Path) -> tuple[int, str | None]:
        size = p.stat().st_size
        return size, sha256_file(p) if size <= _HASHED_BYTES else None

    if path.is_file():
        return one(path)
    return sorted((p.name, *one(p)) for p in path.iterdir() if p.is_file())


def _moved(key: str, before: Any, now: Any, checkpoint: Path | None) -> bool:
    """Whether a must-match path value changed only because its file or folder moved.

    The same contents (:func:`_identity`) at both paths; or, the old path gone, a new one of the
    same name and kind whose contents agree with the copies the checkpoint keeps of the student's
    folder (its config.json and tokenizer files); a moved teacher folder, of which the checkpoint
    keeps nothing, is taken by its name. Said on the ``kd`` logger.
    """
    if not (isinstance(before, str) and isinstance(now, str) and "/" in before + now):
        return False
    old, new = Path(before).expanduser(), Path(now).expanduser()
    try:
        if not new.exists() or old.name != new.name:
            return False
        if old.exists():
            same = old.is_dir() == new.is_dir() and _identity(old) == _identity(new)
        else:
            kept = (
                checkpoint / (HF_CONFIG_FILE if new.is_dir() else new.name)
                if checkpoint is not None and key.split(".")[0] in _COPIED_INTO_CHECKPOINTS
                else None
            )
            inside = new / HF_CONFIG_FILE if new.is_dir() else new
            same = (
                kept is None
                or not kept.is_file()
                or not inside.is_file()
                or _identity(kept) == _identity(inside)
            )
    except OSError:
        return False
    if same:
        logger.info(
            "resume_from_checkpoint: %s moved from %s to %s (the same files)", key, old, new
        )
    return same


def _with_defaults(cfg_yaml: str) -> str:
    """A checkpoint's config with the schema defaults of keys it lacks: a key added by a newer kd
    is, at its default, the behaviour the checkpoint was trained with."""
    from kd.config.parse import fill_defaults

    cfg = OmegaConf.create(cfg_yaml)
    fill_defaults(cfg)
    return OmegaConf.to_yaml(cfg)


_ABSENT: Any = object()  # a key a config does not hold


def _top_level(cfg_yaml: str) -> dict[str, Any]:
    container = OmegaConf.to_container(OmegaConf.create(cfg_yaml), resolve=False)
    return container if isinstance(container, dict) else {}


def _unset(value: Any) -> bool:
    return value is _ABSENT or value is None or value == {}


def _shown(value: Any, limit: int = 160) -> str:
    """A config value as the user wrote it in YAML (``null``, ``true``, a node's
    ``_component_``), cut to ``limit`` characters."""
    if value is _ABSENT:
        return "not set"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict) and isinstance(value.get("_component_"), str):
        return f"{{_component_: {value['_component_']}, ...}}"
    if isinstance(value, (dict, list)):
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    else:
        text = repr(value)
    text = one_line(text)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def check_resume_compatible(
    saved_config_yaml: str, current_config_yaml: str, *, checkpoint: Path | None = None
) -> None:
    """Raise KDUserError naming every must-match key that differs from the checkpoint's config.

    When the checkpoint's marker records the :func:`config_hash` of this run's config, the configs
    agree and nothing more is compared. Otherwise the keys are compared one by one: a marker
    without a hash, or with a hash of an older kd (which hashed other keys), is decided by them.

    Args:
        saved_config_yaml: ``config.yaml`` of the checkpoint.
        current_config_yaml: the resolved config of this run.
        checkpoint: the checkpoint folder: its marker's hash is checked, and it is named in the
            message.
    """
    if checkpoint is not None:
        saved_hash = _saved_config_hash(checkpoint)
        if saved_hash is not None and saved_hash == config_hash(current_config_yaml):
            return
    saved_yaml, current_yaml = (
        _with_defaults(saved_config_yaml),
        _with_defaults(current_config_yaml),
    )
    saved, current = _must_match(saved_yaml), _must_match(current_yaml)
    tops = (_top_level(saved_yaml), _top_level(current_yaml))
    problems = []
    said: set[str] = set()
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, _ABSENT), current.get(key, _ABSENT)
        top = key.split(".", 1)[0]
        if a == b or (top == key and _unset(a) and _unset(b)) or _moved(key, a, b, checkpoint):
            continue  # a top-level null is the key left out (teacher_model: null, no teacher)
        whole = tuple(t.get(top, _ABSENT) for t in tops)
        if _unset(whole[0]) != _unset(whole[1]):
            # A node set on one side only (another teacher): one line for the node, not a line
            # per leaf of it.
            if top not in said:
                said.add(top)
                problems.append(
                    f"{top}: {_shown(whole[0])} in the checkpoint, {_shown(whole[1])} now"
                )
            continue
        problems.append(f"{key}: {_shown(a)} in the checkpoint, {_shown(b)} now")
    if not problems:
        return
    where = (
        f"{checkpoint / CONFIG_SNAPSHOT_FILE}"
        if checkpoint is not None
        else "the checkpoint's config.yaml"
    )
    problems.append(
        f"resume_from_checkpoint: the config changed in ways that alter training; resume with {where} "
        "(only paths, logging, memory and saving keys may change), or set output_dir to a new folder"
    )
    raise KDUserError("\n".join(problems))


def check_resume_position(ckpt: Path, *, steps_per_epoch: int) -> None:
    """Raise unless step checkpoint ``ckpt`` sits inside an epoch of ``steps_per_epoch`` steps.

    Its marker records the step and the epoch; the steps done in that epoch must be between 0 and
    ``steps_per_epoch`` (a run resumed with another ``max_steps_per_epoch`` would skip or repeat
    data).

    Raises:
        KDUserError: the checkpoint does not fit; the message names ``max_steps_per_epoch``.
    """
    marker = read_checkpoint_marker(ckpt)
    done_in_epoch = int(marker["step"]) - int(marker["epoch"]) * steps_per_epoch
    if not 0 <= done_in_epoch <= steps_per_epoch:
        raise KDUserError(
            f"max_steps_per_epoch: the checkpoint is at step {marker['step']} in epoch "
            f"{marker['epoch']}, which does not fit epochs of {steps_per_epoch} steps; "
            "resume with the max_steps_per_epoch the run started with"
        )


# The keys that set how many steps a run has (its schedule's length).
SCHEDULE_KEYS = ("epochs", "max_steps_per_epoch")


def schedule_of(cfg_yaml: str) -> dict[str, Any]:
    """``epochs`` and ``max_steps_per_epoch`` of a config snapshot (the schema's default when a
    key is absent)."""
    cfg = OmegaConf.create(cfg_yaml)
    return {k: cfg.get(k, schema.TOP_LEVEL[k].default) for k in SCHEDULE_KEYS}


def _lr_after(make_scheduler: Callable[[Any, int], Any], total_steps: int, step: int) -> float:
    """The learning rate (of a base lr of 1) a scheduler built for ``total_steps`` steps gives
    after ``step`` steps, on a one-parameter optimizer."""
    import torch

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = make_scheduler(optimizer, total_steps)
    if scheduler is None:  # lr_scheduler: null
        return 1.0
    with warnings.catch_warnings():  # scheduler.step() without optimizer.step(): intended
        warnings.simplefilter("ignore")
        for _ in range(step):
            scheduler.step()
    return float(optimizer.param_groups[0]["lr"])


def check_schedule_change(
    saved_config_yaml: str,
    current_config_yaml: str,
    *,
    checkpoint: Path,
    total_steps: Callable[[int, int | None], int],
    make_scheduler: Callable[[Any, int], Any] | None,
) -> str | None:
    """Say in one line how a resumed run's schedule changed, or refuse a change that jumps.

    A resumed run whose ``epochs`` or ``max_steps_per_epoch`` differ from the checkpoint's has
    another number of steps. It proceeds when every changed key may change on resume (the
    schema's policy) and the learning rate of the next step is what the checkpoint's schedule
    gives (no scheduler, or one whose shape does not depend on the number of steps); a cosine
    stretched over more steps would jump, so it is refused.

    Args:
        saved_config_yaml: the checkpoint's ``config.yaml``.
        current_config_yaml: this run's resolved config.
        checkpoint: the step checkpoint resumed from (its marker gives the step).
        total_steps: ``(epochs, max_steps_per_epoch) -> steps`` of this run's data and ranks.
        make_scheduler: ``(optimizer, num_training_steps) -> scheduler`` of this run's
            ``lr_scheduler`` (None, or returning None: no scheduler).

    Returns:
        The line said (logged on the ``kd`` logger), or None when nothing changed.

    Raises:
        KDUserError: a changed key that must match, or a learning rate that would jump.
    """
    before, now = schedule_of(saved_config_yaml), schedule_of(current_config_yaml)
    changed = [k for k in SCHEDULE_KEYS if before[k] != now[k]]
    if not changed:
        return None
    what = ", ".join(f"{k} {before[k]} -> {now[k]}" for k in changed)
    fixed = [k for k in changed if not _may_change([k])]
    restore = " and ".join(f"{k}={'null' if before[k] is None else before[k]}" for k in changed)
    if fixed:
        raise KDUserError(
            f"{fixed[0]}: changed on resume ({what}), and it must match the checkpoint; resume "
            f"with {restore}, or set output_dir to a new folder"
        )
    step = int(read_checkpoint_marker(checkpoint)["step"])
    old_total = total_steps(before["epochs"], before["max_steps_per_epoch"])
    new_total = total_steps(now["epochs"], now["max_steps_per_epoch"])
    if step > new_total:
        raise KDUserError(
            f"{changed[0]}: the checkpoint {checkpoint} is at step {step}, past the {new_total} "
            f"steps of this run ({what}); resume with {restore}"
        )
    if make_scheduler is not None and old_total != new_total:
        lr_before = _lr_after(make_scheduler, old_total, step)
        lr_now = _lr_after(make_scheduler, new_total, step)
        if not math.isclose(lr_before, lr_now, rel_tol=1e-6, abs_tol=1e-12):
            raise KDUserError(
                f"{changed[0]}: the schedule jumps on resume ({what}: {old_total} -> {new_total} "
                f"steps; lr_scheduler gives step {step + 1} {lr_before:.4g} x lr before, "
                f"{lr_now:.4g} x lr now); resume with {restore}, or start a new run in a new "
                "output_dir"
            )
    line = (
        f"resume_from_checkpoint: {what}: {old_total} -> {new_total} steps, continuing from step "
        f"{step} with the learning rate the checkpoint's schedule gives"
    )
    logger.info("%s", line)
    return line
