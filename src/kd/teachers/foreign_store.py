"""Other tools' top-k teacher files: axolotl's KD dataset fields and DistillKit's raw rows.

``teacher_logits: {path: FILE_OR_DIR, format: axolotl | distillkit}`` trains from such a file
without converting it: the file's own token ids are the training data
(``dataset: {_component_: kd.data.pretokenized_dataset, data_files: FILE_OR_DIR}``, which reads
the same rows through :func:`kd.row_files.read_rows`) and :class:`ForeignStoreReader` returns each batch's
top-k with the interface of :class:`kd.teachers.store_reader.StoreReader`, rows matched by
:func:`kd.teachers.store_format.row_hash` as there.

Files: Parquet (``*.parquet``), Arrow IPC as Hugging Face ``datasets.save_to_disk`` writes it
(``*.arrow``), or JSON lines (``*.jsonl`` / ``*.json``, one object per line); a folder is every
such file in it, in name order, or, for a ``save_to_disk`` folder (axolotl preprocess), the
files its ``state.json`` lists (a ``DatasetDict``: its ``train`` split). Columns (one row per sequence, per-position lists):

* both: ``input_ids`` (list<int>, required), ``labels`` (list<int>, optional: every position
  labelled when absent; ``-100`` = unlabelled).
* ``axolotl`` (``axolotl.integrations.kd.chat_template`` after tokenization, i.e. a prepared
  dataset): ``target_token_ids`` (list<list<int>>) and ``target_logprobs`` (or, in the raw v2
  rows, ``logprobs``) (list<list<float>>). With ``m`` target positions for ``n`` tokens the
  targets cover the last ``m`` positions (axolotl pads them at the front); entry ``j`` is the
  teacher's distribution at position ``j``, the prediction of token ``j + 1``, as axolotl's
  main branch consumes it (it shifts only the labels), or, in axolotl 0.19's files and raw
  vLLM prompt log-probs, the prediction of token ``j`` (``teacher_logits.alignment``:
  ``next`` / ``current``; ``auto`` decides from the rows, :func:`detect_alignment`). ``target_mask`` is not read (axolotl sets it
  from the unshifted label, one position after kd's labelled positions; kd masks by the shifted
  labels as everywhere).
* ``distillkit`` (raw rows of ``distillkit.compression.LogprobCompressor.decompress_to_sparse``):
  ``token_ids`` and ``top_values`` (list<list<...>>), covering the first ``m`` positions
  (``m = n - 1`` from vLLM's prompt log-probs, whose first position is empty, or ``n``); or,
  without ``token_ids``, its compressed ``compressed_logprobs`` / ``bytepacked_indices``,
  decoded into those by :mod:`kd.teachers.distillkit_compressed` with the
  ``compression_config.yaml`` beside the rows (the legacy ``packed_indices`` rows are refused).

Values: per position the entries are sorted by value and the first ``k`` kept; they are taken as
log-probs at ``source_temperature`` (None: the run's temperature). Under ``tail: renorm`` logits
and log-probs give the same distribution (the renormalisation removes the per-position constant),
and a generation temperature ``T_gen`` is re-tempered exactly: ``alpha = T_gen / T``,
``log p' = alpha log p - logsumexp_k(alpha log p)``. ``tail: bucket`` needs the mass outside the
top-k, known only for log-probs at the run's temperature; with re-tempering it is refused.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kd import row_files
from kd.errors import KDUserError, brief
from kd.teachers import answer_checks, distillkit_compressed
from kd.teachers.store_format import dataset_fingerprint, labelled_positions, row_hash

__all__ = [
    "FORMATS",
    "Alignment",
    "ForeignStoreReader",
    "detect_alignment",
]

log = logging.getLogger(__name__)

FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    # format: (ids column, value columns in order of preference)
    "axolotl": ("target_token_ids", ("target_logprobs", "logprobs")),
    "distillkit": ("token_ids", ("top_values",)),
}
KEY = "teacher_logits.path"
ALIGNMENT_KEY = "teacher_logits.alignment"


# Evidence needed to decide an alignment: top-1 agreements (and this many times the other
# alignment's), or row pairs of which (nearly) all point one way.
_MIN_AGREEMENTS, _AGREEMENT_RATIO = 8, 3
_MIN_PAIRS, _PAIR_SHARE = 4, 0.9
_MAX_DETECT_ENTRIES, _MAX_DETECT_ROWS = 50_000, 4096


@dataclass(frozen=True)
class Alignment:
    """What the rows say about which token a file's entry ``j`` predicts.

    Attributes:
        alignment: ``"next"`` (entry j predicts token j + 1), ``"current"`` (token j), or None
            when the evidence is unclear.
        entries: entries whose top-1 id was compared with the tokens.
        agree_next: of those, entries whose top-1 is the following token.
        agree_current: entries whose top-1 is the token at their own position.
        pairs: pairs of rows sharing a prefix whose entries at the first differing token were
            compared (a distribution that predicts that token has not seen it, so it is the same
            in both rows under ``current``, and differs under ``next``).
        pairs_equal: of those, pairs whose entries there are equal.
    """

    alignment: str | None
    entries: int
    agree_next: int
    agree_current: int
    pairs: int
    pairs_equal: int

    def describe(self) -> str:
        """One clause with the evidence."""
        return (
            f"the teacher's top-1 is the next token at {self.agree_next} and the same token at "
            f"{self.agree_current} of {self.entries} entries; {self.pairs_equal} of {self.pairs} "
            "rows sharing a prefix have equal entries where they part"
        )


def _entry(ids: Any, values: Any) -> list[tuple[float, int]] | None:
    """An entry's ``(value, id)`` pairs, largest first; None when empty, padding or malformed."""
    try:
        pairs = sorted(
            ((float(v), int(t)) for v, t in zip(values or [], ids or [], strict=True)),
            reverse=True,
        )
    except (TypeError, ValueError):
        return None  # the row reader refuses it with the row and position
    if not pairs or not math.isfinite(pairs[0][0]):
        return None
    return pairs


