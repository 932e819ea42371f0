"""Stored teacher logits: the teacher's top-k log-probs per labelled position, on disk.

``kd run teacher_logits`` runs the teacher once over the training data and writes them here;
``kd run kd`` with ``teacher_logits.path`` then trains without the teacher's weights or forward.

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

import dataclasses
import hashlib
import json
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kd import folders, models
from kd.errors import KDUserError, brief, one_line
from kd.fileio import fsync_path, pid_alive, sha256_file
from kd.teachers import answer_checks
from kd.teachers.base import TeacherStopped

if TYPE_CHECKING:
    from kd.runtime.run_context import RunContext

__all__ = [
    "CROSS_VERSION",
    "FORMAT",
    "FORMAT_VERSION",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "ROWS_PER_GROUP",
    "Record",
    "StoreSpec",
    "TeacherLogitsReader",
    "acquire_lock",
    "check_store_matches",
    "complete_manifest",
    "dataset_fingerprint",
    "files_sha256",
    "labelled_positions",
    "rank_shards",
    "read_manifest",
    "release_lock",
    "row_hash",
    "shard_done",
    "shard_name",
    "spec_differences",
    "run_teacher_identity",
    "teacher_identity",
    "topk_logprobs",
    "write_manifest",
    "write_shard",
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
# Decoded rows the reader keeps (least recently used row groups go first). A store whose shards
# fit (their file size x _DECODED_PER_FILE_BYTE) is read a whole shard at a time on first use, so
# later epochs read no file; a larger one is read a row group at a time as the batches need it.
CACHE_BYTES = 2 << 30
_DECODED_PER_FILE_BYTE = 4
_COMPRESSION = "zstd"
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


# ------------------------------------------------------------------------------- what a store is
@dataclass(frozen=True)
class StoreSpec:
    """What a store holds: every manifest field but the shard list.

    Attributes:
        teacher: the teacher's identity: ``component``, ``folder``, ``files`` (``[name, size]``
            pairs of its weight files) and ``config_sha256`` (of its config.json, or None).
        config_sha256: hash of the config sections that change the teacher's outputs.
        tokenizer_sha256: :func:`files_sha256` of the tokenizer's files.
        temperature: T of ``log_softmax(z_t / T)``.
        k: top-k entries stored per labelled position.
        vocab: ``min(Vs, Vt)``: the entries the log-softmax runs over.
        teacher_vocab: Vt.
        max_seq_len: ``tokenizer.max_seq_len`` of the precompute (None: untruncated).
        dataset_fingerprint: :func:`dataset_fingerprint` of the rows.
        num_rows: rows of the dataset.
        world_size: ranks of the precompute (rank r wrote rows r, r + W, ...).
        rows_per_shard: rows per shard file.
        cross_tokenizer: for a teacher with another tokenizer, ``teacher_vocab`` (its string ->
            id), ``teacher_size`` (its distribution's entries; ``vocab`` and ``teacher_vocab``
            are the same) and ``teacher_tokenizer_sha256``; None (omitted in the manifest) for
            a teacher scoring the student's tokens.
    """

    teacher: dict[str, Any]
    config_sha256: str
    tokenizer_sha256: str
    temperature: float
    k: int
    vocab: int
    teacher_vocab: int
    max_seq_len: int | None
    dataset_fingerprint: str
    num_rows: int
    world_size: int
    rows_per_shard: int
    cross_tokenizer: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["cross_tokenizer"] is None:  # a plain store's manifest is as before
            del out["cross_tokenizer"]
        return out


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(StoreSpec))


def spec_differences(stored: Mapping[str, Any], spec: StoreSpec) -> list[str]:
    """The :class:`StoreSpec` fields in which a manifest differs from ``spec`` (the teacher by
    what identifies it: a moved folder or server is the same teacher)."""
    ours = dataclasses.asdict(spec)
    return [
        name
        for name in _SPEC_FIELDS
        if (
            _teacher_key(stored.get(name)) != _teacher_key(ours[name])
            if name == "teacher"
            else stored.get(name) != ours[name]
        )
    ]


def teacher_identity(component: str, folder: Path, files: Any) -> dict[str, Any]:
    """A teacher's identity in a manifest: its builder, folder, weight files with their sizes,
    and the sha256 of its config.json (None without one). Stores are matched on all but the
    folder (a moved teacher is the same teacher); two checkpoints of one architecture whose
    files have the same names and sizes are not told apart.

    Args:
        component: the ``teacher_model`` node's ``_component_``.
        folder: the folder of its weights (checkpointer ``checkpoint_dir`` or model ``path``).
        files: its weight files: a list of names or torchtune's ``{filename_format,
            max_filename}`` (:attr:`kd.models.WeightsSource.files`).
    """
    from kd.config.validate import checkpoint_file_names

    files = checkpoint_file_names(files) or []
    config = folders.file_in(folder, folders.CONFIG_JSON, key="teacher_model")
    return {
        "component": component,
        "folder": str(folder.resolve()),
        "files": [[name, (folder / name).stat().st_size] for name in sorted(files)],
        "config_sha256": sha256_file(config) if config is not None else None,
    }


def run_teacher_identity(ctx: RunContext, source: models.WeightsSource) -> dict[str, Any]:
    """The identity (:func:`teacher_identity`) of the run's ``teacher_model``, whose weights are at
    ``source`` (:attr:`kd.runtime.run_context.ModelFacts.teacher_source`)."""
    component = str(ctx.node("teacher_model").get("_component_"))
    return teacher_identity(component, source.folder, source.files)


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


def _locate(row: int, *, world_size: int, rows_per_shard: int) -> tuple[str, int]:
    """The shard holding dataset row ``row`` and the row's position in it."""
    rank, j = row % world_size, row // world_size
    return shard_name(rank, j // rows_per_shard), j % rows_per_shard


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


# ------------------------------------------------------------------------------- writing
def _tmp_path(path: Path) -> Path:
    return path.with_name(f".tmp_{path.name}_{os.getpid()}")


def _replace_synced(tmp: Path, path: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_shard(
    path: Path,
    *,
    rows: Sequence[int],
    hashes: Sequence[str],
    num_tokens: Sequence[int],
    ids: Sequence[np.ndarray],
    logprobs: Sequence[np.ndarray],
    k: int,
    vocab: int,
    teacher: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] | None = None,
    key: str = KEY,
) -> None:
    """Write one shard atomically (temporary file, fsync, rename): whole or absent. A row that
    is not a top-k of one distribution (:mod:`kd.teachers.answer_checks`) is refused first:
    nothing of the shard is written.

    Args:
        path: the shard's final path.
        rows: dataset index of each row.
        hashes: :func:`row_hash` of each row.
        num_tokens: length of each row.
        ids: per row, ``[n_labelled * k]`` int32 top-k token ids.
        logprobs: per row, ``[n_labelled * k]`` float16 log-probs (float32 with ``teacher``).
        k: entries per labelled position.
        vocab: the vocabulary the ids index (the manifest's ``vocab``).
        teacher: a cross-tokenizer store's per row ``(teacher_tokens [n] int32,
            teacher_offsets [2n] int32, teacher_token_logprobs [n] float32, student_offsets
            [2 n_s] int32)``; ``n_labelled`` is then the teacher's ``n``.
        key: the config key named in errors.

    Raises:
        KDUserError: a row the teacher answered with something no distribution gives.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [
        Record(h, int(n), np.asarray(i).reshape(-1, k), np.asarray(lp).reshape(-1, k))
        for h, n, i, lp in zip(hashes, num_tokens, ids, logprobs, strict=True)
    ]
    for rec, extra in zip(records, teacher or [None] * len(records), strict=True):
        if extra is not None:
            tokens, offsets, token_lps, s_offsets = (np.asarray(x) for x in extra)
            rec.teacher_tokens, rec.teacher_offsets = tokens, offsets
            rec.teacher_token_logprobs, rec.student_offsets = token_lps, s_offsets
    found = _records_problem(records, vocab=vocab)
    if found is not None:
        i, where, what = found
        raise KDUserError(
            f"{key}: the teacher's answer for dataset row {rows[i]}, {where}, {what}; nothing "
            f"of shard {path.name} was written (the shards before it are kept): check the "
            "teacher (its weights, or the server's log-probs mode), then rerun kd run "
            "teacher_logits with this config"
        )

    columns = {
        "row": pa.array(rows, pa.int64()),
        "row_hash": pa.array(hashes, pa.string()),
        "num_tokens": pa.array(num_tokens, pa.int32()),
        "ids": pa.array(list(ids), pa.list_(pa.int32())),
        "logprobs": pa.array(
            list(logprobs), pa.list_(pa.float16() if teacher is None else pa.float32())
        ),
    }
    if teacher is not None:
        for i, (name, kind) in enumerate(_CROSS_COLUMNS.items()):
            columns[name] = pa.array([t[i] for t in teacher], pa.list_(kind()))
    table = pa.table(columns)
    tmp = _tmp_path(path)
    pq.write_table(
        table,
        tmp,
        row_group_size=ROWS_PER_GROUP,
        compression=_COMPRESSION,
        write_statistics=False,
        write_page_checksum=True,
    )
    _replace_synced(tmp, path)


def _int32() -> Any:
    import pyarrow as pa

    return pa.int32()


def _float32() -> Any:
    import pyarrow as pa

    return pa.float32()


# A cross-tokenizer store's extra columns and their Arrow element types.
_CROSS_COLUMNS = {
    "teacher_tokens": _int32,
    "teacher_offsets": _int32,
    "teacher_token_logprobs": _float32,
    "student_offsets": _int32,
}


def acquire_lock(folder: Path, *, key: str = KEY) -> Path:
    """Take ``folder/.lock`` (``O_CREAT | O_EXCL``; it records this pid and host) so that two
    precomputes never write into one folder at once.

    A lock left by a killed precompute on this host (its pid gone) is taken over; one from a
    live process, or from another host, is refused.

    Returns:
        The lock file (:func:`release_lock` removes it).

    Raises:
        KDUserError: another precompute holds the folder.
    """
    import socket

    path = folder / LOCK_FILE
    host = socket.gethostname()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(path.read_text())
                pid, owner_host = int(owner["pid"]), str(owner["host"])
            except (OSError, ValueError, KeyError, TypeError):
                pid, owner_host = None, None
            if owner_host == host and pid is not None and not pid_alive(pid):
                path.unlink(missing_ok=True)  # stale: its precompute was killed
                continue
            who = f"process {pid} on {owner_host}" if pid is not None else "an unknown process"
            raise KDUserError(
                f"{key}: {folder} is being written by another kd run ({who}, "
                f"{path}); wait for it to finish, or delete {path} if no such run is alive"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"pid": os.getpid(), "host": host}) + "\n")
        return path
    raise KDUserError(f"{key}: cannot take {path}; delete it and rerun")


def release_lock(path: Path) -> None:
    """Remove a lock taken by :func:`acquire_lock` (if it is still ours)."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def write_manifest(folder: Path, spec: StoreSpec, shards: list[dict[str, Any]] | None) -> None:
    """Write ``folder/manifest.json`` atomically.

    Args:
        folder: the store.
        spec: what it holds.
        shards: every shard's entry (:func:`complete_manifest`) once the store is complete;
            None while the precompute runs.
    """
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION if spec.cross_tokenizer is None else CROSS_VERSION,
        "complete": shards is not None,
        **spec.to_json(),
        "rows_per_group": ROWS_PER_GROUP,
        "shards": shards or [],
    }
    path = folder / MANIFEST_FILE
    tmp = _tmp_path(path)
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    _replace_synced(tmp, path)


