"""GOLD's cross-tokenizer loss: equal to TRL's ``ULDLoss`` (hybrid, extended ULD, bayesian merge)
on the same tensors, exactly kd's same-tokenizer loss when the tokenizers are the same, and
hand-computed alignment and merge cases."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kd import losses
from kd.config.run import DIVERGENCES
from kd.cross_tokenizer import align_spans, merge_groups, sequence_loss, vocab_match
from kd.losses import divergences


class _Vocab:
    """What TRL's ULDLoss reads of a tokenizer."""

    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def _spans(lengths: list[int]) -> list[list[int]]:
    out, pos = [], 0
    for n in lengths:
        out.append([pos, pos + n])
        pos += n
    return out


def _lengths(rng: random.Random) -> tuple[list[int], list[int]]:
    """Token lengths of both sides over the same 30 characters: chunks of 2-4 characters that
    both tokenizers end a token at, each split in one or two tokens per side (groups stay short,
    so no merged probability nears GOLD's 1e-8 floor)."""
    s_len, t_len, left = [], [], 30
    while left:
        chunk = min(left, rng.randint(2, 4))
        left -= chunk
        for side in (s_len, t_len):
            cut = rng.randint(0, chunk - 1)
            side.extend([cut, chunk - cut] if cut else [chunk])
    return s_len, t_len


