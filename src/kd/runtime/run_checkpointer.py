"""The checkpointer a recipe holds: one object that saves and restores one run's student.

It binds what every save of a run shares (output_dir, the student's source folder and LoRA
settings, the config snapshot, ``keep_last_n``, the ranks) so the recipe says only *when* to save
(:meth:`RunCheckpointer.save`, :meth:`RunCheckpointer.save_best`) and where to resume from
(:meth:`RunCheckpointer.restore`). The mechanics are :mod:`kd.runtime.checkpoints`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kd.checkpoint.resume_point import find_latest_checkpoint
from kd.errors import KDUserError
from kd.runtime.checkpoints import (
    Progress,
    StudentSource,
    restore_training_checkpoint,
    save_best_checkpoint,
    save_training_checkpoint,
)
from kd.runtime.distributed import WorldInfo

__all__ = ["RunCheckpointer"]


class RunCheckpointer:
    """Saves (step checkpoints, ``final/``, ``best/``) and restores the student of one run.
    Every method is collective when distributed (rank 0 writes).

    Args:
        output_dir: the run's folder.
        source: where the student came from (what its HF export needs).
        config_yaml: the resolved config snapshot saved with every checkpoint.
        keep_last_n: step checkpoints kept.
        world: this process's place in the job.
        extra: trainable parameters beside the student (:meth:`kd.teachers.Teacher.bind_student`):
            saved in and restored from step checkpoints, never exported.
    """

    def __init__(
        self,
        output_dir: Path,
        *,
        source: StudentSource,
        config_yaml: str,
        keep_last_n: int,
        world: WorldInfo,
        extra: torch.nn.Module | None = None,
    ):
        self.output_dir = output_dir
        self.extra = extra
        self.source = source
        self.config_yaml = config_yaml
        self.keep_last_n = keep_last_n
        self.world = world

    def save(
        self,
        student: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any | None,
        progress: Progress,
        *,
        final: bool,
    ) -> Path | None:
        """``step_<step>/`` with the resume state, or ``final/`` (weights only); the folder on
        rank 0."""
        return save_training_checkpoint(
            self.output_dir,
            student=student,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            progress=progress,
            source=self.source,
            config_yaml=self.config_yaml,
            keep_last_n=self.keep_last_n,
            final=final,
            world=self.world,
            extra=self.extra,
        )

    def save_best(
        self, student: torch.nn.Module, progress: Progress, *, metric: str, value: float, mode: str
    ) -> Path | None:
        """Replace ``best/`` with the student now (``keep_best``)."""
        return save_best_checkpoint(
            self.output_dir,
            student=student,
            progress=progress,
            source=self.source,
            config_yaml=self.config_yaml,
            metric=metric,
            value=value,
            mode=mode,
            world=self.world,
        )

    def restore(
        self,
        ckpt: Path,
        student: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any | None,
    ) -> Progress:
        """Load step checkpoint ``ckpt`` into the student, optimizer, scheduler and RNGs."""
        return restore_training_checkpoint(
            ckpt,
            student=student,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            source=self.source,
            world=self.world,
            extra=self.extra,
        )

    def save_on_stop(
        self,
        err: KDUserError,
        *,
        step: int,
        just_saved: Path | None,
        save: Callable[..., Path | None],
    ) -> KDUserError:
        """A run that must stop mid-step (a teacher that stopped answering): save the steps
        completed (``save(final=False)``, unless step ``step`` was just saved in ``just_saved``;
        the failed step is repeated on resume) and return ``err`` with where in its one line.
        Under torchrun saving is collective: it happens when every rank stopped at the same
        point (``err.collective``, :class:`kd.teachers.TeacherStopped`); otherwise only this
        rank failed, and the line names the newest checkpoint instead."""
        together = not self.world.distributed or bool(getattr(err, "collective", False))
        path = just_saved
        if path is None and together:
            path = save(final=False)
        if path is None:
            path = find_latest_checkpoint(self.output_dir)
        if path is None:
            return err
        verb = "saved" if together else "the newest checkpoint is"
        return type(err)(
            f"{err}; stopped after step {step}; {verb} {path} "
            "(resume_from_checkpoint=true continues from it)"
        )
