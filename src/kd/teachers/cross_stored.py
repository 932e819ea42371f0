"""A teacher with another tokenizer, read from kd's store (``cross_tokenizer:`` beside
``teacher_logits:``): GOLD's aligned hybrid loss without the teacher's weights.

``kd run teacher_logits`` with ``cross_tokenizer:`` runs the teacher on its own tokens of each
row's text (:meth:`kd.teachers.cross.CrossTokenizerTeacher.store_rows`) and keeps, per labelled
teacher token, its id, its character span, its own log-prob and the top-k over the teacher's
vocabulary (float32), and the student's labelled tokens' spans on the same axis (the row's text,
or with chat templates :func:`kd.teachers.cross_chat.chat_spans`'s); the manifest keeps the
teacher's vocabulary (string -> id). Training then needs neither the teacher's weights nor its
tokenizer: both sides' spans and the teacher's rows are the stored ones, and the loss is
:class:`kd.teachers.cross.CrossTokenizerSignal`'s.

The stored top-k is made a full distribution over the teacher's ids (:func:`dense_logprobs`):
the top-k entries and the actual token's own log-prob as stored, the rest of the mass spread
evenly over the other ids. With k the teacher's whole vocabulary nothing is spread and the loss is
the live teacher's (to fp32 summation order); with a smaller k the matched part's divergence and
ULD's sorted distance see a flat tail instead of the teacher's (docs/multi_teacher.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kd import folders
from kd.config.run import RunConfig
from kd.cross_tokenizer import VocabMatch, vocab_match
from kd.errors import KDUserError
from kd.teachers import store_format, store_manifest, store_reader
from kd.teachers.base import Teacher, TeacherInput
from kd.teachers.cross import (
    CrossTokenizerSignal,
    CrossTokenizerSource,
    _Row,
    student_size,
    vocab_of,
)

__all__ = ["CrossStoredSource", "CrossStoredTeacher", "cross_spec", "dense_logprobs"]

KEY = store_format.KEY
# The least tail mass kept when the stored entries sum to 1 (fp rounding): finite log-probs.
_TINY = 1e-30


def cross_spec(
    spec: store_manifest.StoreSpec, source: CrossTokenizerSource, folder: Path
) -> store_manifest.StoreSpec:
    """A store's spec for a cross-tokenizer teacher: its own vocabulary and distribution size.

    Args:
        spec: the plain spec of the run (:func:`kd.teachers.store_folder.store_spec`).
        source: the checked teacher (its tokenizer and sizes).
        folder: the teacher's folder (its tokenizer files are hashed).
    """
    size = source.teacher_size
    files = {
        name: path
        for name in ("tokenizer.json", "tokenizer_config.json")
        if (path := folders.file_in(folder, name, key="teacher_model")) is not None
    }
    vocab = {s: int(i) for s, i in source.teacher_tokenizer.get_vocab().items() if i < size}
    return dataclasses.replace(
        spec,
        vocab=size,
        teacher_vocab=size,
        cross_tokenizer={
            "teacher_size": size,
            "teacher_tokenizer_sha256": store_format.files_sha256(files),
            "teacher_vocab": vocab,
        },
    )


def dense_logprobs(
    ids: np.ndarray, logprobs: np.ndarray, own_ids: np.ndarray, own: np.ndarray, size: int
) -> torch.Tensor:
    """A full ``[n, size]`` float32 log-prob matrix from stored top-k rows.

    Args:
        ids: ``[n, k]`` top-k ids.
        logprobs: ``[n, k]`` their log-probs.
        own_ids: ``[n]`` the actual token at each row.
        own: ``[n]`` its log-prob (kept also when it is outside the top-k).
        size: the teacher's distribution size.

    Returns:
        The stored entries as they are; the remaining mass, ``1 -`` theirs, spread evenly over
        the other ids (nothing to spread when ``k == size``).
    """
    top_ids = torch.from_numpy(ids.astype(np.int64))
    top = torch.from_numpy(logprobs.astype(np.float32))
    own_id = torch.from_numpy(own_ids.astype(np.int64))
    own_lp = torch.from_numpy(own.astype(np.float32))
    n, k = top.shape
    in_top = (top_ids == own_id[:, None]).any(1)
    mass = top.double().exp().sum(1) + torch.where(in_top, 0.0, own_lp.double().exp())
    rest = size - k - (~in_top).long()
    tail = torch.log((1.0 - mass).clamp_min(_TINY) / rest.clamp_min(1)).float()
    dense = tail[:, None].expand(n, size).clone()
    dense.scatter_(1, top_ids, top)
    dense[torch.arange(n), own_id] = own_lp
    return dense


class CrossStoredSource:
    """``teacher_logits:`` + ``cross_tokenizer:``: kd's store of a cross-tokenizer teacher.
    ``teacher_model``, if set, only identifies the teacher the store came from."""

    reads: tuple[str, ...] = ()
    needs_rows = True
    route_field: str | None = None

    def __init__(self, run: RunConfig):
        assert run.teacher_logits is not None and run.cross_tokenizer is not None
        self.run = run
        self.settings = run.teacher_logits
        self.reader: store_reader.StoreReader | None = None
        self.match: VocabMatch | None = None
        self.sizes = (0, 0)

    def check(self, ctx: Any, facts: Any, dataset: Sequence[Any]) -> None:
        """Open the store and check it against this run (rows, student tokenizer files,
        max_seq_len, temperature, k, teacher when named; a store holding the teacher's tokens
        and offsets), then match both vocabularies."""
        settings, run = self.settings, self.run  # format: kd (kd.config.teachers)
        fingerprint = store_format.dataset_fingerprint(
            store_format.row_hash(dataset[i]["tokens"], dataset[i]["labels"])
            for i in range(len(dataset))
        )
        store = store_reader.open_run_store(
            ctx,
            facts,
            run,
            path=settings.path,
            k=settings.k,
            dataset_fingerprint=fingerprint,
            student_vocab=None,
            cross_tokenizer=True,
        )
        cross = store.manifest["cross_tokenizer"]
        size = int(cross["teacher_size"])
        self.sizes = (student_size(ctx, facts), size)
        student_vocab = {s: i for s, i in vocab_of(ctx.tokenizer()).items() if i < self.sizes[0]}
        self.match = vocab_match(student_vocab, cross["teacher_vocab"], teacher_size=size)
        self.reader = store

    def load(self, ctx: Any, facts: Any, *, run_dir: Any = None) -> CrossStoredTeacher:
        assert self.reader is not None and self.match is not None, "check() opens the store"
        settings = self.run.cross_tokenizer
        assert settings is not None
        return CrossStoredTeacher(
            self.reader,
            match=self.match,
            sizes=self.sizes,
            matched_weight=settings.matched_weight,
            k=self.settings.k,
            ignore_index=self.run.loss.ignore_index,
        )


class CrossStoredTeacher(Teacher):
    """A cross-tokenizer teacher answered from kd's store (see the module docstring)."""

    terms = ("kd_loss/matched", "kd_loss/unmatched")

    def __init__(
        self,
        reader: store_reader.StoreReader,
        *,
        match: VocabMatch,
        sizes: tuple[int, int],
        matched_weight: float | None,
        k: int,
        ignore_index: int = -100,
    ):
        self.reader = reader
        self.match = match
        self.sizes = sizes
        self.matched_weight = matched_weight
        self.k = k
        self.ignore_index = ignore_index

    def _row(self, row: int, tokens: torch.Tensor, labels: torch.Tensor) -> _Row:
        rec = self.reader.checked_record(row, tokens, labels)
        assert rec.teacher_tokens is not None and rec.teacher_offsets is not None
        assert rec.teacher_token_logprobs is not None and rec.student_offsets is not None
        shifted = torch.cat([labels[1:], labels.new_full((1,), self.ignore_index)])
        s_rows = (shifted != self.ignore_index).nonzero().squeeze(1)
        if s_rows.numel() != rec.student_offsets.shape[0]:
            raise KDUserError(
                f"{KEY}: {self.reader.folder} holds {rec.student_offsets.shape[0]} student spans "
                f"for dataset row {row}, which has {s_rows.numel()} labelled tokens (edited or "
                "damaged); rerun kd run teacher_logits into a new folder"
            )
        t_logp = dense_logprobs(
            rec.ids[:, : self.k],
            rec.logprobs[:, : self.k],
            rec.teacher_tokens,
            rec.teacher_token_logprobs,
            self.sizes[1],
        )
        return _Row(
            s_rows=s_rows,
            s_ids=shifted[s_rows],
            s_spans=[(int(a), int(b)) for a, b in rec.student_offsets],
            t_hidden=None,
            t_ids=torch.from_numpy(rec.teacher_tokens.astype(np.int64)),
            t_spans=[(int(a), int(b)) for a, b in rec.teacher_offsets],
            t_logp=t_logp,
        )

    def signal(self, batch: TeacherInput) -> CrossTokenizerSignal:
        if batch.rows is None or batch.labels is None:
            raise ValueError("a stored teacher needs the dataset rows and labels of the batch")
        device = batch.tokens.device
        rows = []
        for b, row in enumerate(batch.rows):
            r = self._row(int(row), batch.tokens[b].cpu(), batch.labels[b].cpu())
            assert r.t_logp is not None
            rows.append(
                dataclasses.replace(
                    r,
                    s_rows=r.s_rows.to(device),
                    s_ids=r.s_ids.to(device),
                    t_ids=r.t_ids.to(device),
                    t_logp=r.t_logp.to(device),
                )
            )
        return CrossTokenizerSignal(self, rows)

    def teacher_logp(self, row: _Row, temperature: float) -> torch.Tensor:
        """The stored rows, already ``log_softmax(z_t / T)`` at this run's T (checked)."""
        del temperature  # the store's T is this run's (check_store_matches)
        assert row.t_logp is not None
        return row.t_logp
