"""Device, world size and memory budget: one resolution used by ``kd run``, ``kd validate`` and
``kd plan``.

torch is imported inside the functions that need it, so ``kd plan`` with an explicit budget stays
fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kd.errors import KDUserError

GIB = 1 << 30


def check_device(device: str) -> None:
    """Refuse a CUDA device on a machine without one (what ``kd run`` would hit at start).

    Raises:
        KDUserError: ``device`` names CUDA and no CUDA device is available.
    """
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise KDUserError("device: cuda is not available on this machine; set device=cpu")


def optimizer_in_cpu_problem(in_cpu: bool, device: str, *, distributed: bool) -> str | None:
    """The line ``optimizer_in_cpu`` is refused with (it offloads from one GPU: ``device`` cuda,
    not ``distributed``), by the run and by ``kd plan --world-size N``; None when it may run."""
    if not in_cpu or (device.startswith("cuda") and not distributed):
        return None
    return (
        "optimizer_in_cpu: offloads optimizer states from one GPU (device=cuda, one rank); "
        "with several ranks use fsdp.cpu_offload=true, on CPU set optimizer_in_cpu=false"
    )


def device_total_bytes(device: str) -> int | None:
    """Total memory of ``device``: the CUDA device's memory, or this machine's RAM for ``cpu``.

    Returns:
        Bytes, or None for a CUDA device on a machine without CUDA.
    """
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    import psutil

    return int(psutil.virtual_memory().total)


@dataclass(frozen=True)
class Budget:
    """The memory budget per device and where it came from.

    Attributes:
        gib: GiB per device; None when no budget is known (CUDA config on a machine without CUDA
            and no ``memory.budget_gib``).
        source: a few words for the plan's notes (``memory.budget_gib``, ``device memory``...).
    """

    gib: float | None
    source: str


def resolve_budget(*, budget_gib: float | None, device: str) -> Budget:
    """The per-device budget of a run: ``memory.budget_gib`` if set, else the device's memory.

    ``--budget-gib`` on ``kd plan`` / ``kd validate`` is applied as ``memory.budget_gib``, so all
    three commands resolve the budget here.

    Args:
        budget_gib: ``memory.budget_gib`` (None = the device's total memory).
        device: the config's ``device``.
    """
    if budget_gib is not None:
        return Budget(float(budget_gib), "memory.budget_gib")
    total = device_total_bytes(device)
    if total is None:
        return Budget(
            None, "no CUDA device on this machine: pass --budget-gib (or set memory.budget_gib)"
        )
    where = "this machine's RAM (device=cpu)" if device == "cpu" else f"{device} memory"
    return Budget(total / GIB, where)


def resolve_world_size(flag: int | None) -> int:
    """Ranks the run shards over: ``--world-size`` / ``--nproc_per_node`` when given, else
    torchrun's ``WORLD_SIZE``, else 1.

    Raises:
        KDUserError: a world size below 1.
    """
    if flag is not None:
        if flag < 1:
            raise KDUserError(f"--world-size: {flag} ranks; pass a whole number >= 1")
        return int(flag)
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise KDUserError(f"WORLD_SIZE: {raw!r} is not a rank count >= 1; launch with torchrun")
    return value
