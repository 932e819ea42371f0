"""The teacher interface: what the loss needs from a teacher for one batch.

Every kind of teacher (:mod:`kd.config.teacher_kinds`, ``docs/teachers.md``: a local model of either
backend, hidden-state targets, kd's store of top-k log-probs, another tool's top-k files, a served
model, the student itself, a teacher with another tokenizer, several teachers) implements
:class:`Teacher`. The recipe holds one and calls it; it never asks which kind
it holds. A teacher answers a :class:`TeacherInput` (a micro-batch) with a :class:`TeacherSignal`,
and the signal owns the divergence between itself and the student (:meth:`TeacherSignal.loss`), so
a new kind of signal brings its own loss without a branch in :mod:`kd.training.train`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from kd.config.run import LossSettings
from kd.errors import KDUserError

__all__ = ["Teacher", "TeacherInput", "TeacherSignal", "TeacherStopped", "asks_signal"]


class TeacherStopped(KDUserError):
    """A teacher cannot answer a batch mid-run (a served model stayed down, refused a request or
    answered something malformed): the recipe saves the steps completed, then stops with this
    one line (exit 2); resume continues from the save.

    Args:
        message: the line.
        collective: under torchrun, every rank raised it at the same micro-batch (the teacher
            agreed on it), so the ranks can save together; False: this rank alone may have.
    """

    def __init__(self, message: str, *, collective: bool = False):
        super().__init__(message)
        self.collective = collective


@dataclass(frozen=True)
class TeacherInput:
    """One micro-batch as a teacher sees it.

    Attributes:
        tokens: ``[b, s]`` input ids (right-padded).
        labels: ``[b, s]`` the batch's labels, *not* shifted (files of top-k log-probs match rows
            by ``(tokens, labels)``); None when the batch has none (a model teacher needs none).
        rows: the dataset index of each example (files of top-k log-probs are indexed by row);
            None for rows made during training (on-policy completions).
        source_rows: for on-policy completions, the dataset row whose prompt each one completes
            (a self teacher renders that row's privileged context); None otherwise.
        route: the teacher each example names (its data field ``teachers.route_field``; None:
            none), when the source asks for it (``TeacherSource.route_field``); else None.
    """

    tokens: torch.Tensor
    labels: torch.Tensor | None = None
    rows: Sequence[int] | None = None
    source_rows: Sequence[int] | None = None
    route: Sequence[str | None] | None = None


@runtime_checkable
class TeacherSignal(Protocol):
    """A teacher's answer for one micro-batch, on the training device.

    A signal may also report extra named loss terms (several teachers: ``kd_loss/<name>``):
    after :meth:`loss`, an attribute ``terms: dict[str, Tensor]`` of detached scalars, each a
    mean over the batch's labelled positions (training logs them beside ``kd_loss``; they are
    named in :attr:`Teacher.terms`). For evaluation such a signal has
    ``token_divergences(student_logits, hidden, *, settings)`` (:mod:`kd.training.evaluate`).
    Signals without them report none.
    """

    def loss(
        self,
        student: nn.Module,
        student_hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        settings: LossSettings,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss, ce, kd)``, each a mean over labelled positions, ``loss`` mixed by
        :func:`kd.losses.mix_ce_kd` (plus any extra term's weighted share); a signal whose loss
        has more terms than CE and KD also fills its ``terms`` attribute, ``{name: term}``
        (detached means over labelled positions, e.g. ``hidden_loss``), which the recipe logs
        beside them.

        Args:
            student: the student decoder (its output projection turns ``student_hidden`` into
                logits, chunk by chunk when the loss is fused).
            student_hidden: ``[b, s, d_s]`` the student's final-norm hidden states.
            labels: ``[b, s]`` shifted labels (:func:`kd.training.train.shift_labels`).
            settings: the loss settings.
        """
        ...

    def labelled_hidden(self, index: torch.Tensor | None) -> torch.Tensor:
        """The teacher's states at the flattened positions ``index`` (all when None), ``[n, d]``,
        for :meth:`logits` (evaluation walks them chunk by chunk)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[n, V]`` fp32 of rows of :meth:`labelled_hidden`."""
        ...


