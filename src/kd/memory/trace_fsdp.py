"""Trace one FSDP2 training step of rank 0 of N ranks, on fake CPU tensors (``kd plan --trace``).

The world-size-1 trace (:mod:`kd.memory.trace`) runs the real step under FakeTensorMode; this one
runs it as rank 0 of a *fake* process group of ``world_size`` ranks (collectives are no-ops that
produce correctly shaped fake outputs), with the student and teacher prepared and sharded exactly
as the recipe prepares and shards them (:mod:`kd.runtime.prepare`, :func:`kd.runtime.distributed.shard_model`).
torch's ``FSDPMemTracker`` attributes every storage to a category: sharded / unsharded parameters
and gradients, all-gather and reduce-scatter buffers, activations, temporaries, optimizer states.

Caveats:

* fake CPU tensors only (fake CUDA aborts on autograd; the fake accelerator of
  :mod:`kd.memory.fake_device` runs the device step, but torch's trackers do not see the ops
  autograd runs in its device thread); so ``fsdp.cpu_offload`` cannot be traced (its point is
  the device/host split) and CUDA-only buffer behaviour (streams, allocator rounding, NCCL
  workspace) is not seen: add the plan's runtime reserve on top;
* the optimizer is traced with ``foreach=False``: with ``foreach=True`` FSDPMemTracker reported
  optimizer-step temporaries of 6-15x the sharded parameter bytes in the research probe, which
  looks like an artefact of foreach on DTensors and is unverified on a GPU;
* one process plays rank 0 only; with the recipe's even sharding the other ranks differ by at most
  the padding of one row per parameter.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import nn

from kd.config.run import RunConfig
from kd.errors import KDUserError
from kd.memory.fake_step import (
    build_fake_step,
    check_traceable_optimizer,
    fake_friendly,
)
from kd.memory.trace_phases import TraceResult, trace_step_phases


@contextlib.contextmanager
def fake_process_group(world_size: int, device_type: str = "cpu") -> Iterator[Any]:
    """A fake process group of ``world_size`` ranks (this process is rank 0) and its 1-D mesh of
    ``device_type`` (the CPU, or the fake accelerator: collectives on it and on the CPU, as NCCL
    and gloo beside a GPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise KDUserError(
            "--trace: a process group is already initialized; run kd plan outside torchrun"
        )
    backend = "fake" if device_type == "cpu" else f"{device_type}:fake,cpu:fake"
    dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh(device_type, (world_size,))
    finally:
        if dist.is_initialized():  # what ran inside may have left it (a recipe's cleanup)
            dist.destroy_process_group()


def trace_fsdp_step(run: RunConfig, *, world_size: int) -> TraceResult:
    """Trace one micro-batch + optimizer step of ``run`` as rank 0 of ``world_size`` FSDP2 ranks.

    Same step and result as :func:`kd.memory.trace.trace_step`, sharded with the run's
    ``fsdp`` settings (``reshard_after_forward``, ``reduce_dtype``); the micro-batch is per rank.
    The categories are FSDPMemTracker's (``Sharded Param``, ``Unsharded Param``, ``Buffer``,
    ``Sharded Grad``, ``Unsharded Grad``, ``Activation``, ``Temp``, ``All Gather``,
    ``Reduce Scatter``, ``OptState``, ``Inputs``, ``Total``), per phase (``generation`` with
    ``on_policy``, ``forward``, ``backward``, ``optimizer_step``, ``evaluation`` with
    ``validation``) and per sub-phase (``student_forward``, ``teacher_forward``,
    ``loss_forward``, ``backward``, ``optimizer_step``).

    Args:
        run: the run configuration.
        world_size: ranks (> 1).

    Returns:
        Per-phase allocated peaks (bytes, rank 0) and their categories.

    Raises:
        KDUserError: ``world_size`` < 2, CPU offload (``fsdp.cpu_offload``,
            ``optimizer_in_cpu``), an optimizer that cannot run on fake tensors, or a process
            group that already exists.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from kd import models
    from kd.runtime.prepare import ShardSpec

    if world_size < 2:
        raise KDUserError("--trace: trace_fsdp_step needs world size >= 2; use trace_step for 1")
    if run.fsdp.cpu_offload or run.optimizer.in_cpu:
        raise KDUserError(
            "--trace: CPU offload cannot be traced on fake tensors; drop --trace (the estimate "
            "covers it) or trace with fsdp.cpu_offload=false"
        )
    check_traceable_optimizer(run.optimizer.node)
    t0 = time.perf_counter()
    tdtype = models.DTYPES[run.dtype]
    gc.collect()
    with (
        fake_friendly(run),
        fake_process_group(world_size) as mesh,
        FakeTensorMode(),
    ):
        shard = ShardSpec(
            device_type="cpu",
            param_dtype=tdtype,
            reduce_dtype=models.DTYPES[run.fsdp.reduce_dtype],
            reshard_after_forward=run.fsdp.reshard_after_forward,
            cpu_offload=False,
            mesh=mesh,
        )
        step = build_fake_step(run, shard=shard, num_ranks=world_size, foreach=False)
        mt = FSDPMemTracker(step.student, step.optimizer)
        # FSDPMemTracker instruments the FSDP modules under one root; give it both models (it only
        # walks .modules() and .buffers() of the root after construction).
        both = nn.Module()
        both.student = step.student
        if step.teacher is not None:
            both.teacher = step.teacher
        mt._root_mod = both
        mt.track_inputs(step.inputs())
        _track_replicated(mt, getattr(step.signal_teacher, "projections", None))
        result = trace_step_phases(mt, step, run, grad_scale=float(world_size))
    result.wall_s = time.perf_counter() - t0
    return result


def _track_replicated(mt: Any, module: nn.Module | None) -> None:
    """Count ``module``'s parameters (replicated on every rank, outside FSDP: the width projections
    of ``hidden_states:``) as the trace's ``Unsharded Param``.

    FSDPMemTracker only sees tensors of its FSDP modules, the optimizer's states and what it
    allocates while active (``track_external`` is a no-op for it); parameters made before it are
    otherwise missed. Their gradients and optimizer states are allocated while it is active.
    """
    if module is None:
        return
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    for p in module.parameters():
        mt._update_and_maybe_create_winfos(p, _FSDPRefType.UNSHARDED_PARAM)
