"""Activation terms of transformers' decoder layers (the ``kd.hf`` backend), for the estimate.

transformers' Llama-family layers save different tensors from torchtune's, read off its modules
(``modeling_llama``, ``modeling_qwen3``, ``modeling_gemma3``) and checked against MemTracker traces
of the real step under FakeTensorMode (``kd plan --trace``):

* RMSNorm (``rms``) keeps the fp32 input (4 B per value) and ``rsqrt`` (4 B per row) when its
  input needs a gradient, and the normalised input in the model dtype when its scale trains.
  Gemma's (``rms_1p``) computes ``x * rsqrt * (1 + w)`` in fp32: it also keeps the fp32
  ``1 + w`` vector and, when the scale trains, the fp32 normalised input.
* q/k norms (Qwen3, Gemma 3) are the same RMSNorm per head, on q and k.
* RoPE keeps ``cos`` and ``sin`` (``[1, s, head_dim]``, one pair per forward and layer kind,
  shared by every layer of that kind).
* SDPA keeps q, k, v, its output (also the o projection's input) and an fp32 logsumexp. Without a
  mask transformers asks SDPA for grouped-query attention, so k and v stay at the kv heads; a
  sliding-window layer whose window the sequence reaches passes a ``[b, 1, s, s]`` mask, repeats
  k and v to every head (a view when there is one kv head) and SDPA keeps the mask converted to
  the model dtype.
* The gated MLP (SiLU or GELU-tanh) keeps the gate output, the activation, the up output and their
  product (the down projection's input), as torchtune's SwiGLU.
* Gemma 3 adds a norm after attention and after the MLP, applied to the branch output.

All functions are pure arithmetic on a :class:`~kd.memory.shapes.ModelShape` with ``backend ==
"transformers"``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kd.memory.shapes import RMS_1P, SLIDING, ModelShape, trainable_parts


@dataclass(frozen=True)
class Part:
    """Tensors one step of a decoder layer's forward keeps for backward.

    Attributes:
        step: ``norm1``, ``qkv``, ``q_norm``, ``k_norm``, ``sdpa``, ``o``, ``attn_norm`` (Gemma's
            norm after attention), ``norm2``, ``mlp_in``, ``mlp``, ``mlp_norm`` (after the MLP).
        nbytes: bytes for the whole micro-batch.
    """

    step: str
    nbytes: int


def layer_parts(
    shape: ModelShape, index: int, batch: int, seq: int, a: int, *, input_grad: bool
) -> list[Part]:
    """What decoder layer ``index`` keeps for backward, step by step in forward order.

    RoPE's shared ``cos``/``sin`` are not included (:func:`shared_saved_bytes`).

    Args:
        shape: a transformers decoder.
        index: the layer (its kind decides the mask).
        batch: micro-batch b.
        seq: sequence length s.
        a: activation dtype bytes.
        input_grad: whether the layer's input requires grad.
    """
    h, f, nh, nkv = shape.embed_dim, shape.intermediate_dim, shape.num_heads, shape.num_kv_heads
    q_dim, kv_dim = shape.q_dim, shape.kv_dim
    n = batch * seq
    tr = trainable_parts(shape)
    gemma = shape.norm == RMS_1P
    r = shape.lora.rank if shape.lora else 0
    dropout = bool(shape.lora and shape.lora.dropout > 0)
    dims = shape.linear_dims()
    parts: list[Part] = []

    def norm(step: str, width: int, rows: int, grad: bool) -> None:
        # one RMSNorm: fp32 input + rsqrt (input grad), Gemma's fp32 (1 + w) vector (input grad),
        # the normalised input for the scale's gradient (fp32 for Gemma, else the dtype)
        nbytes = n * (4 * width + 4 * rows) + (4 * (width // rows) if gemma else 0) if grad else 0
        if tr.full:
            nbytes += n * (4 if gemma else a) * width
        parts.append(Part(step, nbytes))

    def lora_extra(name: str) -> int:
        if name in tr.lora_linears:
            return n * (a * r + (dims[name][0] * (a + 1) if dropout else 0))
        return 0

    # attention block
    norm("norm1", h, 1, input_grad)
    normed_grad = input_grad or tr.full
    qkv = n * a * h if any(tr.linear(x) for x in ("q_proj", "k_proj", "v_proj")) else 0
    parts.append(Part("qkv", qkv + sum(lora_extra(x) for x in ("q_proj", "k_proj", "v_proj"))))
    q_grad = normed_grad or tr.linear("q_proj")
    k_grad = normed_grad or tr.linear("k_proj")
    v_grad = normed_grad or tr.linear("v_proj")
    if shape.qk_norm:
        norm("q_norm", q_dim, nh, q_grad)
        norm("k_norm", kv_dim, nkv, k_grad)
    sdpa = q_grad or k_grad or v_grad
    saved = 0
    if sdpa:
        masked = shape.masked(index, seq)
        kv_saved = q_dim if (masked and 1 < nkv < nh) else kv_dim
        saved = n * (a * (2 * q_dim + 2 * kv_saved) + 4 * nh)
        if masked:
            saved += a * batch * seq * seq  # the mask converted to the dtype, [b, 1, s, s]
    parts.append(Part("sdpa", saved))
    parts.append(Part("o", lora_extra("output_proj")))
    attn_grad = sdpa or tr.linear("output_proj")
    if shape.sandwich_norms:
        norm("attn_norm", h, 1, attn_grad)
    mid_grad = input_grad or attn_grad
    # MLP block
    norm("norm2", h, 1, mid_grad)
    mlp_in_grad = mid_grad or tr.full
    mlp_in = n * a * h if (tr.linear("w1") or tr.linear("w3")) else 0
    parts.append(Part("mlp_in", mlp_in + sum(lora_extra(x) for x in ("w1", "w3", "w2"))))
    w1_grad = mlp_in_grad or tr.linear("w1")
    w3_grad = mlp_in_grad or tr.linear("w3")
    mlp = 0
    if w1_grad:
        mlp += 2 * a * f  # activation input; up output (kept by the product)
    if w3_grad:
        mlp += a * f  # activation output (kept by the product)
    if tr.linear("w2"):
        mlp += a * f  # product = down projection input
    parts.append(Part("mlp", n * mlp))
    if shape.sandwich_norms:
        norm("mlp_norm", h, 1, w1_grad or w3_grad or tr.linear("w2"))
    return parts


def layer_saved_bytes(
    shape: ModelShape, index: int, batch: int, seq: int, a: int, *, input_grad: bool
) -> int:
    """Bytes decoder layer ``index`` keeps for backward (no checkpointing); see
    :func:`layer_parts`."""
    return sum(p.nbytes for p in layer_parts(shape, index, batch, seq, a, input_grad=input_grad))


def layer_grads(shape: ModelShape) -> list[tuple[bool, bool]]:
    """Per layer: (its input requires grad, its q or k requires grad)."""
    tr = trainable_parts(shape)
    out = []
    for i in range(shape.num_layers):
        input_grad = i > 0 or tr.full
        out.append((input_grad, input_grad or tr.linear("q_proj") or tr.linear("k_proj")))
    return out


def shared_saved_bytes(
    shape: ModelShape, batch: int, seq: int, a: int, *, checkpointed: bool
) -> dict[int, int]:
    """Tensors every layer of a kind shares, by the layer whose backward frees them.

    RoPE's ``cos`` and ``sin`` (one pair per layer kind) are kept by every layer of that kind whose
    q or k needs a gradient, so they are freed with the lowest such layer (backward runs from the
    last layer down). A checkpointed layer keeps all its inputs for the recomputation: the pair,
    and a sliding layer's boolean ``[b, 1, s, s]`` mask.

    Args:
        shape: a transformers decoder.
        batch: micro-batch b.
        seq: sequence length s.
        a: activation dtype bytes.
        checkpointed: activation checkpointing wraps each layer.
    """
    out: dict[int, int] = {}
    seen: set[str] = set()
    for i, (_, qk) in enumerate(layer_grads(shape)):
        kind = shape.layer_kind(i)
        if (qk or checkpointed) and kind not in seen:
            seen.add(kind)
            extra = 2 * a * seq * shape.head_dim
            if checkpointed and shape.masked(i, seq):
                extra += batch * seq * seq
            out[i] = out.get(i, 0) + extra
    return out


def head_saved_bytes(shape: ModelShape, tokens: int, a: int) -> int:
    """The final norm's saved tensors (its input always needs grad)."""
    h = shape.embed_dim
    full = shape.lora is None
    if shape.norm == RMS_1P:
        return tokens * (4 * h + 4 + (4 * h if full else 0)) + 4 * h
    return tokens * (4 * h + 4 + (a * h if full else 0))


