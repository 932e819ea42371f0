"""The generation phase of the memory estimate (only with ``on_policy:``): what stays resident at
the start of a step plus the larger of the sampling models' rollouts
(:func:`kd.training.on_policy.rollout`: KV cache, prefill or decoding step, the sampler's ``[b, V]``
buffers). Derivation and trace check: ``docs/memory_accuracy.md``. Pure arithmetic, no torch.
"""

from __future__ import annotations

from kd.memory import hf_terms
from kd.memory.activations import mlp_nograd_bytes
from kd.memory.knobs import GenerationKnobs, TrainKnobs
from kd.memory.shapes import ModelShape
from kd.memory.training_step import Components, between_steps

# kd.training.on_policy.rollout's own tensors besides the model's: the prompts (int64 ids, bool mask, int64
# lengths), the [b, P + N] bool mask, the [b, N] int64 completions and the per-row state; the
# stop ids (two: end of turn and end of text).
_STOP_IDS = 2


def rope_bytes(shape: ModelShape, width: int, a: int) -> int:
    """Per token: torchtune's RoPE temporaries on ``width`` values (q or k) at given positions.

    With ``input_pos`` (generation) the fp32 cache is indexed per position: Qwen2 gathers
    ``[cos, sin]`` (8 hd), casts both to the dtype, then holds the rotated copy, both products and
    their sum (4 width); Llama gathers its ``[hd / 2, 2]`` table (4 hd), upcasts x (4 width) and
    holds fp32 products, their difference and sum (8 width).
    """
    hd = shape.head_dim
    if shape.family == "qwen2":
        return 8 * hd + (2 * a * hd if a != 4 else 0) + 4 * a * width
    return 4 * hd + (4 * width if a != 4 else 0) + 8 * width


def cached_layer_peak(shape: ModelShape, batch: int, q_len: int, keys: int, a: int) -> int:
    """A torchtune decoder layer's peak without autograd beyond its input, when ``q_len`` new
    positions per row attend to a KV cache of ``keys`` positions (the rollout's prefill and
    decoding steps).

    The steps: the attention norm (fp32 input, square, product, scaled product: 12 h); RoPE on q,
    then on k with v alive (:func:`rope_bytes`); SDPA, whose keys and values are the whole cache,
    copied to every head for grouped-query attention (a view for one kv head), with the boolean
    mask turned into an additive ``[b, 1, q_len, keys]`` mask in the dtype, the output and an fp32
    logsumexp; the output projection; the MLP norm with the attention output and residual; the
    MLP (:func:`mlp_nograd_bytes`).
    """
    h, q, kv, nh, nkv, hd = (
        shape.embed_dim,
        shape.q_dim,
        shape.kv_dim,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
    )
    n = batch * q_len
    kv_copies = 2 * a * batch * nh * keys * hd if 1 < nkv < nh else 0
    mask = a * batch * q_len * keys
    norm = (12 if a != 4 else 8) * h + 4
    steps = [
        n * norm,
        n * (a * (h + q) + rope_bytes(shape, q, a)),
        n * (a * (h + q + 2 * kv) + rope_bytes(shape, kv, a)),
        n * a * (h + 2 * q) + 4 * batch * nh * q_len + kv_copies + mask,
        n * a * (2 * h + 2 * q) + kv_copies,
        n * (2 * a * h + norm),
        n * mlp_nograd_bytes(shape, a),
    ]
    return max(steps)


def kv_cache_bytes(shape: ModelShape, batch: int, total: int, a: int) -> int:
    """torchtune's KV cache (``local_kv_cache``): per layer, keys and values
    ``[b, n_kv_heads, total, head_dim]`` in the dtype and the int64 positions ``[total]``."""
    return shape.num_layers * (2 * a * batch * shape.kv_dim * total + 8 * total)


def upcast_bytes(vocab: int, batch: int, a: int) -> int:
    """The next-token logits ``[b, V]`` in the dtype and their fp32 copy (``logits_from_hidden``)."""
    return (a + 4) * batch * vocab if a != 4 else 4 * batch * vocab


def sampler_bytes(vocab: int, batch: int, a: int, g: GenerationKnobs) -> int:
    """Peak of the next-token logits and ``kd.training.on_policy.sample_next`` on ``[b, V]``.

    The logits in the dtype and their fp32 copy; then the fp32 logits, the vocabulary-masked
    clone (the sampled vocabulary is taken to be smaller than the output, as a tokenizer's usually
    is) and: greedy, nothing more; with a temperature, the tempered copy and its softmax; with
    top-p, the tempered copy, the sorted values, the int64 order, their softmax, cumulative sum
    and its difference (32 B per entry at the cumulative sum).
    """
    n = batch * vocab
    upcast = upcast_bytes(vocab, batch, a)
    if g.temperature == 0.0:
        return max(upcast, 8 * n)
    if g.top_p >= 1.0:
        return max(upcast, 12 * n)
    return max(upcast, 32 * n)


