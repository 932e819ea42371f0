"""A local teacher model of either backend (torchtune builder or Hugging Face folder), frozen.

It is the teacher of ``kd run kd`` with ``teacher_model``, the scorer of on-policy completions,
the sampler of ``on_policy.seq_kd``, and the model ``kd run teacher_logits`` stores top-k
log-probs of.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kd.teachers.base import Teacher, TeacherInput
from kd.teachers.signals import LogitsSignal
from kd.training import distributed

__all__ = ["ModelTeacher", "as_teacher"]


class ModelTeacher(Teacher):
    """A prepared teacher decoder (frozen, hidden-output mode, possibly FSDP2-sharded).

    Args:
        model: the decoder, as :func:`kd.training.prepare.prepare_teacher` leaves it.
        folder: where its weights were read from (named when they hold NaN or inf).
    """

    def __init__(self, model: nn.Module, *, folder: Path | None = None):
        self.model = model
        self.folder = folder
        self.generator: nn.Module | None = model

    def signal(self, batch: TeacherInput) -> LogitsSignal:
        # The batch's tokens arrive as the loader made them (on the CPU): the model's device.
        device = next(self.model.parameters()).device
        with torch.no_grad():
            hidden = self.model(batch.tokens.to(device))  # [b, s, d_t]
        return LogitsSignal(hidden=hidden, model=self.model)

    def check_loaded(self) -> None:
        from kd.checkpoint.training import check_loaded_weights_finite

        check_loaded_weights_finite({"teacher_model": (self.model, self.folder or Path())})

    def release(self) -> None:
        # Free the sharded teacher's gathered root (norm + output) before the backward peaks.
        distributed.reshard(self.model)


def as_teacher(teacher: object) -> object:
    """``teacher`` as a :class:`kd.teachers.Teacher`: a bare decoder becomes a
    :class:`ModelTeacher` (the library functions of :mod:`kd.training.train` and :mod:`kd.training.evaluate` take
    either), a teacher or None is returned as it is."""
    return ModelTeacher(teacher) if isinstance(teacher, nn.Module) else teacher
