"""Trace one FSDP2 training step of rank 0 of N ranks, on fake CPU tensors (``kd plan --trace``).

The world-size-1 trace (:mod:`kd.memory.trace`) runs the real step under FakeTensorMode; this one
runs it as rank 0 of a *fake* process group of ``world_size`` ranks (collectives are no-ops that
produce correctly shaped fake outputs), with the student and teacher prepared and sharded exactly
as the recipe prepares and shards them (:mod:`kd.prepare`, :func:`kd.distributed.shard_model`).
torch's ``FSDPMemTracker`` attributes every storage to a category: sharded / unsharded parameters
and gradients, all-gather and reduce-scatter buffers, activations, temporaries, optimizer states.

Caveats (memory_anchors.md section 6):

* fake CPU tensors only (fake CUDA aborts on autograd); so ``fsdp.cpu_offload`` cannot be traced
  (its point is the device/host split) and CUDA-only buffer behaviour (streams, allocator rounding,
  NCCL workspace) is not seen: add the plan's runtime reserve on top;
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

from kd.config.run import LossSettings
from kd.errors import KDUserError
from kd.memory.estimate import GenerationKnobs
from kd.memory.tracing import (
    TraceResult,
    build_fake_step,
    check_traceable_optimizer,
    fake_friendly_rope,
    fake_friendly_transformers,
    quiet,
    trace_step_phases,
    uses_transformers,
)


@contextlib.contextmanager
def _fake_process_group(world_size: int) -> Iterator[Any]:
    """A fake process group of ``world_size`` ranks (this process is rank 0) and its 1-D CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise KDUserError(
            "--trace: a process group is already initialized; run kd plan outside torchrun"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def trace_fsdp_step(
    *,
    model: Any,
    teacher_model: Any,
    optimizer: Any,
    world_size: int,
    batch_size: int,
    seq_len: int,
    grad_accum: int = 1,
    dtype: str = "bf16",
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    reduce_dtype: str = "fp32",
    clip_grad_norm: float | None = None,
    loss: LossSettings | None = None,
    eval_batch: int | None = None,
    stored_topk: int | None = None,
    generation: GenerationKnobs | None = None,
) -> TraceResult:
    """Trace one micro-batch + optimizer step of rank 0 of ``world_size`` FSDP2 ranks.

    Same arguments and result as :func:`kd.memory.trace.trace_step` plus the FSDP knobs; the
    categories are FSDPMemTracker's (``Sharded Param``, ``Unsharded Param``, ``Buffer``,
    ``Sharded Grad``, ``Unsharded Grad``, ``Activation``, ``Temp``, ``All Gather``,
    ``Reduce Scatter``, ``OptState``, ``Inputs``, ``Total``), per phase (``forward``, ``backward``,
    ``optimizer_step``, ``evaluation`` with ``eval_batch``) and per sub-phase (``student_forward``, ``teacher_forward``,
    ``loss_forward``, ``backward``, ``optimizer_step``).

    Args:
        model: student ``_component_`` node.
        teacher_model: teacher node or None.
        optimizer: optimizer node (None = AdamW).
        world_size: ranks (> 1).
        batch_size: per-rank micro-batch b.
        seq_len: tokens per sequence s (every position labelled: the worst case).
        grad_accum: > 1 pre-creates the sharded gradients of the earlier micro-batches.
        dtype: ``bf16`` or ``fp32`` (parameters, as the recipe builds them).
        activation_checkpointing: recompute decoder layers in backward.
        reshard_after_forward: ``fsdp.reshard_after_forward`` (decoder layers and embeddings).
        reduce_dtype: ``fsdp.reduce_dtype`` (``fp32`` or ``bf16``).
        clip_grad_norm: traced like the recipe (norm, optional clip).
        loss: loss settings (default: the schema defaults).
        eval_batch: sequences per validation batch (per rank): also trace the evaluation phase;
            None: no validation.
        stored_topk: train from stored teacher logits with this k (``teacher_model`` None).
        generation: on-policy sampling (per rank): also trace the generation phase; None: no
            ``on_policy``.

    Returns:
        Per-phase allocated peaks (bytes, rank 0) and their categories.

    Raises:
        KDUserError: ``world_size`` < 2, or a process group already exists.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from kd import models
    from kd.prepare import ShardSpec

    if world_size < 2:
        raise KDUserError("--trace: trace_fsdp_step needs world size >= 2; use trace_step for 1")
    check_traceable_optimizer(optimizer)
    t0 = time.perf_counter()
    settings = loss or LossSettings()
    tdtype = models.DTYPES[dtype]
    gc.collect()
    with (
        quiet(),
        fake_friendly_rope(),
        fake_friendly_transformers(uses_transformers(model, teacher_model)),
        _fake_process_group(world_size) as mesh,
        FakeTensorMode(),
    ):
        step = build_fake_step(
            model=model,
            teacher_model=teacher_model,
            optimizer=optimizer,
            dtype=tdtype,
            activation_checkpointing=activation_checkpointing,
            batch_size=batch_size,
            seq_len=seq_len,
            grad_accum=grad_accum,
            shard=ShardSpec(
                device_type="cpu",
                param_dtype=tdtype,
                reduce_dtype=models.DTYPES[reduce_dtype],
                reshard_after_forward=reshard_after_forward,
                cpu_offload=False,
                mesh=mesh,
            ),
            num_ranks=world_size,
            foreach=False,
            stored_topk=stored_topk,
        )
        mt = FSDPMemTracker(step.student, step.optimizer)
        # FSDPMemTracker instruments the FSDP modules under one root; give it both models (it only
        # walks .modules() and .buffers() of the root after construction).
        both = nn.Module()
        both.student = step.student
        if step.teacher is not None:
            both.teacher = step.teacher
        mt._root_mod = both
        mt.track_inputs(step.inputs())
        result = trace_step_phases(
            mt,
            step,
            settings=settings,
            clip_grad_norm=clip_grad_norm,
            grad_scale=float(world_size),
            eval_batch=eval_batch,
            generation=generation,
        )
    result.wall_s = time.perf_counter() - t0
    return result