def forward_fixed_bytes(shape: ModelShape, batch: int, seq: int, a: int, *, grad: bool) -> int:
    """Bytes a transformers model's forward holds from its start to its end besides the layers'
    own tensors: the embedding output (``inputs_embeds`` stays referenced), the position ids, each
    sliding kind's boolean mask and, without autograd (the teacher), the RoPE tables.

    Args:
        shape: a transformers decoder.
        batch: micro-batch b.
        seq: sequence length s.
        a: activation dtype bytes.
        grad: the forward records autograd (the student: RoPE tables are then saved tensors,
            counted by :func:`shared_saved_bytes`).
    """
    out = a * batch * seq * shape.embed_dim + 8 * seq
    kinds = {shape.layer_kind(i) for i in range(shape.num_layers)}
    if any(shape.masked(i, seq) for i in range(shape.num_layers)):
        out += batch * seq * seq
    if not grad:
        out += len(kinds) * 2 * a * seq * shape.head_dim
    return out


def final_norm_peak_bytes(shape: ModelShape, tokens: int, a: int) -> int:
    """The final norm's forward peak beyond its saved tensors and its output: its input (the last
    layer's output) and fp32 temporaries (the product by ``rsqrt``, kept only for a trainable
    scale; Gemma's product by ``1 + w``; with a frozen scale the normalised input in the dtype)."""
    h = shape.embed_dim
    frozen = shape.lora is not None
    if a >= 4:  # the fp32 copies are the tensors themselves
        return tokens * h * (4 if frozen else 0)
    if shape.norm == RMS_1P:
        return tokens * h * (max(8, a + 4) if frozen else a + 4)
    return tokens * h * (a + 4 + (a if frozen else 0))