def rollout_bytes(shape: ModelShape, k: TrainKnobs) -> dict[str, int]:
    """The generation's transient components (``kv_cache``, ``activations``, ``sampling``,
    ``buffers``) at its peak when ``shape`` samples: :func:`kd.training.on_policy.rollout` on ``b`` prompts
    of ``P = seq_len - new_tokens`` tokens, with a cache of ``seq_len`` positions.

    The rollout's own tensors are held throughout (torchtune: int32 positions ``[b, total]``, the
    prefill mask ``[b, P, total]`` and the key positions too), and so is the prefill's output
    until the first decoding step returns. The peak is the largest of the prefill (a decoder
    layer on ``b * P`` tokens), the first token's sampling, and the first decoding step (with the
    fp32 logits of the first token still referenced); from the second token on, the new logits
    are computed while the last ones are still referenced.
    """
    g = k.generation
    assert g is not None
    b, a, new = k.batch_size, k.dtype_bytes, g.new_tokens
    prompt = max(1, k.seq_len - new)
    total = prompt + new
    h, vocab = shape.embed_dim, shape.vocab_size
    own = 9 * b * prompt + 8 * b + b * total + 8 * b * new + 9 * b + 8 * _STOP_IDS
    logits = 4 * b * vocab
    sampler = sampler_bytes(vocab, b, a, g)
    if shape.hf:
        candidates = hf_terms.generation_steps(
            shape,
            b,
            prompt,
            new,
            a,
            logits=logits,
            upcast=upcast_bytes(vocab, b, a),
            sampler=sampler,
        )
        best = max(candidates, key=lambda d: sum(d.values()))
        return dict(best, buffers=best.get("buffers", 0) + own)
    own += 4 * b * total + b * prompt * total + 8 * total
    cache = kv_cache_bytes(shape, b, total, a)
    hidden = a * b * prompt * h
    decode = logits + b * total + 8 * b + a * b * h + cached_layer_peak(shape, b, 1, total, a)
    steps = [
        {"activations": hidden + cached_layer_peak(shape, b, prompt, total, a)},
        {"activations": hidden, "sampling": sampler},
        {"activations": hidden + decode - logits, "sampling": logits},
    ]
    if new > 1:  # the next logits, in the dtype and in fp32, while the last ones are referenced
        steps.append({"activations": a * b * h, "sampling": logits + upcast_bytes(vocab, b, a)})
    best = max(steps, key=lambda d: sum(d.values()))
    return dict(best, kv_cache=cache, buffers=own)


def generation_phase(
    student: ModelShape,
    teacher: ModelShape | None,
    k: TrainKnobs,
    resident: Components,
    *,
    model_buffers: int,
) -> Components:
    """The generation phase (``k.generation`` set): the larger of the sampling models' rollouts
    (:func:`rollout_bytes`) on top of what stays between steps
    (:func:`kd.memory.training_step.between_steps`).

    The int64 tokens and labels of the micro-batches sampled before this one stay on the device
    (``grad_accum - 1`` of them, at most ``seq_len`` tokens each; at least one is counted) beside
    both models' buffers (``model_buffers``). Under FSDP2 the sampling model's root unit stays
    gathered and two of its layers are in flight.

    Raises:
        ValueError: a sampling model that is not there.
    """
    g = k.generation
    assert g is not None
    batches = 16 * k.tokens * max(1, k.grad_accum - 1)
    phases = []
    for name in g.models:
        shape = student if name == "student" else teacher
        if shape is None:
            raise ValueError(f"estimate: generation by the {name}, but there is no {name}")
        per_param = k.teacher_dtype_bytes if name == "teacher" else k.dtype_bytes
        in_flight = 0
        if k.num_ranks > 1:
            root = shape.embedding_params() + shape.output_params() + shape.embed_dim
            in_flight = int(per_param * (2 * shape.largest_layer_params() + root))
        phase = between_steps(resident, in_flight=in_flight, buffers=model_buffers + batches)
        for comp, val in rollout_bytes(shape, k).items():
            phase[comp] = phase.get(comp, 0) + val
        phases.append(phase)
    return max(phases, key=lambda d: sum(d.values()), default={})
