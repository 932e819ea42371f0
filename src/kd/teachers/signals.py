"""The signals a teacher answers with, each owning its divergence to the student.

* :class:`LogitsSignal`: a local model's final-norm hidden states and the model (for its output
  projection): the full distribution, compared chunk by chunk by the fused loss
  (:func:`kd.losses.fused_linear_kd_loss`) or through full logits (a LoRA output projection).
* :class:`TopKSignal`: top-k ids and log-probs per position (kd's store, another tool's file),
  compared by :func:`kd.losses.fused_linear_topk_kd_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kd import losses, models
from kd.config.run import LossSettings

__all__ = ["LogitsSignal", "TopKSignal", "fused_kd_settings", "student_ce"]


def student_ce(
    student: nn.Module,
    student_hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    settings: LossSettings,
) -> torch.Tensor:
    """The student's mean CE over labelled positions, the loss of a step without a KD term
    (no teacher, or ``kd_ratio: 0``): the fused CE head chunk by chunk
    (:func:`kd.losses.fused_linear_ce_loss`), or full logits for an output projection that is
    not a plain linear (a LoRA one) or with ``fused_loss: false``.

    Args:
        student: the student decoder (its output projection).
        student_hidden: ``[b, s, d_s]`` its final-norm hidden states.
        labels: ``[b, s]`` shifted labels.
        settings: the loss settings.
    """
    if settings.fused and models.has_plain_output(student):
        return losses.fused_linear_ce_loss(
            student_hidden,
            models.output_weight(student),
            labels,
            ignore_index=settings.ignore_index,
            chunk_size=settings.chunk_size,
        )
    logits = models.logits_from_hidden(student, student_hidden)  # [b, s, v_s] fp32
    return losses.ce_loss(logits, labels, ignore_index=settings.ignore_index)


def fused_kd_settings(settings: LossSettings) -> dict[str, Any]:
    """The knobs both fused KD losses take, from the loss settings."""
    return dict(
        divergence=settings.divergence,
        temperature=settings.temperature,
        kd_ratio=settings.kd_ratio,
        ignore_index=settings.ignore_index,
        chunk_size=settings.chunk_size,
        beta=settings.beta,
        skew_alpha=settings.skew_alpha,
    )


@dataclass
class LogitsSignal:
    """A local teacher's answer: ``hidden [b, s, d_t]`` and the teacher (its output projection).

    No full-vocabulary logits exist until a loss or :meth:`logits` asks for a chunk of them.
    """

    hidden: torch.Tensor
    model: nn.Module

    def loss(
        self,
        student: nn.Module,
        student_hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        settings: LossSettings,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not settings.needs_teacher_logits:  # kd_ratio 0 (asked for hidden states): CE alone
            ce = student_ce(student, student_hidden, labels, settings=settings)
            return ce, ce.detach(), torch.zeros_like(ce).detach()
        if settings.fused and models.has_plain_output(student):
            return losses.fused_linear_kd_loss(
                student_hidden,
                models.output_weight(student),
                self.hidden,
                models.output_weight(self.model),
                labels,
                **fused_kd_settings(settings),
            )
        s_logits = models.logits_from_hidden(student, student_hidden)  # [b, s, v_s] fp32
        with torch.no_grad():
            t_logits = self.logits(self.hidden)  # [b, s, v_t] fp32
        ce = losses.ce_loss(s_logits, labels, ignore_index=settings.ignore_index)
        kd = losses.kd_loss(
            s_logits,
            t_logits,
            labels,
            divergence=settings.divergence,
            temperature=settings.temperature,
            ignore_index=settings.ignore_index,
            beta=settings.beta,
            skew_alpha=settings.skew_alpha,
        )
        loss = losses.mix_ce_kd(ce, kd, settings.kd_ratio)
        return loss, ce, kd

    def labelled_hidden(self, index: torch.Tensor | None) -> torch.Tensor:
        flat = self.hidden.reshape(-1, self.hidden.size(-1))  # [b * s, d_t]
        return flat if index is None else flat.index_select(0, index)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return models.logits_from_hidden(self.model, hidden)


@dataclass
class TopKSignal:
    """Top-k ``ids [b, s, k]`` (int64) and ``logprobs [b, s, k]`` per position, aligned with the
    shifted labels; ``vocab`` is the vocabulary they were taken over (the student's softmax runs
    over the same first ``vocab`` entries; None: all of the student's); ``tail`` how the mass outside the top-k is treated
    (``teacher_logits.tail``)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    vocab: int | None = None
    tail: str | None = None

    def loss(
        self,
        student: nn.Module,
        student_hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        settings: LossSettings,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not models.has_plain_output(student):
            raise ValueError(
                "an offline (top-k) teacher needs a student with a plain output projection "
                "(not a LoRA output layer)"
            )
        return losses.fused_linear_topk_kd_loss(
            student_hidden,
            models.output_weight(student),
            self.ids,
            self.logprobs,
            labels,
            tail=self.tail if self.tail is not None else settings.topk_tail,
            vocab=self.vocab,
            **fused_kd_settings(settings),
        )

    def labelled_hidden(self, index: torch.Tensor | None) -> torch.Tensor:
        raise ValueError(
            "a top-k teacher has no full distribution to evaluate against; validation needs a "
            "teacher model"
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("a top-k teacher has no full-vocabulary logits")
