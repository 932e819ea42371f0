"""Trace the real training step under FakeTensorMode + MemTracker (``kd plan --trace``).

Builds the config's real-size student and teacher with the config's torchtune builders on *fake CPU*
tensors (no storage is allocated), prepares them as the recipe does (:mod:`kd.prepare`: LoRA
trainable set, activation checkpointing, hidden-state output, frozen teacher), then runs
``kd.train.micro_step`` (teacher forward, student forward, loss, backward) and the optimizer step
(then, with ``on_policy``, each sampling model's ``kd.on_policy.rollout``, and with validation,
one validation batch through ``kd.evaluate.batch_sums``), while torch's ``MemTracker`` counts every storage by category. Peaks are read per phase. The
mechanics shared with the FSDP2 trace (:mod:`kd.memory.trace_fsdp`) live in
:mod:`kd.memory.tracing`.

Workarounds (memory_anchors.md section 6), all needed on a CPU-only torch build:

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
from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode

from kd.config.run import LossSettings, RunConfig
from kd.errors import KDUserError
from kd.memory.estimate import GenerationKnobs
from kd.memory.tracing import (
    FrozenSafeMemTracker,
    TraceResult,
    build_fake_step,
    check_traceable_optimizer,
    fake_friendly_rope,
    fake_friendly_transformers,
    quiet,
    trace_step_phases,
    uses_transformers,
)


def trace_run(run: RunConfig, *, world_size: int = 1) -> TraceResult:
    """Trace one training step of ``run`` (fake tensors, no real memory), per rank when sharded.

    Args:
        run: the run configuration.
        world_size: ranks; above 1, rank 0 of an FSDP2 run is traced over a fake process group.

    Returns:
        Per-phase allocated peaks.

    Raises:
        KDUserError: CPU offload with world size > 1, or a component that cannot run on fake
            tensors.
    """
    from kd.memory.plan import inputs_from_run

    knobs = inputs_from_run(run).knobs
    common: dict[str, Any] = {
        "model": run.components["model"],
        # with stored teacher logits a teacher_model node only names their teacher: none is built
        "teacher_model": run.components["teacher_model"] if run.has_teacher else None,
        "optimizer": run.optimizer.node,
        "batch_size": knobs.batch_size,
        "seq_len": knobs.seq_len,
        "grad_accum": knobs.grad_accum,
        "dtype": run.dtype,
        "activation_checkpointing": run.activation_checkpointing,
        "clip_grad_norm": run.optimizer.clip_grad_norm,
        "loss": run.loss,
        "eval_batch": knobs.eval_batch,
        "stored_topk": knobs.stored_topk,
        "generation": knobs.generation,
    }
    if world_size == 1:
        return trace_step(optimizer_in_cpu=run.optimizer.in_cpu, **common)
    # Rank 0 of world_size FSDP2 ranks over a fake process group (FSDPMemTracker).
    from kd.memory.trace_fsdp import trace_fsdp_step

    if run.fsdp.cpu_offload or run.optimizer.in_cpu:
        raise KDUserError(
            "--trace: CPU offload cannot be traced on fake tensors; drop --trace (the estimate "
            "covers it) or trace with fsdp.cpu_offload=false"
        )
    return trace_fsdp_step(
        world_size=world_size,
        reshard_after_forward=run.fsdp.reshard_after_forward,
        reduce_dtype=run.fsdp.reduce_dtype,
        **common,
    )


def trace_step(
    *,
    model: Any,
    teacher_model: Any,
    optimizer: Any,
    batch_size: int,
    seq_len: int,
    grad_accum: int = 1,
    dtype: str = "bf16",
    activation_checkpointing: bool = False,
    optimizer_in_cpu: bool = False,
    clip_grad_norm: float | None = None,
    loss: LossSettings | None = None,
    eval_batch: int | None = None,
    stored_topk: int | None = None,
    generation: GenerationKnobs | None = None,
) -> TraceResult:
    """Trace one micro-batch + optimizer step (+ on-policy sampling, + one validation batch) with
    the given builder nodes.

    Args:
        model: student ``_component_`` node.
        teacher_model: teacher node or None.
        optimizer: optimizer node (None = AdamW foreach).
        batch_size: micro-batch b.
        seq_len: tokens per sequence s (every position labelled: the worst case).
        grad_accum: > 1 pre-creates the gradients of the earlier micro-batches.
        dtype: ``bf16`` or ``fp32``.
        activation_checkpointing: recompute decoder layers in backward.
        optimizer_in_cpu: states off the device (the step is not traced; states not counted).
        clip_grad_norm: traced like the recipe (norm, optional clip).
        loss: loss settings (default: the schema defaults).
        eval_batch: sequences per validation batch: also trace the evaluation phase
            (:func:`kd.memory.tracing.trace_evaluation`); None: no validation.
        stored_topk: train from stored teacher logits with this k (``teacher_model`` None): the
            micro-step gets a fake ``[b, s, k]`` top-k batch (:func:`build_fake_step`).

    Returns:
        Per-phase allocated peaks and categories.
    """
    from kd import models

    t0 = time.perf_counter()
    settings = loss or LossSettings()
    gc.collect()
    check_traceable_optimizer(optimizer)
    with (
        quiet(),
        fake_friendly_rope(),
        fake_friendly_transformers(uses_transformers(model, teacher_model)),
        FakeTensorMode(),
    ):
        step = build_fake_step(
            model=model,
            teacher_model=teacher_model,
            optimizer=optimizer,
            dtype=models.DTYPES[dtype],
            activation_checkpointing=activation_checkpointing,
            batch_size=batch_size,
            seq_len=seq_len,
            grad_accum=grad_accum,
            optimizer_in_cpu=optimizer_in_cpu,
            stored_topk=stored_topk,
        )
        mt = FrozenSafeMemTracker()
        mt.track_external(step.student, *step.inputs(), step.num_tokens_total)
        if step.teacher is not None:
            mt.track_external(step.teacher)
        if step.optimizer is not None:
            mt.track_external(step.optimizer)
        result = trace_step_phases(
            mt,
            step,
            settings=settings,
            clip_grad_norm=clip_grad_norm,
            eval_batch=eval_batch,
            generation=generation,
        )
    result.wall_s = time.perf_counter() - t0
    return result
