"""Activation offloading: the student's saved activations kept in host memory between its forward
and its backward (``enable_activation_offloading``).

The mechanics are torchtune 0.6.1's ``OffloadActivations`` (autograd saved-tensor hooks: a saved
tensor of at least ``min_offload_size`` bytes is copied to pinned host memory on a side stream in
forward and brought back in backward), with kd's changes around its two hooks:

* the compute stream is read live (:attr:`HostActivations.s0`), not cached when the manager is
  built: under FSDP2, activation-checkpoint recompute or a kernel launched on another stream the
  current stream at pack/unpack time is not the default stream, and syncing against the cached
  one orders the copies against the wrong stream (axolotl PR #3833's fix, TRL PR #7195);
* a saved tensor with a storage offset or non-contiguous strides (a slice such as shifted labels)
  is copied on the compute stream *before* torchtune's pack hook sees it (a dense one, such as a
  transposed view, with its own strides, which a compiled layer's backward asserts; one with gaps
  contiguous), so the side stream only ever reads a dense tensor the compute stream finished
  writing and no copy is allocated from the side stream's pool (axolotl PR #3776: without it the
  shifted labels were read after their block was reused);
* views of parameters (the ``weight.t()`` a linear layer saves) stay where they are: they are on
  the device for the whole step anyway (under FSDP2 they are the gathered weights, freed and
  gathered again by FSDP2 itself), and offloading them would only copy weights over PCIe;
* off CUDA (the CPU, the fake accelerator of :mod:`kd.memory.fake_device`) there is no side
  stream: the same hooks run on one stream (``use_streams=False``, no pinned memory), each
  tensor still goes to a separate host copy in forward, and it is moved back to the device it was
  saved from (torchtune's single-stream path would move it to ``"cuda"``).

:func:`enable_activation_offloading` installs the manager around the model's forward as module
hooks, so every ``student(tokens)`` with autograd on (the training step) offloads and the step's
code does not change; under ``no_grad`` nothing is saved and the hooks do nothing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kd._torchtune import OffloadActivations

MIN_OFFLOAD_BYTES = 1024
"""Saved tensors smaller than this stay on the device (torchtune's default)."""


class HostActivations(OffloadActivations):
    """torchtune's ``OffloadActivations`` with a live compute stream, dense tensors handed to the
    side stream, parameter views kept, and a one-stream path off CUDA (see the module doc).

    Args:
        device_type: the training device's type (``"cuda"`` uses a side stream and pinned
            memory; anything else one stream and pageable memory).
        min_offload_size: saved tensors of fewer bytes stay on the device.
        host: off CUDA, where the offloaded copies wait: the CPU (None); ``kd plan --trace``
            keeps them on the meta device, so that its tracker counts them apart from the
            device's memory.
    """

    def __init__(
        self,
        device_type: str,
        *,
        min_offload_size: int = MIN_OFFLOAD_BYTES,
        host: torch.device | None = None,
    ) -> None:
        self.on_cuda = device_type == "cuda"
        self.host = None if host is None or host.type == "cpu" or self.on_cuda else host
        with contextlib.ExitStack() as stack:
            if not self.on_cuda:
                # torchtune's constructor asks for the default CUDA stream (into :attr:`s0`,
                # whose setter ignores it); a CPU-only torch has none to give.
                stack.enter_context(_no_cuda_default_stream())
            super().__init__(
                use_pin_memory=self.on_cuda,
                use_streams=self.on_cuda,
                min_offload_size=min_offload_size,
            )
        self.offloaded_bytes = 0
        """Bytes copied to host memory so far (tests and reports read it)."""
        self._devices: dict[int, torch.device] = {}
        tt_pack, tt_unpack = self.pack_hook, self.unpack_hook

        def pack(activation: torch.Tensor) -> int:
            kept = _is_parameter_view(activation)
            offloaded = not kept and _nbytes(activation) >= self.min_tensor_size_bytes
            if offloaded and (activation.storage_offset() != 0 or not activation.is_contiguous()):
                # On the compute stream, before the side stream is told to wait for it. A dense
                # tensor keeps its strides (a transposed one stays transposed, as torchtune's host
                # copy keeps them): a compiled layer's backward asserts the strides it saved.
                activation = activation.clone(memory_format=torch.preserve_format)
            limit = self.min_tensor_size_bytes
            if kept:
                self.min_tensor_size_bytes = sys.maxsize
            try:
                tensor_id = tt_pack(activation)
            finally:
                self.min_tensor_size_bytes = limit
            if offloaded and not isinstance(activation, nn.Parameter):
                self.offloaded_bytes += _nbytes(activation)
                self._devices[tensor_id] = activation.device
                if self.host is not None and tensor_id in self.tracker:
                    copy, modified = self.tracker[tensor_id]
                    self.tracker[tensor_id] = (copy.to(self.host), modified)
            return tensor_id

        def unpack(tensor_id: int) -> torch.Tensor:
            device = self._devices.pop(tensor_id, None)
            if self.on_cuda or device is None:
                return tt_unpack(tensor_id)
            # One stream off CUDA: torchtune's bookkeeping, kd's move back to the saving device.
            host, _ = self.tracker[tensor_id]
            self.tracker[tensor_id] = (host, False)
            return tt_unpack(tensor_id).to(device)

        self.pack_hook, self.unpack_hook = pack, unpack

    @property
    def s0(self) -> Any:
        """The compute stream: the current CUDA stream when asked (None off CUDA: one stream)."""
        return torch.cuda.current_stream() if self.on_cuda else None

    @s0.setter
    def s0(self, _stream: Any) -> None:
        """torchtune's constructor caches ``torch.cuda.default_stream()`` here; kd ignores it."""


@contextlib.contextmanager
def _no_cuda_default_stream() -> Iterator[None]:
    saved = torch.cuda.default_stream
    torch.cuda.default_stream = lambda *_a, **_k: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.default_stream = saved


def _nbytes(t: torch.Tensor) -> int:
    return t.element_size() * t.nelement()


def _is_parameter_view(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def enable_activation_offloading(
    model: nn.Module, device_type: str, *, host: torch.device | None = None
) -> HostActivations:
    """Offload the saved activations of every forward of ``model`` (hooks around its forward).

    With activation checkpointing each checkpointed layer saves only its input, which is what
    goes to host memory; the layer's recomputed tensors live inside its backward.

    Args:
        model: the student, prepared (LoRA flags and checkpoint wrappers in place).
        device_type: the training device's type.
        host: where the offloaded copies wait off CUDA (:class:`HostActivations`).

    Returns:
        The manager (its ``offloaded_bytes`` counts what went to host memory).
    """
    manager = HostActivations(device_type, host=host)

    def enter(*_args: Any) -> None:
        if torch.is_grad_enabled():
            manager.__enter__()
            model._kd_offloading = True  # type: ignore[assignment]

    def leave(*_args: Any) -> None:
        if getattr(model, "_kd_offloading", False):
            model._kd_offloading = False  # type: ignore[assignment]
            manager.__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    return manager
