"""A local teacher model of either backend (torchtune builder or Hugging Face folder), frozen.

It is the teacher of ``kd run kd`` with ``teacher_model``, the scorer of on-policy completions,
the sampler of ``on_policy.seq_kd``, and the model ``kd run teacher_logits`` stores top-k
log-probs of.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kd import models
from kd.runtime import distributed
from kd.teachers.base import Teacher, TeacherInput
from kd.teachers.parking import ParkedWeights
from kd.teachers.signals import LogitsSignal

__all__ = ["ModelTeacher", "as_teacher"]


class ModelTeacher(Teacher):
    """A prepared teacher decoder (frozen, hidden-output mode, possibly FSDP2-sharded).

    With ``parked`` (``teacher_offload``) its weights wait in host memory and are on the device
    only while it runs (:mod:`kd.teachers.parking`): during its forward (brought in and dropped
    by the parking's hooks, before the loss, whose output projection stays on the device) and
    while it samples (:meth:`generator_for` holds it in until :meth:`release`).

    With ``signal_device`` (``teacher_device``, :mod:`kd.teachers.placement`) it runs on a
    device of its own and its hidden states are copied to ``signal_device`` (the student's).

    Args:
        model: the decoder, as :func:`kd.runtime.prepare.prepare_teacher` leaves it.
        folder: where its weights were read from (named when they hold NaN or inf).
        parked: its parked weights, or None (on the device throughout).
        signal_device: where its signal goes when that is not where it runs; None: the same.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        folder: Path | None = None,
        parked: ParkedWeights | None = None,
        signal_device: torch.device | None = None,
    ):
        self.model = model
        self.folder = folder
        self.parked = parked
        self.signal_device = signal_device
        self.generator: nn.Module | None = model

    @property
    def device(self) -> torch.device:
        """Where the teacher computes (a parked teacher's weights wait elsewhere)."""
        if self.parked is not None:
            return self.parked.device
        if self.signal_device is not None:
            # Its first parameter may be a tied projection, on the student's device between
            # forwards (kd.teachers.placement): a decoder layer's is where it runs.
            return next(models.decoder_layers(self.model).parameters()).device
        return next(self.model.parameters()).device

    def signal(self, batch: TeacherInput) -> LogitsSignal:
        # The batch's tokens arrive as the loader made them (on the CPU): the model's device.
        with torch.no_grad():
            hidden = self.model(batch.tokens.to(self.device))  # [b, s, d_t]
        if self.signal_device is not None:
            hidden = hidden.to(self.signal_device)  # once per micro-batch (teacher_device)
        return LogitsSignal(hidden=hidden, model=self.model)

    def generator_for(self, route: str | None) -> nn.Module | None:
        # Sampling runs the model once per token: a parked teacher stays in until release().
        if self.parked is not None:
            self.parked.hold()
        return self.generator

    def check_loaded(self) -> None:
        from kd.runtime.checkpoints import check_loaded_weights_finite

        check_loaded_weights_finite({"teacher_model": (self.model, self.folder or Path())})

    def release(self) -> None:
        # Free the sharded teacher's gathered root (norm + output) before the backward peaks; a
        # parked teacher held in for sampling goes back to host memory.
        distributed.reshard(self.model)
        if self.parked is not None:
            self.parked.let_go()


def as_teacher(teacher: object) -> object:
    """``teacher`` as a :class:`kd.teachers.Teacher`: a bare decoder becomes a
    :class:`ModelTeacher` (the library functions of :mod:`kd.training.train` and :mod:`kd.training.evaluate` take
    either), a teacher or None is returned as it is."""
    return ModelTeacher(teacher) if isinstance(teacher, nn.Module) else teacher
