"""Writing kd's store (:mod:`kd.teachers.store_format`): shards and the manifest, each
atomically (temporary file, fsync, rename), the one-writer lock, and which shards a rerun keeps.

This module takes plain typed arguments (no config objects).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kd.errors import KDUserError
from kd.fileio import fsync_path, pid_alive, sha256_file
from kd.teachers.store_format import (
    CROSS_COLUMNS,
    CROSS_VERSION,
    FORMAT,
    FORMAT_VERSION,
    KEY,
    LOCK_FILE,
    MANIFEST_FILE,
    ROWS_PER_GROUP,
    Record,
    rank_shards,
    records_problem,
)
from kd.teachers.store_manifest import StoreSpec

__all__ = [
    "acquire_lock",
    "complete_manifest",
    "release_lock",
    "shard_done",
    "write_manifest",
    "write_shard",
]

_COMPRESSION = "zstd"


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
        hashes: :func:`~kd.teachers.store_format.row_hash` of each row.
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
    found = records_problem(records, vocab=vocab)
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
        for i, (name, kind) in enumerate(CROSS_COLUMNS.items()):
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