class Teacher(Protocol):
    """A source of teacher signals, loaded and ready (:mod:`kd.teachers.build` chooses one from
    the config). Implementations subclass it and inherit the defaults below.

    Attributes:
        generator: the model that can sample completions (on-policy ``seq_kd``), or None when the
            teacher is not a local model.
        terms: the names of the extra loss terms its signals report (``TeacherSignal`` terms),
            the same for every batch; logged as they are, validated as ``val_<name>``.
        own_loss: its signal adds a loss term of its own whatever ``kd_ratio`` (hidden-state
            targets), so a step with ``kd_ratio: 0`` still asks it (:func:`asks_signal`); the
            kind declares the same (:attr:`kd.config.teacher_kinds.TeacherKind.own_loss`).
    """

    generator: nn.Module | None = None
    terms: tuple[str, ...] = ()
    own_loss: bool = False

    def signal(self, batch: TeacherInput) -> TeacherSignal:
        """The teacher's signal for ``batch``, on the device the student trains on. Runs without
        autograd."""
        ...

    def generator_for(self, route: str | None) -> nn.Module | None:
        """The model that samples completions (on-policy ``seq_kd``) of a row naming ``route``
        (:attr:`TeacherInput.route`; None when rows name none). Default: :attr:`generator`,
        whatever the row names."""
        return self.generator

    def bind_student(self, student: nn.Module) -> nn.Module | None:
        """Called once the student is loaded and prepared (LoRA, activation checkpointing,
        sharding), before the optimizer is built and before a resume restores it: a teacher
        made from the student itself (self-distillation) or one that reads the student's own
        layers (hidden-state targets) takes what it needs here.

        Returns:
            None, or a module of extra trainable parameters the loss uses (hidden-state
            projections): the recipe trains them with the student (replicated on every rank,
            gradients averaged), saves them in step checkpoints, restores them on resume and
            never exports them with the student. Default: nothing, None.
        """
        return None

    def after_step(self, step: int) -> None:
        """Called by the recipe after each optimizer step (``step``: the steps done, 1 first),
        on every rank, whether or not the step applied its gradients: a teacher that changes
        as the run goes (an EMA of the student, a schedule, a counter) moves here. Default:
        nothing changes."""

    def state_dict(self) -> dict[str, Any]:
        """The teacher's own state (plain values, tensors on the host), saved in step
        checkpoints and given back to :meth:`load_state_dict` on resume so that a resumed run
        matches an uninterrupted one. Rank 0's is saved. Default: none, ``{}``."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` from a step checkpoint (``{}``: one saved before this
        teacher had state, or by a teacher without any). Default: nothing to restore."""

    def close(self) -> None:
        """Let go of what the teacher holds for the run (connections, worker threads, a store's
        lock); called once when the run ends, also when it fails. Default: nothing held."""

    def release(self) -> None:
        """Free what one batch needed and the next does not (a sharded teacher's gathered
        parameters). Collective when distributed. Default: nothing to free."""

    def check_loaded(self) -> None:
        """Called when the first training step is non-finite before any optimizer step: raise
        :class:`kd.errors.KDUserError` naming the files when what the teacher loaded explains it
        (NaN or inf weights). Default: nothing loaded to blame."""

    def look_ahead(
        self, batches: Iterator[dict[str, torch.Tensor]]
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The training batches, in the order :meth:`signal` will be asked about them (collated
        dicts: ``tokens``, ``labels``, ``rows`` when the loader gives rows). A teacher that
        answers slowly (a served model) starts on the next ones while the student trains on
        this one. Default: the batches as they are."""
        return batches


def asks_signal(teacher: Teacher | None, settings: LossSettings) -> bool:
    """Whether a training step or an evaluation asks ``teacher`` for its signal (runs its
    forward on the batch): the loss has a KD term
    (:attr:`kd.config.run.LossSettings.needs_teacher_logits`) or the teacher's signal adds a term
    of its own (:attr:`Teacher.own_loss`). With ``kd_ratio: 0`` a teacher that only samples
    ``seq_kd`` completions is never asked: the loss is the student's CE."""
    if teacher is None:
        return False
    return settings.needs_teacher_logits or bool(getattr(teacher, "own_loss", False))
