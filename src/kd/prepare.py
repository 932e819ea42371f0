"""Prepare a built teacher or student for a training step: the one order of flags and wrappers.

The recipe (one device and N ranks) and the memory traces (``kd plan --trace``, one device and
FSDP2) prepare their models here, so the step a trace measures is the step the recipe runs. The
order is fixed: LoRA trainable flags, activation checkpointing, hidden-output mode, train/eval
mode and gradients, then FSDP2 sharding (:func:`kd.distributed.shard_model` wraps the existing
parameters and modules, so it comes last).

Building and loading stay with the caller: at world size 1 the recipe prepares the model it
loaded; when distributed it prepares and shards a model built on the meta device, then loads rank
0's weights into the shards; the traces prepare models built on fake tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kd import distributed, models

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ShardSpec:
    """How to shard a model with FSDP2: the arguments of :func:`kd.distributed.shard_model`.

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"``; the sharded parameters move to it unless offloaded.
        param_dtype: dtype of the gathered parameters in forward and backward.
        reduce_dtype: dtype of the gradient reduce-scatter.
        reshard_after_forward: free gathered decoder layers (and an untied embedding) after
            their forward.
        cpu_offload: keep sharded parameters, gradients and optimizer states in CPU memory.
        mesh: a 1-D mesh over all ranks; None builds one for ``device_type``.
    """

    device_type: str
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reshard_after_forward: bool
    cpu_offload: bool
    mesh: DeviceMesh | None = None


def _shard(model: nn.Module, spec: ShardSpec) -> nn.Module:
    return distributed.shard_model(
        model,
        device_type=spec.device_type,
        param_dtype=spec.param_dtype,
        reduce_dtype=spec.reduce_dtype,
        reshard_after_forward=spec.reshard_after_forward,
        cpu_offload=spec.cpu_offload,
        mesh=spec.mesh,
    )


def prepare_student(
    model: nn.Module,
    *,
    lora: bool,
    activation_checkpointing: bool,
    shard: ShardSpec | None = None,
) -> nn.Module:
    """Make a built student trainable as the recipe trains it, in place.

    In order: with ``lora`` only the adapter weights require grad; with
    ``activation_checkpointing`` each decoder layer is wrapped to recompute in backward;
    ``model(tokens)`` returns final-norm hidden states ``[b, s, d]`` (the fused loss applies the
    output projection); train mode; then FSDP2 sharding when ``shard`` is given.

    The caller still builds the model, loads its weights (before, at world size 1; into the
    shards after, when distributed, then recomputes the RoPE buffers), compiles it
    (:func:`kd.models.compile_layers`) and builds the optimizer over the parameters that require
    grad.

    Args:
        model: a torchtune ``TransformerDecoder`` (on a device, on meta, or on fake tensors).
        lora: the model has LoRA adapters (:func:`kd.models.is_lora`): train only those.
        activation_checkpointing: recompute each decoder layer in backward.
        shard: FSDP2 settings when distributed; None leaves the model unsharded.

    Returns:
        ``model`` itself (an ``FSDPModule`` too when sharded).
    """
    if lora:
        models.setup_lora_trainable(model)
    if activation_checkpointing:
        models.enable_activation_checkpointing(model)
    models.set_hidden_output(model)
    model.train()
    return _shard(model, shard) if shard is not None else model


def prepare_teacher(model: nn.Module, *, shard: ShardSpec | None = None) -> nn.Module:
    """Make a built teacher a frozen hidden-state producer, in place.

    In order: ``model(tokens)`` returns final-norm hidden states ``[b, s, d]``; eval mode and no
    parameter requires grad (:func:`kd.models.freeze`); then FSDP2 sharding when ``shard`` is
    given. No activation checkpointing: the teacher runs without autograd.

    The caller still builds the model, loads its weights (before, at world size 1; into the
    shards after, when distributed, then recomputes the RoPE buffers) and compiles it.

    Args:
        model: a torchtune ``TransformerDecoder`` (on a device, on meta, or on fake tensors).
        shard: FSDP2 settings when distributed; None leaves the model unsharded.

    Returns:
        ``model`` itself (an ``FSDPModule`` too when sharded).
    """
    models.set_hidden_output(model)
    models.freeze(model)
    return _shard(model, shard) if shard is not None else model