def _case(seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vs, vt = 37, 53
    s_vocab = {f"s{i}": i for i in range(vs)}
    t_vocab = {f"t{i}": i for i in range(vt)}
    for i in range(0, 24, 2):  # 12 shared strings, at other ids on each side
        t_vocab[f"s{i}"] = t_vocab.pop(f"t{(i * 7 + 3) % vt}")
    s_len, t_len = _lengths(rng)
    s_ids = torch.randint(0, vs, (len(s_len),), generator=gen)
    t_ids = torch.randint(0, vt, (len(t_len),), generator=gen)
    s_logits = 0.5 * torch.randn(len(s_len), vs, generator=gen)
    t_logits = 0.5 * torch.randn(len(t_len), vt, generator=gen)
    return s_vocab, t_vocab, s_len, t_len, s_ids, t_ids, s_logits, t_logits


def _trl(s_vocab, t_vocab, s_len, t_len, s_ids, t_ids, s_logits, t_logits, beta):
    from trl.experimental.gold import GOLDConfig
    from trl.experimental.gold.gold_trainer import ULDLoss

    config = GOLDConfig(
        output_dir="/tmp/unused",
        use_uld_loss=True,
        uld_use_hybrid_loss=True,
        uld_token_merge_strategy="bayesian",
        uld_skip_student_eos=False,
        uld_skip_teacher_eos=False,
        beta=beta,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    uld = ULDLoss(config, student_tokenizer=_Vocab(s_vocab), teacher_tokenizer=_Vocab(t_vocab))

    def side(lengths, ids, logits):
        n = len(lengths)
        # position 0 is the prompt; answer tokens 1..n; logits[k] predicts token k + 1
        full = torch.cat([logits, torch.zeros(1, logits.size(-1))])[None]
        labels = torch.tensor([[-100, *ids.tolist()]])
        offsets = torch.tensor([[[0, 0], *_spans(lengths)]])
        assert full.size(1) == n + 1
        return full, labels, labels.clamp_min(0), offsets

    s_full, s_lab, s_in, s_off = side(s_len, s_ids, s_logits)
    t_full, t_lab, t_in, t_off = side(t_len, t_ids, t_logits)
    total = uld(s_full, t_full, s_lab, t_lab, s_in, t_in, s_off, t_off)
    return total, uld.last_matched_loss, uld.last_unmatched_loss


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("divergence", "beta"), [("jsd", 0.5), ("forward_kl", 0.0), ("reverse_kl", 1.0)]
)
def test_equal_to_trl_gold_hybrid_uld(seed, divergence, beta):
    case = _case(seed)
    s_vocab, t_vocab, s_len, t_len, s_ids, t_ids, s_logits, t_logits = case
    total, matched, unmatched = _trl(*case, beta=beta)
    match = vocab_match(s_vocab, t_vocab, teacher_size=t_logits.size(-1))
    ours = sequence_loss(
        torch.log_softmax(s_logits, -1),
        s_ids,
        _spans(s_len),
        torch.log_softmax(t_logits, -1),
        t_ids,
        _spans(t_len),
        match,
        divergence=divergence,
        beta=beta,
    )
    assert match.teacher.numel() == 12
    assert float(ours.matched) == pytest.approx(float(matched), abs=1e-5)
    assert float(ours.unmatched) == pytest.approx(float(unmatched), abs=1e-5)
    assert float(ours.loss) == pytest.approx(float(total), abs=1e-5)
    assert float(ours.matched) > 0 and float(ours.unmatched) > 0


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_same_tokenizer_is_exactly_kds_loss(divergence):
    gen = torch.Generator().manual_seed(3)
    v, n = 41, 17
    vocab = {f"w{i}": i for i in range(v)}
    s_logits = torch.randn(n, v, generator=gen)
    t_logits = torch.randn(n, v, generator=gen)
    ids = torch.randint(0, v, (n,), generator=gen)
    spans = _spans([1 + i % 3 for i in range(n)])
    ours = sequence_loss(
        divergences._log_softmax_fp32(s_logits, v, 1.0),
        ids,
        spans,
        divergences._log_softmax_fp32(t_logits, v, 1.0),
        ids,
        spans,
        vocab_match(vocab, vocab, teacher_size=v),
        divergence=divergence,
    )
    kd = losses.kd_loss(s_logits, t_logits, ids, divergence=divergence)
    assert ours.groups == n
    assert torch.equal(ours.loss, kd), (float(ours.loss), float(kd))
    assert float(ours.unmatched) == 0


def test_alignment_by_hand():
    # "hello world": student "hel|lo| wor|ld", teacher "hello| world"
    s = [[0, 3], [3, 5], [5, 9], [9, 11]]
    t = [[0, 5], [5, 11]]
    assert align_spans(s, t) == ([[0, 1], [2, 3]], [[0], [1]])
    # a trailing student token the teacher lacks is a group of its own, empty on the teacher side
    assert align_spans([[0, 2], [2, 3]], [[0, 2]]) == ([[0], [1]], [[0], []])


def test_merge_by_hand():
    # row k predicts ids[k]; the group [0, 1] is P(a) * P(. | a): row 1 plus log P(ids[0]) of row 0
    p = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    merged = merge_groups(p.log(), torch.tensor([1, 2, 0]), [[0, 1], [2]]).exp()
    torch.testing.assert_close(merged[0], torch.tensor([0.025, 0.15, 0.075]))
    torch.testing.assert_close(merged[1], p[2])


def test_unmatched_part_by_hand():
    # no shared strings: only ULD's sorted L1, (|0.7 - 0.5| + |0.2 - 0.3| + |0.1 - 0.2|) / 1
    match = vocab_match({"a": 0, "b": 1, "c": 2}, {"x": 0, "y": 1, "z": 2}, teacher_size=3)
    out = sequence_loss(
        torch.tensor([[0.1, 0.7, 0.2]]).log(),
        torch.tensor([1]),
        [[0, 1]],
        torch.tensor([[0.3, 0.2, 0.5]]).log(),
        torch.tensor([2]),
        [[0, 1]],
        match,
    )
    assert float(out.unmatched) == pytest.approx(0.4)
    assert float(out.loss) == pytest.approx(0.4)
    assert math.isclose(match.weight, 0.0)


def test_same_tokenizer_gradient_is_kds():
    gen = torch.Generator().manual_seed(4)
    v, n = 23, 9
    vocab = {f"w{i}": i for i in range(v)}
    ids = torch.randint(0, v, (n,), generator=gen)
    t_logits = torch.randn(n, v, generator=gen)
    spans = _spans([2] * n)
    grads = []
    for use_cross in (True, False):
        s_logits = torch.randn(n, v, generator=torch.Generator().manual_seed(5)).requires_grad_()
        if use_cross:
            out = sequence_loss(
                torch.log_softmax(s_logits, -1),
                ids,
                spans,
                torch.log_softmax(t_logits, -1),
                ids,
                spans,
                vocab_match(vocab, vocab, teacher_size=v),
                divergence="forward_kl",
            ).loss
        else:
            out = losses.kd_loss(s_logits, t_logits, ids, divergence="forward_kl")
        out.backward()
        grads.append(s_logits.grad)
    torch.testing.assert_close(grads[0], grads[1])
