"""kd.teachers.answer_checks (issue 41, class 2): every poison kind is found at its position and
said in words; every top-k of a real distribution passes, as float32, float16 (kd's store) or
bfloat16 (DistillKit's exact values), whatever its size or peak (a hypothesis property)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kd.teachers.answer_checks import (
    MASS_TOLERANCE,
    ZERO_LOGPROB,
    check_answer,
    spans_problem,
    topk_problem,
)
from kd.teachers.protocols import BadAnswer, RowTopK

V = 50


def _real(n: int = 6, k: int = 5, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The top-k of n real distributions over V entries."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(n, V, generator=g) * 3, dim=-1)
    values, ids = lp.topk(k, dim=-1)
    return ids.numpy(), values.numpy()


def _poisoned(kind: str, j: int = 3) -> tuple[np.ndarray, np.ndarray]:
    ids, lp = _real()
    if kind == "repeat":
        ids[j, 2] = ids[j, 0]
    elif kind == "mass":
        lp[j] = np.log(0.3)  # five entries of 0.3: 1.5 in all
    elif kind == "renorm":  # the first two renormalised, the rest cut away (vLLM's -9999)
        lp[j, :2] = lp[j, :2] - np.logaddexp(lp[j, 0], lp[j, 1])
        lp[j, 2:] = ZERO_LOGPROB
    elif kind == "renorm_inf":
        lp[j, :2] = lp[j, :2] - np.logaddexp(lp[j, 0], lp[j, 1])
        lp[j, 2:] = -np.inf
    elif kind == "empty":
        lp[j] = -np.inf
    elif kind == "nan":
        lp[j, 1] = np.nan
    elif kind == "posinf":
        lp[j, 4] = np.inf
    elif kind == "positive":
        lp[j, 0] = 0.5
    elif kind == "outside":
        ids[j, 1] = V
    elif kind == "negative":
        ids[j, 1] = -1
    return ids, lp


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("repeat", "repeats the token id"),
        ("mass", "adding up to 1.5000, more than 1 + 0.02"),
        ("renorm", "3 entries of probability 0"),
        ("renorm_inf", "renormalised around a cut vocabulary"),
        ("empty", "holds no finite log-prob"),
        ("nan", "holds the log-prob nan (entry 1)"),
        ("posinf", "holds the log-prob inf (entry 4)"),
        ("positive", "holds a positive log-prob (0.5, entry 0)"),
        ("outside", f"holds the token id {V} (entry 1), outside the vocabulary 0..{V - 1}"),
        ("negative", "holds the token id -1 (entry 1)"),
    ],
)
def test_each_poison_is_found_at_its_position(kind, said):
    assert topk_problem(*_real(), vocab=V) is None
    found = topk_problem(*_poisoned(kind), vocab=V)
    assert found is not None and found.position == 3, found
    assert said in found.what, found.what


def test_zero_entries_pass_as_padding_or_as_the_whole_vocabulary():
    ids, lp = _real(k=V)  # the whole vocabulary: zeros are the distribution's own
    lp[:, -3:] = -np.inf
    lp[:, 0] = np.log1p(-np.exp(lp[:, 1:-3]).sum(-1))  # still one distribution
    assert topk_problem(ids, lp, vocab=V) is None
    ids, lp = _real()
    lp[3, 3:] = -np.inf  # absent entries: the finite ones hold less than 1 - tolerance
    assert np.exp(lp[3, :3]).sum() < 1 - MASS_TOLERANCE
    assert topk_problem(ids, lp, vocab=V) is None


def test_padding_is_not_checked_and_mass_columns_count_only_the_exact_values():
    ids, lp = _poisoned("repeat")
    valid = np.ones(ids.shape, dtype=bool)
    valid[3, 2] = False  # the repeat is padding
    assert topk_problem(ids, lp, vocab=V, valid=valid) is None
    ids, lp = _real()
    lp[:, 2:] += 3.0  # a lossy fit's entries overshoot
    lp = np.minimum(lp, 0.0)
    assert topk_problem(ids, lp, vocab=V) is not None
    assert topk_problem(ids, lp, vocab=V, mass_columns=2) is None


def test_the_actual_token_outside_the_top_k_counts_in_the_mass():
    ids, lp = _real(k=3)
    own_ids = np.full(len(ids), V - 1)
    own_ids[ids[:, :1].ravel() == V - 1] = V - 2
    own = np.log(1.0 - np.exp(lp).sum(-1)) + 1.0  # more than what is left
    found = topk_problem(ids, lp, vocab=V, own=(own_ids, own))
    assert found is not None and found.position == 0 and "more than 1 + 0.02" in found.what
    assert topk_problem(ids, lp, vocab=V, own=(ids[:, 0], lp[:, 0])) is None  # in the top-k
    found = topk_problem(ids, lp, vocab=V, own=(np.full(len(ids), V), lp[:, 0]))
    assert found is not None and "actual token 50" in found.what


def test_a_served_answer_names_the_row_and_the_prompt_position():
    ids, lp = _real()
    rows = [RowTopK(ids[:2], lp[:2], []), RowTopK(*_poisoned("repeat", j=1), [])]
    check_answer(rows[:1], vocab=V)
    with pytest.raises(BadAnswer, match="row 1 position 2 repeats the token id") as err:
        check_answer(rows, vocab=V)
    assert "raw_logprobs" in (err.value.fix or "")


@pytest.mark.parametrize(
    ("spans", "count", "said"),
    [
        ([0, 2, 2, 4, 4, 5], 3, None),
        ([0, 2, 2, 2, 2, 5], 3, None),  # an empty span
        ([0, 2, 4, 2, 4, 5], 3, "[4, 2) at token 1, which is reversed"),
        ([0, 2, 2, 4], 3, "holds 4 span numbers for 3 tokens (6 expected)"),
        ([0, 2, 2, 4, 4], None, "holds 5 span numbers, not [start, end) pairs"),
        ([0, 2, 4, 6, 2, 4], 3, "[2, 4) at token 2, ending before the span before it"),
        ([-1, 2], 1, "[-1, 2) at token 0"),
    ],
)
def test_spans(spans, count, said):
    found = spans_problem(np.asarray(spans, dtype=np.int32), count)
    assert found == said if said is None else said in found


# ------------------------------------------------------------------- valid answers always pass
@st.composite
def real_topk(draw):
    """The top-k (or any k distinct entries) of real distributions, as a dtype stores them."""
    n = draw(st.integers(1, 6))
    vocab = draw(st.integers(2, 300))
    k = draw(st.integers(1, vocab))
    scale = draw(st.floats(0.0, 30.0))  # 0: uniform; 30: one token holds everything
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    masked = draw(st.integers(0, vocab - 1))  # entries the model itself gives -inf
    largest = draw(st.booleans())
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale
    if masked and k == vocab:
        logits[:, :masked] = -math.inf
    lp = torch.log_softmax(logits, dim=-1)
    if largest:
        values, ids = lp.topk(k, dim=-1)
    else:
        ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
        values = lp.gather(1, ids)
    return ids.numpy(), values.to(dtype).double().numpy(), vocab


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(real_topk())
def test_every_top_k_of_a_real_distribution_passes(answer):
    ids, lp, vocab = answer
    found = topk_problem(ids, lp, vocab=vocab)
    assert found is None, (found, np.exp(lp).sum(-1))
