"""A folder of kd's store (:mod:`kd.teachers.store_format`) being written: what it must hold,
taking it, and filling it while training asks a served teacher (write-through).

Two writers share this: ``kd run teacher_logits`` (every row, shard by shard, before training)
and a served teacher with ``teacher_server.store`` (:class:`WriteThroughStore`: each answer the
server gives during ``kd run kd`` is kept and written as soon as its shard is whole). Both
identify the store by the same :class:`~kd.teachers.store_manifest.StoreSpec`
(:func:`store_spec`), so a store the write-through left unfinished is finished by ``kd run
teacher_logits`` with the same config (it writes only the missing shards), and a finished one is
read by ``teacher_logits.path`` like any other.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from kd import models
from kd.config.run import RunConfig
from kd.errors import KDUserError
from kd.runtime.run_context import ModelFacts, RunContext
from kd.teachers import store_format, store_manifest, store_reader, store_writer
from kd.teachers.served import served_identity

__all__ = [
    "WriteThroughStore",
    "check_store_folder",
    "output_sections",
    "start_store_folder",
    "store_spec",
]

log = logging.getLogger("kd")

# Leaves of a checkpointer node that name where to write, not what the teacher computes.
_OUTPUT_LEAVES = ("output_dir", "recipe_checkpoint", "resume_from_checkpoint")


def output_sections(run: RunConfig) -> dict[str, Any]:
    """The config sections that change the teacher's outputs (hashed into the manifest)."""

    def plain(key: str) -> Any:
        node = run.components[key]
        return OmegaConf.to_container(node, resolve=True) if node is not None else None

    common = {
        "tokenizer": plain("tokenizer"),
        "dataset": plain("dataset"),
        "dtype": run.dtype,
        "temperature": run.loss.temperature,
    }
    served = run.teacher_server
    if served is not None:  # what the server computes: its model (not where it listens)
        return {"teacher_server": {"api": served.api, "model": served.model}, **common}
    ckpt = plain("teacher_checkpointer")
    if isinstance(ckpt, dict):
        ckpt = {k: v for k, v in ckpt.items() if k not in _OUTPUT_LEAVES}
    return {"teacher_model": plain("teacher_model"), "teacher_checkpointer": ckpt, **common}


def store_spec(
    run: RunConfig,
    ctx: RunContext,
    facts: ModelFacts,
    *,
    k: int,
    hashes: Sequence[str],
    world_size: int,
    rows_per_shard: int,
) -> store_manifest.StoreSpec:
    """What a store of this run's teacher holds (a served teacher's ids are the student's).

    Args:
        run: the run.
        ctx: its context (tokenizer node, teacher identity).
        facts: the models' facts (vocabularies; the teacher's weights' source).
        k: top-k entries per labelled position.
        hashes: :func:`~kd.teachers.store_format.row_hash` of every dataset row.
        world_size: ranks that write it (rank r writes rows r, r + W, ...).
        rows_per_shard: rows per shard file.
    """
    served = run.teacher_server
    teacher_vocab = facts.student_vocab if served is not None else facts.teacher_vocab
    assert teacher_vocab is not None
    sections = json.dumps(output_sections(run), sort_keys=True, default=str)
    return store_manifest.StoreSpec(
        teacher=served_identity(served)
        if served is not None
        else store_manifest.run_teacher_identity(
            ctx, facts.sources.get("teacher_model") or facts.teacher_source
        ),
        config_sha256=hashlib.sha256(sections.encode()).hexdigest(),
        tokenizer_sha256=store_format.files_sha256(models.tokenizer_files(ctx.node("tokenizer"))),
        temperature=float(run.loss.temperature),
        k=k,
        vocab=facts.shared_vocab,
        teacher_vocab=teacher_vocab,
        max_seq_len=run.max_seq_len,
        dataset_fingerprint=store_format.dataset_fingerprint(hashes),
        num_rows=len(hashes),
        world_size=world_size,
        rows_per_shard=rows_per_shard,
    )


def check_store_folder(
    folder: Path, spec: store_manifest.StoreSpec, *, key: str
) -> dict[str, Any] | None:
    """The store already in ``folder`` (to go on with), or None when there is none yet.

    Raises:
        KDUserError: ``folder`` is a file, holds other files, or the store of another config.
    """
    if folder.exists() and not folder.is_dir():
        raise KDUserError(f"{key}: {folder} is a file; set {key} to a folder")
    manifest = store_manifest.read_manifest(folder)
    if manifest is None:
        others = (
            [
                p.name
                for p in folder.iterdir()
                if not p.name.startswith(".tmp_") and p.name != store_format.LOCK_FILE
            ]
            if folder.is_dir()
            else []
        )
        if others:
            raise KDUserError(
                f"{key}: {folder} holds other files ({', '.join(sorted(others)[:3])}) and "
                f"no teacher-logits manifest; set {key} to a new or empty folder"
            )
        return None
    differ = store_manifest.spec_differences(manifest, spec)
    if differ:
        what = "the teacher logits" if manifest.get("complete") else "an unfinished store"
        raise KDUserError(
            f"{key}: {folder} already holds {what} of another config (its "
            f"{', '.join(differ)} differ); set {key} to a new folder, or delete {folder} "
            "to replace it"
        )
    return manifest


