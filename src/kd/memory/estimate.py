"""Closed-form peak memory of one KD training step: pure arithmetic on shapes and knobs.

What one optimizer step of ``kd.train`` allocates on one device, phase by phase:

* **forward**: the student forward (saved activations), then the teacher forward under ``no_grad``
  (its per-layer temporaries), then the loss forward. The fused loss computes, chunk by chunk, both
  models' logits, CE + divergence and the gradient, so it holds ``grad_hidden [N, Ds]`` and an fp32
  ``grad_weight [Vs, Ds]`` plus one chunk's ``[C, V]`` fp32 temporaries; the unfused path holds full
  fp32 logits of both models and the losses' saved log-probs. Without a teacher model the same
  chunked head computes CE alone (``fused_linear_ce_loss``) or CE + KD against stored teacher
  top-k log-probs (``fused_linear_topk_kd_loss``, :attr:`TrainKnobs.stored_topk`; the batch's
  ``[B, S, k]`` ids and log-probs are resident instead of the teacher's weights and forward).
* **backward**: starts with every saved activation and walks the layers backwards, freeing a layer's
  saved tensors while allocating its parameter gradients (with activation checkpointing, a layer's
  activations are first recomputed).
* **optimizer step**: weights + gradients + states (+ foreach temporaries).
* **evaluation** (only with ``validation``): between steps (gradients freed, optimizer states
  kept), one validation batch through ``kd.evaluate.token_sums``: both models' no-grad forward, the
  labelled hidden states of both, then one chunk of both models' fp32 logits and log-probs.

Every byte term below is derived from the tensors torchtune's modules and ``kd.losses`` save or
allocate (transformers' layers, for ``kd.hf`` models: :mod:`kd.memory.hf_terms`) (see ``docs/memory_accuracy.md`` for the derivation and the check against MemTracker
traces). Bytes are per device; FSDP2 terms divide the sharded pieces by the world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kd.memory import hf_terms
from kd.memory.shapes import NF4_BYTES_PER_PARAM, ModelShape, trainable_parts

GIB = 1 << 30

# Runtime reserve the tracer cannot see, per device: CUDA context + cuBLAS/cuDNN workspaces
# (~0.5-0.7 GiB on H100 with CUDA 12 lazy loading) and caching-allocator rounding/fragmentation
# (2 MiB rounding of large blocks, partly used segments). Documented in docs/memory_accuracy.md;
# override with ``memory.reserve_gib``.
RESERVE_FIXED_BYTES = 1 * GIB
RESERVE_FRACTION = 0.03  # of the allocated peak: allocator rounding and fragmentation
RESERVE_NCCL_BYTES = GIB // 2  # extra per rank when distributed (NCCL channel buffers)

# torchao AdamW8bit: uint8 codes + one fp32 scale per 256-value block, for params >= 4096 values.
ADAMW8BIT_BYTES_PER_STATE = 1.0 + 4.0 / 256


@dataclass(frozen=True)
class OptimizerSpec:
    """What the optimizer keeps per trainable parameter.

    Attributes:
        kind: ``adamw`` (torch Adam/AdamW: 2 states in the parameter dtype), ``adamw8bit``
            (torchao), ``sgd`` (momentum buffer or none), ``other`` (treated like adamw).
        fused: torch ``fused=True`` (one kernel, no per-step temporaries).
        foreach: torch ``foreach``; None = torch's default (foreach on CUDA).
        momentum: SGD momentum (0 = no state).
        in_cpu: states live on the CPU (torchao CPUOffloadOptimizer, ``optimizer_in_cpu``).
    """

    kind: str = "adamw"
    fused: bool = False
    foreach: bool | None = None
    momentum: float = 0.0
    in_cpu: bool = False


@dataclass(frozen=True)
class GenerationKnobs:
    """On-policy sampling at the start of each optimizer step (``on_policy:``,
    :func:`kd.on_policy.rollout`).

    The micro-batch's prompts sample together: ``TrainKnobs.batch_size`` rows, left-padded to
    ``seq_len - new_tokens`` tokens at most (``tokenizer.max_seq_len`` leaves room for the
    completion), so the KV cache spans ``TrainKnobs.seq_len`` positions.

    Attributes:
        new_tokens: tokens sampled per prompt at most (``on_policy.max_new_tokens``).
        models: the models that may sample: ``student`` (``lmbda`` > 0) and/or ``teacher``
            (``seq_kd``); the plan takes the larger.
        temperature: sampling temperature (0 = greedy: no sampler buffers beyond the logits).
        top_p: nucleus mass (< 1 sorts the logits).
    """

    new_tokens: int
    models: tuple[str, ...] = ("student",)
    temperature: float = 0.9
    top_p: float = 1.0


@dataclass(frozen=True)
class TrainKnobs:
    """The config knobs that change memory.

    Attributes:
        batch_size: micro-batch per device.
        seq_len: tokens per sequence (the plan's worst case, ``tokenizer.max_seq_len``).
        grad_accum: micro-batches per optimizer step (>1 keeps gradients resident in forward).
        dtype_bytes: parameter/activation dtype (2 for bf16, 4 for fp32).
        activation_checkpointing: recompute each decoder layer in backward.
        optimizer: optimizer state layout.
        fused_loss: kd's fused linear+loss (no full logits).
        loss_chunk_size: tokens per fused-loss chunk.
        divergence: KD divergence name.
        temperature: KD softmax temperature (T != 1 adds a tempered copy of the logits).
        world_size: FSDP2 ranks (1 = single device, no sharding).
        fsdp_cpu_offload: FSDP2 CPUOffloadPolicy (sharded params, grads, states on CPU).
        reshard_after_forward: FSDP2 frees unsharded layers after forward.
        reduce_dtype_bytes: FSDP2 gradient reduce-scatter dtype (4 = fp32).
        reserve_bytes: runtime reserve override (None = documented default).
        select_labelled: the real fused path copies labelled rows of both hidden states; the
            fake-tensor trace keeps all rows instead (False reproduces the trace).
        teacher_bytes_per_param: a quantized teacher's bytes per parameter (the fit search's
            suggestions; no config key sets it); None: the dtype's.
        eval_batch: sequences per validation batch per device (``validation.batch_size``); None:
            no validation, so no evaluation phase.
        stored_topk: k of stored teacher logits (``teacher_logits.k``): the run trains from them,
            with no teacher model (``estimate``'s teacher is None); None: an online teacher or none.
        generation: on-policy sampling (``on_policy:``); None: no generation phase.
    """

    batch_size: int
    seq_len: int
    grad_accum: int = 1
    dtype_bytes: int = 2
    activation_checkpointing: bool = False
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    fused_loss: bool = True
    loss_chunk_size: int = 1024
    divergence: str = "forward_kl"
    temperature: float = 1.0
    world_size: int = 1
    fsdp_cpu_offload: bool = False
    reshard_after_forward: bool = True
    reduce_dtype_bytes: int = 4
    reserve_bytes: int | None = None
    select_labelled: bool = True
    teacher_bytes_per_param: float | None = None
    eval_batch: int | None = None
    stored_topk: int | None = None
    generation: GenerationKnobs | None = None

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


# The phases of every training step; on-policy sampling precedes them (``on_policy``), the
# evaluation phase follows them when validation is on.
PHASES = ("forward", "backward", "optimizer_step")
GEN_PHASE = "generation"
EVAL_PHASE = "evaluation"

# Component names, in table order.
COMPONENTS = (
    "teacher_weights",
    "student_weights",
    "lora_adapters",
    "buffers",
    "gradients",
    "optimizer_states",
    "optimizer_temp",
    "activations",
    "teacher_forward",
    "stored_logits",
    "logits_loss",
    "backward_temp",
    "kv_cache",
    "sampling",
    "fsdp_in_flight",
    "runtime_reserve",
)


@dataclass
class Estimate:
    """Per-phase component bytes and the peak.

    Attributes:
        phases: phase -> component -> bytes (each phase sums to its total).
        peak_phase: the phase with the largest total.
        student_params: exact student parameter count (base + adapters).
        trainable_params: student parameters that train.
        teacher_params: exact teacher parameter count (0 without a teacher).
        notes: one-line remarks (assumptions the user should know).
    """

    phases: dict[str, dict[str, int]]
    peak_phase: str
    student_params: int
    trainable_params: int
    teacher_params: int
    notes: list[str] = field(default_factory=list)
    subphases: dict[str, int] = field(default_factory=dict)

    @property
    def phase_names(self) -> tuple[str, ...]:
        """The phases estimated, in order: ``generation`` with ``on_policy``, :data:`PHASES`, then
        ``evaluation`` with validation."""
        return tuple(p for p in (GEN_PHASE, *PHASES, EVAL_PHASE) if p in self.phases)

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_bytes(self) -> int:
        return self.total(self.peak_phase)

    @property
    def allocated_peak_bytes(self) -> int:
        """Peak without the runtime reserve (what a MemTracker trace measures)."""
        return self.peak_bytes - self.phases[self.peak_phase].get("runtime_reserve", 0)

    def allocated(self, phase: str) -> int:
        return self.total(phase) - self.phases[phase].get("runtime_reserve", 0)


# --------------------------------------------------------------------------- activations
def layer_saved_bytes(
    shape: ModelShape, batch: int, seq: int, dtype_bytes: int, input_grad: bool
) -> int:
    """Bytes one decoder layer saves for backward (eager, no checkpointing).

    Derived from torchtune's modules (memory_anchors.md section 2.2, checked against MemTracker):
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


def _student_activations(shape: ModelShape, k: TrainKnobs) -> list[int]:
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


def _head_saved_bytes(shape: ModelShape, k: TrainKnobs) -> int:
    """Final RMSNorm's saved tensors (its input always needs grad after the first layer)."""
    if shape.hf:
        return hf_terms.head_saved_bytes(shape, k.tokens, k.dtype_bytes)
    h = shape.embed_dim
    return k.tokens * (4 * h + 4 + (4 * h if shape.lora is None else 0))


# ---- transients (bytes alive only for a moment), measured with MemTracker traces -----------------
def _mlp_nograd_bytes(shape: ModelShape, a: int) -> int:
    """Per token: a no-grad (or checkpointed) SwiGLU layer's peak besides its input.

    The residual after attention, the normed input and a spare residual-sized buffer (3 h), plus
    silu(w1 x), w3 x and their product (3 f); LoRA linears add the adapter output (f + r).
    """
    h, f = shape.embed_dim, shape.intermediate_dim
    extra = a * (f + shape.lora.rank) if shape.lora is not None and shape.lora.mlp else 0
    return a * (3 * h + 3 * f) + extra


def _attn_nograd_bytes(shape: ModelShape, a: int) -> int:
    """Per token: a no-grad attention block's peak besides its input (during RoPE / SDPA).

    Residual and normed input (2 h), q, k, v and the RoPE temporaries of q (Qwen2: x*cos, the
    rotated copy and its product; Llama: an fp32 upcast and the fp32 stack).
    """
    h, q, kv = shape.embed_dim, shape.q_dim, shape.kv_dim
    if shape.family == "qwen2":
        return a * (2 * h + 4 * q + 2 * kv)
    return a * (2 * h + q + 2 * kv) + 4 * 3 * q


def _layer_nograd_peak(shape: ModelShape, batch: int, seq: int, a: int) -> int:
    """Bytes of a no-grad decoder layer's peak besides its input (teacher; checkpointed forward)."""
    per_seq = 2 * a * shape.head_dim * seq if shape.family == "qwen2" else 0  # cos/sin copies
    tokens = batch * seq
    return max(
        tokens * _mlp_nograd_bytes(shape, a), tokens * _attn_nograd_bytes(shape, a) + per_seq
    )


def _nograd_forward_bytes(shape: ModelShape, batch: int, seq: int, a: int) -> int:
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
    return _layer_nograd_peak(shape, batch, seq, a) + hidden


# Backward of the final RMSNorm right after the loss: fp32 gradient temporaries of [N, h]
# (measured 14 h per token with a trainable scale, 18 h with a frozen one).
_HEAD_BWD_FULL = 14
_HEAD_BWD_FROZEN = 18
# Gradient temporaries at the end of one decoder layer's backward, per token (measured: 2.5 h).
_LAYER_BWD_H = 2.5


# --------------------------------------------------------------------------- loss
# kd.losses.fused_linear_kd_loss, per chunk of n rows: the student's fp32 logits (4 Vs) plus, at the
# chunk's peak (the teacher's log-softmax), its bf16 logits, fp32 upcast, log-softmax and clamp
# (12 V); the other divergences keep more fp32 [n, V] buffers alive in their closed-form
# gradient (jsd: log m; tvd: q and |q - p|; skew: log m and the mixture). Per-row vectors: 28 B.
FUSED_CHUNK_BYTES: dict[str, float] = {
    "forward_kl": 12.0,
    "reverse_kl": 12.0,
    "symmetric_kl": 12.0,
    "jsd": 20.0,
    "tvd": 16.0,
    "skew_forward_kl": 24.0,
    "skew_reverse_kl": 20.0,
}
_FUSED_ROW_BYTES = 28
_FUSED_FIXED_BYTES = 664


def _fused_loss_bytes(student: ModelShape, teacher: ModelShape, k: TrainKnobs) -> tuple[int, int]:
    """(forward peak, saved for backward) of kd.losses.fused_linear_kd_loss beyond its inputs.

    Holds ``grad_hidden`` [N, Ds] in the activation dtype, ``grad_weight`` [Vs, Ds] in fp32 while
    accumulating (only when the output weight trains), and per chunk of n = min(C, N) rows the
    chunk temporaries. At the end ``grad_weight`` is cast to the weight dtype (both copies alive).
    On real tensors the labelled rows of both hidden states are gathered first (copies).
    """
    n_tok = k.tokens
    a = k.dtype_bytes
    ds, vs = student.embed_dim, student.vocab_size
    w_trains = student.lora is None
    grad_h = a * n_tok * ds
    grad_w32 = 4 * vs * ds if w_trains else 0
    grad_w = a * vs * ds if w_trains else 0
    n = min(k.loss_chunk_size, n_tok)
    vocab = min(vs, teacher.vocab_size)
    coef = FUSED_CHUNK_BYTES.get(k.divergence, 12.0)
    chunk = int(4 * n * vs + coef * n * vocab) + _FUSED_ROW_BYTES * n + _FUSED_FIXED_BYTES
    copies = a * n_tok * (ds + teacher.embed_dim) if k.select_labelled else 0
    cast = grad_w32 + grad_w if a != 4 else grad_w32
    peak = copies + grad_h + max(grad_w32 + chunk, cast)
    return peak, grad_h + grad_w


# kd.losses' chunked head without a teacher model (_FusedLinearTopK), per chunk of n rows, fp32
# [n, V] buffers. CE alone (fused_linear_ce_loss): the logits and logsumexp's shifted copy (8 V; the
# bf16 logits and their fp32 upcast are 6 V before that). With stored top-k
# (fused_linear_topk_kd_loss), in the top-k gradient: the logits turned softmax gradient, the
# student log-probs turned tail-only and their exp q (12 V); per top-k entry the fp32 teacher
# log-probs and their clamp, the student's gathered log-probs, the categories the divergence
# compares and their gradients (_TOPK_K_BYTES). Measured with MemTracker.
_CE_CHUNK_V = 8
_TOPK_CHUNK_V = 12
_TOPK_K_BYTES = 40
# The stored top-k a micro-batch carries on the device, per token per entry: int64 ids and float16
# log-probs (TeacherLogitsReader.batch, moved to the device by the recipe).
STORED_TOPK_BYTES = 8 + 2


def _chunked_loss_bytes(student: ModelShape, k: TrainKnobs) -> tuple[int, int]:
    """(forward peak, saved for backward) of the chunked head without a teacher model
    (``kd.losses.fused_linear_ce_loss``, or ``fused_linear_topk_kd_loss`` with stored top-k)
    beyond its inputs.

    Holds ``grad_hidden`` and the fp32 ``grad_weight`` like :func:`_fused_loss_bytes`, plus one
    chunk's temporaries. On real tensors the labelled rows of the hidden states (and of the stored
    ids and log-probs) are gathered first (copies).
    """
    n_tok = k.tokens
    a = k.dtype_bytes
    ds, vs = student.embed_dim, student.vocab_size
    w_trains = student.lora is None
    grad_h = a * n_tok * ds
    grad_w32 = 4 * vs * ds if w_trains else 0
    grad_w = a * vs * ds if w_trains else 0
    n = min(k.loss_chunk_size, n_tok)
    topk = k.stored_topk
    if topk is None:
        chunk = _CE_CHUNK_V * n * vs
    else:
        chunk = _TOPK_CHUNK_V * n * vs + _TOPK_K_BYTES * n * topk
    chunk += _FUSED_ROW_BYTES * n + _FUSED_FIXED_BYTES
    copies = 0
    if k.select_labelled:
        copies = a * n_tok * ds + (STORED_TOPK_BYTES * topk * n_tok if topk else 0)
    cast = grad_w32 + grad_w if a != 4 else grad_w32
    peak = copies + grad_h + max(grad_w32 + chunk, cast)
    return peak, grad_h + grad_w


# The logits path (kd.losses.ce_loss + kd_loss on fp32 logits of both models), bytes per token per
# vocab entry, by divergence: (forward peak, kept for backward + the backward start's gradient
# temporaries). forward_kl: both fp32 logits (8), CE log-probs (4), kd_loss's log-probs, clamp
# copies, teacher probabilities and product (24); 12 are kept for backward. The other divergences
# keep more [N, V] fp32 intermediates (log m, q, |q - p|). Measured with MemTracker; T != 1
# divides in place of the upcast copy, so the temperature adds nothing.
_UNFUSED: dict[str, tuple[int, int]] = {
    "forward_kl": (36, 17),
    "reverse_kl": (36, 24),
    "symmetric_kl": (40, 28),
    "jsd": (52, 40),
    "tvd": (36, 24),
    "skew_forward_kl": (48, 36),
    "skew_reverse_kl": (48, 40),
}
_UNFUSED_SAVED = 12  # of the second number: CE and KD log-probs, teacher probabilities


def _unfused_loss_bytes(
    student: ModelShape, teacher: ModelShape | None, k: TrainKnobs
) -> tuple[int, int, int]:
    """(forward peak, saved for backward, backward-start temporaries) of the logits path."""
    n_tok = k.tokens
    vs = student.vocab_size
    if teacher is None:
        # CE only: fp32 logits + log-probs, then their gradients
        return 8 * n_tok * vs, 4 * n_tok * vs, 8 * n_tok * vs
    vocab = min(vs, teacher.vocab_size)
    peak, start = _UNFUSED.get(k.divergence, _UNFUSED["forward_kl"])
    extra = 4 * n_tok * (vs - vocab + teacher.vocab_size - vocab)
    return (
        peak * n_tok * vocab + extra,
        _UNFUSED_SAVED * n_tok * vocab,
        (start - _UNFUSED_SAVED) * n_tok * vocab,
    )


# kd.evaluate.token_sums, per chunk of n labelled rows: fp32 [n, V] buffers. The student's logits
# and cross-entropy's log-softmax; with a teacher, both models' logits plus, at the teacher's
# log-softmax, the student's log-probs, the output and its clamped copy (and the tempered input when
# T != 1); then, the logits freed, both log-probs and the divergence's temporaries: exp, difference
# and product (jsd and the skews also keep the mixture's log).
_EVAL_DIVERGENCE_BUFFERS: dict[str, int] = {"jsd": 4, "skew_forward_kl": 4, "skew_reverse_kl": 4}


def _eval_chunk_bytes(student: ModelShape, teacher: ModelShape | None, k: TrainKnobs) -> int:
    """Peak of one chunk of ``kd.evaluate.token_sums`` beyond the labelled hidden states."""
    assert k.eval_batch is not None
    n = min(k.loss_chunk_size, k.eval_batch * k.seq_len)
    vs = student.vocab_size
    ce = 8 * n * vs
    if teacher is None:
        return ce
    vt = teacher.vocab_size
    vocab = min(vs, vt)
    upcast = k.dtype_bytes if k.dtype_bytes != 4 else 0  # the dtype's logits before the fp32 copy
    tempered = 1 if k.temperature != 1.0 else 0
    steps = (
        ce,
        4 * n * vs + (upcast + 4) * n * vt,  # the teacher's logits
        4 * n * (vs + vt) + 4 * n * vocab * (3 + tempered),  # the teacher's log-softmax
        4 * n * vocab * (2 + _EVAL_DIVERGENCE_BUFFERS.get(k.divergence, 3)),
    )
    return max(steps)


def _evaluation(student: ModelShape, teacher: ModelShape | None, k: TrainKnobs) -> dict[str, int]:
    """The evaluation's transient components (``activations``, ``teacher_forward``,
    ``logits_loss``, ``buffers``) at its peak: one validation batch through ``token_sums``.

    The student's no-grad forward; the teacher's with the student's labelled hidden states kept;
    then both labelled hidden states and one chunk of logits. On real tensors the labelled rows are
    gathered (copies; their int64 index and targets); the fake-tensor trace keeps every row and a
    boolean mask instead. The batch's int64 tokens and shifted labels are held throughout.
    """
    assert k.eval_batch is not None
    b, s, a = k.eval_batch, k.seq_len, k.dtype_bytes
    n_tok = b * s
    hid_s = a * n_tok * student.embed_dim
    hid_t = a * n_tok * teacher.embed_dim if teacher is not None else 0
    copy = 2 if k.select_labelled else 1
    rows = 16 * n_tok + (16 * n_tok if k.select_labelled else n_tok)
    steps = [
        {"activations": max(_nograd_forward_bytes(student, b, s, a), copy * hid_s)},
        {
            "activations": hid_s,
            "teacher_forward": hid_t,
            "logits_loss": _eval_chunk_bytes(student, teacher, k),
        },
    ]
    if teacher is not None:
        steps.append(
            {
                "activations": hid_s,
                "teacher_forward": max(_nograd_forward_bytes(teacher, b, s, a), copy * hid_t),
            }
        )
    best = max(steps, key=lambda d: sum(d.values()))
    return dict(best, buffers=rows)


# --------------------------------------------------------------------------- generation
# kd.on_policy.rollout's own tensors besides the model's: the prompts (int64 ids, bool mask, int64
# lengths), the [b, P + N] bool mask, the [b, N] int64 completions and the per-row state; the
# stop ids (two: end of turn and end of text).
_STOP_IDS = 2


def _rope_bytes(shape: ModelShape, width: int, a: int) -> int:
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
    then on k with v alive (:func:`_rope_bytes`); SDPA, whose keys and values are the whole cache,
    copied to every head for grouped-query attention (a view for one kv head), with the boolean
    mask turned into an additive ``[b, 1, q_len, keys]`` mask in the dtype, the output and an fp32
    logsumexp; the output projection; the MLP norm with the attention output and residual; the
    MLP (:func:`_mlp_nograd_bytes`).
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
        n * (a * (h + q) + _rope_bytes(shape, q, a)),
        n * (a * (h + q + 2 * kv) + _rope_bytes(shape, kv, a)),
        n * a * (h + 2 * q) + 4 * batch * nh * q_len + kv_copies + mask,
        n * a * (2 * h + 2 * q) + kv_copies,
        n * (2 * a * h + norm),
        n * _mlp_nograd_bytes(shape, a),
    ]
    return max(steps)