def nograd_layer_peak(shape: ModelShape, batch: int, seq: int, a: int) -> int:
    """A decoder layer's forward peak without autograd (the teacher; a checkpointed layer's first
    pass), beyond its input: the largest of its steps' live temporaries.

    Attention: the normed input with q, k, v and then RoPE's temporaries (q * cos, the rotated
    copy and its product for q, and for k while the old q is still referenced); the q/k norms'
    fp32 copies; SDPA's inputs, output and logsumexp (a sliding layer adds the repeated k/v and the
    mask in the dtype); the o projection. MLP: the normed input with activation, up and product.
    An RMSNorm holds its fp32 input and product (8 B per value).
    """
    h, f, q, kv, nh, nkv = (
        shape.embed_dim,
        shape.intermediate_dim,
        shape.q_dim,
        shape.kv_dim,
        shape.num_heads,
        shape.num_kv_heads,
    )
    norm = 8 * h + 4  # fp32 input and product, rsqrt
    worst = 0
    for masked in {shape.masked(i, seq) for i in range(shape.num_layers)}:
        # attention block (the layer input stays referenced by the model's loop throughout)
        steps = [norm, a * (h + q + 2 * kv)]
        if shape.qk_norm and shape.sandwich_norms:
            # Gemma 3: q, k, v first, then the q and k norms
            steps += [
                a * (h + q + 2 * kv) + 8 * q + 4 * nh,
                a * (h + q + 2 * kv) + 8 * kv + 4 * nkv,
            ]
        elif shape.qk_norm:
            # Qwen3: each norm right after its projection, v last
            steps += [a * (h + q) + 8 * q + 4 * nh, a * (h + q + kv) + 8 * kv + 4 * nkv]
        steps += [a * (h + 4 * q + 2 * kv), a * (h + 2 * q + 5 * kv)]  # RoPE on q, then on k
        sdpa = a * (h + 2 * q + 2 * kv) + 4 * nh
        if masked:
            sdpa += a * seq + (2 * a * q if 1 < nkv < nh else 0)
        steps += [sdpa, a * (2 * h + q)]
        if shape.sandwich_norms:
            steps.append(a * h + norm)  # the norm after attention, on its output
        # MLP block: the attention residual sum is alive besides the layer input
        steps += [a * h + norm, a * (2 * h + 3 * f), a * (3 * h + f)]
        if shape.sandwich_norms:
            steps.append(2 * a * h + norm)
        worst = max(worst, max(steps))
    return batch * seq * worst


