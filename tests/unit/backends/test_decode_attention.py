"""The sampler copy's one-position attention on a CPU in bf16 (:mod:`kd.backends.decode_attention`):
it computes what the fused kernel computes, it serves exactly the decode steps of the copy it is
installed on (never a prefill, never the training student, never an fp32 copy), on both
backends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kd import models
from kd.backends import backend_of, decode_attention
from kd.rollouts.base import Prompts
from kd.rollouts.decode import fast_rollout
from kd.rollouts.local import sampling_copy
from tests.conftest import tiny_hidden_decoder
from tests.unit.rollouts.test_decode import hf_model, prompts


def reference(q, k, v, mask):
    """fp32 SDPA with every key head repeated for its query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bool per head", "additive"])
def test_equals_the_fused_kernel(heads, kv_heads, mask_kind):
    """bf16 inputs, grouped query heads, each mask form a backend passes: within bf16 rounding
    of fp32 SDPA (the masked positions carry no weight: their values are huge)."""
    gen = torch.Generator().manual_seed(0)
    b, length, d = 3, 17, 16
    q = torch.randn(b, heads, 1, d, generator=gen).bfloat16()
    k = torch.randn(b, kv_heads, length, d, generator=gen).bfloat16()
    v = torch.randn(b, kv_heads, length, d, generator=gen).bfloat16()
    keep = torch.ones(b, 1, 1, length, dtype=torch.bool)
    keep[0, ..., :5] = False  # left padding
    keep[1, ..., 12:] = False  # the cache's unwritten tail
    v = v.masked_fill(~keep.transpose(-1, -2)[:, :, :, :1].expand_as(v), 1e4)
    mask = {
        "none": None,
        "bool": keep,
        "bool per head": keep.expand(b, heads, 1, length),
        "additive": torch.zeros(keep.shape).masked_fill(~keep, float("-inf")).bfloat16(),
    }[mask_kind]
    if mask is None:
        v = v.clamp(max=10)
    want = reference(q, k, v, mask if mask is None or mask.dtype == torch.bool else keep)
    got = decode_attention.decode_attention(q, k, v, mask)
    assert got.dtype == torch.bfloat16 and got.shape == (b, heads, 1, d)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_applies_to_one_low_precision_cpu_position_only():
    one = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    assert decode_attention.applies(one)
    assert decode_attention.applies(one.half())
    assert not decode_attention.applies(one.float())
    assert not decode_attention.applies(torch.zeros(2, 4, 3, 8, dtype=torch.bfloat16))
    assert not decode_attention.applies(
        torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16, device="meta")
    )


VOCAB = 60  # the ids the tests sample from (both tiny models have more)


def greedy(max_new_tokens: int) -> dict:
    """fast_rollout's arguments for greedy completions of ``max_new_tokens`` that never stop."""
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "stop_ids": [],
        "pad_id": 0,
        "vocab_limit": VOCAB,
        "generators": None,
    }


def _models(backend: str, tmp_path):
    if backend == "torchtune":
        return tiny_hidden_decoder(vocab=64, dim=32, seed=1)
    return hf_model(tmp_path)


@pytest.mark.parametrize("backend", ["torchtune", "transformers"])
def test_the_bf16_copy_decodes_with_it_and_nothing_else_does(backend, tmp_path, monkeypatch):
    """sampling_copy(bf16) on a CPU: every decode step's attention of the copy goes through
    decode_attention (one call per layer per step), its prefill does not, its greedy tokens equal
    those of the same cast without it (within rounding: the tiny model's margins are wide), and
    the training student and an fp32 copy keep the backend's own attention."""
    student = _models(backend, tmp_path)
    assert backend_of(student).name == backend
    calls: list[tuple[int, ...]] = []
    real = decode_attention.decode_attention

    def spy(q, k, v, mask, scale=None):
        calls.append(tuple(q.shape))
        return real(q, k, v, mask, scale)

    monkeypatch.setattr(decode_attention, "decode_attention", spy)
    p = prompts(VOCAB, [5, 3, 7])
    common = greedy(6)
    copy = sampling_copy(student, torch.bfloat16)
    done = fast_rollout(copy, p, **common)
    layers = len(backend_of(student).decoder_layers(student))
    assert len(calls) == layers * (done.steps - 1)  # every decode step, no prefill
    assert all(shape[2] == 1 for shape in calls)

    calls.clear()
    plain = sampling_copy(student, None)
    for param in plain.parameters():
        param.data = param.data.bfloat16()
    same = fast_rollout(plain, p, **common)
    assert not calls  # a copy made without a low-precision dtype keeps the backend's attention
    assert torch.equal(same.tokens, done.tokens)

    fast_rollout(student, p, **common)
    fast_rollout(sampling_copy(student, None), p, **common)
    assert not calls  # the training student and an fp32 copy: untouched


def test_a_prompt_of_one_token_prefills_with_the_backends_attention(monkeypatch):
    """A one-token prompt's prefill is one query position too: it takes the same path as a
    decode step and samples what the plain bf16 cast samples."""
    student = tiny_hidden_decoder(vocab=64, dim=32, seed=2)
    models.set_hidden_output(student)
    p = Prompts(torch.tensor([[5], [9]]), torch.ones(2, 1, dtype=torch.bool), torch.tensor([1, 1]))
    common = greedy(4)
    copy = sampling_copy(student, torch.bfloat16)
    plain = sampling_copy(student, None)
    for param in plain.parameters():
        param.data = param.data.bfloat16()
    assert torch.equal(
        fast_rollout(copy, p, **common).tokens, fast_rollout(plain, p, **common).tokens
    )