def _same_entry(a: list[tuple[float, int]], b: list[tuple[float, int]]) -> bool:
    q = min(len(a), len(b), 8)
    return all(
        ta == tb and abs(va - vb) <= 0.05 + 0.02 * abs(va)
        for (va, ta), (vb, tb) in zip(a[:q], b[:q], strict=True)
    )


def _decide(first: str, second: str, a: int, b: int) -> str | None:
    """``first`` when ``a`` is clearly the larger count, ``second`` when ``b`` is, else None."""
    if a >= _MIN_AGREEMENTS and a >= _AGREEMENT_RATIO * b:
        return first
    if b >= _MIN_AGREEMENTS and b >= _AGREEMENT_RATIO * a:
        return second
    return None


def detect_alignment(
    input_ids: Sequence[Sequence[int]],
    ids: Sequence[Any],
    values: Sequence[Any],
    *,
    front_padded: bool,
) -> Alignment:
    """Which token the entries of a top-k file predict, from the rows themselves.

    Two signals, each of which may be silent: a teacher worth distilling puts its top-1 on the
    token that follows far more often than on the token it has just seen (``agree_next`` vs
    ``agree_current``); and two rows sharing a prefix have equal entries at the first token
    where they part exactly when that entry was computed before seeing it (``current``), which
    holds for any teacher, trained or not. A signal that decides is taken; none, or two that
    disagree, leave ``alignment`` None.

    Args:
        input_ids: every row's token ids.
        ids: every row's per-entry top-k ids.
        values: every row's per-entry values.
        front_padded: axolotl's layout (the ``m`` entries cover the last ``m`` tokens); else
            DistillKit's (the first ``m``).
    """

    def base(n: int, m: int) -> int:  # the token position of entry 0
        return n - m if front_padded else 0

    entries = agree_next = agree_current = 0
    for tokens, row_ids, row_values in zip(input_ids, ids, values, strict=True):
        tokens, row_ids, row_values = tokens or [], row_ids or [], row_values or []
        first = base(len(tokens), len(row_ids))
        for e, (pid, pval) in enumerate(zip(row_ids, row_values, strict=False)):
            j = first + e
            entry = _entry(pid, pval)
            if entry is None or not 0 <= j < len(tokens) - 1:
                continue
            entries += 1
            agree_next += entry[0][1] == tokens[j + 1]
            agree_current += entry[0][1] == tokens[j]
        if entries >= _MAX_DETECT_ENTRIES:
            break
    pairs = pairs_equal = 0
    order = sorted(
        range(min(len(input_ids), _MAX_DETECT_ROWS)), key=lambda r: list(input_ids[r] or [])
    )
    for ra, rb in zip(order, order[1:], strict=False):
        ta, tb = list(input_ids[ra] or []), list(input_ids[rb] or [])
        split = next((j for j, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
        if not split:
            continue  # identical prefixes to the end, or parting at the first token
        found = []
        for r, t in ((ra, ta), (rb, tb)):
            row_ids, row_values = ids[r] or [], values[r] or []
            e = split - base(len(t), len(row_ids))
            ok = 0 <= e < min(len(row_ids), len(row_values))
            found.append(_entry(row_ids[e], row_values[e]) if ok else None)
        if found[0] is not None and found[1] is not None:
            pairs += 1
            pairs_equal += _same_entry(found[0], found[1])
    by_top1 = _decide("next", "current", agree_next, agree_current)
    by_prefix = None
    if pairs >= _MIN_PAIRS:
        if pairs_equal >= _PAIR_SHARE * pairs:
            by_prefix = "current"
        elif pairs - pairs_equal >= _PAIR_SHARE * pairs:
            by_prefix = "next"
    decided = {by_top1, by_prefix} - {None}
    return Alignment(
        decided.pop() if len(decided) == 1 else None,
        entries,
        agree_next,
        agree_current,
        pairs,
        pairs_equal,
    )


@dataclass
class _Row:
    row_hash: str
    num_tokens: int
    positions: torch.Tensor  # [n_labelled] int64
    ids: torch.Tensor  # [n_labelled, k] int64
    logprobs: torch.Tensor  # [n_labelled, k] float16


class ForeignStoreReader:
    """An axolotl or DistillKit top-k file, read, checked and converted once.

    Every row is read when it opens (the converted top-k of the labelled positions stay in
    memory: ``10 k`` bytes per labelled token), so every bad input is refused before training.

    Args:
        path: the file or folder (``teacher_logits.path``).
        format: ``"axolotl"`` or ``"distillkit"``.
        k: entries used per labelled position (``teacher_logits.k``).
        alpha: ``source_temperature / temperature`` (1: the values are used as stored).
        max_seq_len: ``tokenizer.max_seq_len`` (rows are truncated as the dataset truncates them).
        student_vocab: Vs; every teacher id used must be below it.
        ignore_index: label of unlabelled positions.
        alignment: ``"next"`` (entry j predicts token j + 1), ``"current"`` (token j) or
            ``"auto"`` (:func:`detect_alignment`; said in one INFO line, refused when unclear).

    Attributes:
        num_rows: rows of the file.
        alignment: the alignment read (``"next"`` or ``"current"``).
        fingerprint: :func:`kd.teachers.store_format.dataset_fingerprint` of its rows.

    Raises:
        KDUserError: missing file or column, lengths that do not match, a labelled position
            without an entry or with fewer than ``k``, non-finite or positive values, repeated,
            negative or out-of-vocabulary ids, an alignment the rows cannot tell.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        format: str,
        k: int,
        alpha: float,
        max_seq_len: int | None,
        student_vocab: int,
        ignore_index: int = -100,
        alignment: str = "auto",
    ):
        self.path = Path(path).expanduser()
        self.k = k
        self._vocab = student_vocab
        ids_col, value_cols = FORMATS[format]
        present = row_files.column_names(self.path, KEY)
        values_col = next((c for c in value_cols if c in present), value_cols[0])
        compressed = (
            format == "distillkit" and ids_col not in present and row_files.COMPRESSED[0] in present
        )
        wanted = row_files.COMPRESSED if compressed else (ids_col, values_col)
        columns = ["input_ids", *wanted] + (["labels"] if "labels" in present else [])
        cols = row_files.read_rows(self.path, columns=columns, key=KEY)
        # DistillKit's compressed rows: only the exact values count toward the mass check.
        self._mass_columns: int | None = None
        if compressed:
            self._mass_columns = _decode_compressed(cols, self.path)
        row_files.check_token_ids(cols["input_ids"], self.path, KEY)
        if alignment == "auto":
            evidence = detect_alignment(
                cols["input_ids"], cols[ids_col], cols[values_col], front_padded=format == "axolotl"
            )
            if evidence.alignment is None:
                raise KDUserError(
                    f"{ALIGNMENT_KEY}: cannot tell which token the entries of {self.path} "
                    f"predict ({evidence.describe()}); set {ALIGNMENT_KEY} to next (entry j "
                    "predicts token j + 1: kd, axolotl main) or current (entry j predicts token "
                    "j: axolotl 0.19, raw vLLM prompt log-probs)"
                )
            log.info(
                "%s: %s is read with %s=%s, detected: %s (set %s to override)",
                KEY,
                self.path,
                ALIGNMENT_KEY,
                evidence.alignment,
                evidence.describe(),
                ALIGNMENT_KEY,
            )
            alignment = evidence.alignment
        self.alignment = alignment
        # The entry of kd's position j (which predicts token j + 1) is entry j + shift.
        self._shift = 1 if alignment == "current" else 0
        self.rows: list[_Row] = []
        for i, tokens in enumerate(cols["input_ids"]):
            try:
                self.rows.append(
                    self._row(
                        i,
                        tokens,
                        cols,
                        format,
                        ids_col,
                        values_col,
                        alpha,
                        max_seq_len,
                        student_vocab,
                        ignore_index,
                    )
                )
            except (TypeError, ValueError) as e:  # a value of another shape or type
                raise KDUserError(
                    f"{KEY}: row {i} of {self.path} cannot be read as {format} top-k rows "
                    f"({brief(e)}); {ids_col} and {values_col} must be lists (one per position) "
                    "of numbers"
                ) from e
        self.num_rows = len(self.rows)
        self.fingerprint = dataset_fingerprint(r.row_hash for r in self.rows)

    def _row(
        self,
        i: int,
        tokens: list[Any],
        cols: dict[str, list[Any]],
        format: str,
        ids_col: str,
        values_col: str,
        alpha: float,
        max_seq_len: int | None,
        student_vocab: int,
        ignore_index: int,
    ) -> _Row:
        """Row ``i`` checked and converted."""
        labels = cols["labels"][i] if "labels" in cols else list(tokens)
        where = f"{KEY}: row {i} of {self.path}"
        ids, values = cols[ids_col][i] or [], cols[values_col][i] or []
        if len(ids) != len(values):
            raise KDUserError(
                f"{where} has {len(ids)} positions of {ids_col} and {len(values)} of "
                f"{values_col}; the two must have one entry list per position"
            )
        n_all = len(tokens)
        if len(labels) != n_all:
            raise KDUserError(
                f"{where} has {n_all} input_ids and {len(labels)} labels; each row needs one "
                "label per token"
            )
        if len(ids) > n_all:
            raise KDUserError(
                f"{where} has {len(ids)} positions of {ids_col} for {n_all} input_ids; "
                "there is at most one per token"
            )
        # axolotl pads its targets at the front, DistillKit's cover the first positions; under
        # the `current` alignment the entry one further on holds position j's distribution.
        offset = (n_all - len(ids) if format == "axolotl" else 0) - self._shift
        n = n_all if max_seq_len is None else min(n_all, int(max_seq_len))
        lab = torch.tensor([int(x) for x in labels[:n]], dtype=torch.int64)
        positions = labelled_positions(lab, ignore_index)
        sel = positions - offset
        if positions.numel() and (int(sel.min()) < 0 or int(sel.max()) >= len(ids)):
            j = int(positions[(sel < 0) | (sel >= len(ids))][0])
            raise KDUserError(
                f"{where}: labelled position {j} has no entry in {ids_col} ({len(ids)} "
                f"positions for {n_all} tokens, read with {ALIGNMENT_KEY}={self.alignment}); "
                "the file's rows and targets do not line up: check the file, or set "
                f"{ALIGNMENT_KEY} to the tool's convention"
            )
        top_ids, top_lp = self._topk(ids, values, sel.tolist(), where)
        token_ids = lab.new_tensor([int(t) for t in tokens[:n]])
        if token_ids.numel() and int(token_ids.max()) >= student_vocab:
            raise KDUserError(
                f"{where} holds the token id {int(token_ids.max())} in input_ids, outside the "
                f"student's {student_vocab}-entry vocabulary; the file was tokenized by another "
                "tokenizer: the student (and the teacher) must use the file's"
            )
        return _Row(
            row_hash(token_ids, lab),
            n,
            positions,
            top_ids,
            _retemper(top_lp, alpha).to(torch.float16),
        )

    def _topk(
        self, ids: list[Any], values: list[Any], sel: list[int], where: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k (by value, descending) of the selected positions: ``[n, k]`` int64, fp32.

        Every stored entry of those positions is checked first, all positions at once
        (:func:`kd.teachers.answer_checks.topk_problem`: distinct ids, finite or -inf log-probs
        <= 0, probabilities adding up to at most 1, no distribution renormalised around -inf);
        under DistillKit's compression only its exact values count toward the mass (the rest
        are a lossy fit)."""
        k = self.k
        pid = [ids[j] or [] for j in sel]
        pval = [values[j] or [] for j in sel]
        n_ids = np.fromiter(map(len, pid), dtype=np.int64, count=len(sel))
        n_values = np.fromiter(map(len, pval), dtype=np.int64, count=len(sel))
        if (n_ids != n_values).any():
            r = int(np.flatnonzero(n_ids != n_values)[0])
            raise KDUserError(
                f"{where}: position {sel[r]} has {n_ids[r]} ids and {n_values[r]} values; each "
                "id needs its value"
            )
        if len(sel) and int(n_ids.min()) == 0:
            r = int(np.flatnonzero(n_ids == 0)[0])
            raise KDUserError(
                f"{where}: labelled position {sel[r]} holds no entries (an empty list); every "
                "labelled position needs the teacher's top-k: fix or rewrite the file (or, for "
                f"entries read at the wrong position, set {ALIGNMENT_KEY} to the tool's convention)"
            )
        if len(sel) and int(n_ids.min()) < k:
            r = int(np.flatnonzero(n_ids < k)[0])
            raise KDUserError(
                f"teacher_logits.k: {k} is more than the {n_ids[r]} entries stored at "
                f"position {sel[r]} of row {where.split(': row ')[-1]}; set teacher_logits.k to "
                f"{n_ids[r]} or less"
            )
        m = int(n_ids.max()) if len(sel) else k
        if (n_ids == m).all():
            all_ids = np.asarray(pid, dtype=np.int64).reshape(len(sel), m)
            all_lp = np.asarray(pval, dtype=np.float64).reshape(len(sel), m)
            valid = None
        else:  # positions of unequal length: padded, the padding marked
            all_ids = np.zeros((len(sel), m), dtype=np.int64)
            all_lp = np.full((len(sel), m), -np.inf)
            for r, (i, v) in enumerate(zip(pid, pval, strict=True)):
                all_ids[r, : len(i)], all_lp[r, : len(v)] = i, v
            valid = np.arange(m) < n_ids[:, None]
        beyond = all_ids >= self._vocab if valid is None else valid & (all_ids >= self._vocab)
        if beyond.any():  # any stored entry, not only the top-k kept: another tokenizer's ids
            r = int(np.flatnonzero(beyond.any(axis=1))[0])
            raise KDUserError(
                f"{where}: position {sel[r]} holds the teacher id {int(all_ids[r][beyond[r]][0])}, "
                f"outside the student's {self._vocab}-entry vocabulary; the teacher and student "
                "must share a tokenizer"
            )
        found = answer_checks.topk_problem(
            all_ids,
            all_lp,
            vocab=self._vocab,
            valid=valid,
            mass_columns=self._mass_columns,
            whole=m >= self._vocab,
        )
        if found is not None:
            raise KDUserError(
                f"{where}: position {sel[found.position]} {found.what}; the teacher "
                "file is damaged, or not top-k log-probs of the teacher (each position: distinct "
                "ids, log_softmax values, at most 1 in all); fix or rewrite it (or, for entries "
                f"read at the wrong position, set {ALIGNMENT_KEY} to the tool's convention)"
            )
        order = np.argsort(-all_lp, axis=-1, kind="stable")[:, :k]
        top_ids = np.take_along_axis(all_ids, order, axis=-1)
        top_lp = np.take_along_axis(all_lp, order, axis=-1)
        return torch.from_numpy(top_ids), torch.from_numpy(top_lp.astype(np.float32))

    def batch(
        self,
        rows: Sequence[int],
        tokens: torch.Tensor,
        labels: torch.Tensor,
        *,
        k: int,
        ignore_index: int = -100,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k of a batch aligned with its shifted labels, as
        :meth:`kd.teachers.store_reader.StoreReader.batch` returns it.

        Raises:
            KDUserError: a row whose tokens or labels differ from the file's row.
        """
        b, s = tokens.shape
        ids = torch.zeros(b, s, k, dtype=torch.int64)  # [b, s, k]
        logprobs = torch.zeros(b, s, k, dtype=torch.float16)  # [b, s, k]
        tokens, labels = tokens.cpu(), labels.cpu()
        for i, row in enumerate(rows):
            rec = self.rows[int(row)]
            n = rec.num_tokens
            if n > s or row_hash(tokens[i, :n], labels[i, :n]) != rec.row_hash:
                raise KDUserError(
                    f"{KEY}: dataset row {int(row)} differs from row {int(row)} of {self.path} "
                    "(its hash); set dataset to kd.data.pretokenized_dataset of the same file"
                )
            ids[i, rec.positions] = rec.ids[:, :k]
            logprobs[i, rec.positions] = rec.logprobs[:, :k]
        return ids, logprobs


def _decode_compressed(cols: dict[str, list[Any]], path: Path) -> int:
    """Replace DistillKit's compressed columns in ``cols`` by the raw ``token_ids`` /
    ``top_values`` they hold (:mod:`kd.teachers.distillkit_compressed`, with the
    ``compression_config.yaml`` beside the rows); returns the exact values per position
    (``exact_k``: the first of each position's entries, the rest a lossy fit)."""
    cfg = distillkit_compressed.load_config(path, KEY)
    cols["token_ids"], cols["top_values"] = [], []
    for i, (lp, ids) in enumerate(
        zip(cols.pop(row_files.COMPRESSED[0]), cols.pop(row_files.COMPRESSED[1]), strict=True)
    ):
        row_ids, row_values = distillkit_compressed.decode_rows(
            lp, ids, cfg, f"{KEY}: row {i} of {path}"
        )
        cols["token_ids"].append(row_ids)
        cols["top_values"].append(row_values)
    return cfg.exact_k


def _retemper(logprobs: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha log p - logsumexp_k(alpha log p)`` per position (fp32); unchanged for alpha = 1."""
    if alpha == 1.0:
        return logprobs
    scaled = logprobs * alpha
    return scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
