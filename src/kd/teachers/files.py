"""Teachers read from files of top-k log-probs: kd's own store and other tools' files.

Both readers (:class:`kd.teachers.store_reader.StoreReader`, kd's Parquet store;
:class:`kd.teachers.foreign_store.ForeignStoreReader`, axolotl / DistillKit files) implement
:class:`StoreFile`, the one reader interface; :class:`StoreTeacher` turns either into a
:class:`kd.teachers.Teacher`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kd.teachers.base import Teacher, TeacherInput
from kd.teachers.signals import TopKSignal

__all__ = ["StoreTeacher", "FixedTopKTeacher", "StoreFile"]


class StoreFile(Protocol):
    """A file (or folder) of the teacher's top-k log-probs per labelled position of each row.

    Attributes:
        num_rows: rows it holds (dataset rows ``0 .. num_rows - 1``).
    """

    num_rows: int

    def batch(
        self,
        rows: Sequence[int],
        tokens: torch.Tensor,
        labels: torch.Tensor,
        *,
        k: int,
        ignore_index: int = -100,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [b, s, k] int64, logprobs [b, s, k])`` of dataset rows ``rows`` (tokens and
        unshifted labels ``[b, s]``), aligned with the shifted labels; rows are checked against
        what the file was computed on."""
        ...


class StoreTeacher(Teacher):
    """The teacher of a :class:`StoreFile`: no model, no weights in memory.

    Args:
        reader: the opened, checked file.
        k: entries used per position (``teacher_logits.k``).
        vocab: the vocabulary the log-probs were taken over (the student's softmax runs over the
            same first ``vocab`` entries); None for the student's whole vocabulary.
        tail: ``teacher_logits.tail``.
        device: where the student trains.
    """

    def __init__(
        self,
        reader: StoreFile,
        *,
        k: int,
        vocab: int | None,
        tail: str,
        device: torch.device,
    ):
        self.reader = reader
        self.k = k
        self.vocab = vocab
        self.tail = tail
        self.device = device

    def signal(self, batch: TeacherInput) -> TopKSignal:
        if batch.rows is None or batch.labels is None:
            raise ValueError("a file teacher needs the dataset rows and labels of the batch")
        ids, logprobs = self.reader.batch(batch.rows, batch.tokens, batch.labels, k=self.k)
        return TopKSignal(
            ids=ids.to(self.device),
            logprobs=logprobs.to(self.device),
            vocab=self.vocab,
            tail=self.tail,
        )


class FixedTopKTeacher(Teacher):
    """A teacher that answers every batch with the same top-k tensors (the memory tracer's
    stand-in for a file teacher: fake tensors of the shapes a reader returns).

    Args:
        ids: ``[b, s, k]`` int64.
        logprobs: ``[b, s, k]``.
        tail: the tail treatment the signal carries (None: the loss settings').
    """

    def __init__(self, ids: torch.Tensor, logprobs: torch.Tensor, *, tail: str | None = None):
        self.ids = ids
        self.logprobs = logprobs
        self.tail = tail

    def signal(self, batch: TeacherInput) -> TopKSignal:
        return TopKSignal(ids=self.ids, logprobs=self.logprobs, tail=self.tail)
