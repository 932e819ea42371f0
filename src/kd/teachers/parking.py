"""A frozen teacher's weights kept in host memory and put on the device only while it runs
(``teacher_offload``).

``park``: the whole teacher but its output projection (the loss reads that after the forward; for
a tied model it is the embedding) is one unit, brought to the device when the teacher's forward
starts and dropped when it ends, so the student's backward, the optimizer step and every other
teacher of ``teachers:`` never share the device with it. ``stream``: each decoder layer (and the
embedding) is its own unit, brought in for its own forward only, so at most one teacher layer is
on the device at a time.

The teacher is frozen, so its weights never go back: each parameter keeps one host copy (pinned on
CUDA, so the copies are asynchronous DMA on the compute stream), its module holds a device copy
while its unit runs and the host copy after; dropping the device copy is freeing it (the caching
allocator orders the reuse after the kernels that read it). The modules' parameter entries are
swapped (not ``param.data``), so a parameter always is one tensor on one device. Moved bytes are
counted (:attr:`ParkedWeights.moved_bytes`). Sampling (``on_policy.seq_kd``) calls the
teacher once per token: :meth:`ParkedWeights.hold` keeps every unit in until
:meth:`ParkedWeights.let_go`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kd import models

MODES = ("park", "stream")


@dataclass
class _Slot:
    """One parked parameter: its host copy and where the module tree holds it."""

    host: nn.Parameter
    places: list[tuple[nn.Module, str]]


@dataclass
class _Unit:
    """The parameters brought in and dropped together."""

    slots: list[_Slot]

    @property
    def nbytes(self) -> int:
        return sum(s.host.numel() * s.host.element_size() for s in self.slots)

    def bring_in(self, device: torch.device) -> int:
        """Put a device copy of every parameter in place; the bytes copied."""
        for slot in self.slots:
            copy = nn.Parameter(
                slot.host.detach().to(device, non_blocking=True, copy=True), requires_grad=False
            )
            for module, name in slot.places:
                module._parameters[name] = copy
        return self.nbytes

    def drop(self) -> None:
        """Put the host copies back (the device copies are freed)."""
        for slot in self.slots:
            for module, name in slot.places:
                module._parameters[name] = slot.host


class ParkedWeights:
    """The host copies of a frozen model's weights and the hooks that bring them in.

    Args:
        model: the prepared teacher (frozen, hidden-output mode), on the host (CPU) or on
            ``device``; its kept parameters (the output projection) and buffers move to
            ``device``.
        device: the training device.
        mode: ``park`` (the model is one unit) or ``stream`` (each decoder layer and the
            embedding are units).
    """

    def __init__(self, model: nn.Module, device: torch.device, *, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"teacher_offload: {mode!r} is not one of {MODES}")
        self.device = device
        self.mode = mode
        self.moved_bytes = 0
        """Bytes copied from host to device so far."""
        self.forwards = 0
        """Units brought in so far (a park brings its one unit per forward)."""
        self._held = False
        kept_ids = {id(models.output_weight(model))}
        if mode == "park":
            units: list[nn.Module] = [model]
        else:
            units = [models.input_embeddings(model), *models.decoder_layers(model)]
        pin = device.type == "cuda"
        seen: set[int] = set(kept_ids)
        self._units: list[_Unit] = []
        for unit in units:
            slots: dict[int, _Slot] = {}
            for module in unit.modules():
                for name, p in module._parameters.items():
                    if p is None or id(p) in kept_ids or (id(p) in seen and id(p) not in slots):
                        continue
                    if id(p) not in slots:
                        seen.add(id(p))
                        host = p.detach().to("cpu", copy=True)
                        host = host.pin_memory() if pin else host
                        slots[id(p)] = _Slot(nn.Parameter(host, requires_grad=False), [])
                    slots[id(p)].places.append((module, name))
            self._units.append(_Unit(list(slots.values())))
        for u in self._units:
            u.drop()  # the device copies (if the model was loaded there) are freed here
        self._to_device(model, parked=seen - kept_ids)
        for unit, u in zip(units, self._units, strict=True):
            unit.register_forward_pre_hook(self._pre_hook(u))
            unit.register_forward_hook(self._post_hook(u), always_call=True)

    def _to_device(self, model: nn.Module, *, parked: set[int]) -> None:
        """Everything not parked (output projection, final norm, buffers) lives on the device."""
        device = self.device
        moved: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) not in parked:
                    if id(p) not in moved:
                        moved[id(p)] = nn.Parameter(p.detach().to(device), requires_grad=False)
                    module._parameters[name] = moved[id(p)]
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)

    @property
    def parked_bytes(self) -> int:
        """Bytes of the host copies."""
        return sum(u.nbytes for u in self._units)

    def host_copies(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """``(the module's parameter now, its host copy)`` of every parked parameter."""
        return [
            (getattr(module, name), slot.host)
            for u in self._units
            for slot in u.slots
            for module, name in slot.places
        ]

    def _pre_hook(self, unit: _Unit) -> Any:
        def hook(*_args: Any) -> None:
            if not self._held:
                self._bring_in(unit)

        return hook

    def _post_hook(self, unit: _Unit) -> Any:
        def hook(*_args: Any) -> None:
            if not self._held:
                unit.drop()

        return hook

    def _bring_in(self, unit: _Unit) -> None:
        self.forwards += 1
        self.moved_bytes += unit.bring_in(self.device)

    def hold(self) -> None:
        """Bring every unit in and keep it until :meth:`let_go` (the teacher samples)."""
        if not self._held:
            for unit in self._units:
                self._bring_in(unit)
            self._held = True

    def let_go(self) -> None:
        """Drop what :meth:`hold` brought in (nothing when not held)."""
        if self._held:
            self._held = False
            for unit in self._units:
                unit.drop()
