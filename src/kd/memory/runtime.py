"""The memory a training process holds beyond its tensors: named terms, each with its source.

A trace (``kd plan --trace``) counts tensors, which is what ``torch.cuda.max_memory_allocated``
reports. A device holds more: the caching allocator keeps whole segments (``max_memory_reserved``),
and the CUDA runtime holds memory no allocator sees (the device's used memory). The plan adds:

- ``allocator_slack``, inside the allocator: the cuBLAS workspace and the caching allocator's
  rounding and fragmentation; allocated peak + slack = the planned **reserved** peak.
- ``cuda_runtime``, outside it: the CUDA context (kernels loaded lazily), cuBLAS / cuBLASLt
  handles, and NCCL's buffers on each rank of a distributed run; reserved peak + runtime = the
  planned **device** peak, which ``memory.budget_gib`` is checked against.

Sources: ``scripts/gpu_check.py`` on one NVIDIA H100 80GB HBM3 (driver 580.159.04, CUDA 13.0,
torch 2.11.0+cu130, default allocator), 2026-11-27, ``scripts/bench_data/gpu_check_h100.json``,
``docs/gpu.md``:

- context: every kd run held exactly 758 MiB more than its allocator reserved (NVML's per-process
  ``usedGpuMemory`` minus ``max_memory_reserved``, six configurations). A fresh process held
  621 MiB after ``torch.cuda.init`` and one tensor; its first bf16 matmul added 130 MiB outside
  the allocator (cuBLAS 98 MiB, cuBLASLt 32 MiB).
- cuBLAS workspace: 32 MiB through the caching allocator on the first matmul
  (``CUBLAS_WORKSPACE_CONFIG`` default ``:4096:8`` on sm_90; PyTorch allocates it through its
  allocator, one per handle and stream).
- fragmentation: ``max_memory_reserved`` over the planned allocated peak was 9.3-13.3% with
  activation checkpointing (five configurations) and 3.5% without (one): recomputing each layer
  frees and retakes blocks of many sizes. Offloading the saved activations does the same
  (every saved tensor leaves and comes back): without checkpointing it reserved 10.8% over its
  planned allocated peak (one row, the H100 run of 2026-11-27 evening), so it takes the
  checkpointing fraction. The fractions below cover every measured row.
- NCCL: a one-rank NCCL group took 565-578 MiB after its first all-reduce.

``expandable_segments``: kd leaves ``PYTORCH_CUDA_ALLOC_CONF`` as the user set it. With
``expandable_segments:True`` the allocator maps memory in pages rather than segments, so a 1 MiB
tensor no longer takes a 20 MiB segment (measured); the fractions above were measured with the
default allocator and stay the plan with either setting (an upper bound with expandable segments
until a GPU run measures them, ``scripts/gpu_check.py``).

- a parked or streamed teacher (``teacher_offload``): the allocator kept far more than the
  tensors' peak, since the blocks of the teacher's weights brought in for its forward are freed
  while the copies and kernels queued behind them still run, and are reused only after: one row
  each (Qwen2.5-3B -> 0.5B full, 2048 tokens, AC; the H100 run of 2026-11-27 evening) reserved
  1.65 GiB (``park``) and 3.22 GiB (``stream``) beyond the planned allocated peak and the
  fragmentation above: 0.32 and 0.62 of the 5.17 GiB of weights moved in. The plan adds 0.35
  and 0.65 of them (``offload_cache``), a fit to those two rows until a GPU run measures more
  (the streamed teacher's host now waits for the device before each copy,
  :class:`kd.teachers.parking._Throttle`, which should lower its share: not yet measured).
On the CPU (``device: cpu``) the terms are the interpreter and its libraries (1 GiB, a process
running kd holds 0.8-1.0 GiB before its first tensor) and 3% of the tensors for the allocator.
``memory.reserve_gib`` replaces all of them with one number.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30

CUDA_CONTEXT_BYTES = 758 * MIB
CUBLAS_WORKSPACE_BYTES = 32 * MIB
FRAGMENTATION_AC = 0.135
FRAGMENTATION = 0.05
NCCL_BYTES_PER_RANK = 580 * MIB

# teacher_offload -> the share of the moved-in teacher weights the allocator keeps beyond its
# fragmentation (module doc)
OFFLOAD_CACHE = {"park": 0.35, "stream": 0.65}
CPU_PROCESS_BYTES = GIB
CPU_FRAGMENTATION = 0.03
CPU_PROCESS_GROUP_BYTES = GIB // 2  # gloo's process group and its threads (not measured)


@dataclass(frozen=True)
class RuntimeTerms:
    """The named terms of one device (bytes).

    Attributes:
        fragmentation: the caching allocator's rounding and fragmentation.
        workspace: cuBLAS workspaces (through the allocator).
        context: the CUDA context and library handles (outside the allocator), or on the CPU
            the interpreter and its libraries.
        nccl: NCCL's buffers (outside the allocator; distributed runs only).
        offload_cache: blocks of a parked or streamed teacher's weights the allocator keeps
            (inside it).
        override: ``memory.reserve_gib`` in bytes, which replaces the others; None when unset.
    """

    fragmentation: int = 0
    workspace: int = 0
    context: int = 0
    nccl: int = 0
    offload_cache: int = 0
    override: int | None = None

    @property
    def allocator_slack(self) -> int:
        """Inside the caching allocator: reserved peak = allocated peak + this."""
        if self.override is not None:
            return 0
        return self.fragmentation + self.workspace + self.offload_cache

    @property
    def cuda_runtime(self) -> int:
        """Outside the allocator: device peak = reserved peak + this."""
        return self.override if self.override is not None else self.context + self.nccl

    def to_json(self) -> dict[str, float]:
        if self.override is not None:
            return {"memory.reserve_gib": round(self.override / GIB, 4)}
        return {
            "allocator_fragmentation": round(self.fragmentation / GIB, 4),
            "cublas_workspace": round(self.workspace / GIB, 4),
            **({"offload_cache": round(self.offload_cache / GIB, 4)} if self.offload_cache else {}),
            "cuda_context": round(self.context / GIB, 4),
            "nccl": round(self.nccl / GIB, 4),
        }


def runtime_terms(
    allocated_peak: int,
    *,
    device_type: str,
    activation_checkpointing: bool,
    num_ranks: int,
    override: int | None = None,
    activation_offloading: bool = False,
    teacher_offload: str = "none",
    parked_teacher: int = 0,
) -> RuntimeTerms:
    """The terms for a run whose tensors peak at ``allocated_peak`` bytes on one device.

    Args:
        allocated_peak: the planned allocated peak (tensors only).
        device_type: ``cuda`` or ``cpu``.
        activation_checkpointing: recomputed layers fragment the allocator more.
        activation_offloading: offloaded activations fragment it as much.
        num_ranks: ranks of the run (NCCL's buffers when more than one).
        override: ``memory.reserve_gib`` in bytes (replaces every term).
        teacher_offload: ``none``, ``park`` or ``stream``.
        parked_teacher: bytes of the teacher's weights moved in for each forward when parked
            or streamed (:func:`kd.memory.offload.parked_teacher_bytes`).
    """
    if override is not None:
        return RuntimeTerms(override=int(override))
    if device_type == "cpu":
        return RuntimeTerms(
            fragmentation=int(CPU_FRAGMENTATION * allocated_peak),
            context=CPU_PROCESS_BYTES,
            nccl=CPU_PROCESS_GROUP_BYTES if num_ranks > 1 else 0,
        )
    frac = FRAGMENTATION_AC if activation_checkpointing or activation_offloading else FRAGMENTATION
    return RuntimeTerms(
        fragmentation=int(frac * allocated_peak),
        workspace=CUBLAS_WORKSPACE_BYTES,
        offload_cache=int(OFFLOAD_CACHE.get(teacher_offload, 0.0) * parked_teacher),
        context=CUDA_CONTEXT_BYTES,
        nccl=NCCL_BYTES_PER_RANK if num_ranks > 1 else 0,
    )
