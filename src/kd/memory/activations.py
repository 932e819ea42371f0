"""Activation terms of the memory estimate: what a decoder layer saves for backward, and the
transients of a forward without autograd (the teacher; a checkpointed student layer; evaluation).

Derived from the tensors torchtune's modules save or allocate (transformers' layers, for ``kd.hf``
models: :mod:`kd.memory.hf_terms`) and checked against MemTracker traces
(``docs/memory_accuracy.md``). Pure arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kd.memory import hf_terms
from kd.memory.knobs import TrainKnobs
from kd.memory.shapes import ModelShape, trainable_parts


def layer_saved_bytes(
    shape: ModelShape, batch: int, seq: int, dtype_bytes: int, input_grad: bool
) -> int:
    """Bytes one decoder layer saves for backward (eager, no checkpointing).

    Derived from torchtune's modules (torchtune 0.6.1's attention, MLP and norm modules, checked against torch's MemTracker):
    RMSNorm keeps fp32 ``x`` (4h) and ``rsqrt`` (4) when its input needs a gradient, plus the fp32
    normalised ``x`` (4h) when its scale trains; linears keep their input only when their weight (or
    LoRA ``lora_a``) trains; SDPA keeps q, k, v, out (k/v at full head count after GQA's
    expand+flatten copy, except MQA) and an fp32 logsumexp; SwiGLU keeps w1 out, silu out, w3 out and
    their product (the last only for a trainable w2). LoRA adds ``lora_a``'s output (r) per adapter.
    Qwen2's RoPE keeps dtype copies of cos and sin per sequence position for q and for k.

    Args:
        shape: the decoder.
        batch: micro-batch size b.
        seq: sequence length s.
        dtype_bytes: activation dtype bytes a.
        input_grad: whether the layer's input requires grad (False only for LoRA's first layer).

    Returns:
        Bytes for ``b * s`` tokens.
    """
    a = dtype_bytes
    h, f, nh = shape.embed_dim, shape.intermediate_dim, shape.num_heads
    q_dim = shape.q_dim
    k_saved = shape.kv_dim if (shape.num_kv_heads == 1 and nh > 1) else q_dim
    tr = trainable_parts(shape)
    norm_tr = tr.full
    r = shape.lora.rank if shape.lora else 0
    dropout = bool(shape.lora and shape.lora.dropout > 0)
    dims = shape.linear_dims()
    per_tok = 0
    per_seq = 0

    def lora_extra(name: str) -> int:
        if name in tr.lora_linears:
            extra = a * r
            if dropout:
                extra += dims[name][0] * (a + 1)  # dropout output + bool mask
            return extra
        return 0

    # attention block
    x_normed_grad = input_grad or norm_tr
    per_tok += (4 * h + 4 if input_grad else 0) + (4 * h if norm_tr else 0)
    if any(tr.linear(n) for n in ("q_proj", "k_proj", "v_proj")):
        per_tok += a * h
    per_tok += sum(lora_extra(n) for n in ("q_proj", "k_proj", "v_proj"))
    q_grad = x_normed_grad or tr.linear("q_proj")
    k_grad = x_normed_grad or tr.linear("k_proj")
    v_grad = x_normed_grad or tr.linear("v_proj")
    sdpa = q_grad or k_grad or v_grad
    if sdpa:
        per_tok += a * (2 * q_dim + 2 * k_saved) + 4 * nh
        if shape.family == "qwen2":
            per_seq += (2 * a * shape.head_dim) * (int(q_grad) + int(k_grad))
    per_tok += lora_extra("output_proj")
    attn_grad = sdpa or tr.linear("output_proj")
    mid_grad = input_grad or attn_grad
    # MLP block
    per_tok += (4 * h + 4 if mid_grad else 0) + (4 * h if norm_tr else 0)
    mlp_in_grad = mid_grad or norm_tr
    if tr.linear("w1") or tr.linear("w3"):
        per_tok += a * h
    per_tok += sum(lora_extra(n) for n in ("w1", "w3", "w2"))
    w1_grad = mlp_in_grad or tr.linear("w1")
    w3_grad = mlp_in_grad or tr.linear("w3")
    if w1_grad:
        per_tok += a * f  # silu input
    if w3_grad:
        per_tok += a * f  # silu output, kept by the product for w3's gradient
    if w1_grad:
        per_tok += a * f  # w3 output, kept by the product for silu's gradient
    if tr.linear("w2"):
        per_tok += a * f  # product = w2 input
    return batch * seq * per_tok + seq * per_seq


def student_layer_saved(shape: ModelShape, k: TrainKnobs) -> list[int]:
    """Saved bytes per decoder layer (index 0 first) after the forward.

    transformers' shared RoPE tables (and, with checkpointing, a sliding layer's mask) are counted
    with the layer whose backward frees them.
    """
    b, s, a = k.batch_size, k.seq_len, k.dtype_bytes
    first_input_grad = shape.lora is None  # a trainable embedding makes layer 0's input need grad
    out = []
    for i in range(shape.num_layers):
        if k.activation_checkpointing:
            out.append(a * b * s * shape.embed_dim)  # the checkpointed layer's input
        elif shape.hf:
            out.append(
                hf_terms.layer_saved_bytes(shape, i, b, s, a, input_grad=i > 0 or first_input_grad)
            )
        else:
            out.append(layer_saved_bytes(shape, b, s, a, input_grad=(i > 0 or first_input_grad)))
    if shape.hf:
        for i, extra in hf_terms.shared_saved_bytes(
            shape, b, s, a, checkpointed=k.activation_checkpointing
        ).items():
            out[i] += extra
    return out


def head_saved_bytes(shape: ModelShape, k: TrainKnobs) -> int:
    """Final RMSNorm's saved tensors (its input always needs grad after the first layer)."""
    if shape.hf:
        return hf_terms.head_saved_bytes(shape, k.tokens, k.dtype_bytes)
    h = shape.embed_dim
    return k.tokens * (4 * h + 4 + (4 * h if shape.lora is None else 0))


