"""A CPU stand-in for a CUDA graph: :func:`tape_capture` records a call's aten operations and
replays them the way ``torch.cuda.CUDAGraph.replay`` replays kernels.

A CUDA graph replays the kernels it recorded on the tensors it recorded, with every argument
that is not a tensor's contents frozen: a Python int (a position, a length) keeps its captured
value, and a tensor made during the call (from a Python value or otherwise) is remade as it was
made then. The tape does the same on any device: it records each aten operation the call
dispatches (with its arguments), and a replay runs the same operations again, where an argument
that an earlier operation of the tape produced is that operation's new result and every other
tensor (a parameter, a KV cache, a static input buffer) is the same tensor object, read with its
contents of now. No Python of the call runs again. So a step that depends on anything but its
buffers' contents (a Python value of the position, a tensor's shape changing) replays the stale
value here exactly as it would on a GPU, and a test comparing replays with eager steps fails.

What it cannot see: whether each operation may be captured at all (a device-to-host read or a
copy from pageable host memory raises during a real capture); :func:`capture_hazards` lists
those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["HOST_READS", "capture_hazards", "tape_capture"]

# aten operations that read a device tensor's values back to the host (illegal while a CUDA
# graph captures: the host would wait for kernels that are only being recorded).
HOST_READS = frozenset(
    {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique"}
)


class _Tape(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, Any, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def tape_capture(
    fn: Callable[[], torch.Tensor],
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """A :data:`kd.rollouts.graphs.Capture` that records ``fn``'s operations while running it
    once; the replay runs the recorded operations and returns the result in the captured output
    tensor (as a graph's output is the same memory at every replay)."""
    with torch.no_grad(), _Tape() as tape:
        out = fn()
    static = out.clone()

    def replay() -> torch.Tensor:
        new: dict[int, Any] = {}

        def now(a: Any) -> Any:
            return new.get(id(a), a) if isinstance(a, torch.Tensor) else a

        with torch.no_grad():
            for func, args, kwargs, result in tape.ops:
                again = func(*tree_map(now, args), **tree_map(now, kwargs))
                for old, fresh in zip(tree_flatten(result)[0], tree_flatten(again)[0], strict=True):
                    if isinstance(old, torch.Tensor):
                        new[id(old)] = fresh
            static.copy_(new.get(id(out), out))
        return static

    return static, replay


class _Hazards(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        out = func(*args, **kwargs)
        if name in HOST_READS:
            self.names.append(name)
        elif name in _COPIES and _host_to_device(args, out):
            self.names.append(f"{name} from the host")
        return out


_COPIES = frozenset({"_to_copy", "copy_", "_copy_from", "lift_fresh_copy"})


def _host_to_device(args: Any, out: Any) -> bool:
    """Whether a copy reads a host tensor into a device one (a pageable host copy: a capture
    refuses it)."""
    ins = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    return any(a.device.type == "cpu" for a in ins) and any(o.device.type != "cpu" for o in outs)


def capture_hazards(fn: Callable[[], Any]) -> list[str]:
    """The operations of ``fn()`` a CUDA graph capture refuses: reads of device values to the
    host (:data:`HOST_READS`) and copies of host tensors to the device. On the CPU only the
    reads show; on the fake accelerator (:mod:`kd.memory.fake_device`) both do."""
    with torch.no_grad(), _Hazards() as mode:
        fn()
    return mode.names
