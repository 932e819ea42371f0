"""One-token attention for the local sampler's low-precision copy on a CPU.

On a CPU, torch's fused attention kernel (``scaled_dot_product_attention``'s flash kernel for
the CPU) is slow on a bf16 query of one position: a decode step of the pair's student at batch
16 took 1.77 ms per layer in it against 0.19 ms for the same product written as two matrix
products (``scripts/bench_rollout.py --attention``; ``docs/benchmarks_rollout.md``). A prompt's prefill (many
query positions) stays on the fused kernel, which is faster there.

:func:`decode_attention` is that product: the query heads grouped over their key/value head (no
copy of the cache per query head), scores and softmax in fp32, the weighted sum in fp32, the
result in the query's dtype. Each backend's ``install_decode_attention`` (:func:`install_torchtune`,
:func:`install_transformers`) puts it in front of each attention module's own call on one model
(the sampler's copy, never the training student): torchtune's
``MultiHeadAttention._attention_call`` of that module, or (transformers) the copy's
``attn_implementation``, registered with transformers' ``AttentionInterface`` under
:data:`HF_NAME` with sdpa's mask. Every other call (more than one query position, another
device, fp32) goes to the module's own attention unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "HF_NAME",
    "LOW_PRECISION",
    "applies",
    "decode_attention",
    "install_torchtune",
    "install_transformers",
]

HF_NAME = "kd_cpu_decode"
LOW_PRECISION = (torch.bfloat16, torch.float16)


def applies(query: torch.Tensor) -> bool:
    """Whether ``query`` ``[b, h, q, d]`` is one position of a low-precision query on a CPU."""
    return query.shape[2] == 1 and query.device.type == "cpu" and query.dtype in LOW_PRECISION


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of one query position: ``query`` ``[b, h, 1, d]`` over ``key`` / ``value``
    ``[b, h_kv, T, d]`` (``h`` a multiple of ``h_kv``: query head ``i`` reads key head
    ``i // (h / h_kv)``), ``mask`` broadcastable to ``[b, h, 1, T]``: bool (True attends) or
    additive float, or None. Returns ``[b, h, 1, d]`` in the query's dtype."""
    b, h, _, d = query.shape
    n_kv, length = key.shape[1], key.shape[2]
    group = h // n_kv
    scores = torch.matmul(query.reshape(b, n_kv, group, d), key.transpose(-1, -2)).float()
    scores = scores * (scale if scale is not None else 1.0 / math.sqrt(d))
    if mask is not None:
        if mask.dim() == 4 and mask.shape[1] == h and h != 1:
            mask = mask.reshape(mask.shape[0], n_kv, group, length)
        else:  # one mask for every head: [b | 1, 1, 1, T]
            mask = mask.reshape(mask.shape[0], 1, 1, length)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    probs = scores.softmax(dim=-1)
    out = torch.matmul(probs, value.float())  # [b, n_kv, group, d]
    return out.reshape(b, h, 1, d).to(query.dtype)


def install_torchtune(model: nn.Module) -> None:
    """Put :func:`decode_attention` in front of each torchtune attention module of ``model``
    (the sampler's own copy): its ``_attention_call``."""
    from torchtune.modules import MultiHeadAttention

    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            group = module.num_heads // module.num_kv_heads
            module._attention_call = functools.partial(
                _torchtune_call, module._attention_call, group
            )


def install_transformers(model: nn.Module) -> None:
    """Set ``model``'s (the sampler's own copy's) ``attn_implementation`` to :data:`HF_NAME`."""
    _register_hf()
    inner = model
    while not hasattr(inner, "set_attn_implementation") and hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()  # a PEFT model: the transformers model it wraps
    if hasattr(inner, "set_attn_implementation"):
        inner.set_attn_implementation(HF_NAME)


def _torchtune_call(
    own: Callable[..., torch.Tensor],
    group: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
) -> torch.Tensor:
    """torchtune's ``_attention_call`` signature; its ``k`` / ``v`` come with each key head
    repeated ``group`` times (``expand`` then ``flatten``), so every ``group``-th head is one
    key head. Its ``mask`` is ``[b, q, T]``."""
    if not applies(q) or dropout_p > 0.0 or (is_causal and mask is None):
        return own(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    heads = slice(None, None, group)
    return decode_attention(q, k[:, heads], v[:, heads], None if mask is None else mask[:, None])


@functools.cache
def _register_hf() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def forward(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if not applies(query) or dropout > 0.0:
            return sdpa_attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                **kwargs,
            )
        out = decode_attention(query, key, value, attention_mask, scaling)
        return out.transpose(1, 2).contiguous(), None  # [b, 1, h, d], as sdpa's

    AttentionInterface.register(HF_NAME, forward)
    AttentionMaskInterface.register(HF_NAME, sdpa_mask)
