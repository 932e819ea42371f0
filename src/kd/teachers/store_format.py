"""kd's store of a teacher's top-k log-probs per labelled position, on disk: its format.

``kd run teacher_logits`` runs the teacher once over the training data and writes them here;
``kd run kd`` with ``teacher_logits.path`` then trains without the teacher's weights or forward.
The store's modules: this one (the format: constants, row hashes, shard layout, a row and its
check), :mod:`kd.teachers.store_manifest` (what a store holds, read and checked against a run),
:mod:`kd.teachers.store_writer` (shards, manifest and lock, written atomically),
:mod:`kd.teachers.store_reader` (:class:`~kd.teachers.store_reader.StoreReader`) and
:mod:`kd.teachers.store_folder` (a folder being written, read while it grows).

Format: a folder of Parquet files (pyarrow) and a JSON manifest::

    DIR/manifest.json                  written last (atomically); "complete": true when done
    DIR/rank{r:05d}-{n:05d}.parquet    the n-th shard of rank r: rows r, r + W, r + 2W, ...
                                       (W = world size of the precompute), rows_per_shard each

One Parquet row per dataset row; columns:

* ``row`` (int64): the dataset index.
* ``row_hash`` (string): sha256 hex of the row's token ids then labels, int32 little-endian
  (:func:`row_hash`); training checks it against each batch, so a row is never matched to the
  logits of another text.
* ``num_tokens`` (int32): the row's length (tokens after truncation to ``max_seq_len``).
* ``ids`` (list<int32>): ``n_labelled * k`` token ids, the teacher's top-k by value, descending,
  at each labelled position in order (position ``j`` is labelled when the shifted label
  ``labels[j + 1]`` is not ``ignore_index``; :func:`kd.training.train.shift_labels`).
* ``logprobs`` (list<halffloat>): the matching ``log_softmax(z_t / T)`` over the teacher's first
  ``vocab = min(Vs, Vt)`` entries (the :mod:`kd.losses` convention), T the run's temperature.

Why Parquet: rows have a variable number of labelled positions (list columns need no padding);
columns are compressed (zstd); row groups of :data:`ROWS_PER_GROUP` rows let a reader fetch one
batch's rows without decoding a whole shard; page checksums make a flipped byte an error instead
of a wrong number; and pandas, duckdb, polars and Hugging Face ``datasets`` read the files as
they are, as do the top-k logit datasets of axolotl and DistillKit (Parquet/Arrow too).
A store of a teacher with another tokenizer (``cross_tokenizer:``, :mod:`kd.teachers.cross`)
is format version :data:`CROSS_VERSION` (an older kd refuses it rather than read the teacher's ids
as the student's) and its manifest's ``cross_tokenizer`` holds the teacher's vocabulary (string ->
id) and distribution size; its rows hold, per labelled token of the TEACHER's tokenization of the
row's text (``teacher_tokens``: ids; ``teacher_offsets``: ``[start, end)`` character pairs;
``teacher_token_logprobs``: float32 log-prob of that actual token), the student's labelled
tokens' spans on the same axis (``student_offsets``: the row's text, or with chat templates
:func:`kd.teachers.cross_chat.chat_spans`'s), ``ids``/``logprobs`` of k entries over the
teacher's vocabulary, the log-probs float32 (the alignment multiplies
probabilities over a group; 8 bytes per entry). Plain stores stay version :data:`FORMAT_VERSION`.

safetensors holds fixed-shape tensors only, so variable-length rows would need an offsets index
of our own and could not be read by those tools.

Atomicity: each shard is written to a temporary file, fsynced and renamed into place (a shard
under its final name is whole); the manifest is written the same way, first incomplete (the
identity of the precompute, so a rerun knows what it resumes) and last complete (with every
shard's size and sha256). One writer per rank; a killed precompute rerun skips the shards already
in place and, being deterministic, writes byte-identical files.

This module takes plain typed arguments (no config objects).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kd.teachers import answer_checks

__all__ = [
    "CROSS_COLUMNS",
    "CROSS_VERSION",
    "FORMAT",
    "FORMAT_VERSION",
    "KEY",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "ROWS_PER_GROUP",
    "Record",
    "dataset_fingerprint",
    "files_sha256",
    "labelled_positions",
    "rank_shards",
    "records_problem",
    "row_hash",
    "shard_name",
    "topk_logprobs",
]

FORMAT = "kd.teacher_logits"
FORMAT_VERSION = 1
# A store of a teacher with another tokenizer: the teacher's tokens, offsets and float32 log-probs.
CROSS_VERSION = 2
MANIFEST_FILE = "manifest.json"
# One precompute per folder: created with O_EXCL by rank 0, removed when it ends.
LOCK_FILE = ".lock"
# Rows per Parquet row group: a reader decodes one group to read one row.
ROWS_PER_GROUP = 8
KEY = "teacher_logits.path"


# ------------------------------------------------------------------------------- hashes
def row_hash(tokens: Sequence[int] | torch.Tensor, labels: Sequence[int] | torch.Tensor) -> str:
    """sha256 hex of a row's token ids then its labels, each as int32 little-endian.

    Args:
        tokens: the row's ``n`` token ids (unpadded).
        labels: its ``n`` labels (unshifted, as the dataset returns them).
    """
    h = hashlib.sha256()
    for x in (tokens, labels):
        values = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        h.update(np.ascontiguousarray(values, dtype="<i4").tobytes())
    return h.hexdigest()


def dataset_fingerprint(row_hashes: Iterable[str]) -> str:
    """sha256 hex over the row hashes of a dataset, in order."""
    h = hashlib.sha256()
    for value in row_hashes:
        h.update(value.encode("ascii"))
    return h.hexdigest()


def files_sha256(files: Mapping[str, Path]) -> str:
    """sha256 hex over files (a tokenizer's), in name order: each name, then its bytes."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode())
        h.update(Path(files[name]).read_bytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------- layout
def shard_name(rank: int, index: int) -> str:
    """File name of rank ``rank``'s shard number ``index``."""
    return f"rank{rank:05d}-{index:05d}.parquet"


def rank_shards(
    num_rows: int, *, world_size: int, rank: int, rows_per_shard: int
) -> list[tuple[str, list[int]]]:
    """The shards rank ``rank`` writes: ``(file name, dataset rows)``; rows r, r + W, ... in order."""
    rows = list(range(rank, num_rows, world_size))
    return [
        (shard_name(rank, n), rows[start : start + rows_per_shard])
        for n, start in enumerate(range(0, len(rows), rows_per_shard))
    ]


# ------------------------------------------------------------------------------- the teacher side
def labelled_positions(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Positions ``j`` of one row whose shifted label ``labels[j + 1]`` is not ``ignore_index``.

    Args:
        labels: ``[n]`` the row's unshifted labels.

    Returns:
        ``[n_labelled]`` int64 positions, ascending.
    """
    return torch.nonzero(labels[1:] != ignore_index).flatten()


def topk_logprobs(
    logits: torch.Tensor, *, vocab: int, temperature: float, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of ``log_softmax(logits[..., :vocab] / T)`` in fp32, by value, descending.

    Args:
        logits: ``[n, Vt]`` teacher logits of the labelled positions.
        vocab: ``min(Vs, Vt)``.
        temperature: T.
        k: entries kept (<= vocab).

    Returns:
        ``(ids, logprobs)``: ``[n, k]`` int32 and ``[n, k]`` float16.
    """
    logprobs = torch.log_softmax(logits[..., :vocab].float() / temperature, dim=-1)
    values, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return ids.to(torch.int32), values.to(torch.float16)


# ------------------------------------------------------------------------------- a row
@dataclass
class Record:
    row_hash: str
    num_tokens: int
    ids: np.ndarray  # [n_labelled, K] int32
    logprobs: np.ndarray  # [n_labelled, K] float16 (float32 in a cross-tokenizer store)
    # A cross-tokenizer store's: the teacher's labelled tokens [n] int32, their character
    # spans [n, 2] int32, and each actual token's log-prob [n] float32.
    teacher_tokens: np.ndarray | None = None
    teacher_offsets: np.ndarray | None = None
    teacher_token_logprobs: np.ndarray | None = None
    student_offsets: np.ndarray | None = None  # [n_s, 2] int32: the student's on the same axis

    @property
    def nbytes(self) -> int:
        extra = (
            self.teacher_tokens,
            self.teacher_offsets,
            self.teacher_token_logprobs,
            self.student_offsets,
        )
        return (
            self.ids.nbytes + self.logprobs.nbytes + sum(a.nbytes for a in extra if a is not None)
        )


def records_problem(records: Sequence[Record], *, vocab: int) -> tuple[int, str, str] | None:
    """The first of a shard's rows that is not a top-k row of one distribution
    (:func:`kd.teachers.answer_checks.topk_problem`, every position of every row in one pass)
    or, in a cross-tokenizer store, whose teacher columns or spans do not fit its positions
    (:func:`kd.teachers.answer_checks.spans_problem`): ``(index in records, where, what)``;
    None when every row is sound.

    Args:
        records: the rows (spans flat or as pairs).
        vocab: the vocabulary the ids index (a cross-tokenizer store's: the teacher's).
    """
    if not records:
        return None
    cross = records[0].teacher_tokens is not None
    tokens, token_lps = [], []
    for i, rec in enumerate(records if cross else ()):  # per row, not per token
        assert rec.teacher_tokens is not None and rec.teacher_token_logprobs is not None
        assert rec.teacher_offsets is not None and rec.student_offsets is not None
        n = rec.ids.shape[0]
        if not len(rec.teacher_tokens) == len(rec.teacher_token_logprobs) == n:
            return (
                i,
                "its teacher_tokens and teacher_token_logprobs",
                f"hold {len(rec.teacher_tokens)} and {len(rec.teacher_token_logprobs)} entries "
                f"for {n} top-k positions",
            )
        spans = (
            ("teacher_offsets", rec.teacher_offsets, n),
            ("student_offsets", rec.student_offsets, None),
        )
        for name, value, count in spans:
            problem = answer_checks.spans_problem(value.reshape(-1), count)
            if problem is not None:
                return i, f"its {name}", problem
        tokens.append(rec.teacher_tokens)
        token_lps.append(rec.teacher_token_logprobs)
    lengths = np.array([rec.ids.shape[0] for rec in records])
    found = answer_checks.topk_problem(
        np.concatenate([rec.ids for rec in records]),
        np.concatenate([rec.logprobs for rec in records]),
        vocab=vocab,
        own=(np.concatenate(tokens), np.concatenate(token_lps)) if cross else None,
    )
    if found is None:
        return None
    ends = np.cumsum(lengths)
    i = int(np.searchsorted(ends, found.position, side="right"))
    j = found.position - int(ends[i] - lengths[i])
    what = "teacher token" if cross else "labelled position"
    return i, f"{what} {j} (of {int(lengths[i])})", found.what


def _int32() -> Any:
    import pyarrow as pa

    return pa.int32()


def _float32() -> Any:
    import pyarrow as pa

    return pa.float32()


# A cross-tokenizer store's extra columns and their Arrow element types.
CROSS_COLUMNS = {
    "teacher_tokens": _int32,
    "teacher_offsets": _int32,
    "teacher_token_logprobs": _float32,
    "student_offsets": _int32,
}
