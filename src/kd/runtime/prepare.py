"""Prepare a built teacher or student for a training step: the one order of flags and wrappers.

The recipe (one device and N ranks) and the memory traces (``kd plan --trace``, one device and
FSDP2) prepare their models here, so the step a trace measures is the step the recipe runs. The
order is fixed: LoRA trainable flags, activation checkpointing, hidden-output mode, train/eval
mode and gradients, then FSDP2 sharding (:func:`kd.runtime.distributed.shard_model` wraps the existing
parameters and modules, so it comes last).

Building and loading stay with the caller: at world size 1 the recipe prepares the model it
loaded; when distributed it prepares and shards a model built on the meta device, then loads rank
0's weights into the shards; the traces prepare models built on fake tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kd import models
from kd.config.run import FSDPSettings
from kd.runtime import distributed, offload
from kd.runtime.distributed import WorldInfo

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ShardSpec:
    """How to shard a model with FSDP2: the arguments of :func:`kd.runtime.distributed.shard_model`.

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


def shard_spec(fsdp: FSDPSettings, *, device_type: str, param_dtype: torch.dtype) -> ShardSpec:
    """The :class:`ShardSpec` of a run's ``fsdp:`` settings (one mesh over all ranks).

    Args:
        fsdp: the run's FSDP2 settings (``reduce_dtype`` by its config name, ``fp32`` or ``bf16``).
        device_type: the training device's type.
        param_dtype: the models' dtype (``dtype``).
    """
    return ShardSpec(
        device_type=device_type,
        param_dtype=param_dtype,
        reduce_dtype=models.DTYPES[fsdp.reduce_dtype],
        reshard_after_forward=fsdp.reshard_after_forward,
        cpu_offload=fsdp.cpu_offload,
    )


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
    activation_offloading: str | None = None,
) -> nn.Module:
    """Make a built student trainable as the recipe trains it, in place.

    In order: with ``lora`` only the adapter weights require grad; with
    ``activation_checkpointing`` each decoder layer is wrapped to recompute in backward;
    ``model(tokens)`` returns final-norm hidden states ``[b, s, d]`` (the fused loss applies the
    output projection); train mode; then FSDP2 sharding when ``shard`` is given; then, with
    ``activation_offloading``, hooks around its forward that keep its saved activations in host
    memory until backward (:mod:`kd.runtime.offload`).

    The caller still builds the model, loads its weights (before, at world size 1; into the
    shards after, when distributed, then recomputes the RoPE buffers), compiles it
    (:func:`kd.models.compile_layers`) and builds the optimizer over the parameters that require
    grad.

    Args:
        model: a torchtune ``TransformerDecoder`` (on a device, on meta, or on fake tensors).
        lora: the model has LoRA adapters (:func:`kd.models.is_lora`): train only those.
        activation_checkpointing: recompute each decoder layer in backward.
        shard: FSDP2 settings when distributed; None leaves the model unsharded.
        activation_offloading: the training device's type to offload from, or None.

    Returns:
        ``model`` itself (an ``FSDPModule`` too when sharded).
    """
    if lora:
        models.setup_lora_trainable(model)
    if activation_checkpointing:
        models.enable_activation_checkpointing(model)
    models.set_hidden_output(model)
    model.train()
    if shard is not None:
        model = _shard(model, shard)
    if activation_offloading is not None:
        offload.enable_activation_offloading(model, activation_offloading)
    return model


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


def materialize(
    build: Callable[[torch.device], nn.Module],
    load: Callable[[nn.Module], None],
    prepare: Callable[[nn.Module, ShardSpec | None], nn.Module],
    *,
    device: torch.device,
    shard: ShardSpec | None,
    world: WorldInfo,
) -> nn.Module:
    """A built, loaded and prepared model, on one device or sharded over the ranks.

    One device (``shard`` None): built on ``device``, loaded, prepared. Distributed: rank 0 alone
    builds a CPU copy and loads the files into it; every rank builds the same model on the meta
    device, prepares and shards it, allocates its shards and receives rank 0's weights (a LoRA
    student's adapters too, drawn under the seed as on one device), then recomputes the RoPE
    buffers. Collective when distributed.

    Args:
        build: builds the model on the given device (in the run's dtype).
        load: loads the checkpoint's weights into a built model.
        prepare: :func:`prepare_student` or :func:`prepare_teacher` with the caller's flags.
        device: the training device.
        shard: FSDP2 settings when distributed.
        world: this process's place in the job.

    Raises:
        KDUserError: whatever ``build`` or ``load`` raise (on every rank).
    """

    def built_and_loaded() -> nn.Module:
        model = build(torch.device("cpu") if shard is not None else device)
        load(model)
        return model

    model = distributed.on_rank_zero(built_and_loaded, world=world)
    if shard is None:
        assert model is not None
        return prepare(model, None)
    full = model.state_dict() if model is not None else {}  # tensors outlive the module
    # Non-persistent buffers are in no state dict: torchtune's RoPE caches are recomputed, the
    # rest (transformers' inv_freq, Gemma's embed_scale: small) come from rank 0's real model.
    buffers = models.unrecomputable_buffers(model) if model is not None else {}
    buffers = distributed.broadcast_object(buffers, world=world)
    del model
    distributed.sync_cpu_rng(world=world)
    meta = build(torch.device("meta"))
    prepare(meta, shard)
    # Shards live on the device, or in CPU memory with cpu_offload.
    init_device = torch.device("cpu") if shard.cpu_offload else device
    distributed.load_into_meta_sharded(meta, full, init_device=init_device, world=world)
    with device:  # buffers are not offloaded: RoPE caches belong on the device
        models.reset_rope_buffers(meta)
    models.set_buffers(meta, buffers, device)
    return meta