def _norm_backward(shape: ModelShape, width: int, a: int) -> int:
    """Per token: an RMSNorm's backward peak beyond its saved tensors and its incoming gradient.

    Five fp32 temporaries of the input's size (20 B per value) while the incoming gradient and,
    with a trainable scale, the normalised input (in the dtype; fp32 for Gemma) are freed on the
    way.
    """
    normed = (4 if shape.norm == RMS_1P else a) if shape.lora is None else 0
    return (20 - a - normed) * width


def head_backward_bytes(shape: ModelShape, tokens: int, a: int) -> int:
    """The final norm's backward peak beyond the loss's saved tensors (the incoming gradient among
    them) and the norm's own (measured in bf16: 16 h per token with a trainable scale, 18 h with a
    frozen one; Gemma's norm 14 h and 18 h)."""
    return tokens * _norm_backward(shape, shape.embed_dim, a)


def layer_backward_steps(
    shape: ModelShape, index: int, batch: int, seq: int, a: int, *, input_grad: bool
) -> list[tuple[int, int, tuple[str, ...]]]:
    """The peaks inside decoder layer ``index``'s backward, in backward order.

    Each step is (bytes of the layer's saved tensors still held, temporaries, the layer linears
    whose weight gradients exist by then). A node frees its saved tensors when it is done, so the
    held part shrinks step by step. An RMSNorm's backward peaks at about 20 B per value of fp32
    temporaries, minus its incoming gradient and (trainable scale) its normalised input, both
    freed on the way; the residual stream's gradient stays alive across the block.
    """
    h, f, q = shape.embed_dim, shape.intermediate_dim, shape.q_dim
    n = batch * seq
    parts = layer_parts(shape, index, batch, seq, a, input_grad=input_grad)
    masked = shape.masked(index, seq)
    kv_saved = q if (masked and 1 < shape.num_kv_heads < shape.num_heads) else shape.kv_dim

    def held(upto: str) -> int:
        total = 0
        for part in parts:
            total += part.nbytes
            if part.step == upto:
                return total
        return total

    def norm(width: int) -> int:
        return n * (a * width + _norm_backward(shape, width, a))  # with its incoming gradient

    g = n * a * h  # the residual stream's gradient
    steps: list[tuple[int, int, tuple[str, ...]]] = []
    if shape.sandwich_norms:
        steps.append((held("mlp_norm"), g + norm(h), ()))
    steps.append((held("mlp"), g * (2 if shape.sandwich_norms else 1) + 2 * n * a * f, ("w2",)))
    steps.append((held("norm2"), g + norm(h), ("w1", "w2", "w3")))
    if shape.sandwich_norms:
        steps.append((held("attn_norm"), g + norm(h), ("w1", "w2", "w3", "output_proj")))
    attn_grads = n * a * (2 * q + 2 * kv_saved)  # d(output) and d(q, k, v)
    steps.append((held("sdpa"), g + attn_grads, ("w1", "w2", "w3", "output_proj")))
    if shape.qk_norm:
        steps.append(
            (
                held("q_norm"),
                g + n * a * 2 * shape.kv_dim + norm(q),
                ("w1", "w2", "w3", "output_proj"),
            )
        )
    steps.append((held("norm1"), g + norm(h), tuple(shape.linear_dims())))
    return steps


# --------------------------------------------------------------------------- generation
def _gen_norm(shape: ModelShape, width: int, rows: int) -> int:
    """Per token: an RMSNorm's peak without autograd beyond its input (fp32 copy and product,
    the mean and ``rsqrt`` per row)."""
    return 8 * width + 8 * rows


