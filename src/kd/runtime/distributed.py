"""torch.distributed plumbing: process group, FSDP2 sharding of student and teacher, full state dicts.

Everything here is a no-op (or the plain single-process operation) at world size 1, so one recipe
serves one device and N ranks (as in torchtitan, FSDP with one shard is not applied at all on a
single device).

Sharding layout (:func:`shard_model`), the same for student and teacher:

* every decoder layer is its own FSDP2 group (gathered for its forward, freed after it when
  ``reshard_after_forward``, gathered again for its backward);
* an untied ``tok_embeddings`` is its own group too (only needed at the start of forward);
* the root group holds the rest: the final norm and the output projection (the embedding itself when
  tied). The root is *not* resharded after forward, because the fused loss
  (:func:`kd.losses.fused_linear_kd_loss`) reads the output projection weight
  (:func:`kd.models.output_weight`) after the model's forward returned. While the root is gathered,
  ``module.weight`` is the unsharded parameter FSDP2 all-gathered, so the loss's weight gradient
  accumulates into it and FSDP2 reduce-scatters it to the sharded parameter in its post-backward
  callback. For the student, backward reshards the root. The teacher has no backward: its root
  stays gathered between steps unless :func:`reshard` is called.

State dicts use ``torch.distributed.checkpoint.state_dict`` at every world size, so the resume state
has one format (full tensors keyed by parameter name) whatever the number of ranks.

Loading weights when distributed (host memory of one full copy per node, not one per rank): only
rank 0 reads the checkpoint files into a model built on CPU (:func:`on_rank_zero`); every rank,
rank 0 included, builds the same model on the meta device, shards it, and
:func:`load_into_meta_sharded` gives the shards storage and fills them from rank 0's full state
dict, tensor by tensor. Rank 0's dict includes everything its builder initialised (LoRA adapters),
so every rank gets the weights a single-device run would have.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from kd import _torchtune as tt
from kd import models
from kd.errors import KDUserError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")


@dataclass(frozen=True)
class WorldInfo:
    """Where this process sits in the job.

    Attributes:
        world_size: number of ranks (1 without torchrun).
        rank: global rank of this process.
        local_rank: rank on this node (the CUDA device index).
    """

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
    """Join the torchrun process group when launched by torchrun with ``WORLD_SIZE`` > 1.

    CUDA runs use NCCL for CUDA tensors and gloo for CPU tensors (CPU-offloaded state); CPU runs use
    gloo.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1 and not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            dist.init_process_group(backend="cuda:nccl,cpu:gloo")
        else:
            dist.init_process_group(backend="gloo")
    return WorldInfo(world_size=world_size, rank=rank, local_rank=local_rank)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over ranks (returns ``t`` unchanged at world size 1)."""
    if dist.is_available() and dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(flag: bool, *, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank (``flag`` itself at world size 1).

    For decisions that change which collectives run next (stop and save on SIGTERM): every rank
    must take the same branch, even when the signal reached them on different sides of a step.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def is_distributed() -> bool:
    """Whether this process is one rank of several (a process group is up)."""
    return dist.is_available() and dist.is_initialized()


def all_gather_text(
    text: str | None, *, device: torch.device, limit: int = 2048
) -> list[str | None]:
    """Every rank's ``text`` (None where a rank has none), by rank; ``[text]`` at world size 1.
    UTF-8 bytes in a tensor (nothing is pickled), cut at ``limit`` bytes."""
    if not is_distributed():
        return [text]
    data = (text or "").encode()[:limit]
    box = torch.zeros(limit + 1, dtype=torch.int64, device=device)
    box[0] = len(data) if text is not None else -1
    if data:
        box[1 : 1 + len(data)] = torch.tensor(list(data), dtype=torch.int64)
    out = [torch.empty_like(box) for _ in range(dist.get_world_size())]
    dist.all_gather(out, box)
    texts: list[str | None] = []
    for t in out:
        n = int(t[0])
        texts.append(None if n < 0 else bytes(t[1 : 1 + n].tolist()).decode(errors="replace"))
    return texts


def barrier() -> None:
    """Wait for every rank (no-op at world size 1)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def destroy() -> None:
    """Leave the process group (no-op at world size 1)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(
    model: nn.Module,
    *,
    device_type: str,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """FSDP2 ``fully_shard`` each decoder layer, an untied embedding, then the root.

    Call it after LoRA setup and activation checkpointing (it shards the existing parameters in
    place; every rank keeps 1/world of each). Meta parameters stay meta until
    :func:`load_into_meta_sharded`. See the module docstring for the
    layout and why the root keeps its parameters gathered after forward.

    Args:
        model: a decoder of either backend (:func:`kd.models.decoder_layers`) on
            the meta device (then :func:`load_into_meta_sharded`) or on CPU.
        device_type: ``"cuda"`` or ``"cpu"``; the sharded parameters move to it unless offloaded.
        param_dtype: dtype of the gathered parameters in forward/backward.
        reduce_dtype: dtype of the gradient reduce-scatter (fp32 avoids bf16 rounding in the sum).
        reshard_after_forward: free gathered layers after their forward (less memory, one more
            all-gather per layer in backward).
        cpu_offload: keep sharded parameters, their gradients and the optimizer states in CPU
            memory (``CPUOffloadPolicy``; the optimizer step runs on CPU).
        mesh: a 1-D ``DeviceMesh`` over all ranks; default: one built for ``device_type``.

    Returns:
        ``model`` itself (its class now also subclasses ``FSDPModule``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if cpu_offload:
        # Pinned memory needs an accelerator; on a CPU-only run the policy changes nothing anyway.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    for layer in models.decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    if not models.is_tied(model):
        # Untied: the embedding is only needed at the start of forward (and for its own gradient).
        fully_shard(
            models.input_embeddings(model), reshard_after_forward=reshard_after_forward, **kwargs
        )
    # The root keeps norm + output projection gathered after forward: the fused loss uses the
    # projection weight after model(tokens) returned.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP group of ``model`` (no-op when not sharded).

    Useful for the teacher, whose root group stays gathered after its forward (no backward
    reshards it); call it after the loss of the step was computed.
    """
    if not _is_fsdp(model):
        return
    for module in model.modules():
        if _is_fsdp(module):
            module.reshard()


def full_state_dict(model: nn.Module, *, world: WorldInfo) -> dict[str, torch.Tensor]:
    """The unsharded model state dict on CPU (complete on rank 0; empty elsewhere when distributed).

    Every rank must call it when distributed (it all-gathers).
    """
    if not world.distributed:
        return {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return sd if world.is_rank_zero else {}


def adapter_state_dict(model: nn.Module, *, world: WorldInfo) -> dict[str, torch.Tensor]:
    """LoRA adapter weights only, unsharded on CPU (complete on rank 0; collective when distributed)."""
    full = full_state_dict(model, world=world)
    return tt.get_adapter_state_dict(full) if full else {}


def load_full_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool, world: WorldInfo
) -> None:
    """Load full (unsharded) tensors into ``model``, sharded or not.

    When distributed, only rank 0's ``state_dict`` is read (the others pass ``{}``): rank 0
    broadcasts tensor by tensor and every rank keeps its shard, so no other rank ever holds a full
    copy. Collective when distributed.

    Args:
        model: the model, after :func:`shard_model` when distributed.
        state_dict: parameter name -> full tensor (rank 0).
        strict: every model key must be present (False for a LoRA adapter on its own).
        world: this process's place in the job.
    """
    if not world.distributed:
        model.load_state_dict(state_dict, strict=strict)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(
        model,
        state_dict,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict),
    )


def on_rank_zero(fn: Callable[[], T], *, world: WorldInfo) -> T | None:
    """``fn()`` on rank 0 only (``fn()`` itself at world size 1); ``None`` on the other ranks.

    For work only rank 0 does before a collective, such as reading checkpoint files: a failure
    there must not leave the other ranks waiting in the next collective, so every rank learns of
    it. Rank 0 raises its own exception; the others raise a :class:`KDUserError` that says rank 0
    failed (the CLI prints rank 0's message only). Collective when distributed.
    """
    if not world.distributed:
        return fn()
    result: T | None = None
    error: Exception | None = None
    if world.is_rank_zero:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
            error = e
    failed = broadcast_object(None if error is None else type(error).__name__, world=world)
    if error is not None:
        raise error
    if failed is not None:
        raise KDUserError(f"rank 0 failed ({failed}); see its error message")
    return result


def sync_cpu_rng(*, world: WorldInfo) -> None:
    """Give every rank rank 0's torch CPU RNG state (no-op at world size 1).

    Building on the meta device draws no random numbers, so after rank 0 alone built a real model
    (drawing its random init) the ranks' generators differ; this makes them equal again, as they
    are when every rank builds the same model.
    """
    if world.distributed:
        torch.set_rng_state(broadcast_object(torch.get_rng_state(), world=world))


def load_into_meta_sharded(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    *,
    init_device: torch.device,
    world: WorldInfo,
) -> None:
    """Give a model built on the meta device and sharded storage, then rank 0's full weights.

    Every rank allocates only its shards (``to_empty``: uninitialised memory) and copies its part of
    each tensor rank 0 broadcasts (:func:`load_full_state_dict`, strict). Non-persistent buffers
    (RoPE caches) are not in any state dict: they hold garbage afterwards and the caller recomputes
    them (:func:`kd.models.reset_rope_buffers`). Collective.

    Args:
        model: built on the meta device, after :func:`shard_model`.
        state_dict: rank 0: every parameter and persistent buffer, full, on CPU (a LoRA model's
            adapters included); other ranks: ``{}``.
        init_device: where the shards live: the training device, or CPU with ``cpu_offload``.
        world: this process's place in the job (distributed).
    """
    model.to_empty(device=init_device)
    load_full_state_dict(model, state_dict, strict=True, world=world)


def broadcast_object(obj: Any, *, world: WorldInfo) -> Any:
    """Rank 0's ``obj`` (picklable) on every rank; ``obj`` itself at world size 1."""
    if not world.distributed:
        return obj
    box = [obj if world.is_rank_zero else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def seed_all_ranks(seed: int | None, *, world: WorldInfo) -> int:
    """Seed torch and Python's ``random`` alike on every rank. Collective when distributed.

    Args:
        seed: the run's seed; None draws one (on rank 0: every rank must shuffle alike).
        world: this process's place in the job.

    Returns:
        The seed used (rank 0's).
    """
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    seed = int(broadcast_object(seed, world=world))
    torch.manual_seed(seed)
    random.seed(seed)
    return seed


def optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, world: WorldInfo
) -> dict[str, Any]:
    """The optimizer state with full (unsharded) CPU tensors, keyed by parameter name.

    The same format at every world size, so a checkpoint resumes on any number of ranks. Collective
    when distributed (complete on rank 0, empty elsewhere).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return sd if world.is_rank_zero else {}


def load_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    *,
    world: WorldInfo,
) -> None:
    """Inverse of :func:`optimizer_state_dict`.

    When distributed, only rank 0's ``state_dict`` is read (the others pass ``{}``) and broadcast;
    each rank keeps the shards of its parameters. A state keyed by parameter index (plain
    ``optimizer.state_dict()``) loads directly at world size 1.
    """
    groups = state_dict.get("param_groups", [])
    if not world.distributed and any(isinstance(p, int) for g in groups for p in g["params"]):
        optimizer.load_state_dict(state_dict)
        return
    # An optimizer without per-parameter state (SGD without momentum) has only its groups'
    # settings to restore; torch's set_optimizer_state_dict fails on an empty state.
    stateless = broadcast_object(not state_dict.get("state"), world=world)
    if stateless:
        groups = broadcast_object(groups, world=world)
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        model,
        optimizer,
        state_dict,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=world.distributed),
    )
