"""What every teacher answer read into training must be: one place, used by every reader.

A teacher's answer at one position is ``k`` token ids and their log-probs, the top-k of one
distribution (a served vLLM / SGLang teacher's, kd's store written and read, axolotl's and
DistillKit's files, a cross-tokenizer store's rows). :func:`topk_problem` says, for a whole batch
of positions at once (numpy, no Python loop per token), the first position that cannot be such a
top-k and why; each reader turns that into one line naming its source, the row, the position and
the fix. At each position:

* ids: distinct, in ``[0, vocab)``.
* log-probs: finite, or ``-inf`` for probability 0; NaN and ``+inf`` are refused, and so is a
  value more than :data:`POSITIVE_SLACK` above 0 (log-probs are <= 0).
* mass: the entries' probabilities add up to at most ``1 +`` :data:`MASS_TOLERANCE` (a top-k of
  one distribution adds up to at most 1; the tolerance covers storage rounding, see there).
* probability 0: an entry whose log-prob is ``-inf`` or at most :data:`ZERO_LOGPROB` (vLLM
  writes log 0 as -9999.0 in its JSON) holds no mass. A model's log-softmax of finite logits is
  never that low; a sampler's *processed* log-probs are: top-k / top-p cut the vocabulary and
  the rest is renormalised (vLLM ``--logprobs-mode processed_logprobs``, a proxy that
  renormalises), so the finite entries add up to 1 "around" the zeros and kd would train on a
  truncated distribution as if it were the teacher's. Zero entries are therefore accepted only
  as padding for absent entries, when the finite ones add up to less than ``1 -``
  :data:`MASS_TOLERANCE` (the vocabulary outside holds the rest), or when the entries cover the
  whole vocabulary (``k >= vocab``: the zeros are the distribution's own); a position whose
  finite entries add up to at least ``1 - MASS_TOLERANCE`` beside zero entries is refused
  ("renormalised around -inf"), and so is a position of zero entries only (no distribution:
  ``tail: renorm`` would make it uniform).

:func:`spans_problem` checks a cross-tokenizer store's character spans the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kd.teachers.protocols import RowTopK

__all__ = [
    "MASS_TOLERANCE",
    "POSITIVE_SLACK",
    "ZERO_LOGPROB",
    "BadPosition",
    "check_answer",
    "spans_problem",
    "topk_problem",
]

# How far above 1 a position's probabilities may add up. A top-k of one distribution adds up to
# at most 1; stored log-probs are rounded: float16 (kd's store) by at most 2**-11 relative, so
# the sum by at most 2**-11 * (ln k + 1/e) (0.0043 at k = 4096); bfloat16 (DistillKit's exact
# values) by 2**-8 * (ln k + 1/e) (0.02 at k = 115). Also the margin below 1 under which zero
# entries count as padding rather than a renormalised cut.
MASS_TOLERANCE = 0.02
# A log-prob this far above 0 is rounding of a certain token (fp16 rounds log 1 to at most this).
POSITIVE_SLACK = 1e-3
# A log-prob at or below this is probability 0: vLLM's JSON writes -inf as -9999.0
# (its clamp_prompt_logprobs); exp(-9999) is 0 in any float.
ZERO_LOGPROB = -9999.0
_ID_FILL = np.iinfo(np.int64).min  # padding ids, below any id (distinct per column)


@dataclass(frozen=True)
class BadPosition:
    """The first position of a batch that is not a top-k of one distribution.

    Attributes:
        position: its index along the batch's first axis.
        what: what is wrong there, a clause (``"repeats token id 17 (entries 0 and 3) ..."``).
    """

    position: int
    what: str


def topk_problem(
    ids: np.ndarray,
    logprobs: np.ndarray,
    *,
    vocab: int | None = None,
    valid: np.ndarray | None = None,
    mass_columns: int | None = None,
    own: tuple[np.ndarray, np.ndarray] | None = None,
    whole: bool | None = None,
) -> BadPosition | None:
    """The first position of ``[n, m]`` top-k entries that breaks the rules of the module
    docstring, or None when every one keeps them.

    Args:
        ids: ``[n, m]`` integer token ids.
        logprobs: ``[n, m]`` their log-probs (any float dtype; checked in float64).
        vocab: the vocabulary the ids index (ids at or above it are refused); None: not checked.
        valid: ``[n, m]`` which entries exist (rows of unequal length padded); None: all.
        mass_columns: only the first this many entries count toward the mass ``<= 1 +``
            :data:`MASS_TOLERANCE` (DistillKit's exact values; the rest are a lossy fit); None:
            all.
        own: ``(ids [n], logprobs [n])`` of one more entry per position, counted in the mass
            when its id is not among the k (a cross-tokenizer store's actual teacher token).
        whole: the entries cover the whole vocabulary (zero entries are the distribution's
            own); None: ``m >= vocab`` (False without ``vocab``).
    """
    ids = np.asarray(ids)
    lp = np.asarray(logprobs, dtype=np.float64)
    if ids.shape != lp.shape or lp.ndim != 2:
        raise ValueError(f"ids {ids.shape} and log-probs {lp.shape} are not one [n, m] batch")
    n, m = lp.shape
    if n == 0 or m == 0:
        return None
    ok = np.ones(lp.shape, dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    ids = ids.astype(np.int64, copy=False)
    nonfinite = ok & (np.isnan(lp) | (lp == np.inf))
    positive = ok & (lp > POSITIVE_SLACK)
    outside = ok & ((ids < 0) | (ids >= vocab if vocab is not None else False))
    keyed = np.sort(np.where(ok, ids, _ID_FILL + np.arange(m)), axis=1)
    repeated = (keyed[:, 1:] == keyed[:, :-1]).any(axis=1)
    zero = ok & ~nonfinite & (lp <= ZERO_LOGPROB)  # -inf included
    finite = ok & ~nonfinite & ~zero
    p = np.where(finite, np.exp(np.minimum(np.where(finite, lp, 0.0), 0.0)), 0.0)
    mass = p.sum(axis=1)
    counted = mass if mass_columns is None else p[:, :mass_columns].sum(axis=1)
    own_bad = np.zeros(n, dtype=bool)
    if own is not None:
        own_ids = np.asarray(own[0]).astype(np.int64)
        own_lp = np.asarray(own[1], dtype=np.float64)
        own_bad = (
            np.isnan(own_lp)
            | (own_lp == np.inf)
            | (own_lp > POSITIVE_SLACK)
            | (own_ids < 0)
            | (own_ids >= vocab if vocab is not None else False)
        )
        outside_top = ~((ids == own_ids[:, None]) & ok).any(axis=1)
        counts = outside_top & ~own_bad & (own_lp > ZERO_LOGPROB)
        extra = np.where(counts, np.exp(np.minimum(np.where(counts, own_lp, 0.0), 0.0)), 0.0)
        mass = mass + extra
        counted = counted + extra
    empty = ok.any(axis=1) & ~finite.any(axis=1) & ~nonfinite.any(axis=1)
    over = counted > 1.0 + MASS_TOLERANCE
    if whole is None:
        whole = vocab is not None and m >= vocab
    renormalised = zero.any(axis=1) & ~empty & (mass >= 1.0 - MASS_TOLERANCE) & (not whole)
    rules = (
        nonfinite.any(axis=1),
        positive.any(axis=1),
        outside.any(axis=1),
        own_bad,
        repeated,
        empty,
        over,
        renormalised,
    )
    bad = np.logical_or.reduce(rules)
    if not bad.any():
        return None
    j = int(np.flatnonzero(bad)[0])
    rule = next(i for i, r in enumerate(rules) if r[j])
    return BadPosition(j, _describe(rule, j, ids, lp, ok, zero, mass[j], counted[j], vocab, own))


def _describe(
    rule: int,
    j: int,
    ids: np.ndarray,
    lp: np.ndarray,
    ok: np.ndarray,
    zero: np.ndarray,
    mass: float,
    counted: float,
    vocab: int | None,
    own: tuple[np.ndarray, np.ndarray] | None,
) -> str:
    """What rule ``rule`` of :func:`topk_problem` found at position ``j``, a clause."""
    row_ids, row_lp, row_ok = ids[j], lp[j], ok[j]
    if rule == 0:
        e = int(np.flatnonzero(row_ok & (np.isnan(row_lp) | (row_lp == np.inf)))[0])
        return (
            f"holds the log-prob {row_lp[e]} (entry {e}): not a number a teacher gives "
            "(a log-prob is finite, or -inf for probability 0)"
        )
    if rule == 1:
        e = int(np.flatnonzero(row_ok & (row_lp > POSITIVE_SLACK))[0])
        return (
            f"holds a positive log-prob ({row_lp[e]:.4g}, entry {e}); log-probs are <= 0: "
            "these are logits or probabilities, not log_softmax values"
        )
    if rule == 2:
        e = int(np.flatnonzero(row_ok & ((row_ids < 0) | (row_ids >= (vocab or 0))))[0])
        return (
            f"holds the token id {int(row_ids[e])} (entry {e}), outside the vocabulary "
            f"0..{(vocab or 0) - 1}"
        )
    if rule == 3:
        assert own is not None
        return (
            f"holds the actual token {int(own[0][j])} with the log-prob {float(own[1][j])}: "
            "not a token id of the vocabulary with a log-prob <= 0"
        )
    if rule == 4:
        seen: dict[int, int] = {}
        for e in np.flatnonzero(row_ok):
            t = int(row_ids[e])
            if t in seen:
                return (
                    f"repeats the token id {t} (entries {seen[t]} and {int(e)}); a top-k holds "
                    "k distinct ids"
                )
            seen[t] = int(e)
    if rule == 5:
        return (
            f"holds no finite log-prob (all {int(row_ok.sum())} entries have probability 0): "
            "no distribution to learn from"
        )
    if rule == 6:
        return (
            f"holds probabilities adding up to {counted:.4f}, more than 1 + {MASS_TOLERANCE} "
            "(a top-k of one distribution adds up to at most 1): these are not one "
            "distribution's log-probs"
        )
    return (
        f"holds {int(zero[j].sum())} entries of probability 0 (log-prob -inf or <= "
        f"{ZERO_LOGPROB:g}) beside entries adding up to {mass:.4f}: a distribution renormalised "
        "around a cut vocabulary (a sampler's processed log-probs), not the teacher's own"
    )


def spans_problem(spans: np.ndarray, count: int | None) -> str | None:
    """What is wrong with one row's character spans (None: nothing): ``count`` ``[start, end)``
    pairs, flat (``[2 count]``), each with ``0 <= start <= end``, their ends in text order (the
    alignment walks them by their ends).

    Args:
        spans: the flat pairs.
        count: the tokens they belong to; None: any number of pairs.
    """
    spans = np.asarray(spans).astype(np.int64, copy=False)
    if count is None and spans.size % 2:
        return f"holds {spans.size} span numbers, not [start, end) pairs"
    if count is not None and spans.size != 2 * count:
        return f"holds {spans.size} span numbers for {count} tokens ({2 * count} expected)"
    pairs = spans.reshape(-1, 2)
    bad = (pairs[:, 0] < 0) | (pairs[:, 0] > pairs[:, 1])
    if bad.any():
        e = int(np.flatnonzero(bad)[0])
        return f"holds the span [{pairs[e, 0]}, {pairs[e, 1]}) at token {e}, which is reversed"
    back = np.flatnonzero(np.diff(pairs[:, 1]) < 0)
    if back.size:
        e = int(back[0]) + 1
        return (
            f"holds the span [{pairs[e, 0]}, {pairs[e, 1]}) at token {e}, ending before the "
            f"span before it ([{pairs[e - 1, 0]}, {pairs[e - 1, 1]})): not in text order"
        )
    return None


def check_answer(rows: Sequence[RowTopK], *, vocab: int) -> None:
    """Refuse a served teacher's parsed answer (:class:`kd.teachers.protocols.BadAnswer`, with a
    ``fix``) unless every position of every row is a top-k of one distribution (the module
    docstring); one vectorised pass over the whole answer.

    Args:
        rows: the answer, one :class:`~kd.teachers.protocols.RowTopK` per row of the request.
        vocab: the ids' vocabulary.
    """
    from kd.teachers.protocols import BadAnswer

    if not rows:
        return
    lengths = np.array([r.ids.shape[0] for r in rows])
    found = topk_problem(
        np.concatenate([r.ids for r in rows]),
        np.concatenate([r.logprobs for r in rows]),
        vocab=vocab,
    )
    if found is None:
        return
    ends = np.cumsum(lengths)
    r = int(np.searchsorted(ends, found.position, side="right"))
    j = found.position - int(ends[r] - lengths[r]) + 1  # positions 1 .. n - 1 of the prompt
    error = BadAnswer(f"row {r} position {j} {found.what}")
    error.fix = (
        "serve the teacher's own log-probs: vLLM's default --logprobs-mode raw_logprobs (not "
        "processed_*), SGLang without a logit processor, nothing between kd and the server "
        "rewriting answers"
    )
    raise error
