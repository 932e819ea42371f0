"""Trace the real training step under FakeTensorMode + MemTracker (``kd plan --trace``).

:func:`trace_run` traces a RunConfig on one device (:func:`trace_step`) or as rank 0 of N FSDP2
ranks (:mod:`kd.memory.trace_fsdp`). Both build the run's real-size student and teacher with its
builders on *fake CPU* tensors (no storage is allocated), prepare them as the recipe does
(:mod:`kd.runtime.prepare`: LoRA trainable set, activation checkpointing, hidden-state output, frozen
teacher), then run ``kd.training.train.micro_step`` (teacher forward, student forward, loss, backward) and
the optimizer step (then, with ``on_policy``, each sampling model's ``kd.rollouts.sampling.rollout``, and
with validation, one validation batch through ``kd.training.evaluate.batch_sums``), while torch's
``MemTracker`` counts every storage by category. Peaks are read per phase. That step lives in
:mod:`kd.memory.fake_step`.

Workarounds, all needed on a CPU-only torch build:

* fake *CPU* tensors, never fake CUDA (the first autograd op on fake CUDA aborts the process);
* modules are built directly in the target dtype (``module.to(dtype)`` fails on fake params);
* MemTracker hooks only trainable parameters (it raises on frozen ones);
* the optimizer state is created once before tracking (steady state: states exist from step 1);
  with gradient accumulation the gradients of earlier micro-batches are pre-created too;
* phases are split by wrapping ``Tensor.backward`` and resetting the tracker's private peak.

The trace counts allocated bytes exactly (MemTracker rounds nothing on CPU); the plan's runtime
reserve is added on top when the two are shown side by side.
"""

from __future__ import annotations

import gc
import time

from torch._subclasses.fake_tensor import FakeTensorMode

from kd.config.run import RunConfig
from kd.memory.fake_step import (
    build_fake_step,
    check_traceable_optimizer,
    fake_friendly,
)
from kd.memory.trace_phases import FrozenSafeMemTracker, TraceResult, trace_step_phases


def trace_run(run: RunConfig, *, world_size: int = 1) -> TraceResult:
    """Trace one training step of ``run`` (fake tensors, no real memory), per rank when sharded.

    Args:
        run: the run configuration.
        world_size: ranks; above 1, rank 0 of an FSDP2 run is traced over a fake process group
            (:func:`kd.memory.trace_fsdp.trace_fsdp_step`).

    Returns:
        Per-phase allocated peaks.

    Raises:
        KDUserError: CPU offload with world size > 1, or a component that cannot run on fake
            tensors.
    """
    if world_size == 1:
        return trace_step(run)
    from kd.memory.trace_fsdp import trace_fsdp_step

    return trace_fsdp_step(run, world_size=world_size)


def trace_step(run: RunConfig) -> TraceResult:
    """Trace one micro-batch + optimizer step (+ on-policy sampling, + one validation batch) of
    ``run`` on one device.

    The micro-batch is the plan's (``batch_size`` x the planned sequence length, every position
    labelled: the worst case); ``optimizer_in_cpu`` keeps the states off the device (the
    optimizer step is not traced, its states not counted).

    Args:
        run: the run configuration.

    Returns:
        Per-phase allocated peaks and categories.

    Raises:
        KDUserError: a component that cannot run on fake tensors (torchao's optimizers).
    """
    t0 = time.perf_counter()
    gc.collect()
    check_traceable_optimizer(run.optimizer.node)
    with fake_friendly(run), FakeTensorMode():
        step = build_fake_step(run)
        mt = FrozenSafeMemTracker()
        mt.track_external(step.student, *step.inputs(), step.num_tokens_total)
        if step.teacher is not None:
            mt.track_external(step.teacher)
        if getattr(step.signal_teacher, "projections", None) is not None:
            mt.track_external(step.signal_teacher.projections)  # hidden_states: trained too
        if step.optimizer is not None:
            mt.track_external(step.optimizer)
        result = trace_step_phases(mt, step, run)
    result.wall_s = time.perf_counter() - t0
    return result
