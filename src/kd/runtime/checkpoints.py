"""Save and restore a training run's student at any world size (collective when distributed).

A step checkpoint holds the student as an HF folder (merged LoRA + PEFT adapter for a LoRA
student) and the resume state: the full (unsharded) optimizer state keyed by parameter name, the
LR scheduler, counters, the seed and every RNG. Rank 0 writes and reads the files; the other ranks
take part in the gathers and receive what they need by broadcast, so no rank but 0 ever holds a
full copy and a checkpoint of N ranks resumes on M.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kd.backends import backend_named
from kd.checkpoint.layout import BEST_DIRNAME, RECIPE_STATE_FILE
from kd.checkpoint.recipe_state import capture_rng_state, load_recipe_state, restore_rng_state
from kd.checkpoint.store import save_checkpoint
from kd.config.run import LoraSettings
from kd.errors import KDUserError, brief
from kd.runtime import distributed
from kd.runtime.distributed import WorldInfo

log = logging.getLogger("kd")


@dataclass(frozen=True)
class StudentSource:
    """Where the student came from: what an HF export of it needs.

    Attributes:
        model_type: torchtune ``ModelType`` name (``checkpointer.model_type``); for the
            transformers backend, config.json's ``model_type``.
        source_dir: the student's HF folder (``checkpointer.checkpoint_dir`` or ``model.path``):
            its config.json and tokenizer files are copied next to the saved weights.
        lora: the LoRA settings of a LoRA student, None for a full fine-tune.
        backend: ``torchtune`` (weights are converted to HF names) or ``transformers``.
        tokenizer_files: file name -> path of the run's tokenizer files, copied when the source
            folder has none of that name (a tokenizer kept outside the model folder).
    """

    model_type: str
    source_dir: Path
    lora: LoraSettings | None
    backend: str = "torchtune"
    tokenizer_files: dict[str, Path] = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    """The loop's position, saved in and restored from a step checkpoint.

    Attributes:
        global_step: optimizer steps done.
        epoch: the epoch the next step belongs to.
        seed: the run's seed.
        validation: the best validation value so far and the evaluations since it improved
            (:meth:`kd.training.evaluate.BestTracker.state_dict`); empty without validation and when
            restored from a checkpoint written before kd had it.
        rollouts: the on-policy component's state
            (:meth:`kd.training.on_policy.OnPolicyBatches.state_dict`: the sampler's, the next
            step's completions sampled ahead); empty without on_policy.
        teacher: the teacher's own state (:meth:`kd.teachers.Teacher.state_dict`); empty
            without one, and when restored from a checkpoint written before kd had it.
    """

    global_step: int
    epoch: int
    seed: int
    validation: dict[str, Any] = field(default_factory=dict)
    rollouts: dict[str, Any] = field(default_factory=dict)
    teacher: dict[str, Any] = field(default_factory=dict)


def save_training_checkpoint(
    output_dir: Path,
    *,
    student: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any | None,
    progress: Progress,
    source: StudentSource,
    config_yaml: str,
    keep_last_n: int,
    final: bool,
    world: WorldInfo,
    extra: torch.nn.Module | None = None,
) -> Path | None:
    """Write ``output_dir/step_<step>/`` (``final/`` when ``final``) atomically. Collective.

    ``extra`` (trainable parameters beside the student: :meth:`kd.teachers.Teacher.bind_student`)
    goes into a step checkpoint's resume state (its weights and optimizer state), never into the
    exported student.

    Returns:
        The folder on rank 0, None on the other ranks.
    """
    full = distributed.full_state_dict(student, world=world)
    state = None
    if not final:
        # Collective when distributed (gathers the optimizer state); complete on rank 0 only.
        state = {
            "optimizer": distributed.optimizer_state_dict(
                trained_module(student, extra), optimizer, world=world
            ),
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else {},
            "global_step": progress.global_step,
            "epoch": progress.epoch,
            "seed": progress.seed,
            "validation": dict(progress.validation),
            "rollouts": dict(progress.rollouts),
            "teacher": dict(progress.teacher),
            "world_size": world.world_size,
            "rng": capture_rng_state(),
        }
        if source.lora is not None:
            state["adapter"] = distributed.adapter_state_dict(student, world=world)
        if extra is not None:
            state["extra"] = {k: v.detach().cpu() for k, v in extra.state_dict().items()}
    path = None
    if world.is_rank_zero:
        path = save_checkpoint(
            output_dir,
            progress.global_step,
            epoch=progress.epoch,
            write_model=_model_writer(student, full, source),
            recipe_state=state,
            config_yaml=config_yaml,
            keep_last_n=keep_last_n,
        )
    distributed.barrier()
    return path


def trained_module(student: torch.nn.Module, extra: torch.nn.Module | None) -> torch.nn.Module:
    """What the optimizer trains, as one module (the optimizer state is keyed by its parameter
    names): the student, or the student and ``extra`` side by side (``student.*``, ``extra.*``)."""
    if extra is None:
        return student
    return torch.nn.ModuleDict({"student": student, "extra": extra})


def save_best_checkpoint(
    output_dir: Path,
    *,
    student: torch.nn.Module,
    progress: Progress,
    source: StudentSource,
    config_yaml: str,
    metric: str,
    value: float,
    mode: str,
    world: WorldInfo,
) -> Path | None:
    """Replace ``output_dir/best/`` atomically with the student now (``keep_best``). Collective.

    The folder holds what ``final/`` holds (HF weights, config, tokenizer files; no resume
    state); its marker records the step and ``{"best": {"metric", "value", "mode"}}``.

    Returns:
        The folder on rank 0, None on the other ranks.
    """
    full = distributed.full_state_dict(student, world=world)
    path = None
    if world.is_rank_zero:
        path = save_checkpoint(
            output_dir,
            progress.global_step,
            epoch=progress.epoch,
            write_model=_model_writer(student, full, source),
            recipe_state=None,
            config_yaml=config_yaml,
            keep_last_n=1,
            name=BEST_DIRNAME,
            marker_extra={"best": {"metric": metric, "value": float(value), "mode": mode}},
        )
    distributed.barrier()
    return path


def _model_writer(
    student: torch.nn.Module, full: dict[str, torch.Tensor], source: StudentSource
) -> Callable[[Path], None]:
    """Writes the student's HF files (``full``: its full state dict) into a folder."""

    def write_model(dest: Path) -> None:
        backend_named(source.backend).export_student(dest, student, full, source)

    return write_model


# What restore_training_checkpoint reads from a recipe state, and the type each must have.
_STATE_TYPES: dict[str, type] = {
    "optimizer": dict,
    "lr_scheduler": dict,
    "global_step": int,
    "epoch": int,
    "seed": int,
    "rng": dict,
}


def _check_recipe_state(state: dict[str, Any], ckpt: Path) -> None:
    """Raise KDUserError naming the first entry of a kd recipe state that is missing or mistyped."""
    for name, kind in _STATE_TYPES.items():
        value = state.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            what = "missing" if name not in state else f"a {type(value).__name__}"
            raise KDUserError(
                f"{Path(ckpt) / RECIPE_STATE_FILE}: its {name!r} is {what}, so this is not a kd "
                f"recipe state; delete {Path(ckpt).name} to resume from an older checkpoint"
            )


def restore_training_checkpoint(
    ckpt: Path,
    *,
    student: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any | None,
    source: StudentSource,
    world: WorldInfo,
    extra: torch.nn.Module | None = None,
) -> Progress:
    """Load the student, optimizer, scheduler and RNG of step checkpoint ``ckpt`` (and ``extra``,
    as :func:`save_training_checkpoint` saved it). Collective.

    Rank 0 reads the files and broadcasts (tensor by tensor when distributed).

    Returns:
        Where the loop continues.

    Raises:
        KDUserError: the recipe state is not kd's, or restoring failed anywhere (a damaged state
            fails anywhere in torch): one line naming ``ckpt`` and the fix. Out-of-memory errors
            pass through.
    """
    try:
        return _restore(ckpt, student, optimizer, lr_scheduler, source, world, extra)
    except (KDUserError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - a damaged state fails anywhere in torch
        raise KDUserError(
            f"resume_from_checkpoint: cannot restore {ckpt} ({brief(e)}); "
            f"delete {ckpt.name} to resume from an older checkpoint"
        ) from e


def _restore(
    ckpt: Path,
    student: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any | None,
    source: StudentSource,
    world: WorldInfo,
    extra: torch.nn.Module | None = None,
) -> Progress:
    """The body of :func:`restore_training_checkpoint` (which turns its failures into one line)."""
    rank0 = world.is_rank_zero
    state: dict[str, Any] = {}
    problem = None
    if rank0:
        try:
            state = load_recipe_state(ckpt)
            _check_recipe_state(state, ckpt)
        except KDUserError as e:
            problem = str(e)
    # Every rank raises (rank 0 alone would leave the others waiting in the next collective).
    problem = distributed.broadcast_object(problem, world=world)
    if problem is not None:
        raise KDUserError(problem)
    weights: dict[str, torch.Tensor] = {}
    if source.lora is not None:
        weights = state.get("adapter", {})
    elif rank0:
        weights = backend_named(source.backend).saved_student_weights(student, ckpt, source)
    distributed.load_full_state_dict(student, weights, strict=source.lora is None, world=world)
    del weights
    distributed.load_optimizer_state_dict(
        trained_module(student, extra), optimizer, state.pop("optimizer", {}), world=world
    )
    state.pop("adapter", None)
    state = distributed.broadcast_object(state, world=world)
    if extra is not None:
        if "extra" not in state:
            raise KDUserError(
                f"{ckpt}: holds no hidden-state projections (hidden_states was off when it was "
                "saved); resume with the config it was saved with, or start a new output_dir"
            )
        extra.load_state_dict(state["extra"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    restore_rng_state(state["rng"])
    saved_world = int(state.get("world_size", world.world_size))
    if rank0 and saved_world != world.world_size:
        log.warning(
            "resuming a %d-rank checkpoint on %d ranks: batch_size is per rank, so the global "
            "batch changes and the run will not match an uninterrupted one; the epoch's position "
            "is counted in this run's batches, so rows of this epoch are %s; resume on %d ranks "
            "to go on exactly",
            saved_world,
            world.world_size,
            "trained again" if world.world_size < saved_world else "skipped",
            saved_world,
        )
    validation = state.get("validation")
    rollouts = state.get("rollouts")
    teacher = state.get("teacher")
    progress = Progress(
        int(state["global_step"]),
        int(state["epoch"]),
        int(state["seed"]),
        validation=dict(validation) if isinstance(validation, dict) else {},
        rollouts=dict(rollouts) if isinstance(rollouts, dict) else {},
        teacher=dict(teacher) if isinstance(teacher, dict) else {},
    )
    if rank0:
        log.info("resumed from %s at step %d", ckpt, progress.global_step)
    return progress


def _first_nonfinite(model: torch.nn.Module) -> tuple[int, str | None]:
    """How many of ``model``'s parameters hold a NaN or inf on any rank, and the first such name
    this rank sees (None when its shards are finite)."""
    first = None
    local = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            data = param.to_local() if hasattr(param, "to_local") else param
            if not bool(torch.isfinite(data).all()):
                local += 1
                first = first or name
    count = distributed.all_reduce_sum(torch.tensor([local], dtype=torch.int64))
    return int(count.item()), first


def check_loaded_weights_finite(loaded: dict[str, tuple[torch.nn.Module | None, Path]]) -> None:
    """Blame a non-finite first step on the weights file when the weights were loaded so.

    Called when the first step of a process has a non-finite loss or gradient norm, before any
    optimizer step: NaN or inf in a model's weights then came from the files it was loaded from,
    and no learning rate would help. Collective under torchrun (every rank calls it).

    Args:
        loaded: per config key (``model``, ``teacher_model``), the model (None: not loaded) and
            the folder its weights were read from.

    Raises:
        KDUserError: a model holds NaN or inf; names the key, the folder and a parameter.
    """
    for key, (model, folder) in loaded.items():
        if model is None:
            continue
        count, name = _first_nonfinite(model)
        if count:
            which = f", e.g. {name}" if name is not None else ""
            raise KDUserError(
                f"{key}: {count} weight tensors hold NaN or inf as loaded from {folder}{which}, "
                "before any optimizer step, so every loss is non-finite; the weights file is "
                "damaged: export or download it again (the learning rate is not the cause)"
            )
