"""Distillation between models whose tokenizers differ: GOLD's aligned hybrid ULD loss.

The same text is tokenized by both tokenizers; each labelled position's row is the distribution
that predicts one token, known with its character span ``[start, end)`` in the text. Following
TRL's GOLD trainer (``trl.experimental.gold``, ``ULDLoss`` with ``use_extended_uld`` and the
``bayesian`` merge, the one whose row ``k`` predicts token ``k`` as kd's shifted labels do):

1. **Alignment** (:func:`align_spans`): both sides' token spans are walked together; a group
   closes where both tokenizers end a token at the same character, so each group covers the same
   text on both sides (one token on one side may cover several on the other).
2. **Merging** (:func:`merge_groups`): a group of several tokens becomes one row, the last
   token's distribution times the probabilities of the group's earlier (actual) tokens: the
   chain rule ``P(t_1..t_k) = P(t_1) ... P(t_k | t_<k)`` with the last factor kept as a full
   distribution. kd does it in log space (GOLD multiplies probabilities floored at 1e-8).
3. **Hybrid loss** (:func:`hybrid_loss`): over the token strings both vocabularies share
   (:func:`vocab_match`), kd's divergence (``kd_loss.divergence``: TRL's generalized JSD is
   ``jsd`` with its ``beta``; ``beta`` 0 / 1 are forward / reverse KL) on the merged rows,
   column to column; over the rest ULD's distance: the L1 distance between the two sides'
   probabilities sorted in decreasing order (zero-padded to the same length). The two parts are
   weighted by ``matched_weight`` (default: the share of the teacher's vocabulary that is
   matched, as GOLD) and ``1 - matched_weight``, each a mean over the aligned groups.

With the same tokenizer on both sides every group is one token, every token matched and the
weight 1, so the loss is exactly kd's same-tokenizer divergence (:func:`kd.losses.kd_loss`)
over the same positions. Where GOLD floors probabilities at 1e-8 before taking logs, kd keeps the
exact log-probabilities, so the two agree to 1e-5 on distributions without such tiny entries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kd import losses

__all__ = [
    "HybridLoss",
    "VocabMatch",
    "align_spans",
    "hybrid_loss",
    "merge_groups",
    "sequence_loss",
    "vocab_match",
]


@dataclass(frozen=True)
class VocabMatch:
    """The token strings two vocabularies share: ``student[i]`` and ``teacher[i]`` are the ids
    of the same string (sorted by teacher id); ``teacher_size`` is the teacher's vocabulary.
    ``student_rest`` / ``teacher_rest``, when given, are each side's other ids in increasing
    order (else :func:`hybrid_loss` finds them; the memory trace gives them, since finding them
    reads values)."""

    student: Tensor
    teacher: Tensor
    teacher_size: int
    student_rest: Tensor | None = None
    teacher_rest: Tensor | None = None

    @property
    def weight(self) -> float:
        """GOLD's adaptive matched weight: matched teacher tokens / teacher vocabulary."""
        return self.teacher.numel() / max(1, self.teacher_size)


def vocab_match(
    student_vocab: Mapping[str, int], teacher_vocab: Mapping[str, int], *, teacher_size: int
) -> VocabMatch:
    """The shared token strings of two vocabularies (``tokenizer.get_vocab()``).

    Args:
        student_vocab: the student tokenizer's string -> id.
        teacher_vocab: the teacher tokenizer's.
        teacher_size: the teacher's distribution size (its output rows).
    """
    pairs = sorted((t, student_vocab[s]) for s, t in teacher_vocab.items() if s in student_vocab)
    pairs = [(t, s) for t, s in pairs if t < teacher_size]
    return VocabMatch(
        student=torch.tensor([s for _, s in pairs], dtype=torch.long),
        teacher=torch.tensor([t for t, _ in pairs], dtype=torch.long),
        teacher_size=teacher_size,
    )


