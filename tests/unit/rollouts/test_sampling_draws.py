"""The batched per-row draw (:func:`kd.rollouts.sampling.draw_rows`, every sampled token of every
sampler) draws what ``torch.multinomial`` draws row by row with each row's own generator, bit for
bit, step after step: the per-row RNG streams of today's runs are unchanged."""

from __future__ import annotations

import pytest
import torch

from kd.rollouts.sampling import draw_rows, row_generators, sample_next


def per_row(probs, generators):
    return torch.cat(
        [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)]
    )


@pytest.mark.parametrize("vocab", [7, 4099, 49152])
def test_draw_rows_equals_multinomial_per_row(vocab):
    rows = [3, 11, 0, 42, 7]
    mine = row_generators(5, 1, rows, device=torch.device("cpu"))
    theirs = row_generators(5, 1, rows, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(vocab)
    for step in range(20):  # consecutive draws: the generators advance alike
        logits = torch.randn(len(rows), vocab, generator=gen) * (1 + step % 4)
        logits[:, vocab // 2 :: 3] = float("-inf")  # zero-probability ids (top-p, vocab limit)
        probs = logits.softmax(dim=-1)
        assert torch.equal(draw_rows(probs, mine), per_row(probs, theirs))


def test_sample_next_top_p_draws_per_row():
    rows = list(range(6))
    mine = row_generators(0, 0, rows, device=torch.device("cpu"))
    theirs = row_generators(0, 0, rows, device=torch.device("cpu"))
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    got = sample_next(logits, temperature=0.7, top_p=0.8, vocab_limit=250, generators=mine)
    scaled = logits.clone()
    scaled[:, 250:] = float("-inf")
    scaled = scaled / 0.7
    ordered, order = scaled.sort(dim=-1, descending=True)
    p = ordered.softmax(dim=-1)
    drop = p.cumsum(dim=-1) - p >= 0.8
    drop[:, 0] = False
    probs = scaled.masked_fill(drop.scatter(-1, order, drop), float("-inf")).softmax(dim=-1)
    assert torch.equal(got, per_row(probs, theirs))
    assert int(got.max()) < 250


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_draw_rows_refuses_a_broken_distribution(bad):
    probs = torch.full((2, 5), 0.2)
    probs[1, 2] = bad
    with pytest.raises(RuntimeError, match="next-token probabilities"):
        draw_rows(probs, row_generators(0, 0, [0, 1], device=torch.device("cpu")))