def complete_manifest(folder: Path, spec: StoreSpec) -> None:
    """Describe every shard (rows, size, sha256) and write the complete manifest (rank 0, after
    every rank wrote its shards)."""
    shards = []
    for rank in range(spec.world_size):
        layout = rank_shards(
            spec.num_rows,
            world_size=spec.world_size,
            rank=rank,
            rows_per_shard=spec.rows_per_shard,
        )
        for name, rows in layout:
            path = folder / name
            shards.append(
                {
                    "name": name,
                    "num_rows": len(rows),
                    "size": path.stat().st_size,
                    "sha256": sha256_file(path),
                }
            )
    write_manifest(folder, spec, shards)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of the store in ``folder``, or None when there is none.

    Raises:
        KDUserError: the manifest exists but is not a kd teacher-logits manifest of this version.
    """
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KDUserError(
            f"{KEY}: {path} is unreadable ({brief(e)}); delete {folder} and rerun "
            "kd run teacher_logits"
        ) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise KDUserError(
            f"{KEY}: {path} is not a kd teacher-logits manifest; point {KEY} at a folder "
            "written by kd run teacher_logits"
        )
    if manifest.get("version") not in (FORMAT_VERSION, CROSS_VERSION):
        raise KDUserError(
            f"{KEY}: {folder} has format version {manifest.get('version')}, this kd reads "
            f"{FORMAT_VERSION} and {CROSS_VERSION}; rerun kd run teacher_logits into a new folder"
        )
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise KDUserError(
            f"{KEY}: {path} {problem} (edited or damaged); restore the file kd run "
            "teacher_logits wrote, or rerun it into a new folder"
        )
    return manifest


# Manifest fields the reader computes with, and their least value.
_MANIFEST_INTS = {
    "k": 1,
    "vocab": 1,
    "world_size": 1,
    "rows_per_shard": 1,
    "rows_per_group": 1,
    "num_rows": 0,
}


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _manifest_problem(manifest: Mapping[str, Any]) -> str | None:
    """What is wrong with a manifest's fields (None: nothing): each number the reader computes
    with an integer in range, each shard a plain file name with an integer size."""
    for name, least in _MANIFEST_INTS.items():
        if name not in manifest:
            return f"has no {name!r}"
        if not _is_int(manifest[name], least):
            return f"has {name}={one_line(repr(manifest[name]))[:40]}, not an integer >= {least}"
    cross = manifest.get("cross_tokenizer")
    if (manifest.get("version") == CROSS_VERSION) != isinstance(cross, Mapping) or (
        isinstance(cross, Mapping)
        and not (
            isinstance(cross.get("teacher_vocab"), Mapping)
            and _is_int(cross.get("teacher_size"), 1)
        )
    ):
        return f"has version {manifest.get('version')} with cross_tokenizer {type(cross).__name__}"
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        return "has no list of shards"
    for entry in shards:
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            return f"lists the shard {one_line(repr(name))[:60]}, not a file name"
        if not _is_int(entry.get("size"), 0):
            return f"gives shard {name} the size {one_line(repr(entry.get('size')))[:40]}"
    return None


def shard_done(path: Path, rows: Sequence[int], entry: Mapping[str, Any] | None) -> bool:
    """Whether the shard at ``path`` is in place and whole: readable, holding ``rows``, and (when
    the manifest describes it, ``entry``) of the recorded size and sha256."""
    import pyarrow.parquet as pq

    if not path.is_file():
        return False
    if entry is not None and (
        path.stat().st_size != entry.get("size") or sha256_file(path) != entry.get("sha256")
    ):
        return False
    try:
        stored = pq.read_table(path, columns=["row"]).column("row").to_pylist()
    except Exception:  # noqa: BLE001 - any damage makes the shard one to rewrite
        return False
    return stored == list(rows)


# ------------------------------------------------------------------------------- reading
def check_store_matches(
    manifest: Mapping[str, Any],
    folder: Path,
    *,
    tokenizer_sha256: str,
    max_seq_len: int | None,
    dataset_fingerprint: str,
    temperature: float,
    k: int,
    student_vocab: int | None,
    teacher: Mapping[str, Any] | None,
    cross_tokenizer: bool = False,
) -> None:
    """Refuse a store that was not made for this run, one line naming the difference and the fix.

    Args:
        manifest: the complete store's manifest (:func:`read_manifest`).
        folder: the store.
        tokenizer_sha256: :func:`files_sha256` of this run's tokenizer files.
        max_seq_len: this run's ``tokenizer.max_seq_len``.
        dataset_fingerprint: this run's :func:`dataset_fingerprint`.
        temperature: this run's temperature.
        k: ``teacher_logits.k`` of this run (at most the stored k).
        student_vocab: Vs; ``min(Vs, Vt)`` must be the stored ``vocab`` (None: not compared;
            a cross-tokenizer store's vocabulary is the teacher's own).
        teacher: this run's teacher identity when the config names a teacher (else None: not
            compared).
        cross_tokenizer: whether this run sets ``cross_tokenizer:`` (the store must then hold a
            cross-tokenizer teacher's tokens and offsets, and must not otherwise).

    Raises:
        KDUserError: the first difference.
    """
    redo = (
        f"rerun kd run teacher_logits with this config into a new {KEY}, or point {KEY} at "
        "the store made for it"
    )
    _check_cross(manifest, folder, cross_tokenizer)
    if teacher is not None and _teacher_key(manifest.get("teacher")) != _teacher_key(teacher):
        stored = manifest.get("teacher") or {}
        raise KDUserError(
            f"{KEY}: {folder} holds the logits of another teacher ({_describe(stored)}) than "
            f"teacher_model ({_describe(teacher)}); {redo}"
        )
    checks = (
        ("other tokenizer files", manifest.get("tokenizer_sha256"), tokenizer_sha256, False),
        ("another tokenizer.max_seq_len", manifest.get("max_seq_len"), max_seq_len, True),
        (
            "other rows (the tokenized dataset)",
            manifest.get("dataset_fingerprint"),
            dataset_fingerprint,
            False,
        ),
        ("another temperature", manifest.get("temperature"), float(temperature), True),
    )
    for what, stored_value, ours, show in checks:
        if stored_value != ours:
            shown = f" ({stored_value} there, {ours} here)" if show else ""
            raise KDUserError(
                f"{KEY}: {folder} was made with {what} than this run's{shown}; {redo}"
            )
    stored_k = int(manifest.get("k", 0))
    if k > stored_k:
        raise KDUserError(
            f"teacher_logits.k: {k} is more than the {stored_k} stored in {folder} ({KEY}); set "
            f"teacher_logits.k to {stored_k} or less, or rerun kd run teacher_logits with "
            f"teacher_logits.k={k} into a new {KEY}"
        )
    if student_vocab is None:
        return
    vocab = min(student_vocab, int(manifest.get("teacher_vocab", 0)))
    if vocab != manifest.get("vocab"):
        raise KDUserError(
            f"{KEY}: {folder} holds log-probs over {manifest.get('vocab')} vocabulary entries, "
            f"but this student's vocabulary gives {vocab}; {redo}"
        )


def _check_cross(manifest: Mapping[str, Any], folder: Path, cross_tokenizer: bool) -> None:
    """A cross-tokenizer store with ``cross_tokenizer:`` only, and only such a store."""
    held = manifest.get("cross_tokenizer") is not None
    if cross_tokenizer and not held:
        raise KDUserError(
            f"{KEY}: {folder} holds top-k log-probs over the student's tokens, without the "
            "teacher's token ids and offsets cross_tokenizer needs; rerun kd run teacher_logits "
            "with this config (cross_tokenizer and the teacher's kd.hf teacher_model) into a new "
            f"{KEY}, or remove cross_tokenizer"
        )
    if held and not cross_tokenizer:
        raise KDUserError(
            f"{KEY}: {folder} holds a teacher with another tokenizer (its own token ids and "
            "offsets); set cross_tokenizer: {} as when it was written (beside teacher_logits, "
            f"in its teachers member if any), or point {KEY} at a store of the student's tokens"
        )


def _teacher_key(teacher: Any) -> Any:
    """What identifies a teacher (its folder may move): component, weight files and sizes,
    config.json hash."""
    if not isinstance(teacher, Mapping):
        return None
    files = [list(f) for f in teacher.get("files") or []]
    return (teacher.get("component"), files, teacher.get("config_sha256"))


def _describe(teacher: Mapping[str, Any]) -> str:
    folder = teacher.get("folder")
    return f"{teacher.get('component')} from {folder}" if folder else str(teacher.get("component"))


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


def _records_problem(records: Sequence[Record], *, vocab: int) -> tuple[int, str, str] | None:
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


class TeacherLogitsReader:
    """A complete store, opened and checked; :meth:`batch` returns a batch's aligned top-k.

    Opening reads the manifest and checks that every shard is in place with its recorded size
    (a missing or truncated shard is refused here); rows are decoded when first needed with
    Parquet's page checksums verified (a damaged byte is refused then), and each row's hash is
    checked against the batch it is used for. Decoded rows stay in a least-recently-used cache of
    ``cache_bytes``: when the whole store fits, a shard is decoded at once on first use (one read
    instead of one per row group; shuffled batches touch every group), else one row group at a
    time.

    Args:
        folder: the store (``teacher_logits.path``).
        cache_bytes: memory for decoded rows.
        partial: a store still being written, of this spec: no manifest is required and only
            the shards the writer says are in place are read
            (:class:`kd.teachers.store_folder.WriteThroughStore`).
        key: the config key errors name.

    Raises:
        KDUserError: no store, an incomplete one, a missing or truncated shard.
    """

    def __init__(
        self,
        folder: Path,
        *,
        cache_bytes: int = CACHE_BYTES,
        partial: StoreSpec | None = None,
        key: str = KEY,
    ):
        self.folder = Path(folder)
        self.key = key
        self._files: dict[str, Any] = {}
        self._cache: OrderedDict[tuple[str, int], list[Record]] = OrderedDict()
        self._cached_bytes = 0
        self._cache_limit = cache_bytes
        if partial is not None:  # being written (kd.teachers.store_folder): its written shards
            self.manifest = partial.to_json()
            self.k, self.world_size = partial.k, partial.world_size
            self.rows_per_shard, self.num_rows = partial.rows_per_shard, partial.num_rows
            self.rows_per_group = ROWS_PER_GROUP
            self._whole_shards = True
            return
        manifest = read_manifest(self.folder)
        redo = (
            "rerun kd run teacher_logits --config <this config> (it rewrites only what is missing)"
        )
        if manifest is None:
            what = "does not exist" if not self.folder.exists() else "holds no manifest.json"
            raise KDUserError(
                f"{KEY}: {self.folder} {what}; run kd run teacher_logits --config <this config> "
                f"first, or point {KEY} at a complete store"
            )
        if not manifest.get("complete"):
            raise KDUserError(
                f"{KEY}: {self.folder} is incomplete (its precompute did not finish); {redo}"
            )
        self.manifest = manifest
        self.k = int(manifest["k"])
        self.world_size = int(manifest["world_size"])
        self.rows_per_shard = int(manifest["rows_per_shard"])
        self.rows_per_group = int(manifest["rows_per_group"])
        self.num_rows = int(manifest["num_rows"])
        layout = [
            name
            for rank in range(self.world_size)
            for name, _ in rank_shards(
                self.num_rows,
                world_size=self.world_size,
                rank=rank,
                rows_per_shard=self.rows_per_shard,
            )
        ]
        if sorted(layout) != sorted(entry["name"] for entry in manifest["shards"]):
            raise KDUserError(
                f"{KEY}: {self.folder / MANIFEST_FILE} lists other shards than its num_rows, "
                "world_size and rows_per_shard give (edited or damaged); restore the file kd run "
                "teacher_logits wrote, or rerun it into a new folder"
            )
        for entry in manifest["shards"]:
            path = self.folder / entry["name"]
            if not path.is_file():
                raise KDUserError(f"{KEY}: shard {path} is missing; {redo}")
            size = path.stat().st_size
            if size != entry["size"]:
                raise KDUserError(
                    f"{KEY}: shard {path} has {size} bytes, the manifest says {entry['size']} "
                    f"(truncated or overwritten); {redo}"
                )
        file_bytes = sum(int(entry["size"]) for entry in manifest["shards"])
        self._whole_shards = file_bytes * _DECODED_PER_FILE_BYTE <= cache_bytes

    def _records(self, name: str, group: int) -> list[Record]:
        import pyarrow.parquet as pq

        key = (name, group)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        path = self.folder / name
        try:
            if name not in self._files:
                self._files[name] = pq.ParquetFile(path, page_checksum_verification=True)
            shard = self._files[name]
            first = 0 if self._whole_shards else group
            groups = list(range(shard.num_row_groups)) if self._whole_shards else [group]
            table = shard.read_row_groups(groups)
        except Exception as e:  # noqa: BLE001 - pyarrow raises OSError, ArrowInvalid, ...
            raise KDUserError(
                f"{self.key}: shard {path} is damaged ({brief(e)}); delete it and rerun kd run "
                "teacher_logits --config <this config> (it rewrites only what is missing)"
            ) from e
        try:
            records = self._decode(table)
            stored_rows = np.asarray(table.column("row").to_numpy(zero_copy_only=False))
        except (KeyError, TypeError, ValueError) as e:
            raise KDUserError(
                f"{self.key}: shard {path} does not hold rows of k={self.k} entries ({brief(e)}); its "
                f"{MANIFEST_FILE} was edited, or the shard replaced: restore them, or rerun kd "
                "run teacher_logits into a new folder"
            ) from e
        self._check(path, records, stored_rows, first, len(groups))
        per = self.rows_per_group
        for g in groups:
            part = records[(g - first) * per : (g - first + 1) * per]
            self._cache[(name, g)] = part
            self._cached_bytes += sum(r.nbytes for r in part)
        while self._cached_bytes > self._cache_limit and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= sum(r.nbytes for r in dropped)
        return self._cache[key]

    def _check(
        self, path: Path, records: list[Record], stored: np.ndarray, first: int, groups: int
    ) -> None:
        """Refuse decoded rows that are not the ones the manifest places in the shard's ``groups``
        row groups from ``first`` on (a shard rewritten behind the manifest), or that
        are not top-k rows of one distribution (:mod:`kd.teachers.answer_checks`): one line
        naming the shard, the dataset row and the position. Raised as
        :class:`~kd.teachers.TeacherStopped`, so that training saves the steps completed."""
        redo = (
            f"delete {path} and rerun kd run teacher_logits --config <this config> (it rewrites "
            "only what is missing)"
        )
        per = self.rows_per_group
        expected = self._rows_at(path.name, first * per, groups * per)
        if stored.shape != expected.shape or not np.array_equal(stored, expected):
            if stored.size == expected.size:
                bad = int(np.flatnonzero(stored != expected)[0])
                what = (
                    f"dataset row {int(stored[bad])} where its manifest places row "
                    f"{int(expected[bad])}"
                )
            else:
                what = f"{stored.size} rows where its manifest places {expected.size}"
            raise TeacherStopped(
                f"{self.key}: shard {path} holds {what}: it was rewritten behind "
                f"{MANIFEST_FILE}; {redo}"
            )
        found = _records_problem(records, vocab=int(self.manifest["vocab"]))
        if found is not None:
            i, where, what = found
            raise TeacherStopped(
                f"{self.key}: shard {path}, dataset row {int(stored[i])}, {where}, {what}; the "
                f"store holds values no teacher gives (edited, or written by another tool); {redo}"
            )
        for rec in records:  # checked: the spans as pairs
            if rec.teacher_offsets is not None and rec.student_offsets is not None:
                rec.teacher_offsets = rec.teacher_offsets.reshape(-1, 2)
                rec.student_offsets = rec.student_offsets.reshape(-1, 2)

    def _rows_at(self, name: str, start: int, count: int) -> np.ndarray:
        """The dataset rows the layout puts at positions ``start .. start + count - 1`` of shard
        ``name`` (fewer where the shard ends): rank r's shard i holds rows r, r + W, ... from its
        ``i * rows_per_shard``-th on."""
        found = re.fullmatch(r"rank(\d+)-(\d+)\.parquet", name)
        if found is None:  # not a shard name of this layout: it holds no row
            return np.zeros(0, dtype=np.int64)
        rank, index = int(found[1]), int(found[2])
        per_rank = range(rank, self.num_rows, self.world_size)
        shard = per_rank[index * self.rows_per_shard : (index + 1) * self.rows_per_shard]
        return np.asarray(shard[start : start + count], dtype=np.int64)

    def _decode(self, table: Any) -> list[Record]:
        """A decoded table's rows (a cross-tokenizer store's with the teacher's columns)."""
        k = self.k
        cross = self.manifest.get("cross_tokenizer") is not None
        lp_dtype = np.float32 if cross else np.float16
        records = [
            Record(
                h,
                int(n),
                np.asarray(i, dtype=np.int32).reshape(-1, k),
                np.asarray(lp, dtype=lp_dtype).reshape(-1, k),
            )
            for h, n, i, lp in zip(
                table.column("row_hash").to_pylist(),
                table.column("num_tokens").to_pylist(),
                table.column("ids").to_numpy(zero_copy_only=False),
                table.column("logprobs").to_numpy(zero_copy_only=False),
                strict=True,
            )
        ]
        if cross:
            tokens, offsets, token_lps, s_offsets = (
                table.column(name).to_numpy(zero_copy_only=False) for name in _CROSS_COLUMNS
            )
            for r, t, o, lp, so in zip(records, tokens, offsets, token_lps, s_offsets, strict=True):
                # The spans stay flat until checked (_records_problem), then are made pairs.
                r.teacher_tokens = np.asarray(t, dtype=np.int32)
                r.teacher_offsets = np.asarray(o, dtype=np.int32)
                r.teacher_token_logprobs = np.asarray(lp, dtype=np.float32)
                r.student_offsets = np.asarray(so, dtype=np.int32)
        return records

    def record(self, row: int) -> Record:
        """The stored entry of dataset row ``row``."""
        if not 0 <= row < self.num_rows:
            raise KDUserError(
                f"{self.key}: dataset row {row} is beyond the {self.num_rows} rows of {self.folder}; "
                "rerun kd run teacher_logits with this config"
            )
        name, pos = _locate(row, world_size=self.world_size, rows_per_shard=self.rows_per_shard)
        group, offset = divmod(pos, self.rows_per_group)
        return self._records(name, group)[offset]

    def checked_record(self, row: int, tokens: torch.Tensor, labels: torch.Tensor) -> Record:
        """The stored entry of dataset row ``row``, checked against the batch's row.

        Args:
            row: the dataset index.
            tokens: ``[s]`` the batch's (right-padded) token ids of that row.
            labels: ``[s]`` its unshifted labels.

        Raises:
            KDUserError: the row's tokens or labels differ from the stored row's hash.
        """
        rec = self.record(int(row))
        n = rec.num_tokens
        if n > tokens.numel() or row_hash(tokens[:n], labels[:n]) != rec.row_hash:
            raise KDUserError(
                f"{self.key}: dataset row {int(row)} differs from the row the teacher's logits in "
                f"{self.folder} were computed on (its hash); the data or tokenizer changed, "
                "so rerun kd run teacher_logits with this config into a new folder"
            )
        return rec

    def batch(
        self,
        rows: Sequence[int],
        tokens: torch.Tensor,
        labels: torch.Tensor,
        *,
        k: int,
        ignore_index: int = -100,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored top-k of a batch, aligned with its shifted labels.

        Args:
            rows: the dataset index of each example of the batch.
            tokens: ``[b, s]`` the batch's (right-padded) token ids.
            labels: ``[b, s]`` its unshifted labels.
            k: entries to return per position (the first ``k`` of the stored, <= stored k).
            ignore_index: label of unlabelled positions.

        Returns:
            ``(ids, logprobs)``: ``[b, s, k]`` int64 and float16; row ``b``, position ``j`` holds
            the teacher's top-k at the position whose shifted label is ``shifted[b, j]``;
            positions without a label hold zeros.

        Raises:
            KDUserError: a row whose tokens or labels differ from the stored row's hash.
        """
        b, s = tokens.shape
        ids = torch.zeros(b, s, k, dtype=torch.int64)  # [b, s, k]
        logprobs = torch.zeros(b, s, k, dtype=torch.float16)  # [b, s, k]
        tokens, labels = tokens.cpu(), labels.cpu()
        for i, row in enumerate(rows):
            rec = self.checked_record(int(row), tokens[i], labels[i])
            n = rec.num_tokens
            positions = labelled_positions(labels[i, :n], ignore_index)
            if positions.numel() != rec.ids.shape[0]:
                raise KDUserError(
                    f"{self.key}: {self.folder} holds {rec.ids.shape[0]} positions of k={self.k} "
                    f"entries for dataset row {int(row)}, which has {positions.numel()} labelled "
                    f"ones; its {MANIFEST_FILE} (k) was edited: restore it, or rerun kd run "
                    "teacher_logits into a new folder"
                )
            ids[i, positions] = torch.from_numpy(rec.ids[:, :k].astype(np.int64))
            logprobs[i, positions] = torch.from_numpy(rec.logprobs[:, :k].copy())
        return ids, logprobs


def open_run_store(
    ctx: Any,
    facts: Any,
    run: Any,
    *,
    path: Path,
    k: int,
    dataset_fingerprint: str,
    student_vocab: int | None,
    cross_tokenizer: bool = False,
) -> TeacherLogitsReader:
    """Open kd's store at ``path`` and check it against this run (:func:`check_store_matches`):
    the run's tokenizer files, ``max_seq_len``, temperature, ``k``, data and, when the config
    names one, the teacher.

    Args:
        ctx: the run's ``RunContext`` (tokenizer node, teacher identity).
        facts: its ``ModelFacts`` (teacher source).
        run: its ``RunConfig``.
        path: ``teacher_logits.path``.
        k: ``teacher_logits.k``.
        dataset_fingerprint: :func:`dataset_fingerprint` of the run's rows.
        student_vocab: the student's vocabulary size, or None (another tokenizer).
        cross_tokenizer: the run has ``cross_tokenizer:``.
    """
    store = TeacherLogitsReader(path)
    source = facts.teacher_source
    check_store_matches(
        store.manifest,
        path,
        tokenizer_sha256=files_sha256(models.tokenizer_files(ctx.node("tokenizer"))),
        max_seq_len=run.max_seq_len,
        dataset_fingerprint=dataset_fingerprint,
        temperature=run.loss.temperature,
        k=k,
        student_vocab=student_vocab,
        teacher=run_teacher_identity(ctx, source) if source is not None else None,
        cross_tokenizer=cross_tokenizer,
    )
    return store