def prefill_layer_peak(shape: ModelShape, index: int, batch: int, prompt: int, a: int) -> int:
    """Decoder layer ``index``'s peak during the rollout's prefill beyond its input, its own cache
    entry included.

    As :func:`nograd_layer_peak`, with the generation's differences: the attention always gets
    an explicit ``[b, 1, P, P]`` mask (left padding), so grouped-query attention repeats k and v to
    every head and SDPA holds the mask in the dtype; the cache update copies k and v (a
    concatenation) before the roped k and v are dropped.
    """
    h, f, q, kv, nh, nkv = (
        shape.embed_dim,
        shape.intermediate_dim,
        shape.q_dim,
        shape.kv_dim,
        shape.num_heads,
        shape.num_kv_heads,
    )
    own = 2 * a * kv  # the layer's keys and values in the cache
    repeated = 2 * a * q if 1 < nkv < nh else 0
    norm = _gen_norm(shape, h, 1)
    steps = [norm]
    if shape.qk_norm and shape.sandwich_norms:
        steps += [
            a * (h + q + 2 * kv) + _gen_norm(shape, q, nh),
            a * (h + q + 2 * kv) + _gen_norm(shape, kv, nkv),
        ]
    elif shape.qk_norm:
        steps += [
            a * (h + q) + _gen_norm(shape, q, nh),
            a * (h + q + kv) + _gen_norm(shape, kv, nkv),
        ]
    steps += [
        a * (h + q + 2 * kv),
        a * (h + 4 * q + 2 * kv),  # RoPE on q
        a * (h + 2 * q + 5 * kv),  # RoPE on k
        a * (h + q + 2 * kv) + own,  # the cache update's copies
        a * (h + 2 * q + prompt) + own + repeated + 4 * nh,  # SDPA
        a * (2 * h + 2 * q) + own,  # the output projection
    ]
    if shape.sandwich_norms:
        steps.append(a * h + own + norm)
    steps += [a * h + own + norm, a * (2 * h + 3 * f) + own, a * 3 * h + own]
    if shape.sandwich_norms:
        steps.append(2 * a * h + own + norm)
    return batch * prompt * max(steps)


def _stored(shape: ModelShape, index: int, length: int, prompt: int) -> int:
    """Positions layer ``index``'s cache storage holds once ``length`` positions were seen
    (transformers' ``DynamicCache``: a full layer keeps all; a sliding one keeps a view of its
    last concatenation: the prompt after the prefill, then at most its window)."""
    window = shape.sliding_window
    if shape.layer_kind(index) != SLIDING or window is None or length == prompt:
        return length
    return min(length, window)


def _cached_bytes(shape: ModelShape, unit: int, length: int, prompt: int) -> int:
    """Every layer's keys and values after ``length`` positions (``unit``: one position of one
    layer's keys)."""
    return sum(2 * unit * _stored(shape, i, length, prompt) for i in range(shape.num_layers))


def _decoding_cache_peak(shape: ModelShape, unit: int, length: int, prompt: int) -> int:
    """The caches' peak while a decoding step brings them from ``length - 1`` to ``length``
    positions (the values' concatenation of the layer where it is largest)."""
    layers = shape.num_layers
    worst = 0
    for j in range(layers):
        old = [_stored(shape, i, length - 1, prompt) for i in range(layers)]
        now = [_stored(shape, i, length, prompt) for i in range(layers)]
        held = sum(now[:j]) * 2 + now[j] * 2 + old[j] + sum(old[j + 1 :]) * 2
        worst = max(worst, unit * held)
    return worst


def prefill_held(shape: ModelShape, batch: int, prompt: int, a: int) -> int:
    """What the prefill holds while its layers run: the embedding output, one boolean mask per
    layer kind and the RoPE tables of the ``P`` positions."""
    n = batch * prompt
    kinds = {shape.layer_kind(i) for i in range(shape.num_layers)}
    rope = shape.rope_types * 2 * a * n * shape.head_dim
    return a * n * shape.embed_dim + len(kinds) * n * prompt + rope


