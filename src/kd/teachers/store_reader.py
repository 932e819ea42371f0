"""Reading kd's store (:mod:`kd.teachers.store_format`): :class:`StoreReader`, a
complete store opened and checked, and :func:`open_run_store`, one opened for a run and checked
against it.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kd import models
from kd.errors import KDUserError, brief
from kd.teachers.base import TeacherStopped
from kd.teachers.store_format import (
    CROSS_COLUMNS,
    KEY,
    MANIFEST_FILE,
    ROWS_PER_GROUP,
    Record,
    files_sha256,
    labelled_positions,
    rank_shards,
    records_problem,
    row_hash,
    shard_name,
)
from kd.teachers.store_manifest import (
    StoreSpec,
    check_store_matches,
    read_manifest,
    run_teacher_identity,
)

__all__ = ["CACHE_BYTES", "StoreReader", "open_run_store"]

# Decoded rows the reader keeps (least recently used row groups go first). A store whose shards
# fit (their file size x _DECODED_PER_FILE_BYTE) is read a whole shard at a time on first use, so
# later epochs read no file; a larger one is read a row group at a time as the batches need it.
CACHE_BYTES = 2 << 30
_DECODED_PER_FILE_BYTE = 4


def _locate(row: int, *, world_size: int, rows_per_shard: int) -> tuple[str, int]:
    """The shard holding dataset row ``row`` and the row's position in it."""
    rank, j = row % world_size, row // world_size
    return shard_name(rank, j // rows_per_shard), j % rows_per_shard


class StoreReader:
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
        found = records_problem(records, vocab=int(self.manifest["vocab"]))
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
                table.column(name).to_numpy(zero_copy_only=False) for name in CROSS_COLUMNS
            )
            for r, t, o, lp, so in zip(records, tokens, offsets, token_lps, s_offsets, strict=True):
                # The spans stay flat until checked (records_problem), then are made pairs.
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
) -> StoreReader:
    """Open kd's store at ``path`` and check it against this run
    (:func:`~kd.teachers.store_manifest.check_store_matches`): the run's tokenizer files,
    ``max_seq_len``, temperature, ``k``, data and, when the config names one, the teacher.

    Args:
        ctx: the run's ``RunContext`` (tokenizer node, teacher identity).
        facts: its ``ModelFacts`` (teacher source).
        run: its ``RunConfig``.
        path: ``teacher_logits.path``.
        k: ``teacher_logits.k``.
        dataset_fingerprint: :func:`~kd.teachers.store_format.dataset_fingerprint` of the
            run's rows.
        student_vocab: the student's vocabulary size, or None (another tokenizer).
        cross_tokenizer: the run has ``cross_tokenizer:``.
    """
    store = StoreReader(path)
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
