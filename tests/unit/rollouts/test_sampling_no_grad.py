"""The on-policy rollout samples a trainable student without autograd: otherwise every decode
step's graph stays alive through the KV cache (written in place) until the rollout ends."""

from __future__ import annotations

import torch

from kd.rollouts.base import Prompts
from kd.rollouts.sampling import rollout
from tests.conftest import tiny_hidden_decoder


def test_rollout_builds_no_graph_for_a_trainable_student():
    model = tiny_hidden_decoder(vocab=64, dim=32)
    assert all(p.requires_grad for p in model.parameters())
    seen: list[bool] = []
    model.layers[0].register_forward_hook(lambda *_: seen.append(torch.is_grad_enabled()))
    tokens = torch.randint(1, 64, (2, 5))
    prompts = Prompts(tokens, torch.ones_like(tokens, dtype=torch.bool), torch.tensor([5, 5]))
    out = rollout(
        model,
        prompts,
        max_new_tokens=4,
        temperature=0.0,
        top_p=1.0,
        stop_ids=[],
        pad_id=0,
        vocab_limit=None,
        generators=None,
    )
    assert out.tokens.shape == (2, 4) and out.tokens.grad_fn is None
    assert seen and not any(seen)  # prefill and every decode step ran without autograd
    assert torch.is_grad_enabled() and model.training  # restored for the training step
