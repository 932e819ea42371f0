"""The transformers backend's cached decode passes its KV cache by the keyword the installed
transformers takes (``cache``; ``past_key_values`` before 5.2x, removed in 5.40)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from kd.backends.transformers import cache_keyword
from tests.unit.rollouts.test_decode import hf_model, prompts


class _Old(nn.Module):
    def forward(self, input_ids=None, past_key_values=None):  # noqa: ANN001, ANN201
        return input_ids


def test_the_cache_keyword_is_the_one_the_model_class_takes(tmp_path):
    """Read from the class (kd's hidden-output mode replaces the instance's forward), under a
    peft wrapper too."""
    model = hf_model(tmp_path)  # hidden-output mode: its instance forward takes **kwargs
    assert cache_keyword(model) == "cache"
    assert cache_keyword(_Old()) == "past_key_values"

    class Wrapped(nn.Module):
        def get_base_model(self) -> nn.Module:
            return model

        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            return None

    assert cache_keyword(Wrapped()) == "cache"


def test_cached_decoding_raises_no_deprecation_warning(tmp_path):
    from kd.backends import backend_of
    from kd.rollouts.decode import next_logits

    model = hf_model(tmp_path).eval()
    p = prompts(60, [4, 2])
    mask = torch.cat([p.mask, torch.ones(2, 2, dtype=torch.bool)], dim=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for static in (False, True):
            steps = backend_of(model).kv_cache_steps(model, mask, width=4, total=6, static=static)
            with torch.no_grad(), steps as forward:
                next_logits(model, forward, p.tokens, 0)
                next_logits(model, forward, p.tokens[:, -1:], 4)
