"""The recipe's own step on the fake accelerator: what ``kd run`` does on a GPU, tested on a CPU.

:func:`fake_device_step` takes a config whose ``device`` is ``cuda`` and runs ``kd run kd``'s
:class:`kd.recipes.kd.KDRecipe` on the fake accelerator (:mod:`kd.memory.fake_device`: torch's
PrivateUse1 backend under fake tensors) in bf16 or fp32 as the config says: ``preload()`` (every
check, for real), ``load()`` (the teacher source's ``load``, the student, the optimizer and the
scheduler, the validator, the on-policy sampler: models built on the fake device, the files read
for real and copied into them), then ``train_step`` (micro-steps, clip, optimizer step,
scheduler) on the loader's first micro-batches and, with ``validation:``, one ``validate()``.
Nothing is re-implemented: a tensor that stays on the CPU where the device needed it (a batch,
a served teacher's answer, a store's rows, a tensor kd makes without a device) meets the device's
tensors and raises ``FakeTensorDeviceMismatchError``, as CUDA raises its device mismatch.

``world_size`` 2 runs the same as rank 0 of two FSDP2 ranks over torch's fake process group
(collectives return at once; this process plays rank 0).

Values are fake: the step's numbers (loss, gradient norm) read as 0 and its checkpoints cannot
be written; what is checked is that every op of the step runs, on the device, in its dtype.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kd.memory import fake_device


@dataclass
class FakeStepResult:
    """What one step on the fake accelerator ran on.

    Attributes:
        recipe: the :class:`kd.recipes.kd.KDRecipe` after the step (models, teacher, optimizer).
        stats: the step's :class:`kd.training.train.StepStats` (values fake: zeros).
        validated: whether a validation pass ran.
        devices: where each kind of tensor the step trained lives: ``student``, ``teacher`` (a
            model teacher), ``optimizer_state``, ``grad`` (the last gradients, before the
            optimizer zeroed them: None after the step).
        dtypes: the student's parameter dtypes.
    """

    recipe: Any
    stats: Any
    validated: bool
    devices: dict[str, set[str]]
    dtypes: set[torch.dtype]


@contextlib.contextmanager
def _fake_process_group(world_size: int) -> Iterator[None]:
    """Rank 0 of ``world_size`` over torch's fake process group, on the fake device (nothing at
    world size 1)."""
    import torch.distributed as dist

    from kd.memory.trace_fsdp import fake_process_group

    if world_size == 1:
        yield
        return

    def rank_zeros_objects(object_list: list[Any], src: int = 0, **kwargs: Any) -> None:
        # This process is rank 0, the source: a broadcast leaves its objects as they are (torch's
        # pickling into a byte tensor is not done on the fake device).
        assert src == 0

    broadcast = dist.broadcast_object_list
    dist.broadcast_object_list = rank_zeros_objects
    try:
        with fake_process_group(world_size, fake_device.FAKE_DEVICE):
            yield
    finally:
        dist.broadcast_object_list = broadcast


def _run_of(config: Path | str, overrides: Sequence[str]) -> Any:
    from kd.config import load_config, validate_config
    from kd.config.run import run_config

    cfg = load_config(str(config), list(overrides))
    validate_config(cfg)
    if not str(cfg.device).startswith("cuda"):
        raise ValueError(f"fake_device_step runs a cuda config; {config} has device={cfg.device}")
    # In the config itself: what is derived from its text (several teachers' member runs, the
    # checkpoint's snapshot) sees the fake device too.
    cfg.device = _on_fake(str(cfg.device))
    if cfg.get("teacher_device") is not None:  # cuda:1 beside cuda:0: fakecuda:1
        cfg.teacher_device = _on_fake(str(cfg.teacher_device))
    return run_config(cfg)


def _on_fake(device: str) -> str:
    """A CUDA device name as the fake accelerator's (``cuda:1`` -> ``fakecuda:1``); the CPU
    stays."""
    if not device.startswith("cuda"):
        return device
    return fake_device.FAKE_DEVICE + device[len("cuda") :]


def _device_types(tensors: Any) -> set[str]:
    return {t.device.type for t in tensors}


def fake_device_step(
    config: Path | str,
    overrides: Sequence[str] = (),
    *,
    world_size: int = 1,
) -> FakeStepResult:
    """One optimizer step (and one validation pass with ``validation:``) of ``kd run kd`` on the
    fake accelerator (module doc).

    Args:
        config: a kd config file whose ``device`` is ``cuda``.
        overrides: ``key=value`` overrides, as on the command line.
        world_size: 1, or the ranks of an FSDP2 run (this process is rank 0 over a fake process
            group).

    Raises:
        FakeTensorDeviceMismatchError: a tensor met a tensor on another device.
        ValueError: the config's device is not cuda.
    """
    from kd.memory.fake_step import fake_friendly, fake_friendly_kv_cache
    from kd.recipes.kd import KDRecipe
    from kd.runtime.distributed import WorldInfo

    fake_device.register()
    run = _run_of(config, overrides)
    world = WorldInfo(world_size=world_size, rank=0, local_rank=0)
    with _fake_process_group(world_size):
        recipe = KDRecipe(run, world=world)
        try:
            recipe.preload()
            # What lets torchtune, transformers and peft build and sample on fake tensors (as
            # the tracer): value reads in their own checks.
            with fake_friendly(run), fake_friendly_kv_cache(), fake_device.FakeAccelerator():
                recipe.load()
                grad_accum = recipe.run.optimizer.grad_accum
                batches = list(itertools.islice(iter(recipe.loader), grad_accum))
                stats = recipe.train_step(batches)
                validated = recipe.validator is not None
                if validated:
                    recipe.validate()
        finally:
            recipe.cleanup(failing=True)
    teacher_model = getattr(recipe.teacher, "model", None)
    devices = {
        "student": _device_types(recipe.student.parameters()),
        "optimizer_state": _device_types(
            v
            for state in recipe.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ),
    }
    if isinstance(teacher_model, torch.nn.Module):
        devices["teacher"] = _device_types(teacher_model.parameters())
    dtypes = {p.dtype for p in recipe.student.parameters()}
    return FakeStepResult(recipe, stats, validated, devices, dtypes)
