"""The local sampler's fast decoding loop (``on_policy.batch_rollouts: true``).

:func:`fast_rollout` samples like :func:`kd.rollouts.sampling.rollout` (the same
:func:`~kd.rollouts.sampling.sample_next`, one generator per row, each row drawing once per
token it samples) with three differences that save work:

- the prompts run in groups of similar length (:func:`length_groups`: sorted by length, at most
  ``group_size`` rows a group), so short prompts are not padded to the longest of the step;
- the KV cache is preallocated for the whole rollout: torchtune's ``local_kv_cache`` (it always
  was) and transformers' ``StaticCache`` (in place of the growing ``DynamicCache``);
- finished rows leave the batch: once a quarter of the rows still decoding have stopped, the
  cache, mask and positions keep only the live rows (one ``index_select``), so later steps run
  on fewer rows;
- with ``compile`` (``compile: true``), the one-token decode step (the model's forward over the
  preallocated cache and the last position's logits) is one ``torch.compile`` graph with dynamic
  shapes: compiled once per model, not again when rows leave the batch, a group is narrower or
  the position moves on. The prompts' prefill and the sampling stay eager (the sampling draws from
  each row's generator exactly as without it);
- with ``graphs`` (``on_policy.cuda_graphs: true``), the same step is replayed from a CUDA graph
  captured once per batch size (:mod:`kd.rollouts.graphs`); a batch of more than 16 rows is then
  compacted once half of its rows have finished, a smaller one never.

A row's tokens are those :func:`~kd.rollouts.sampling.rollout` would sample from the same
logits: its generator is asked once per token it samples, in the same order. Only float
rounding may differ (another batch width, other padding), so greedy completions are equal and
sampled ones come from the same distribution.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from kd import models
from kd.backends import backend_of
from kd.rollouts import graphs as decode_graphs
from kd.rollouts.base import Completions, Prompts
from kd.rollouts.sampling import sample_next

__all__ = ["compiled_step", "fast_rollout", "length_groups"]

# Compact the batch once this share of its rows has finished.
SHRINK_AT = 0.25
# A compiled step keeps at least this many rows (a batch of one would be one more compile).
MIN_ROWS = 2


def length_groups(lengths: Sequence[int], group_size: int | None) -> list[list[int]]:
    """Row indices in groups of similar prompt length: sorted by length (stable), cut into
    groups of at most ``group_size`` rows (None: one group)."""
    order = sorted(range(len(lengths)), key=lambda i: int(lengths[i]))
    size = group_size or max(len(order), 1)
    return [order[i : i + size] for i in range(0, len(order), size)]


def next_logits(
    model: nn.Module,
    forward: Callable[[torch.Tensor, int], torch.Tensor],
    x: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """One decode step: ``forward(x, start)`` (the backend's cached forward), then the fp32
    logits ``[b, V]`` of the last position."""
    hidden = forward(x, start)
    return models.logits_from_hidden(model, hidden[:, -1])


@functools.cache
def compiled_step(backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """:func:`next_logits` under ``torch.compile`` (``backend``) with dynamic shapes, made once per
    process.

    The batch, the cache length and the position are symbolic, the KV cache's tensors included
    (torchtune's are the model's buffers, which dynamo otherwise keeps static): a model compiles
    once for its first batch, once for every other (rows leaving, narrower groups, other prompt
    widths), and never for a single row (:func:`_decode_group` keeps two).
    """
    compiled = torch.compile(next_logits, dynamic=True, backend=backend)

    def step(*args: Any) -> torch.Tensor:
        with torch._dynamo.config.patch(
            force_parameter_static_shapes=False, force_nn_module_property_static_shapes=False
        ):
            return compiled(*args)

    return step


def fast_rollout(
    model: nn.Module,
    prompts: Prompts,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: Sequence[int],
    pad_id: int,
    vocab_limit: int | None,
    generators: Sequence[torch.Generator] | None,
    group_size: int | None = None,
    compile: bool = False,
    graphs: decode_graphs.Capture | None = None,
) -> Completions:
    """Sample up to ``max_new_tokens`` tokens after each prompt, group by group (one device).

    Args: as :func:`kd.rollouts.sampling.rollout`, plus ``group_size``: rows per generation
        (``on_policy.rollout_batch_size``; None: all of them at once), ``compile``: the
        decode step compiled (:func:`compiled_step`), and ``graphs``: how decode steps are
        captured to be replayed (:func:`kd.rollouts.graphs.cuda_capture`; not with ``compile``).
    """
    if compile and graphs is not None:
        raise ValueError("fast_rollout: compile and graphs are two ways of one step; pick one")
    b = prompts.tokens.shape[0]
    device = prompts.tokens.device
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    steps = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for group in length_groups(prompts.lengths.tolist(), group_size):
                width = int(prompts.lengths[group].max())
                index = torch.tensor(group, dtype=torch.long, device=device)
                part = Prompts(
                    tokens=prompts.tokens.index_select(0, index)[:, -width:],
                    mask=prompts.mask.index_select(0, index)[:, -width:],
                    lengths=prompts.lengths[group],
                )
                tokens, done_lengths, n = _decode_group(
                    model,
                    part,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    stop_ids=stop_ids,
                    pad_id=pad_id,
                    vocab_limit=vocab_limit,
                    generators=None if generators is None else [generators[i] for i in group],
                    step=compiled_step() if compile else next_logits,
                    graphs=graphs,
                )
                out.index_copy_(0, index, tokens)
                lengths.index_copy_(0, index, done_lengths)
                steps = max(steps, n)
    finally:
        model.train(was_training)
    return Completions(tokens=out, lengths=lengths, steps=steps)


def _decode_group(
    model: nn.Module,
    prompts: Prompts,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: Sequence[int],
    pad_id: int,
    vocab_limit: int | None,
    generators: Sequence[torch.Generator] | None,
    step: Callable[..., torch.Tensor],
    graphs: decode_graphs.Capture | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One group's rollout with a preallocated cache; finished rows leave the batch; ``step``
    (:func:`next_logits`, compiled or not) runs each decode step, or a graph captured by
    ``graphs`` replays it (:class:`kd.rollouts.graphs.DecodeGraphs`)."""
    b, width = prompts.tokens.shape
    device = prompts.tokens.device
    total = width + max_new_tokens
    mask = torch.cat(
        [prompts.mask, torch.ones(b, max_new_tokens, dtype=torch.bool, device=device)], dim=1
    )
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    live = torch.arange(b, device=device)  # the group's rows still in the batch
    gens = list(generators) if generators is not None else None
    backend = backend_of(model)
    kwargs = {"static": True} if backend.name == "transformers" else {}
    steps = 0
    with backend.kv_cache_steps(model, mask, width=width, total=total, **kwargs) as forward:
        cache = forward.__self__  # the steps object: select() drops rows
        logits = next_logits(model, forward, prompts.tokens, 0)  # the prefill, eager
        graph = None
        if graphs is not None and decode_graphs.capturable(cache):
            graph = decode_graphs.DecodeGraphs(
                lambda x, pos: next_logits(model, cache.decode, x, pos), graphs
            )
        shrink_at = decode_graphs.SHRINK_AT if graph is not None else SHRINK_AT
        done = torch.zeros(b, dtype=torch.bool, device=device)  # of the rows in the batch
        for t in range(max_new_tokens):
            token = sample_next(
                logits,
                temperature=temperature,
                top_p=top_p,
                vocab_limit=vocab_limit,
                generators=gens,
            )
            token = torch.where(done, torch.full_like(token, pad_id), token)
            out[live, t] = token
            lengths[live] += (~done).long()
            if stops.numel():
                done |= torch.isin(token, stops)
            steps = t + 1
            if t + 1 == max_new_tokens or bool(done.all()):
                break
            compact = graph is None or graph.compacts(done.numel())
            if compact and int(done.sum()) >= shrink_at * done.numel():  # finished rows leave
                keep = _kept_rows(done, at_least=MIN_ROWS if step is not next_logits else 1)
                if keep.numel() < done.numel():
                    cache.select(keep)
                    if graph is not None:
                        graph.reset()
                    live, token, done = live[keep], token[keep], done[keep]
                    if gens is not None:
                        gens = [gens[i] for i in keep.tolist()]
            if graph is not None:
                logits = graph(token, width + t)
            else:
                logits = step(model, forward, token[:, None], width + t)
    return out, lengths, steps


def _kept_rows(done: torch.Tensor, *, at_least: int) -> torch.Tensor:
    """Indices of the rows still decoding, topped up with finished ones to ``at_least`` rows
    (a finished row's further tokens are written as padding and not counted)."""
    keep = (~done).nonzero().squeeze(1)
    if keep.numel() < at_least:
        extra = done.nonzero().squeeze(1)[: at_least - keep.numel()]
        keep = torch.cat([keep, extra]).sort().values
    return keep
