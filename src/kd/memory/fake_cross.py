"""The cross-tokenizer teacher on fake tensors (``cross_tokenizer:`` under ``kd plan --trace``).

:class:`kd.teachers.cross.CrossTokenizerTeacher` tokenizes each row's text with the teacher's
tokenizer, which reads token values that fake tensors do not have. :class:`FakeCrossTeacher` is
that teacher with the planner's synthetic rows in place of the tokenization: every position
labelled, the teacher's tokens as many as the student's and aligned one to one, and the first
``matched`` ids of both vocabularies shared (:func:`kd.memory.loss_head.cross_matched`); the
teacher's forward, the signal and GOLD's loss (:func:`kd.cross_tokenizer.sequence_loss`) are
the real code. :class:`FakeCrossStore` is the store's teacher
(:class:`kd.teachers.cross_stored.CrossStoredTeacher`): each row's dense fp32 log-probs made by
the signal, no teacher forward.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from kd.cross_tokenizer import VocabMatch
from kd.teachers.base import Teacher, TeacherInput
from kd.teachers.cross import TERMS, CrossTokenizerSignal, CrossTokenizerTeacher, _Row


class _Nested(nn.Module):
    """A parent module call around ``fn``: the trackers take a module's second top-level call
    for the next iteration, and the cross loss calls each model's output projection once per
    row; inside this parent those calls are nested ones, which they accept."""

    def forward(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


class _FakeCrossSignal(CrossTokenizerSignal):
    """:class:`CrossTokenizerSignal` whose loss runs inside a :class:`_Nested` call."""

    def loss(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return _Nested()(super().loss, *args, **kwargs)


def planner_match(sizes: tuple[int, int], matched: int) -> VocabMatch:
    """The planner's vocabularies: the first ``matched`` ids of both shared, the rest not."""
    vs, vt = sizes
    return VocabMatch(
        student=torch.arange(matched),
        teacher=torch.arange(matched),
        teacher_size=vt,
        student_rest=torch.arange(matched, vs),
        teacher_rest=torch.arange(matched, vt),
    )


class FakeCrossTeacher(CrossTokenizerTeacher):
    """A cross-tokenizer teacher whose rows are the planner's (see the module docstring).

    Args:
        model: the teacher (fake tensors, hidden-output mode).
        sizes: the student's and the teacher's distribution sizes.
        matched: token strings both vocabularies share.
        matched_weight: ``cross_tokenizer.matched_weight``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        sizes: tuple[int, int],
        matched: int,
        matched_weight: float | None,
    ):
        super().__init__(
            model,
            student_tokenizer=None,
            teacher_tokenizer=None,
            match=planner_match(sizes, matched),
            sizes=sizes,
            matched_weight=matched_weight,
        )

    def signal(self, batch: TeacherInput) -> CrossTokenizerSignal:
        """The signal of ``batch`` (the trace's step passes no labels: its rows label every
        position, and :meth:`_row` reads none)."""
        made = super().signal(replace(batch, labels=batch.tokens))
        return _FakeCrossSignal(made.owner, made.rows)

    def _row(
        self, tokens: torch.Tensor, labels: torch.Tensor, index: int | None
    ) -> tuple[list[int], dict[str, Any]]:
        s = int(tokens.shape[0])
        spans = [(i, i + 1) for i in range(s)]
        return [0] * s, {
            "s_rows": torch.arange(s),
            "s_ids": torch.zeros(s, dtype=torch.long),
            "s_spans": spans,
            "t_rows": list(range(s)),
            "t_ids": torch.zeros(s, dtype=torch.long),
            "t_spans": spans,
        }


class FakeCrossStore(Teacher):
    """A cross-tokenizer store's teacher on the planner's rows: as
    :class:`kd.teachers.cross_stored.CrossStoredTeacher`, the signal makes every row's dense fp32
    log-probs ``[s, Vt]`` (on the batch's device) before the loss, and the loss reads them.

    Args:
        sizes: the student's and the teacher's distribution sizes.
        matched: token strings both vocabularies share.
        matched_weight: ``cross_tokenizer.matched_weight``.
    """

    terms = TERMS

    def __init__(self, *, sizes: tuple[int, int], matched: int, matched_weight: float | None):
        self.sizes = sizes
        self.match = planner_match(sizes, matched)
        self.matched_weight = matched_weight

    def signal(self, batch: TeacherInput) -> CrossTokenizerSignal:
        b, s = batch.tokens.shape
        device = batch.tokens.device
        spans = [(i, i + 1) for i in range(s)]
        rows = [
            _Row(
                s_rows=torch.arange(s, device=device),
                s_ids=torch.zeros(s, dtype=torch.long, device=device),
                s_spans=spans,
                t_hidden=None,
                t_ids=torch.zeros(s, dtype=torch.long, device=device),
                t_spans=spans,
                t_logp=torch.zeros(s, self.sizes[1], device=device),  # [s, Vt] fp32
            )
            for _ in range(b)
        ]
        return _FakeCrossSignal(self, rows)

    def teacher_logp(self, row: _Row, temperature: float) -> torch.Tensor:
        assert row.t_logp is not None
        return row.t_logp