def start_store_folder(
    folder: Path, spec: store_manifest.StoreSpec, manifest: dict[str, Any] | None, *, key: str
) -> Path:
    """Create ``folder``, take its lock (one writer at a time), drop a killed writer's half
    files, and write the incomplete manifest when there is none.

    Returns:
        The lock (:func:`kd.teachers.store_writer.release_lock` removes it).
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KDUserError(
            f"{key}: cannot create {folder} ({e.strerror or e}); set {key} to a folder you can "
            "write to"
        ) from e
    # One writer per folder (before a stale temporary file of a live writer is removed).
    lock = store_writer.acquire_lock(folder, key=key)
    for stale in folder.glob(".tmp_*"):  # a killed writer's half file
        stale.unlink()
    if manifest is None:
        store_writer.write_manifest(folder, spec, None)
    return lock


def row_entries(
    labels: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, *, ignore_index: int = -100
) -> tuple[np.ndarray, np.ndarray]:
    """One row's stored entries: the top-k at its labelled positions, flattened.

    Args:
        labels: ``[n]`` the row's unshifted labels (unpadded).
        ids: ``[>= n, k]`` the signal's ids of the row (position j predicts token j + 1).
        logprobs: ``[>= n, k]`` the matching log-probs.

    Returns:
        ``ids [n_labelled * k]`` int32 and ``logprobs [n_labelled * k]`` float16.
    """
    positions = store_format.labelled_positions(labels, ignore_index)
    return (
        ids[positions].to(torch.int32).flatten().numpy(),
        logprobs[positions].to(torch.float16).flatten().numpy(),
    )


class WriteThroughStore(store_reader.StoreReader):
    """A store filled while a served teacher answers training (one process).

    Rows answered wait in memory until every row of their shard has been answered; the shard is
    then written (atomically) and read back from the file like any store. When the last shard is
    in place the manifest is completed. :meth:`holds` says whether a batch can be answered from
    here instead of the server; :meth:`batch` answers it.

    Args:
        folder: ``teacher_server.store``, started (:func:`start_store_folder`).
        spec: what it holds (``world_size`` 1).
        hashes: every dataset row's hash.
        key: the config key named in errors.
        lock: the folder's lock, released by :meth:`close`.
    """

    def __init__(
        self,
        folder: Path,
        spec: store_manifest.StoreSpec,
        hashes: Sequence[str],
        *,
        key: str,
        lock: Path | None = None,
    ):
        super().__init__(folder, partial=spec, key=key)
        self.lock = lock
        self.spec = spec
        self.hashes = list(hashes)
        layout = store_format.rank_shards(
            spec.num_rows, world_size=1, rank=0, rows_per_shard=spec.rows_per_shard
        )
        self.layout = dict(layout)
        self.done = {
            name for name, rows in layout if store_writer.shard_done(folder / name, rows, None)
        }
        self.pending: dict[int, store_format.Record] = {}

    def _shard_of(self, row: int) -> str:
        return store_format.shard_name(0, row // self.spec.rows_per_shard)

    def holds(self, rows: Sequence[int]) -> bool:
        """Whether every row of ``rows`` is answered here (written, or waiting in memory)."""
        return all(int(r) in self.pending or self._shard_of(int(r)) in self.done for r in rows)

    def record(self, row: int) -> store_format.Record:
        waiting = self.pending.get(row)
        return waiting if waiting is not None else super().record(row)

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.layout)

    def add(
        self,
        rows: Sequence[int],
        labels: torch.Tensor,
        ids: torch.Tensor,
        logprobs: torch.Tensor,
        *,
        lengths: Sequence[int],
        ignore_index: int = -100,
    ) -> None:
        """Keep a batch's answers; write each shard they complete.

        Args:
            rows: the dataset index of each example.
            labels: ``[b, s]`` the batch's unshifted labels.
            ids: ``[b, s, k]`` the signal's ids (position j predicts token j + 1).
            logprobs: ``[b, s, k]`` its log-probs.
            lengths: each example's length (tokens before padding).
            ignore_index: label of unlabelled positions.
        """
        k = self.spec.k
        for i, row in enumerate(int(r) for r in rows):
            name = self._shard_of(row)
            if name in self.done or row in self.pending:
                continue
            n = int(lengths[i])
            flat_ids, flat_lps = row_entries(
                labels[i, :n].cpu(), ids[i].cpu(), logprobs[i].cpu(), ignore_index=ignore_index
            )
            self.pending[row] = store_format.Record(
                self.hashes[row], n, flat_ids.reshape(-1, k), flat_lps.reshape(-1, k)
            )
            if all(r in self.pending for r in self.layout[name]):
                self._write(name)

    def _write(self, name: str) -> None:
        rows = self.layout[name]
        records = [self.pending.pop(r) for r in rows]
        store_writer.write_shard(
            self.folder / name,
            rows=rows,
            hashes=[rec.row_hash for rec in records],
            num_tokens=[rec.num_tokens for rec in records],
            ids=[rec.ids.flatten() for rec in records],
            logprobs=[rec.logprobs.flatten() for rec in records],
            k=self.spec.k,
            vocab=self.spec.vocab,
            key=self.key,
        )
        self.done.add(name)
        if self.complete:
            store_writer.complete_manifest(self.folder, self.spec)
            log.info(
                "teacher_server.store: %s is complete (%d rows); later runs read it instead of "
                "asking the server",
                self.folder,
                self.spec.num_rows,
            )

    def close(self) -> None:
        """Release the folder (rows answered whose shard is not whole are not kept)."""
        if self.lock is not None:
            store_writer.release_lock(self.lock)
            self.lock = None