def generation_boundaries(
    shape: ModelShape, batch: int, prompt: int, new: int, a: int, *, logits: int
) -> dict[str, dict[str, int]]:
    """The rollout's tensors between decoder layers (where FSDP2 gathers the next layer while
    the last one's gathered buffer is still referenced), as :func:`generation_steps`' components:
    ``embedding`` before the first forward's embedding, ``first`` before its first layer,
    ``between`` before its last layer (the earlier layers' caches filled), ``decoding`` before
    the last layer of the last decoding step (the caches at their longest, the last logits
    referenced)."""
    h, hd = shape.embed_dim, shape.head_dim
    layers = shape.num_layers
    unit = a * batch * shape.kv_dim
    total = prompt + new
    kinds = {shape.layer_kind(i) for i in range(layers)}
    buffers = 16 * batch * total
    held = prefill_held(shape, batch, prompt, a)
    last = layers - 1
    out = {
        "embedding": {"buffers": buffers},
        "first": {"activations": held, "buffers": buffers},
        "between": {
            "kv_cache": 2 * unit * prompt * last,
            "activations": held + a * batch * prompt * h,
            "buffers": buffers,
        },
    }
    if new > 1:
        step = 2 * a * batch * h + shape.rope_types * 2 * a * batch * hd
        out["decoding"] = {
            "kv_cache": _cached_bytes(shape, unit, total - 1, prompt),
            "activations": step + len(kinds) * batch * (total - 1),
            "sampling": logits,
            "buffers": buffers,
        }
    return out


def generation_steps(
    shape: ModelShape,
    batch: int,
    prompt: int,
    new: int,
    a: int,
    *,
    logits: int,
    upcast: int,
    sampler: int,
) -> list[dict[str, int]]:
    """The candidate peaks of :func:`kd.rollouts.sampling.rollout` on a transformers model, as
    components (``kv_cache``, ``activations``, ``sampling``, ``buffers``) beyond the rollout's
    own tensors.

    transformers' ``DynamicCache`` grows by concatenation: a layer's keys and values are copied
    into a tensor one position longer at every step (old and new alive together while the
    layer runs), up to ``P + N - 1`` positions (the last token is not run); each forward also
    holds its embedding output, one boolean mask per layer kind and the RoPE tables of its
    positions. The candidates: the prefill at each layer (the earlier layers' caches at ``P``
    positions), the first token's sampling (with the prefill's output), the first decoding step
    (the first logits referenced), the last decoding step (the caches at their longest), and
    the last token's sampling.

    Args:
        shape: a transformers decoder.
        batch: prompts b.
        prompt: prompt width P.
        new: tokens sampled N.
        a: dtype bytes.
        logits: the fp32 next-token logits ``[b, V]``.
        upcast: the logits in the dtype and in fp32 (their computation).
        sampler: the sampling's peak (logits and sampler buffers).
    """
    h, q, kv, hd = shape.embed_dim, shape.q_dim, shape.kv_dim, shape.head_dim
    layers = shape.num_layers
    unit = a * batch * kv  # one position of one layer's keys (or values)
    n = batch * prompt
    kinds = {shape.layer_kind(i) for i in range(layers)}
    total = prompt + new
    buffers = 16 * batch * total  # the int64 padding mask and positions
    hidden = a * n * h
    fixed = prefill_held(shape, batch, prompt, a)
    steps = []
    for j in range(layers):
        cache = 2 * unit * prompt * j
        act = fixed + (hidden if j else 0) + prefill_layer_peak(shape, j, batch, prompt, a)
        steps.append({"kv_cache": cache, "activations": act, "buffers": buffers})

    steps.append(
        {
            "kv_cache": _cached_bytes(shape, unit, prompt, prompt),
            "activations": hidden,
            "sampling": sampler,
            "buffers": buffers,
        }
    )

    step = a * batch * (2 * h + q + 2 * kv) + shape.rope_types * 2 * a * batch * hd
    if new > 1:
        steps.append(
            {
                "kv_cache": _decoding_cache_peak(shape, unit, prompt + 1, prompt),
                "activations": hidden + step + len(kinds) * batch * (prompt + 1),
                "sampling": logits,
                "buffers": buffers,
            }
        )
        steps.append(
            {
                "kv_cache": _decoding_cache_peak(shape, unit, total - 1, prompt),
                "activations": a * batch * h + step + len(kinds) * batch * (total - 1),
                "sampling": logits,
                "buffers": buffers,
            }
        )
    last = _cached_bytes(shape, unit, total - 1, prompt)
    steps.append(
        {
            "kv_cache": last,
            "activations": a * batch * h,
            "sampling": max(sampler, logits + upcast) if new > 1 else sampler,
            "buffers": buffers,
        }
    )
    return steps
