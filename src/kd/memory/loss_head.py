"""Loss-head terms of the memory estimate: the output projection, logits and loss of both models
(``kd.losses``' chunked heads or the full-logits path) and the start of backward.

Each constant is measured with MemTracker on the real ``kd.losses`` functions
(``docs/memory_accuracy.md``). Pure arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kd.memory import hf_terms
from kd.memory.knobs import TrainKnobs
from kd.memory.shapes import ModelShape

# Backward of the final RMSNorm right after the loss: fp32 gradient temporaries of [N, h]
# (measured 14 h per token with a trainable scale, 18 h with a frozen one).
HEAD_BWD_FULL = 14
HEAD_BWD_FROZEN = 18

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
# log-probs (StoreReader.batch, moved to the device by the recipe).
STORED_TOPK_BYTES = 8 + 2


def _chunked_head_bytes(
    student: ModelShape, k: TrainKnobs, chunk: int, copies: int
) -> tuple[int, int]:
    """(forward peak, saved for backward) of a chunked head (``kd.losses``' ``_FusedLinear*``)
    beyond its inputs, given one chunk's temporaries and the copies of the labelled rows.

    Holds ``grad_hidden`` [N, Ds] in the activation dtype, ``grad_weight`` [Vs, Ds] in fp32 while
    accumulating (only when the output weight trains), and one chunk's temporaries. At the end
    ``grad_weight`` is cast to the weight dtype (both copies alive).
    """
    a = k.dtype_bytes
    ds, vs = student.embed_dim, student.vocab_size
    w_trains = student.lora is None
    grad_h = a * k.tokens * ds
    grad_w32 = 4 * vs * ds if w_trains else 0
    grad_w = a * vs * ds if w_trains else 0
    cast = grad_w32 + grad_w if a != 4 else grad_w32
    peak = copies + grad_h + max(grad_w32 + chunk, cast)
    return peak, grad_h + grad_w


def fused_loss_bytes(student: ModelShape, teacher: ModelShape, k: TrainKnobs) -> tuple[int, int]:
    """(forward peak, saved for backward) of ``kd.losses.fused_linear_kd_loss`` beyond its inputs.

    Per chunk of n = min(C, N) rows: the student's fp32 logits and the divergence's
    :data:`FUSED_CHUNK_BYTES` over the shared vocabulary (:func:`_chunked_head_bytes`). On real
    tensors the labelled rows of both hidden states are gathered first (copies).
    """
    n = min(k.loss_chunk_size, k.tokens)
    vocab = min(student.vocab_size, teacher.vocab_size)
    coef = FUSED_CHUNK_BYTES.get(k.divergence, 12.0)
    chunk = int(4 * n * student.vocab_size + coef * n * vocab)
    chunk += _FUSED_ROW_BYTES * n + _FUSED_FIXED_BYTES
    copies = 0
    if k.select_labelled:
        copies = k.dtype_bytes * k.tokens * (student.embed_dim + teacher.embed_dim)
    return _chunked_head_bytes(student, k, chunk, copies)


def chunked_loss_bytes(student: ModelShape, k: TrainKnobs) -> tuple[int, int]:
    """(forward peak, saved for backward) of the chunked head without a teacher model
    (``kd.losses.fused_linear_ce_loss``, or ``fused_linear_topk_kd_loss`` with stored top-k)
    beyond its inputs.

    On real tensors the labelled rows of the hidden states (and of the stored ids and log-probs)
    are gathered first (copies).
    """
    n_tok, vs = k.tokens, student.vocab_size
    n = min(k.loss_chunk_size, n_tok)
    topk = k.stored_topk
    if topk is None:
        chunk = _CE_CHUNK_V * n * vs
    else:
        chunk = _TOPK_CHUNK_V * n * vs + _TOPK_K_BYTES * n * topk
    chunk += _FUSED_ROW_BYTES * n + _FUSED_FIXED_BYTES
    copies = 0
    if k.select_labelled:
        copies = k.dtype_bytes * n_tok * student.embed_dim
        copies += STORED_TOPK_BYTES * topk * n_tok if topk else 0
    return _chunked_head_bytes(student, k, chunk, copies)


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


def unfused_loss_bytes(
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


# The cross-tokenizer loss (kd.teachers.cross.CrossTokenizerSignal.loss, kd.cross_tokenizer), row
# by row, bytes per labelled token per vocabulary entry (fp32): Vs, Vt the two distribution
# sizes, M = min(Vs, Vt). The planner counts the two ends of the shared vocabulary m (every
# byte term is linear in m, so its peak is largest at an end): m = 0, where only ULD's sorted
# distance runs (each side's probabilities, their exp, the sort's values and int64 indices, the
# zero-padded copies of width W = max(Vs, Vt), their difference and its abs), and m = M, where
# one side has no unmatched id left and only the divergence on the shared columns runs.
# Coefficients per divergence (m = M): the forward peak's and the saved part's coefficient of M,
# and the backward's first-row candidates max(c * M, 12 Vs - c' * M). Derived from the
# operations and checked against MemTracker on the real code (tests/unit/memory/test_loss_head_cross.py).
_CROSS_MATCHED: dict[str, tuple[int, int, int, int]] = {
    "forward_kl": (20, 4, 8, 4),
    "reverse_kl": (20, 8, 8, 8),
    "symmetric_kl": (24, 12, 8, 12),
    "jsd": (36, 20, 12, 20),
    "tvd": (20, 8, 8, 8),
    "skew_forward_kl": (32, 12, 16, 12),
    "skew_reverse_kl": (32, 16, 16, 16),
}
# Per labelled token: the signal's int64 positions, targets and teacher ids.
_CROSS_ROW_BYTES = 24


def _cross_row(vs: int, vt: int, matched: int, divergence: str) -> tuple[int, int, int]:
    """(forward peak, saved, backward transient) of one row's hybrid loss per token, beyond the
    student's and the teacher's log-probs' own inputs (see :data:`_CROSS_MATCHED`)."""
    if matched == 0:  # ULD's sorted distance alone
        w = max(vs, vt)
        peak = max(32 * vs + 20 * vt, 32 * vs + 8 * vt + 4 * w, 28 * vs + 8 * vt + 8 * w)
        peak = max(peak, 28 * vs + 4 * vt + 16 * w)
        return peak, 20 * vs + 4 * w, 8 * w
    c_peak, c_saved, c_bwd, c_bwd2 = _CROSS_MATCHED.get(divergence, _CROSS_MATCHED["jsd"])
    m = matched
    return (
        16 * vs + 4 * vt + c_peak * m,
        8 * vs + c_saved * m,
        max(c_bwd * m, 12 * vs - c_bwd2 * m),
    )


def cross_loss_bytes(
    student: ModelShape, teacher: ModelShape, k: TrainKnobs, matched: int
) -> tuple[int, int, int]:
    """(forward peak, saved for backward, backward-start temporaries) of the cross-tokenizer
    loss beyond both models' hidden states, with ``matched`` shared token strings.

    The loss walks the micro-batch row by row (``batch_size`` rows of ``seq_len`` labelled
    tokens, the teacher's as many: one group per token, the planner's case): each row gathers
    the student's hidden rows (kept for the output weight's gradient when it trains), takes its
    full logits ``[n, Vs]`` in fp32, CE's and the tempered log-softmax (both kept), the
    teacher's fp32 log-probs ``[n, Vt]``, the merged rows of both sides and the hybrid loss
    (:func:`_cross_row`). The rows before the last keep what their backward needs; the last
    adds its peak. Backward starts with every row's saved tensors and the first row's
    gradient temporaries.
    """
    a, b, n = k.dtype_bytes, k.batch_size, k.seq_len
    vs, vt = student.vocab_size, teacher.vocab_size
    keeps_input = student.lora is None or student.lora.output
    x = a * n * student.embed_dim if keeps_input else 0
    peak_row, saved_row, bwd_row = _cross_row(vs, vt, matched, k.divergence)
    if k.stored_topk is not None:
        # A store (kd.teachers.cross_stored): every row's dense fp32 log-probs [n, Vt] are made
        # by the signal, before the loss, and live through it; no teacher logits are computed.
        peak = (b - 1) * (x + n * saved_row) + x + n * peak_row + 4 * b * n * vt
        return peak + _CROSS_ROW_BYTES * b * n, b * (x + n * saved_row), n * bwd_row
    # the teacher's log-probs of the row (4 Vt) beside its peak; while they are computed: its
    # logits in the dtype, the tempered fp32 copy and the log-softmax, beside the student's
    # logits and CE log-probs and, after the first row, the last row's log-probs.
    teacher_lp = 8 * vs + (a + 8 + (4 if b > 1 else 0)) * vt
    peak = (b - 1) * (x + n * saved_row) + x + n * max(peak_row + 4 * vt, teacher_lp)
    peak += _CROSS_ROW_BYTES * b * n
    return peak, b * (x + n * saved_row), n * bwd_row


def cross_teacher(
    student: ModelShape, teacher: ModelShape | None, k: TrainKnobs
) -> ModelShape | None:
    """The shape whose vocabulary the cross-tokenizer loss runs over: the planned teacher's, or
    ``k.cross_vocab`` (a store's teacher, another member's); None when the loss is not the
    cross-tokenizer one."""
    if not k.cross_tokenizer:
        return None
    if k.cross_vocab is not None:
        return replace(teacher or student, vocab_size=k.cross_vocab)
    return teacher


def cross_matched(student: ModelShape, teacher: ModelShape, k: TrainKnobs) -> int:
    """The shared token strings the plan assumes: the end (none, or every id of the smaller
    vocabulary) whose loss needs more (the tokenizers are not read; every term is linear in the
    count, so an end is the worst case)."""

    def need(m: int) -> int:
        peak, saved, start = cross_loss_bytes(student, teacher, k, m)
        return max(peak, saved + start)

    return max((0, min(student.vocab_size, teacher.vocab_size)), key=need)


@dataclass(frozen=True)
class LossHead:
    """The loss head of one micro-step (``kd.training.train.compute_loss``'s choice of path).

    Attributes:
        peak: forward peak beyond its inputs (logits, chunk temporaries, gradients it holds).
        saved: bytes kept from the loss forward for backward.
        backward_start: gradient temporaries at the start of backward (loss and final norm).
        output_grad_held: the output (tied: embedding) weight's gradient the chunked head holds
            from the loss until the layers' backward is done; 0 on the logits path.
        notes: one-line remarks for the plan.
    """

    peak: int
    saved: int
    backward_start: int
    output_grad_held: int
    notes: tuple[str, ...] = ()


def loss_head(
    student: ModelShape, teacher: ModelShape | None, k: TrainKnobs, *, output_grad: int
) -> LossHead:
    """The loss head's terms: the chunked head for a plain output projection when the loss is
    fused, and always with stored top-k (which refuses a LoRA output projection); else the
    full-logits path.

    Args:
        student: the trainable decoder.
        teacher: the frozen decoder, or None (also without a KD term: ``k.teacher_logits``
            false, ``kd_ratio: 0``, the head is the student's CE).
        k: the knobs.
        output_grad: the output weight gradient's bytes on this device (0 when it does not train).

    Raises:
        ValueError: stored teacher logits (``k.stored_topk``) with a teacher model.
    """
    teacher = teacher if k.teacher_logits else None
    stored = k.stored_topk is not None
    crossed = cross_teacher(student, teacher, k)
    if crossed is not None:
        matched = cross_matched(student, crossed, k)
        peak, saved, start = cross_loss_bytes(student, crossed, k, matched)
        note = (
            "cross_tokenizer: planned with "
            + ("no token string shared" if matched == 0 else "the smaller vocabulary shared")
            + " (the worse end), each side's tokens one per student token"
        )
        return LossHead(peak, saved, start, 0, (note,))
    if stored and teacher is not None:
        raise ValueError("estimate: stored teacher logits (knobs.stored_topk) take no teacher")
    a, n_tok, h = k.dtype_bytes, k.tokens, student.embed_dim
    full = student.lora is None
    lora_output = not full and student.lora.output
    if not (k.fused_loss or stored) or lora_output:
        peak, saved, start = unfused_loss_bytes(student, teacher, k)
        notes = []
        if stored:
            notes.append(
                "stored teacher logits need a plain output projection: set "
                "model.apply_lora_to_output=false"
            )
        elif k.fused_loss:
            notes.append("LoRA on the output projection: the unfused logits path is used")
        if full or lora_output:
            saved += a * n_tok * h  # the output projection keeps its input for its weight gradient
        return LossHead(peak, saved, start, 0, tuple(notes))
    if teacher is not None:
        peak, saved = fused_loss_bytes(student, teacher, k)
    else:
        peak, saved = chunked_loss_bytes(student, k)
    if student.hf:
        start = hf_terms.head_backward_bytes(student, n_tok, a)
    else:
        start = (HEAD_BWD_FULL if full else HEAD_BWD_FROZEN) * n_tok * h * a // 2
    return LossHead(peak, saved, start, output_grad)