def kv_cache_bytes(shape: ModelShape, batch: int, total: int, a: int) -> int:
    """torchtune's KV cache (``local_kv_cache``): per layer, keys and values
    ``[b, n_kv_heads, total, head_dim]`` in the dtype and the int64 positions ``[total]``."""
    return shape.num_layers * (2 * a * batch * shape.kv_dim * total + 8 * total)


def _upcast_bytes(vocab: int, batch: int, a: int) -> int:
    """The next-token logits ``[b, V]`` in the dtype and their fp32 copy (``logits_from_hidden``)."""
    return (a + 4) * batch * vocab if a != 4 else 4 * batch * vocab


def _sampler_bytes(vocab: int, batch: int, a: int, g: GenerationKnobs) -> int:
    """Peak of the next-token logits and ``kd.on_policy.sample_next`` on ``[b, V]``.

    The logits in the dtype and their fp32 copy; then the fp32 logits, the vocabulary-masked
    clone (the sampled vocabulary is taken to be smaller than the output, as a tokenizer's usually
    is) and: greedy, nothing more; with a temperature, the tempered copy and its softmax; with
    top-p, the tempered copy, the sorted values, the int64 order, their softmax, cumulative sum
    and its difference (32 B per entry at the cumulative sum).
    """
    n = batch * vocab
    upcast = _upcast_bytes(vocab, batch, a)
    if g.temperature == 0.0:
        return max(upcast, 8 * n)
    if g.top_p >= 1.0:
        return max(upcast, 12 * n)
    return max(upcast, 32 * n)


