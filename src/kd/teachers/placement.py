"""A local teacher model on a device of its own (``teacher_device``): its forward there, its
signal on the student's device.

The teacher is built and loaded on ``teacher_device``; the loss reads its final hidden states and
its output projection (:class:`kd.teachers.signals.LogitsSignal`) beside the student's, so:

* the hidden states ``[b, s, d_t]`` are copied to the student's device once per micro-batch
  (:meth:`kd.teachers.model.ModelTeacher.signal`);
* the output projection is copied to the student's device once, when the teacher is placed
  (:class:`HeadOnStudentDevice`): the module's parameter entries hold that copy between the
  teacher's forwards. A tied projection is also the teacher's embedding, which its forward reads
  on its own device: a forward pre-hook puts the teacher-device copy back for the forward and a
  hook puts the student-device copy in after it (an untied one is read by no forward, so only
  the student-device copy is kept).

Nothing else crosses: the batch's tokens go to the teacher's device, the loss and every gradient
stay on the student's. One process only (an FSDP2-sharded teacher shards over the ranks' devices
instead).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kd import models
from kd.config.teacher_kinds.model import teacher_device_under_torchrun
from kd.errors import KDUserError


def check_teacher_device(name: str, *, distributed: bool) -> torch.device:
    """The device ``teacher_device`` names, checked before any weight is read.

    Args:
        name: the ``teacher_device`` value (``cuda:1``, ``cpu``; the fake accelerator in tests).
        distributed: whether this run is one of several ranks (torchrun).

    Raises:
        KDUserError: under torchrun, or a device this machine does not have.
    """
    if distributed:
        raise KDUserError(teacher_device_under_torchrun(name))
    device = torch.device(name)
    if device.type == "cpu":
        return device
    module = getattr(torch, device.type, None)
    available = module is not None and module.is_available()
    count = int(module.device_count()) if available else 0
    index = 0 if device.index is None else device.index
    if index >= count:
        have = f"has {count} {device.type} device(s)" if count else f"has no {device.type} device"
        raise KDUserError(
            f"teacher_device: {name} is not on this machine (it {have}); set teacher_device to "
            "one it has, or remove it"
        )
    return device


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (``cuda`` is ``cuda:0`` in one process)."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


class HeadOnStudentDevice:
    """The teacher's output projection on the student's device (module doc).

    Args:
        model: the prepared teacher (frozen, hidden-output mode) on its own device.
        student_device: where the loss runs.
    """

    def __init__(self, model: nn.Module, student_device: torch.device) -> None:
        head = models.output_weight(model)
        self.places = [
            (module, name)
            for module in model.modules()
            for name, p in module._parameters.items()
            if p is head
        ]
        self.on_student = nn.Parameter(head.detach().to(student_device), requires_grad=False)
        # A tied projection is the embedding the forward reads on the teacher's device.
        self.on_teacher = head if models.is_tied(model) else None
        self._put(self.on_student)
        if self.on_teacher is not None:
            model.register_forward_pre_hook(self._for_forward)
            model.register_forward_hook(self._after_forward, always_call=True)

    def _put(self, weight: nn.Parameter) -> None:
        for module, name in self.places:
            module._parameters[name] = weight

    def _for_forward(self, *_args: Any) -> None:
        assert self.on_teacher is not None
        self._put(self.on_teacher)

    def _after_forward(self, *_args: Any) -> None:
        self._put(self.on_student)