# ---- transients (bytes alive only for a moment), measured with MemTracker traces -----------------
def mlp_nograd_bytes(shape: ModelShape, a: int) -> int:
    """Per token: a no-grad (or checkpointed) SwiGLU layer's peak besides its input.

    The residual after attention, the normed input and a spare residual-sized buffer (3 h), plus
    silu(w1 x), w3 x and their product (3 f); LoRA linears add the adapter output (f + r).
    """
    h, f = shape.embed_dim, shape.intermediate_dim
    extra = a * (f + shape.lora.rank) if shape.lora is not None and shape.lora.mlp else 0
    return a * (3 * h + 3 * f) + extra


def attn_nograd_bytes(shape: ModelShape, a: int) -> int:
    """Per token: a no-grad attention block's peak besides its input (during RoPE / SDPA).

    Residual and normed input (2 h), q, k, v and the RoPE temporaries of q (Qwen2: x*cos, the
    rotated copy and its product; Llama: an fp32 upcast and the fp32 stack).
    """
    h, q, kv = shape.embed_dim, shape.q_dim, shape.kv_dim
    if shape.family == "qwen2":
        return a * (2 * h + 4 * q + 2 * kv)
    return a * (2 * h + q + 2 * kv) + 4 * 3 * q


def layer_nograd_peak(shape: ModelShape, batch: int, seq: int, a: int) -> int:
    """Bytes of a no-grad decoder layer's peak besides its input (teacher; checkpointed forward)."""
    per_seq = 2 * a * shape.head_dim * seq if shape.family == "qwen2" else 0  # cos/sin copies
    tokens = batch * seq
    return max(tokens * mlp_nograd_bytes(shape, a), tokens * attn_nograd_bytes(shape, a) + per_seq)


def nograd_forward_bytes(shape: ModelShape, batch: int, seq: int, a: int) -> int:
    """A whole no-grad forward's peak (the teacher; the student during evaluation): the hidden
    states between layers plus one layer's transients (transformers: plus the embedding output,
    positions, masks and RoPE tables held for the whole forward)."""
    hidden = a * batch * seq * shape.embed_dim
    if shape.hf:
        return (
            hf_terms.forward_fixed_bytes(shape, batch, seq, a, grad=False)
            + hf_terms.nograd_layer_peak(shape, batch, seq, a)
            + hidden
        )
    return layer_nograd_peak(shape, batch, seq, a) + hidden


@dataclass(frozen=True)
class StudentActivations:
    """What the student's forward saves for backward.

    Attributes:
        layers: saved bytes per decoder layer, index 0 first (:func:`student_layer_saved`).
        head: the final norm's saved bytes (:func:`head_saved_bytes`).
    """

    layers: tuple[int, ...]
    head: int

    @property
    def total(self) -> int:
        """Every saved tensor: the layers' and the final norm's."""
        return sum(self.layers) + self.head


def student_activations(shape: ModelShape, k: TrainKnobs) -> StudentActivations:
    """The student's saved tensors after its forward, per layer and at the head."""
    return StudentActivations(tuple(student_layer_saved(shape, k)), head_saved_bytes(shape, k))


def student_forward_bytes(shape: ModelShape, k: TrainKnobs, acts: StudentActivations) -> int:
    """The student forward's peak (with autograd) beyond the resident bytes.

    Eager: every saved activation, the final hidden states and the final norm's temporaries.
    With activation checkpointing only the layers' inputs are saved, and the peak is inside one
    layer's no-grad forward or at the final norm (transformers: plus the embedding output,
    positions, masks and RoPE tables held for the whole forward).
    """
    a, b, s, n_tok = k.dtype_bytes, k.batch_size, k.seq_len, k.tokens
    h = shape.embed_dim
    layers = sum(acts.layers)
    hid_s = a * n_tok * h
    if shape.hf:
        fixed = hf_terms.forward_fixed_bytes(shape, b, s, a, grad=True)
        head_peak = acts.total + hid_s + hf_terms.final_norm_peak_bytes(shape, n_tok, a)
        if not k.activation_checkpointing:
            return fixed + head_peak
        # the embedding output is layer 0's (checkpointed) input, counted in its activations
        fixed -= hid_s
        inner = layers + hf_terms.nograd_layer_peak(shape, b, s, a)
        return fixed + max(inner, head_peak - hid_s)
    if k.activation_checkpointing:
        return layers + layer_nograd_peak(shape, b, s, a)
    full = shape.lora is None
    return acts.total + hid_s + (6 if full else 8) * n_tok * h * a // 2  # final norm's fp32 temps
