"""Sampling the on-policy completions: batched decoding with a KV cache and the per-row sampler.

:func:`rollout` samples with either backend's KV cache (torchtune's ``local_kv_cache`` and its
padding masks, transformers' cache) through the model's own ``__call__`` (FSDP2's hooks gather
sharded weights); :func:`sample_next` is the one sampler (temperature, top-p, the shared
vocabulary, one ``torch.Generator`` per dataset row: :func:`row_generators`, seeded by
:func:`derive_seed`). Below :mod:`kd.training.on_policy` (which decides what is sampled) and used
by every sampler of :mod:`kd.rollouts`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from kd import models
from kd.backends import backend_of
from kd.rollouts.base import Completions, Prompts

__all__ = ["derive_seed", "rollout", "row_generators", "sample_next", "stop_token_ids"]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (a hash: nearby inputs give unrelated seeds)."""
    digest = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def row_generators(
    seed: int, epoch: int, rows: Sequence[int], *, device: torch.device
) -> list[torch.Generator]:
    """One generator per dataset row: a row samples the same tokens whatever batch, rank or
    resumed run it lands in."""
    return [
        torch.Generator(device=device).manual_seed(derive_seed(seed, epoch, int(r))) for r in rows
    ]


def stop_token_ids(tokenizer: object) -> list[int]:
    """Ids that end a completion: the tokenizer's stop tokens (torchtune's end-of-turn and
    end-of-text ids), else its eos id."""
    stops = getattr(tokenizer, "stop_tokens", None)
    ids = [int(t) for t in stops] if stops else []
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None and int(eos) not in ids:
        ids.append(int(eos))
    return ids


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    vocab_limit: int | None,
    generators: Sequence[torch.Generator] | None,
) -> torch.Tensor:
    """One token per row from next-token logits ``[b, V]`` -> ``[b]`` (int64).

    Ids from ``vocab_limit`` on are never drawn (the vocabulary both models and the tokenizer
    share). ``temperature`` 0 is greedy. ``top_p`` < 1 keeps the smallest set of most likely
    tokens whose probability reaches ``top_p`` (at least one). Row ``i`` draws from
    ``generators[i]`` alone.
    """
    logits = logits.float()
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[:, vocab_limit:] = float("-inf")
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the tokens more likely than it already reach top_p.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    assert generators is not None and len(generators) == probs.shape[0]
    picks = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)]
    return torch.cat(picks)


def rollout(
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
    all_done: Callable[[bool], bool] | None = None,
    stop_early: bool = True,
) -> Completions:
    """Sample up to ``max_new_tokens`` tokens after each prompt, with a KV cache.

    ``model`` is a prepared kd model in hidden-output mode (:func:`kd.models.set_hidden_output`),
    of either backend, possibly FSDP2-sharded; the logits of the last position come from
    :func:`kd.models.logits_from_hidden`. The prompt runs once (prefill), then one token per step.
    The model samples in eval mode (then goes back): the completions are its policy's, without
    dropout (TRL's GKD disables dropout), and draw nothing from the global RNG.

    Args:
        model: the model that samples (the student, or the teacher for ``seq_kd``).
        prompts: left-padded prompts (:func:`prompts_of`).
        max_new_tokens: tokens sampled per row at most.
        temperature: sampling temperature (0 = greedy).
        top_p: nucleus mass.
        stop_ids: ids that end a row's completion (included in it).
        pad_id: id written after a row's end.
        vocab_limit: ids from here on are never sampled.
        generators: one per row (:func:`row_generators`); None only when greedy.
        all_done: ``all_done(done_here)`` -> whether every rank's rows are done (a collective);
            None on one rank.
        stop_early: stop when every row has ended (False runs all ``max_new_tokens`` steps: the
            memory tracer, whose fake tensors have no values).
    """
    b, width = prompts.tokens.shape
    device = prompts.tokens.device
    total = width + max_new_tokens
    mask = torch.cat(
        [prompts.mask, torch.ones(b, max_new_tokens, dtype=torch.bool, device=device)], dim=1
    )
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    backend = backend_of(model)
    steps = 0
    was_training = model.training
    model.eval()
    try:
        # No autograd: the student is trainable, and without this every decode step's graph
        # (all its saved activations) stays alive through the KV cache until the rollout ends.
        with (
            torch.no_grad(),
            backend.kv_cache_steps(model, mask, width=width, total=total) as forward,
        ):
            hidden = forward(prompts.tokens, 0)
            for t in range(max_new_tokens):
                logits = models.logits_from_hidden(model, hidden[:, -1])
                token = sample_next(
                    logits,
                    temperature=temperature,
                    top_p=top_p,
                    vocab_limit=vocab_limit,
                    generators=generators,
                )
                token = torch.where(done, torch.full_like(token, pad_id), token)
                out[:, t] = token
                lengths += (~done).long()
                if stops.numel():
                    done |= torch.isin(token, stops)
                steps = t + 1
                if stop_early:
                    finished = bool(done.all())
                    if all_done is not None:
                        finished = all_done(finished)
                    if finished:
                        break
                if t + 1 < max_new_tokens:
                    hidden = forward(token[:, None], width + t)
    finally:
        model.train(was_training)
    return Completions(tokens=out, lengths=lengths, steps=steps)