def _generation(shape: ModelShape, k: TrainKnobs) -> dict[str, int]:
    """The generation's transient components (``kv_cache``, ``activations``, ``sampling``,
    ``buffers``) at its peak when ``shape`` samples: :func:`kd.on_policy.rollout` on ``b`` prompts
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
    sampler = _sampler_bytes(vocab, b, a, g)
    if shape.hf:
        candidates = hf_terms.generation_steps(
            shape,
            b,
            prompt,
            new,
            a,
            logits=logits,
            upcast=_upcast_bytes(vocab, b, a),
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
        steps.append({"activations": a * b * h, "sampling": logits + _upcast_bytes(vocab, b, a)})
    best = max(steps, key=lambda d: sum(d.values()))
    return dict(best, kv_cache=cache, buffers=own)


def _generation_phase(
    student: ModelShape,
    teacher: ModelShape | None,
    k: TrainKnobs,
    resident: dict[str, int],
    buffers: int,
) -> dict[str, int]:
    """The generation phase: what stays resident at the start of a step (weights, optimizer
    states; no gradients: the last ``optimizer_step`` set them to None) plus the larger of the
    sampling models' rollouts (:func:`_generation`).

    The int64 tokens and labels of the micro-batches sampled before this one stay on the device
    (``grad_accum - 1`` of them, at most ``seq_len`` tokens each; at least one is counted). Under
    FSDP2 the sampling model's root unit stays gathered and two of its layers are in flight.
    """
    g = k.generation
    assert g is not None
    ws = max(1, k.world_size)
    batches = 16 * k.tokens * max(1, k.grad_accum - 1)
    best: dict[str, int] = {}
    for name in g.models:
        shape = student if name == "student" else teacher
        if shape is None:
            raise ValueError(f"estimate: generation by the {name}, but there is no {name}")
        per_param = k.dtype_bytes
        if name == "teacher" and k.teacher_bytes_per_param is not None:
            per_param = k.teacher_bytes_per_param
        in_flight = 0
        if ws > 1:
            root = shape.embedding_params() + shape.output_params() + shape.embed_dim
            in_flight = int(per_param * (2 * shape.largest_layer_params() + root))
        phase = dict(
            resident,
            gradients=0,
            stored_logits=0,
            fsdp_in_flight=in_flight,
            buffers=buffers + batches,
        )
        for comp, val in _generation(shape, k).items():
            phase[comp] = phase.get(comp, 0) + val
        if sum(phase.values()) > sum(best.values()):
            best = phase
    return best


# --------------------------------------------------------------------------- optimizer
def _state_bytes(trainable: int, largest: int, k: TrainKnobs) -> tuple[int, int]:
    """(states, step temporaries) on the device for ``trainable`` parameters."""
    opt, a = k.optimizer, k.dtype_bytes
    if opt.in_cpu:
        return 0, 0
    if opt.kind == "adamw8bit":
        return int(2 * ADAMW8BIT_BYTES_PER_STATE * trainable), 0
    if opt.kind == "sgd":
        return (a * trainable if opt.momentum else 0), 0
    states = 2 * a * trainable
    if opt.fused:
        temp = 0
    elif opt.foreach is False:
        temp = a * largest  # the for-loop step holds one parameter-sized denominator
    else:
        temp = a * trainable  # foreach: sqrt(exp_avg_sq) for every parameter at once
    return states, temp


# --------------------------------------------------------------------------- the estimate
def _trained_share(shape: ModelShape, linears: tuple[str, ...]) -> float:
    """The share of a layer's trainable parameters that belongs to ``linears``."""
    dims = shape.linear_dims()
    if shape.lora is None:
        total = shape.layer_base_params()
        part = sum(i * o for name, (i, o) in dims.items() if name in linears)
    else:
        total = shape.layer_lora_params()
        part = sum(
            shape.lora.rank * (i + o)
            for name, (i, o) in dims.items()
            if name in linears and shape.lora.adapted(name)
        )
    return part / total if total else 0.0