def align_spans(
    student: Sequence[Sequence[int]], teacher: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """Group both sides' tokens where their spans end at the same character (GOLD's walk).

    Args:
        student: ``[start, end)`` character span of each student token, in text order.
        teacher: the teacher's.

    Returns:
        ``(student groups, teacher groups)``: lists of token positions, pairwise covering the
        same text; tokens left over at the end form one last group (possibly empty on a side).
    """
    s_groups: list[list[int]] = []
    t_groups: list[list[int]] = []
    s_start = t_start = s = t = 0
    n_s, n_t = len(student), len(teacher)
    while s < n_s and t < n_t:
        s_end, t_end = student[s][1], teacher[t][1]
        if s_end < t_end:
            s += 1
        elif s_end > t_end:
            t += 1
        else:
            s += 1
            t += 1
            s_groups.append(list(range(s_start, s)))
            t_groups.append(list(range(t_start, t)))
            s_start, t_start = s, t
    if s < n_s or t < n_t:
        s_groups.append(list(range(s_start, n_s)))
        t_groups.append(list(range(t_start, n_t)))
    return s_groups, t_groups


def merge_groups(logp: Tensor, ids: Tensor, groups: Sequence[Sequence[int]]) -> Tensor:
    """One row per group: the last token's log-probs plus the log-probs of the group's earlier
    actual tokens (differentiable; no Python loop over the vocabulary).

    Args:
        logp: ``[n, V]`` log-probs, row ``k`` predicting token ``ids[k]``.
        ids: ``[n]`` the actual tokens.
        groups: non-empty lists of consecutive positions.

    Returns:
        ``[len(groups), V]``.
    """
    device = logp.device
    last = torch.tensor([g[-1] for g in groups], dtype=torch.long, device=device)
    merged = logp.index_select(0, last)
    earlier = [(gi, k) for gi, g in enumerate(groups) for k in g[:-1]]
    if not earlier:
        return merged
    group_of = torch.tensor([gi for gi, _ in earlier], dtype=torch.long, device=device)
    pos = torch.tensor([k for _, k in earlier], dtype=torch.long, device=device)
    token_lp = logp[pos, ids.to(device)[pos]]
    scalar = torch.zeros(len(groups), dtype=logp.dtype, device=device).index_add(
        0, group_of, token_lp
    )
    return merged + scalar[:, None]


@dataclass(frozen=True)
class HybridLoss:
    """One sequence's hybrid loss: ``loss = w * matched + (1 - w) * unmatched``; ``groups`` is
    the number of aligned groups the means are over."""

    loss: Tensor
    matched: Tensor
    unmatched: Tensor
    groups: int


def hybrid_loss(
    s_merged: Tensor,
    t_merged: Tensor,
    match: VocabMatch,
    *,
    divergence: str = "jsd",
    beta: float = 0.5,
    skew_alpha: float = 0.1,
    matched_weight: float | None = None,
) -> HybridLoss:
    """GOLD's hybrid loss between aligned, merged rows of both sides.

    Args:
        s_merged: ``[g, Vs]`` student log-probs per group (:func:`merge_groups`).
        t_merged: ``[g, Vt]`` the teacher's.
        match: the shared token strings (:func:`vocab_match`).
        divergence: kd's divergence on the matched columns (TRL's generalized JSD: ``jsd``).
        beta: its JSD weight.
        skew_alpha: its skew weight.
        matched_weight: the matched part's weight; None: ``match.weight`` (GOLD's adaptive).
    """
    g = max(s_merged.size(0), 1)
    device = s_merged.device
    s_cols, t_cols = match.student.to(device), match.teacher.to(device)
    zero = s_merged.sum() * 0.0
    matched = zero
    if t_cols.numel():
        per_group = losses.per_token_divergence(
            s_merged.index_select(1, s_cols),
            t_merged.detach().index_select(1, t_cols),
            divergence,
            beta,
            skew_alpha,
        )
        matched = per_group.sum() / g
    s_rest = _rest(s_cols, match.student_rest, s_merged.size(-1))
    t_rest = _rest(t_cols, match.teacher_rest, t_merged.size(-1))
    unmatched = zero
    if s_rest.numel() and t_rest.numel():
        s_sorted = s_merged.index_select(1, s_rest).exp().sort(dim=-1, descending=True).values
        t_sorted = t_merged.detach().index_select(1, t_rest).exp()
        t_sorted = t_sorted.sort(dim=-1, descending=True).values
        width = max(s_sorted.size(-1), t_sorted.size(-1))
        s_sorted = F.pad(s_sorted, (0, width - s_sorted.size(-1)))
        t_sorted = F.pad(t_sorted, (0, width - t_sorted.size(-1)))
        unmatched = (s_sorted - t_sorted).abs().sum() / g
    w = match.weight if matched_weight is None else matched_weight
    loss = matched if w == 1.0 else w * matched + (1.0 - w) * unmatched
    return HybridLoss(loss=loss, matched=matched, unmatched=unmatched, groups=g)


def _rest(cols: Tensor, given: Tensor | None, size: int) -> Tensor:
    """The ids below ``size`` not in ``cols``, increasing: ``given`` when it covers them."""
    if given is not None and given.numel() + cols.numel() == size:
        return given.to(cols.device)
    keep = torch.ones(size, dtype=torch.bool, device=cols.device)
    keep[cols] = False
    return keep.nonzero().squeeze(1)


def sequence_loss(
    s_logp: Tensor,
    s_ids: Tensor,
    s_spans: Sequence[Sequence[int]],
    t_logp: Tensor,
    t_ids: Tensor,
    t_spans: Sequence[Sequence[int]],
    match: VocabMatch,
    **kwargs: object,
) -> HybridLoss:
    """Align one sequence's labelled tokens of both sides, merge, and take the hybrid loss.

    Args:
        s_logp: ``[n_s, Vs]`` student log-probs (``log_softmax(z / T)``), row k predicting
            ``s_ids[k]`` whose characters are ``s_spans[k]``.
        s_ids: ``[n_s]``.
        s_spans: ``n_s`` character spans ``[start, end)``.
        t_logp: the teacher's ``[n_t, Vt]``.
        t_ids: ``[n_t]``.
        t_spans: ``n_t`` spans, in the same text.
        match: the shared token strings.
        **kwargs: :func:`hybrid_loss`'s knobs.
    """
    s_groups, t_groups = align_spans(s_spans, t_spans)
    pairs = [(sg, tg) for sg, tg in zip(s_groups, t_groups, strict=False) if sg and tg]
    if not pairs:
        zero = s_logp.sum() * 0.0
        return HybridLoss(loss=zero, matched=zero, unmatched=zero, groups=0)
    s_merged = merge_groups(s_logp, s_ids, [sg for sg, _ in pairs])
    t_merged = merge_groups(t_logp, t_ids, [tg for _, tg in pairs])
    return hybrid_loss(s_merged, t_merged, match, **kwargs)  # type: ignore[arg-type]
