"""Self-distillation: the student is its own teacher, conditioned on a privileged context.

Context distillation (off-policy: the dataset's completions) and on-policy self-distillation
(OPSD, "Self-Distilled Reasoner", arXiv 2601.18734: the student's own rollouts) with one model.
The teacher is

* a LoRA student with its adapters switched off (``self_teacher.weights: initial``): the base
  model, no second copy of any weight (:func:`kd.models.adapters_disabled`: peft's
  ``enable_adapters`` for transformers models, torchtune's ``disable_adapter``);
* a full fine-tune: a frozen copy of the initial weights loaded beside the student (``initial``);
* with ``weights: live`` the student's current weights (no copy; the target moves as the student
  learns).

Its input is the row with the context (:mod:`kd.teachers.privileged`), then the student's
completion tokens; :func:`map_batch` pairs each labelled student position with the teacher's
position holding the same completion token, and the teacher's hidden states are re-indexed onto
the student's positions, so :class:`SelfSignal` is an ordinary :class:`LogitsSignal` for every
divergence and the CE mix of :mod:`kd.losses`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kd import models
from kd.config.run import IGNORE_INDEX
from kd.errors import KDUserError
from kd.runtime import distributed
from kd.teachers.base import Teacher, TeacherInput
from kd.teachers.privileged import PrivilegedRows, TeacherRow, labelled_positions
from kd.teachers.signals import LogitsSignal

__all__ = ["MappedBatch", "SelfSignal", "SelfTeacher", "map_batch", "on_policy_rows"]


@dataclass(frozen=True)
class MappedBatch:
    """The teacher's batch and where its predictions go in the student's.

    Attributes:
        tokens: ``[b, s_t]`` the teacher's inputs, right-padded.
        rows: ``[n]`` batch row of each mapped prediction.
        student: ``[n]`` the student position predicting a labelled token (label position - 1).
        teacher: ``[n]`` the teacher position predicting the same token.
    """

    tokens: torch.Tensor
    rows: torch.Tensor
    student: torch.Tensor
    teacher: torch.Tensor


def map_batch(
    student_labels: torch.Tensor,
    teacher_tokens: Sequence[Sequence[int]],
    teacher_labelled: Sequence[Sequence[int]],
    *,
    pad_id: int,
    ignore_index: int = IGNORE_INDEX,
) -> MappedBatch:
    """Pair the student's labelled positions with the teacher's, row by row, in order.

    The i-th labelled token of a student row is the i-th of its teacher row (the completion is
    token-identical; the prompts differ in length). Position ``p`` is labelled when its label
    (not shifted) is set, so the prediction of that token is at ``p - 1`` in each sequence.
    Wherever the student's padding is (left or right), only its labels are read.

    Args:
        student_labels: ``[b, s_s]`` the student's labels, not shifted.
        teacher_tokens: per row, the teacher's tokens.
        teacher_labelled: per row, the teacher's labelled positions, in order.
        pad_id: the padding id of the teacher's batch (right-padded).
        ignore_index: the label of unlabelled positions.

    Raises:
        ValueError: a row whose teacher and student label different numbers of tokens.
    """
    b = student_labels.shape[0]
    width = max(len(t) for t in teacher_tokens)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)  # [b, s_t]
    rows: list[int] = []
    s_idx: list[int] = []
    t_idx: list[int] = []
    labels = student_labels.tolist()
    for i in range(b):
        tokens[i, : len(teacher_tokens[i])] = torch.tensor(
            list(teacher_tokens[i]), dtype=torch.long
        )
        s_pos = labelled_positions(labels[i], ignore_index)
        t_pos = list(teacher_labelled[i])
        if len(s_pos) != len(t_pos):
            raise ValueError(
                f"row {i}: the student labels {len(s_pos)} tokens, its teacher row {len(t_pos)}"
            )
        for p, q in zip(s_pos, t_pos, strict=True):
            if p >= 1 and q >= 1:  # a first token has no prediction
                rows.append(i)
                s_idx.append(p - 1)
                t_idx.append(q - 1)
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return MappedBatch(tokens, as_long(rows), as_long(s_idx), as_long(t_idx))


def on_policy_rows(
    prompts: Sequence[TeacherRow], student_tokens: torch.Tensor, student_labels: torch.Tensor
) -> tuple[list[list[int]], list[list[int]]]:
    """The teacher's tokens and labelled positions of on-policy completions: each row's
    privileged prompt (:attr:`TeacherRow.prompt_len` tokens of its rendering), then the
    student's completion (its labelled tokens).

    Args:
        prompts: the rendered dataset row each completion continues.
        student_tokens: ``[b, s]`` prompt + completion as the student trains on them.
        student_labels: ``[b, s]`` their labels (the completion), not shifted.
    """
    tokens, labelled = [], []
    labels = student_labels.tolist()
    ids = student_tokens.tolist()
    for row, lab, tok in zip(prompts, labels, ids, strict=True):
        completion = [tok[j] for j in labelled_positions(lab)]
        start = row.prompt_len
        tokens.append(row.tokens[:start] + completion)
        labelled.append(list(range(start, start + len(completion))))
    return tokens, labelled


@dataclass
class SelfSignal(LogitsSignal):
    """The teacher's hidden states on the student's positions (:func:`map_batch`); its logits
    come from the student's output projection, with the adapters off when the teacher is the
    base model (``adapters_off``: only the unfused path reads a LoRA output layer)."""

    adapters_off: bool = False

    def _teacher_head(self) -> contextlib.AbstractContextManager[None]:
        return (
            models.adapters_disabled(self.model) if self.adapters_off else contextlib.nullcontext()
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._teacher_head():
            return super().logits(hidden)


class SelfTeacher(Teacher):
    """The student as its own teacher (see the module docstring).

    Args:
        rows: the training rows rendered with the context (checked by the source).
        pad_id: the tokenizer's padding id.
        model: a frozen copy of the initial weights (full fine-tune, ``weights: initial``), or
            None: the student, given by :meth:`bind_student`.
        adapters_off: run the student with its LoRA adapters off (``weights: initial``).
        folder: where the frozen copy was read from (named when its weights are not finite).
    """

    def __init__(
        self,
        rows: PrivilegedRows,
        *,
        pad_id: int,
        model: nn.Module | None = None,
        adapters_off: bool = False,
        folder: Path | None = None,
    ):
        self.privileged = rows
        self.pad_id = pad_id
        self.model = model
        self.copy = model is not None
        self.adapters_off = adapters_off
        self.folder = folder
        self.generator: nn.Module | None = None  # it scores; sampling with context is not asked

    def bind_student(self, student: nn.Module) -> None:
        if self.model is None:
            self.model = student

    @contextlib.contextmanager
    def _as_teacher(self, model: nn.Module) -> Iterator[None]:
        """``model`` as the teacher runs it: eval mode, no autograd, adapters off if asked."""
        was_training = model.training
        model.eval()
        off = models.adapters_disabled(model) if self.adapters_off else contextlib.nullcontext()
        try:
            with torch.no_grad(), off:
                yield
        finally:
            model.train(was_training)

    def teacher_rows(self, batch: TeacherInput) -> tuple[list[list[int]], list[list[int]]]:
        """The teacher's tokens and labelled positions for ``batch``."""
        if batch.labels is None:
            raise KDUserError("self_teacher: a batch without labels has no completion to score")
        if batch.source_rows is not None:  # on-policy completions of these rows' prompts
            rendered = [self.privileged.render(int(r)) for r in batch.source_rows]
            return on_policy_rows(rendered, batch.tokens.cpu(), batch.labels.cpu())
        if batch.rows is None:
            raise KDUserError(
                "self_teacher: the batch does not say which dataset rows it holds, so the "
                "teacher cannot render their context (held-out validation is not supported)"
            )
        rendered = [self.privileged.render(int(r)) for r in batch.rows]
        return [r.tokens for r in rendered], [r.labelled for r in rendered]

    def signal(self, batch: TeacherInput) -> SelfSignal:
        model = self.model
        assert model is not None, "bind_student() gives the self teacher its model"
        tokens, labelled = self.teacher_rows(batch)
        mapped = map_batch(batch.labels.cpu(), tokens, labelled, pad_id=self.pad_id)
        device = next(model.parameters()).device
        with self._as_teacher(model):
            hidden_t = model(mapped.tokens.to(device))  # [b, s_t, d]
        b, s = batch.tokens.shape
        hidden = hidden_t.new_zeros(b, s, hidden_t.shape[-1])  # [b, s_s, d]
        rows = mapped.rows.to(device)
        hidden[rows, mapped.student.to(device)] = hidden_t[rows, mapped.teacher.to(device)]
        return SelfSignal(hidden=hidden, model=model, adapters_off=self.adapters_off)

    def check_loaded(self) -> None:
        if self.copy and self.model is not None:
            from kd.runtime.checkpoints import check_loaded_weights_finite

            check_loaded_weights_finite({"model": (self.model, self.folder or Path())})

    def release(self) -> None:
        if self.copy and self.model is not None:
            distributed.reshard(self.model)  # the frozen copy's gathered root, as ModelTeacher