def _ceil_div(x: int, d: int) -> int:
    return -(-x // d)


def estimate(student: ModelShape, teacher: ModelShape | None, knobs: TrainKnobs) -> Estimate:
    """Per-phase bytes of one training step on one device.

    Args:
        student: the trainable decoder (LoRA when ``student.lora`` is set).
        teacher: the frozen decoder, or None.
        knobs: batch, sequence, precision, checkpointing, optimizer, loss and sharding knobs.

    Returns:
        The estimate; ``peak_bytes`` includes the runtime reserve.
    """
    k = knobs
    a = k.dtype_bytes
    ws = max(1, k.world_size)
    n_tok = k.tokens
    b, s = k.batch_size, k.seq_len
    h = student.embed_dim
    full = student.lora is None
    notes: list[str] = []

    # ---- weights, grads, states ----
    qbase = student.quantizable_params()
    student_w = int((student.base_params() - qbase) * a + qbase * NF4_BYTES_PER_PARAM)
    lora_w = a * student.lora_params()
    teacher_params = teacher.total_params() if teacher is not None else 0
    t_bytes = a if k.teacher_bytes_per_param is None else k.teacher_bytes_per_param
    teacher_w = int(t_bytes * teacher_params)
    trainable = student.total_params() if full else student.lora_params()
    largest = max(student.vocab_size * h, h * student.intermediate_dim)
    if not full:
        largest = student.lora.rank * max(
            student.vocab_size if student.lora.output else 0, student.intermediate_dim
        )
    grads = a * trainable
    states, opt_temp = _state_bytes(trainable, largest, k)
    buffers = student.buffer_bytes(a) + (teacher.buffer_bytes(a) if teacher else 0)
    layer_g = a * (student.layer_base_params() if full else student.layer_lora_params())
    out_g = a * student.vocab_size * h if full else 0  # output (tied: embedding) weight gradient
    in_flight_fwd = in_flight_bwd = 0
    if ws > 1:
        # FSDP2: parameters, gradients and states are sharded over the ranks (all on the CPU with
        # cpu_offload). In flight: the current + prefetched unsharded layer of whichever model runs,
        # the root unit (embedding, final norm, output) unsharded from forward to backward, and in
        # backward the current layer's unsharded gradient in the reduce dtype plus its shard.
        div = (lambda x: 0) if k.fsdp_cpu_offload else (lambda x: _ceil_div(x, ws))
        student_w, lora_w, teacher_w = div(student_w), div(lora_w), div(teacher_w)
        grads, states, opt_temp = div(grads), div(states), div(opt_temp)
        layer_g, out_g = div(layer_g), div(out_g)
        s_layer = a * student.largest_layer_params()
        t_layer = int(t_bytes * teacher.largest_layer_params()) if teacher else 0
        s_root = a * (student.embedding_params() + student.output_params() + h)
        t_root = (
            int(t_bytes * (teacher.embedding_params() + teacher.output_params())) if teacher else 0
        )
        in_flight_fwd = 2 * max(s_layer, t_layer) + s_root + t_root
        train_layer = student.largest_layer_params() if full else student.layer_lora_params()
        rs = int(k.reduce_dtype_bytes * train_layer * (1 + 1 / ws))
        in_flight_bwd = 2 * s_layer + s_root + rs
        notes.append(f"FSDP2 over {ws} ranks: per-rank numbers; weights, grads and states / {ws}")
    # head gradients present from the start of backward: the final norm's (the untied embedding's
    # gradient only appears at the very end)
    emb_g_late = 0 if (not full or student.tie_word_embeddings) else a * student.embedding_params()
    if ws > 1:
        emb_g_late = 0 if k.fsdp_cpu_offload else _ceil_div(emb_g_late, ws)
    head_g = max(grads - layer_g * student.num_layers - out_g - emb_g_late, 0)

    # ---- activations ----
    layer_saved = _student_activations(student, k)
    head_saved = _head_saved_bytes(student, k)
    acts = sum(layer_saved) + head_saved
    hid_s = a * n_tok * h
    hid_t = a * n_tok * teacher.embed_dim if teacher else 0
    small = 8 * n_tok * 2  # int64 tokens + labels

    # ---- loss ----
    stored = k.stored_topk is not None
    if stored and teacher is not None:
        raise ValueError("estimate: stored teacher logits (knobs.stored_topk) take no teacher")
    lora_output = student.lora is not None and student.lora.output
    # kd.train.compute_loss: the chunked head for a plain output projection when the loss is
    # fused, and always with stored top-k (which refuses a LoRA output projection)
    use_fused = (k.fused_loss or stored) and not lora_output
    if stored and lora_output:
        notes.append(
            "stored teacher logits need a plain output projection: set "
            "model.apply_lora_to_output=false"
        )
    if use_fused:
        if teacher is not None:
            loss_peak, loss_saved = _fused_loss_bytes(student, teacher, k)
        else:
            loss_peak, loss_saved = _chunked_loss_bytes(student, k)
        if student.hf:
            bwd_start = hf_terms.head_backward_bytes(student, n_tok, a)
        else:
            bwd_start = (_HEAD_BWD_FULL if full else _HEAD_BWD_FROZEN) * n_tok * h * a // 2
        out_g_held = out_g  # d(weight) from the loss is held until the layers are done
    else:
        loss_peak, loss_saved, bwd_start = _unfused_loss_bytes(student, teacher, k)
        if k.fused_loss and not stored:
            notes.append("LoRA on the output projection: the unfused logits path is used")
        if full or student.lora.output:
            loss_saved += hid_s  # the output projection keeps its input for its weight gradient
        out_g_held = 0

    grads_resident = grads if k.grad_accum > 1 else 0
    resident = {
        "teacher_weights": teacher_w,
        "student_weights": student_w,
        "lora_adapters": lora_w,
        "buffers": buffers + small,
        "stored_logits": STORED_TOPK_BYTES * k.stored_topk * n_tok if stored else 0,
        "optimizer_states": states,
        "gradients": grads_resident,
    }
    base = sum(resident.values())

    # ---- forward: student forward, teacher forward (no grad) on top, the loss on top ----
    if student.hf:
        fixed = hf_terms.forward_fixed_bytes(student, b, s, a, grad=True)
        head_peak = acts + hid_s + hf_terms.final_norm_peak_bytes(student, n_tok, a)
        if k.activation_checkpointing:
            # the embedding output is layer 0's (checkpointed) input, counted in its activations
            fixed -= hid_s
            inner = sum(layer_saved) + hf_terms.nograd_layer_peak(student, b, s, a)
            s_fwd = fixed + max(inner, head_peak - hid_s)
        else:
            s_fwd = fixed + head_peak
    elif k.activation_checkpointing:
        s_fwd = sum(layer_saved) + _layer_nograd_peak(student, b, s, a)
    else:
        s_fwd = (
            acts + hid_s + (6 if full else 8) * n_tok * h * a // 2
        )  # final norm's fp32 temporaries
    t_fwd = _nograd_forward_bytes(teacher, b, s, a) if teacher is not None else 0
    l_fwd = hid_t + loss_peak
    subphases = {
        "student_forward": base + s_fwd + in_flight_fwd,
        "teacher_forward": base + acts + hid_s + t_fwd + in_flight_fwd,
        "loss_forward": base + acts + hid_s + l_fwd + in_flight_fwd,
    }
    fwd_kind = max(subphases, key=lambda x: subphases[x])
    forward = dict(resident, fsdp_in_flight=in_flight_fwd)
    if fwd_kind == "student_forward":
        forward.update(activations=s_fwd)
    elif fwd_kind == "teacher_forward":
        forward.update(activations=acts + hid_s, teacher_forward=t_fwd)
    else:
        forward.update(activations=acts + hid_s, teacher_forward=hid_t, logits_loss=loss_peak)

    # ---- backward: start (loss gradients + final norm), then the layers from the last ----
    if grads_resident and out_g_held and not student.tie_word_embeddings:
        # untied output, accumulating: d(weight) is added in place into .grad and freed before
        # the final norm's backward allocates its temporaries
        bwd_start = max(0, bwd_start - out_g_held)
    best = {
        "activations": acts,
        "logits_loss": loss_saved - (0 if grads_resident else out_g_held) + bwd_start,
        "gradients": grads_resident or (head_g + out_g_held),
        "backward_temp": 0,
    }
    g_done = head_g + out_g_held
    remaining = sum(layer_saved)
    full_layer = layer_saved_bytes(student, b, s, a, input_grad=True)
    ltemp = int(_LAYER_BWD_H * n_tok * h * a / 2)
    # Inside a layer's backward the peak is at the SwiGLU product's backward: the recomputed (AC)
    # or remaining saved set, the gradients so far plus w2's, two [N, f] gradients and d(output).
    f = student.intermediate_dim
    w2_g = a * h * f if full else 0
    if ws > 1:
        w2_g = 0 if k.fsdp_cpu_offload else _ceil_div(w2_g, ws)
    mlp_temp = n_tok * (2 * a * f + a * h)
    held_apart = out_g_held if student.tie_word_embeddings else 0
    for i in reversed(range(student.num_layers)):
        g_now = g_done + layer_g
        recompute = full_layer if k.activation_checkpointing else 0
        # (gradients, saved activations, temporaries) at the layer's backward peaks
        steps = [
            (g_now, remaining + recompute, ltemp),
            (g_done + w2_g, remaining + recompute, mlp_temp),
        ]
        if student.hf:
            # transformers: the layer's own saved tensors (recomputed first with checkpointing)
            # shrink step by step as its nodes finish
            input_grad = i > 0 or full
            own = 0
            if not k.activation_checkpointing:
                own = hf_terms.layer_saved_bytes(student, i, b, s, a, input_grad=input_grad)
            steps = [
                (
                    g_done + int(layer_g * _trained_share(student, done)),
                    remaining - own + held,
                    temp,
                )
                for held, temp, done in hf_terms.layer_backward_steps(
                    student, i, b, s, a, input_grad=input_grad
                )
            ]
        for grads_here, saved, temp in steps:
            cand = {
                "activations": saved,
                "logits_loss": 0,
                "gradients": grads_resident or grads_here,
                # with accumulation, new gradients are temporaries and the loss's d(weight) is
                # held apart from the resident gradients until the embedding's backward
                "backward_temp": temp
                + ((grads_here - g_done + held_apart) if grads_resident else 0),
            }
            if sum(cand.values()) > sum(best.values()):
                best = cand
        remaining -= layer_saved[i]
        g_done = g_now
    # end, tied embeddings: the embedding's dense gradient and its sum with the output's gradient
    # (held since the loss) exist together before the accumulation
    emb_temp = 2 * a * student.embedding_params() if (full and student.tie_word_embeddings) else 0
    if ws > 1:
        emb_temp = 0 if k.fsdp_cpu_offload else _ceil_div(emb_temp, ws)
    end = {"activations": 0, "logits_loss": 0, "gradients": grads, "backward_temp": emb_temp}
    if sum(end.values()) > sum(best.values()):
        best = end
    backward = dict(resident, fsdp_in_flight=in_flight_bwd)
    backward.update(best)

    step = dict(resident)
    step.update(gradients=grads, optimizer_temp=opt_temp)

    phases = {"forward": forward, "backward": backward, "optimizer_step": step}
    if k.eval_batch is not None:
        # between steps: the optimizer step set the gradients to None; states stay
        evaluation = dict(resident, gradients=0, stored_logits=0, fsdp_in_flight=in_flight_fwd)
        for comp, val in _evaluation(student, teacher, k).items():
            evaluation[comp] = val + (buffers if comp == "buffers" else 0)
        phases[EVAL_PHASE] = evaluation
    if k.generation is not None:
        phases[GEN_PHASE] = _generation_phase(student, teacher, k, resident, buffers)
    for ph in phases.values():
        for c in COMPONENTS:
            ph.setdefault(c, 0)
    peak_phase = max(phases, key=lambda p: sum(phases[p].values()))
    allocated = sum(phases[peak_phase].values())
    if k.reserve_bytes is not None:
        reserve = int(k.reserve_bytes)
    else:
        reserve = RESERVE_FIXED_BYTES + int(RESERVE_FRACTION * allocated)
        if ws > 1:
            reserve += RESERVE_NCCL_BYTES
    for ph in phases.values():
        ph["runtime_reserve"] = reserve
    subphases["backward"] = sum(backward.values()) - reserve
    subphases["optimizer_step"] = sum(step.values()) - reserve
    for extra in (EVAL_PHASE, GEN_PHASE):
        if extra in phases:
            subphases[extra] = sum(phases[extra].values()) - reserve
    return Estimate(
        phases={p: {c: int(phases[p][c]) for c in COMPONENTS} for p in phases},
        peak_phase=peak_phase,
        student_params=student.total_params(),
        trainable_params=trainable,
        teacher_params=teacher_params,
        notes=notes,
        subphases=subphases,
    )
