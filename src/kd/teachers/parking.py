"""A frozen teacher's weights kept in host memory and put on the device only while it runs
(``teacher_offload``).

``park``: the whole teacher but its output projection (the loss reads that after the forward; for
a tied model it is the embedding) is one unit, brought to the device when the teacher's forward
starts and dropped when it ends, so the student's backward, the optimizer step and every other
teacher of ``teachers:`` never share the device with it. ``stream``: each decoder layer (and the
embedding) is its own unit, brought in for its own forward only, so at most one teacher layer is
on the device at a time, and the next one on its way: when a unit's forward starts, the next
unit's copy starts on a side CUDA stream (:attr:`ParkedWeights.prefetch`), so the copy of layer
``i + 1`` overlaps the compute of layer ``i``.

The teacher is frozen, so its weights never go back: each parameter keeps one host copy (pinned on
CUDA, so the copies are asynchronous DMA), its module holds a device copy while its unit runs and
the host copy after; dropping the device copy is freeing it. Stream safety of the prefetch: the
compute stream waits on an event recorded after the side stream's copies before the unit runs,
and each prefetched copy is marked used by the compute stream (``record_stream``), so the caching
allocator does not hand its memory to a later copy before the kernels that read it are done. Off
CUDA (the CPU, the fake accelerator) there is one stream: the same code copies at once; on
``device: cpu`` the host copy is on the device already, so a unit brought in is its host
copies' storage (a copy would hold the teacher twice in the same memory). The modules' parameter entries are
swapped (not ``param.data``), so a parameter always is one tensor on one device. Moved bytes are
counted (:attr:`ParkedWeights.moved_bytes`).

How far the host runs ahead (``stream`` on CUDA, :class:`_Throttle`): a streamed layer's blocks
are freed while the kernels that read them may still be queued, and the caching allocator gives
them to a later copy only once those kernels are done; a host running ahead of the device
therefore takes new blocks for every layer it copies (an H100 reserved 4.0 GiB beyond the
tensors' peak streaming a 3B teacher, ``docs/gpu.md``). Before it copies unit ``i``, the host
waits until unit ``i - 3``'s forward is done on the device, so a freed block is free to reuse and
at most three units' kernels are queued (FSDP's ``limit_all_gathers`` bounds its all-gathers so,
for the same reason). Sampling (``on_policy.seq_kd``) calls the
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

    def copies(self, device: torch.device) -> list[nn.Parameter]:
        """A device copy of every parameter (asynchronous from pinned memory, on the current
        stream); on the host's own device (``device: cpu``) the host copy's storage itself, not
        a second copy of the teacher in the same memory."""
        return [
            nn.Parameter(
                slot.host.detach()
                if slot.host.device == device
                else slot.host.detach().to(device, non_blocking=True, copy=True),
                requires_grad=False,
            )
            for slot in self.slots
        ]

    def put(self, copies: list[nn.Parameter]) -> None:
        """Put the device copies in place."""
        for slot, copy in zip(self.slots, copies, strict=True):
            for module, name in slot.places:
                module._parameters[name] = copy

    def drop(self) -> None:
        """Put the host copies back (the device copies are freed)."""
        for slot in self.slots:
            for module, name in slot.places:
                module._parameters[name] = slot.host


class _Throttle:
    """The host's wait before it copies a streamed unit (module doc): ``finished(i)`` after
    unit ``i``'s forward is queued records an event on the current (compute) stream;
    ``before_copy(i)`` waits, on the host, for unit ``i - depth``'s event. ``event`` makes the
    events (None off CUDA: one stream, nothing runs ahead)."""

    def __init__(self, depth: int, event: Any = None) -> None:
        self.depth = depth
        self._event = event
        self._done: dict[int, Any] = {}
        self.waits = 0
        """Host waits so far."""

    def finished(self, index: int) -> None:
        if self._event is not None:
            done = self._event()
            done.record()
            self._done[index] = done

    def before_copy(self, index: int) -> None:
        done = self._done.pop(index - self.depth, None)
        if done is not None:
            done.synchronize()
            self.waits += 1

    def clear(self) -> None:
        self._done.clear()


class ParkedWeights:
    """The host copies of a frozen model's weights and the hooks that bring them in.

    Args:
        model: the prepared teacher (frozen, hidden-output mode), on the host (CPU) or on
            ``device``; its kept parameters (the output projection) and buffers move to
            ``device``.
        device: the training device.
        mode: ``park`` (the model is one unit) or ``stream`` (each decoder layer and the
            embedding are units).
        host: where the host copies live: the CPU (None); ``kd plan --trace`` keeps them on the
            meta device, so that its tracker counts them apart from the device's memory.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        mode: str,
        host: torch.device | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"teacher_offload: {mode!r} is not one of {MODES}")
        self.device = device
        self.mode = mode
        self.moved_bytes = 0
        """Bytes copied from host to device so far."""
        self.forwards = 0
        """Units brought in so far (a park brings its one unit per forward)."""
        self._held = False
        self.prefetch = mode == "stream"
        """Whether a unit's forward starts the next unit's copy (``stream``)."""
        self.prefetched = 0
        """Units whose copy was started ahead of their forward."""
        # The side stream of the prefetch on CUDA; elsewhere one stream copies at once.
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._throttle = _Throttle(3, torch.cuda.Event if self._side is not None else None)
        self._pending: dict[int, tuple[list[nn.Parameter], Any]] = {}
        kept_ids = {id(models.output_weight(model))}
        if mode == "park":
            units: list[nn.Module] = [model]
        else:
            units = [models.input_embeddings(model), *models.decoder_layers(model)]
        host = torch.device("cpu") if host is None else host
        pin = device.type == "cuda" and host.type == "cpu"
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
                        copy = p.detach().to(host, copy=True)
                        copy = copy.pin_memory() if pin else copy
                        slots[id(p)] = _Slot(nn.Parameter(copy, requires_grad=False), [])
                    slots[id(p)].places.append((module, name))
            self._units.append(_Unit(list(slots.values())))
        for u in self._units:
            u.drop()  # the device copies (if the model was loaded there) are freed here
        # The modules now hold the host copies: those stay where they are.
        self._to_device(model, parked={id(s.host) for u in self._units for s in u.slots})
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
                if self.prefetch:
                    self._start_next(unit)

        return hook

    def _post_hook(self, unit: _Unit) -> Any:
        def hook(*_args: Any) -> None:
            if not self._held:
                unit.drop()
                if self.prefetch:
                    self._throttle.finished(self._index(unit))
                if unit is self._units[-1]:  # a forward that stopped early leaves none behind
                    self._pending.clear()
                    self._throttle.clear()

        return hook

    def _start_next(self, unit: _Unit) -> None:
        """Start the copy of the unit after ``unit`` (none after the last), on the side stream
        on CUDA: the copy overlaps ``unit``'s compute."""
        at = self._index(unit) + 1
        if at >= len(self._units) or id(self._units[at]) in self._pending:
            return
        after = self._units[at]
        self._throttle.before_copy(at)
        if self._side is None:
            self._pending[id(after)] = (after.copies(self.device), None)
        else:
            with torch.cuda.stream(self._side):
                copies = after.copies(self.device)
                done = torch.cuda.Event()
                done.record(self._side)
            self._pending[id(after)] = (copies, done)
        self.moved_bytes += after.nbytes
        self.prefetched += 1

    def _index(self, unit: _Unit) -> int:
        return next(i for i, u in enumerate(self._units) if u is unit)

    def _bring_in(self, unit: _Unit) -> None:
        """Put ``unit``'s device copies in place: the prefetched ones once their copy is done
        (for the compute stream), else fresh ones copied on the compute stream."""
        self.forwards += 1
        pending = self._pending.pop(id(unit), None)
        if pending is None:
            unit.put(unit.copies(self.device))
            self.moved_bytes += unit.nbytes
            return
        copies, done = pending
        if done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(done)
            for copy in copies:
                # Made on the side stream, read on the compute stream: its memory is reused only
                # after the compute stream's kernels that read it are done.
                copy.record_stream(compute)
        unit.put(copies)

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
            self._pending.clear()
