"""torch.distributed plumbing: process group, FSDP2 sharding of student and teacher, rank-0 gathers.

Everything here is a no-op at world size 1, so one recipe serves one device and N ranks (as in
torchtitan, FSDP with one shard is not applied at all on a single device).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kd import _torchtune as tt


@dataclass(frozen=True)
class WorldInfo:
    world_size: int
    rank: int
    local_rank: int

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str) -> WorldInfo:
    """Join the torchrun process group when launched by torchrun (``WORLD_SIZE`` > 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
    return WorldInfo(world_size=world_size, rank=rank, local_rank=local_rank)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over ranks (returns ``t`` unchanged at world size 1)."""
    if dist.is_available() and dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard_model(
    model: nn.Module,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool,
) -> nn.Module:
    """FSDP2 ``fully_shard`` each decoder layer, then the root (tok_embeddings, norm, output)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "reshard_after_forward": reshard_after_forward,
    }
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in model.layers:
        if isinstance(layer, nn.Module):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_state_dict(model: nn.Module, *, world: WorldInfo) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU (complete on rank 0; empty elsewhere when distributed)."""
    if not world.distributed:
        return {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if world.is_rank_zero else {}


def adapter_state_dict(model: nn.Module, *, world: WorldInfo) -> dict[str, torch.Tensor]:
    """LoRA adapter weights only, unsharded on CPU."""
    full = full_state_dict(model, world=world)
    return tt.get_adapter_state_dict(full) if full else {}
