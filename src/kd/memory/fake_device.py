"""A fake accelerator: the training step's device code on a CPU-only machine, under fake tensors.

On a CPU-only torch build, ``FakeTensorMode`` fakes ``device="cuda"`` for forward ops, but the
first backward aborts the process (torch is not linked with CUDA). torch's PrivateUse1 backend,
renamed (:func:`torch.utils.backend_registration._setup_privateuseone_for_python_backend`), is a
device of its own that autograd, the optimizers and FSDP2 accept; under fake tensors it runs
forward and backward and raises ``FakeTensorDeviceMismatchError`` when a CPU tensor meets it, as
CUDA would. :func:`register` names it :data:`FAKE_DEVICE` once per process.

:class:`FakeAccelerator` is the mode a step runs in. It differs from a plain ``FakeTensorMode``
in two ways, both so that the step's host side runs for real as it does beside a GPU:

* an op that touches no fake tensor and makes nothing on the fake device runs for real (the data
  loader's collation, safetensors and Parquet reads, a served teacher's request and answer,
  tokenization): those tensors are real CPU tensors, as on a GPU machine, and one that reaches a
  device tensor without being moved is a device mismatch;
* reading a value off a fake tensor (``float(t)``, ``t.item()``, ``bool(t)``, ``t.tolist()``)
  gives zeros (``0``, ``0.0``, ``False``): the step's host-side decisions take their zero branch
  (a finite gradient norm, so the optimizer steps; a sampled token that is not EOS, so rollouts
  run to their length), and an op whose output shape depends on values takes its largest shape
  (``nonzero``: every position, so a selection of labelled positions keeps them all, the
  worst case the planner plans for). Values are fake; shapes, dtypes and devices are the
  step's.

Further, so that the device step runs as on CUDA: attention takes a fused kernel (torch has no
fused-kernel choice for a Python backend and would keep the math path's ``[b, h, s, s]``
weights); ``torch.Generator(device=<fake>)`` is a CPU generator (a Python backend cannot make
one; its device is not checked); FSDP2's streams and events are one stream's no-ops; a device
mismatch in backward (autograd's device thread, where an exception would abort the process) is
noted and raised as :class:`FakeDeviceMismatch`, with the frame that made it, when the mode
exits.

How the fake device answers kd's ``device.type == "cuda"`` branches: it is not ``"cuda"``, so the
CUDA-only host calls are skipped (``torch.cuda.synchronize`` in :class:`kd.metrics.PhaseTimer`,
``torch.cuda.max_memory_allocated`` in :func:`kd.metrics.peak_memory_gib` (the process's RSS is
logged instead), ``torch.cuda.set_device``, ``pin_memory`` for FSDP2's CPU offload); kd uses no
autocast and builds its optimizer as the config names it (no implicit ``fused``). Everything
else (where tensors live, which dtype they have) follows the run's device as on CUDA.
``optimizer_in_cpu`` (one CUDA device only) is refused by the recipe on it.

``kd plan --trace`` stays on fake CPU tensors: torch's memory trackers (``MemTracker``,
``FSDPMemTracker``) do not see the ops autograd runs in the fake device's thread, so a trace on
it would miss the backward's allocations. :mod:`kd.testing_device` runs ``kd run``'s step on it.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    _check_for_subclass,
)

try:  # torch 2.12+: its own class; before, fake tensors raise a RuntimeError on a mismatch
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
except ImportError:  # pragma: no cover - torch < 2.12 (the CUDA image's 2.11)
    FakeTensorDeviceMismatchError = RuntimeError  # type: ignore[misc,assignment]
from torch.utils import _pytree as pytree

FAKE_DEVICE = "fakecuda"
"""The fake accelerator's device type (torch's PrivateUse1 backend, renamed)."""

DEVICE_COUNT = 2
"""Devices the fake accelerator has (``fakecuda:0`` and ``fakecuda:1``: a teacher on its own
device, ``teacher_device``); a tensor on one meeting a tensor on the other is a mismatch."""

_aten = torch.ops.aten


class _FakeDeviceModule:
    """``torch.fakecuda``: what torch asks a device module for (autocast's dtypes, activation
    checkpointing's RNG state, FSDP2's streams and events, device counts), answered as one CUDA
    device with one stream answers."""

    class device:  # noqa: N801 - torch calls ``torch.<backend>.device(index)`` as CUDA's
        def __init__(self, device: Any) -> None:
            self.device = device

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    @staticmethod
    def Stream(device: Any = None, priority: int = 0) -> torch.Stream:  # noqa: N802 - CUDA's name
        return torch.Stream(device=FAKE_DEVICE, priority=priority)

    @staticmethod
    def Event(enable_timing: bool = False, **kwargs: Any) -> torch.Event:  # noqa: N802
        return torch.Event(device=FAKE_DEVICE, enable_timing=enable_timing)

    @staticmethod
    def current_stream(device: Any = None) -> torch.Stream:
        return torch.Stream(device=FAKE_DEVICE)

    @staticmethod
    @contextlib.contextmanager
    def stream(stream: Any) -> Iterator[None]:
        yield  # one stream: every op is in order

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return DEVICE_COUNT

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        return None

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        return None

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)  # a host byte tensor, as CUDA's

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        return None

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def is_bf16_supported() -> bool:
        return True


def register() -> torch.device:
    """Register the fake accelerator (idempotent: once per process); its device.

    Raises:
        RuntimeError: PrivateUse1 is already registered under another name in this process
            (another backend extension is loaded).
    """
    from torch.utils import backend_registration

    name = torch._C._get_privateuse1_backend_name()
    if name == FAKE_DEVICE:
        return torch.device(FAKE_DEVICE)
    if name != "privateuseone":
        raise RuntimeError(
            f"the PrivateUse1 backend is already {name!r}; the fake accelerator needs it unused"
        )
    backend_registration._setup_privateuseone_for_python_backend(
        FAKE_DEVICE, backend_module=_FakeDeviceModule()
    )
    return torch.device(FAKE_DEVICE)


def is_fake_device(device: torch.device | str) -> bool:
    """Whether ``device`` is the fake accelerator."""
    return torch.device(device).type == FAKE_DEVICE


def _on_fake_device(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == FAKE_DEVICE
    if isinstance(value, str):
        return value.split(":", 1)[0] == FAKE_DEVICE
    return False


def _index_of(leaves: Sequence[object]) -> int:
    """The index of the first fake device ``leaves`` name (``fakecuda:1`` -> 1; none: 0)."""
    for value in leaves:
        if _on_fake_device(value):
            index = torch.device(value).index  # type: ignore[arg-type]
            return 0 if index is None else index
    return 0


def _zero(dtype: torch.dtype) -> bool | int | float:
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point or dtype.is_complex:
        return 0.0
    return 0


def _where(error: Exception) -> str:
    """``error`` and the frames of the stack outside torch that led to it."""
    torch_dir = str(Path(torch.__file__).parent)
    frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.startswith(torch_dir)]
    return "".join(traceback.format_list(frames)) + f"{type(error).__name__}: {error}"


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` on the fake device as a fused kernel: the CPU's flash
    attention (it takes grouped k/v heads and a mask, as the CPU's choice does), which saves the
    output and the log-sum-exp for backward like CUDA's flash and memory-efficient kernels."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


def _fused_attention(original: Any) -> Any:
    """``scaled_dot_product_attention`` that takes a fused kernel on the fake device, as on
    CUDA. torch picks one per device type, and has none for a Python backend: it would run the
    math path, which keeps the ``[b, h, s, s]`` weights for backward, memory the device step
    never holds. Elsewhere: ``original``."""

    def attention(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(query, torch.Tensor) and query.device.type == FAKE_DEVICE:
            return _attention(query, *args, **kwargs)
        return original(query, *args, **kwargs)

    return attention


class _HostGenerator(torch.Generator):
    """``torch.Generator(device=<the fake device>)``: a CPU generator (torch's Python backend
    cannot make one of its own; fake sampling draws nothing from it)."""

    def __new__(cls, device: Any = "cpu") -> torch.Generator:
        if is_fake_device(device):
            device = "cpu"
        return super().__new__(cls, device)


class FakeDeviceMismatch(RuntimeError):
    """A device mismatch met during backward (autograd's device thread), raised when the mode
    exits; the message holds the first one's traceback."""


class FakeAccelerator(FakeTensorMode):
    """``FakeTensorMode`` for a step on the fake device; real CPU work stays real (module doc).

    Real tensors that meet fake ones are converted (``allow_non_fake_inputs``), so a real CPU
    tensor meeting a fake device tensor raises ``FakeTensorDeviceMismatchError``.
    """

    def __init__(self, **kwargs: Any) -> None:
        register()
        super().__init__(allow_non_fake_inputs=True, **kwargs)
        self.mismatches: list[str] = []  # tracebacks of those met in autograd's device thread
        self._depth = 0

    @property
    def avoid_device_init(self) -> bool:
        """Always: the device allocates nothing, so ``torch.tensor(data, device=...)`` must be
        made on the CPU and then moved (through this mode) as on a machine without CUDA."""
        return True

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        kwargs = dict(kwargs or {})
        # Autograd's device thread (backward, activation checkpointing's recompute) runs with the
        # mode but not its thread-local flag that makes ``torch.tensor(data, device=...)`` move
        # its CPU tensor through the mode (FakeTensorMode sets it on entering, for one thread).
        torch._C._set_only_lift_cpu_tensors(True)
        leaves = pytree.arg_tree_leaves(*args, **kwargs)
        if _check_for_subclass(leaves):  # a DTensor...: its own dispatch goes first
            return super().__torch_dispatch__(func, types, args, kwargs)
        fake = [x for x in leaves if isinstance(x, FakeTensor)]
        if func is _aten._local_scalar_dense.default and fake:
            return _zero(fake[0].dtype)
        if func is _aten.nonzero.default and fake:
            (arg,) = args
            assert isinstance(arg, torch.Tensor)
            size = [arg.numel(), arg.dim()]  # every position: the largest answer
            return super().__torch_dispatch__(
                _aten.empty.memory_format,
                types,
                (size,),
                {"dtype": torch.long, "device": arg.device},
            )
        if not fake:
            if not any(_on_fake_device(x) for x in leaves):
                return func(*args, **kwargs)  # host work: real (the mode is off in its handler)
            if any(isinstance(x, torch.Tensor) for x in leaves):
                return self._made_on_device(func, args, kwargs)
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except FakeTensorDeviceMismatchError as e:
            if threading.current_thread() is threading.main_thread():
                raise
            # In autograd's device thread an exception aborts the process (torch's Python
            # device guard cannot unwind it): note it, go on as if both were on the device, and
            # raise it when the mode exits.
            self.mismatches.append(_where(e))
            args, kwargs = pytree.tree_map_only(torch.Tensor, self._to_device, (args, kwargs))
            return super().__torch_dispatch__(func, types, args, kwargs)

    def _made_on_device(self, func: Any, args: Any, kwargs: dict[str, Any]) -> object:
        """A real (or meta) tensor's op whose output goes to the fake device (``.to(device)``,
        ``to_empty``, ``empty_like(t, device=...)``): run on the meta device, the output made
        fake on the fake device. The inputs are not converted (a conversion keeps a reference
        to them, and a module's ``to_empty`` then cannot swap its parameters)."""
        meta = torch.device("meta")
        device = torch.device(FAKE_DEVICE, _index_of(pytree.tree_leaves((args, kwargs))))
        args, kwargs = pytree.tree_map(lambda x: meta if _on_fake_device(x) else x, (args, kwargs))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(
            torch.Tensor, lambda t: FakeTensor(self, t.to(meta), device), out
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (fake, or a real host tensor) on the fake device; 0-d tensors may stay."""
        if t.device.type == FAKE_DEVICE or t.dim() == 0:
            return t
        to = {"device": torch.device(FAKE_DEVICE)}
        if not isinstance(t, FakeTensor):
            return self._made_on_device(_aten._to_copy.default, (t,), to)  # type: ignore[return-value]
        moved = super().__torch_dispatch__(_aten._to_copy.default, (type(t),), (t,), to)
        assert isinstance(moved, FakeTensor)
        return moved

    def __enter__(self) -> FakeAccelerator:
        # Fake tensors re-enter their mode for each op: patch on the outermost entry only.
        if self._depth == 0:
            self._generator = torch.Generator
            torch.Generator = _HostGenerator  # type: ignore[misc]
            self._sdpa = torch.nn.functional.scaled_dot_product_attention
            torch.nn.functional.scaled_dot_product_attention = _fused_attention(self._sdpa)
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            torch.Generator = self._generator  # type: ignore[misc]
            torch.nn.functional.scaled_dot_product_attention = self._sdpa
        super().__exit__(*exc)
        if self.mismatches and exc[0] is None and self._depth == 0:
            found, self.mismatches = self.mismatches, []
            raise FakeDeviceMismatch(
                f"{len(found)} device mismatch(es) in autograd's device thread; the first:\n"
                + found[0]
            )
