"""The offline teacher's loss: the student's full vocabulary against a teacher's top-k ids and
log-probs, over k + 1 (``bucket``) or k (``renorm``) categories, fused like
:mod:`kd.losses.fused` (:func:`fused_linear_topk_kd_loss`); with no teacher entry the same head is the fused CE
(:func:`fused_linear_ce_loss`). The two tails: :mod:`kd.losses`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kd.losses.divergences import (
    _LOG_MIN,
    _check_divergence,
    _log_softmax_fp32,
    per_token_divergence,
)
from kd.losses.fused import _FusedHead, _labelled_rows

TAILS: tuple[str, ...] = ("bucket", "renorm")

# Floor of the bucket teacher's tail log-prob: log of the smallest normal float32 (see the module
# docstring).
_TAIL_LOG_MIN = math.log(torch.finfo(torch.float32).tiny)


def _renorms_student(divergence: str, beta: float, skew_alpha: float) -> bool:
    """Whether ``tail="renorm"`` must renormalise the student too (the divergence is infinite
    against a teacher with zeros wherever the student has mass)."""
    return (
        divergence in ("reverse_kl", "symmetric_kl")
        or (divergence == "jsd" and beta == 1.0)
        or (divergence == "skew_reverse_kl" and skew_alpha == 0.0)
    )


def _topk_categories(
    s_top: Tensor,
    s_tail: Tensor,
    t_top: Tensor,
    *,
    tail: str,
    has_tail: bool,
    renorm_student: bool,
) -> tuple[Tensor, Tensor]:
    """The student and teacher log-probs over the categories the divergence compares.

    Args:
        s_top: ``[n, k]`` student log q at the teacher's ids (full-vocab softmax).
        s_tail: ``[n]`` student log q_tail (clamped to a finite minimum).
        t_top: ``[n, k]`` fp32 teacher log p at its ids (clamped to a finite minimum).
        tail: ``"bucket"`` or ``"renorm"``.
        has_tail: False when k equals the vocab size (no tail category).
        renorm_student: renormalise the student over the k ids (renorm with a reverse-type
            divergence).

    Returns:
        ``(student, teacher)`` log-probs, ``[n, k + 1]`` or ``[n, k]``.
    """
    if tail == "renorm":
        t_top = t_top - torch.logsumexp(t_top, dim=-1, keepdim=True)
        if renorm_student:
            return s_top - torch.logsumexp(s_top, dim=-1, keepdim=True), t_top
        t_tail = torch.full_like(s_tail, _LOG_MIN)
    else:
        # p_tail = max(1 - sum p, 0) = -expm1(logsumexp log p), floored (module docstring).
        t_tail = torch.log((-torch.expm1(torch.logsumexp(t_top, dim=-1))).clamp_min(0.0))
        t_tail = t_tail.clamp_min(_TAIL_LOG_MIN)
    if not has_tail:
        return s_top, t_top
    return (
        torch.cat([s_top, s_tail[:, None]], dim=-1),
        torch.cat([t_top, t_tail[:, None]], dim=-1),
    )


def _topk_value_and_grad(
    s: Tensor,
    ids: Tensor,
    t_top: Tensor,
    *,
    tail: str,
    divergence: str,
    beta: float,
    skew_alpha: float,
) -> tuple[Tensor, Tensor]:
    """Per-token top-k divergence and its gradient w.r.t. the tempered student logits u.

    The divergence depends on s = log_softmax(u) only through ``s_top = s[ids]`` and
    ``s_tail = logsumexp(s[not ids])``; autograd on those small ``[n, k]`` / ``[n]`` tensors gives
    ``a = dL/ds_top`` and ``b = dL/ds_tail``, so with s a free variable ``h = dL/ds`` is ``a`` on
    the ids and ``b q_j / q_tail`` on the tail, and ``dL/du = h - q sum(h)``. ``s`` is consumed.

    Args:
        s: ``[n, V]`` fp32 student log-probs (finite).
        ids: ``[n, k]`` int64 teacher ids, distinct per row, < V.
        t_top: ``[n, k]`` fp32 teacher log-probs at ``ids`` (finite).
        tail: ``"bucket"`` or ``"renorm"``.
        divergence: one of ``DIVERGENCES``.
        beta: JSD mixture weight.
        skew_alpha: skew-KL mixture weight.

    Returns:
        ``([n] divergence, [n, V] gradient w.r.t. u)``, both fp32.
    """
    has_tail = ids.size(1) < s.size(1)
    renorm_student = tail == "renorm" and _renorms_student(divergence, beta, skew_alpha)
    s_top = s.gather(1, ids)
    q = torch.exp(s)
    # s becomes the tail-only log-probs: -inf on the ids (an empty tail gives -inf everywhere),
    # then, in place, exp(s - m) with m its row max: torch.logsumexp's own steps (the same
    # s_tail, bit for bit) without its [n, V] temporary, a fourth fp32 buffer beside g, s and q
    # (the served teacher's row on the H100, docs/gpu.md).
    s.scatter_(1, ids, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m.masked_fill_(m.abs() == math.inf, 0.0)
    e = s.sub_(m).exp_()  # q_j / exp(m) on the tail, 0 on the ids
    m = m.squeeze(1)
    s_tail = e.sum(dim=-1).log_().add_(m).clamp_min(_LOG_MIN)
    with torch.enable_grad():
        leaf_top = s_top.detach().requires_grad_()
        leaf_tail = s_tail.detach().requires_grad_()
        stu, tea = _topk_categories(
            leaf_top,
            leaf_tail,
            t_top,
            tail=tail,
            has_tail=has_tail,
            renorm_student=renorm_student,
        )
        value = per_token_divergence(stu, tea, divergence, beta, skew_alpha)
        grad_top, grad_tail = torch.autograd.grad(
            value.sum(), (leaf_top, leaf_tail), allow_unused=True
        )
    if grad_tail is None or not has_tail:
        h = e.zero_()
    else:
        # q_j / q_tail = exp(s_j - m) exp(m - s_tail) on the tail, 0 on the ids, times b.
        h = e.mul_((torch.exp(m - s_tail) * grad_tail)[:, None])
    h.scatter_add_(1, ids, grad_top)
    h_sum = h.sum(-1, keepdim=True)
    return value.detach(), h.addcmul_(q, h_sum, value=-1.0)


class _FusedLinearTopK(_FusedHead):
    """Chunked linear + CE + top-k KD (offline teacher), gradient computed in forward.

    Like :class:`_FusedLinearKD`, with the teacher given as stored top-k ids and log-probs instead
    of hidden states; without them (``ids is None``) it is a chunked CE.
    """

    # NOTE: one function on purpose (~80 lines): the chunk loop computes each chunk's logits, loss
    # and gradient and folds the gradient into d(hidden), d(weight) before the next chunk exists, so
    # a chunk's [C, V] buffers are the only vocabulary-sized memory; the planner's loss term is
    # derived from this loop (kd.memory.loss_head).
    @staticmethod
    # forward is over 80 lines because it is one chunk loop whose temporaries are freed in
    # place as it goes: split into functions, each chunk's [n, V] tensors would outlive their use.
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        h_s: Tensor,
        w_s: Tensor,
        ids: Tensor | None,
        t_lp: Tensor | None,
        labels: Tensor,
        mask: Tensor,
        n_lab: Tensor,
        masked: bool,
        vocab: int,
        tail: str,
        divergence: str,
        temperature: float,
        kd_ratio: float,
        chunk_size: int,
        beta: float,
        skew_alpha: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        n_tok = h_s.size(0)
        v_s = w_s.size(0)
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h_s) if need_h else None
        grad_w = torch.zeros(w_s.shape, dtype=torch.float32, device=w_s.device) if need_w else None
        ce_sum = torch.zeros((), dtype=torch.float32, device=h_s.device)
        kd_sum = torch.zeros((), dtype=torch.float32, device=h_s.device)
        inv_n = 1.0 / n_lab.to(torch.float32)
        use_kd = ids is not None
        if not use_kd:
            kd_ratio = 0.0

        for start in range(0, n_tok, chunk_size):
            end = min(start + chunk_size, n_tok)
            hs = h_s[start:end]
            m = mask[start:end]
            lab = (
                torch.where(m, labels[start:end], 0)[:, None] if masked else labels[start:end, None]
            )

            z = (hs.to(w_s.dtype) @ w_s.t()).float()  # [n, Vs] student logits, fp32
            lse = torch.logsumexp(z, dim=-1)
            ce_tok = lse - z.gather(1, lab).squeeze(1)
            s_logp = None
            if use_kd:
                if temperature == 1.0 and vocab == v_s:
                    s_logp = (z - lse[:, None]).clamp_min_(_LOG_MIN)
                else:
                    s_logp = _log_softmax_fp32(z, vocab, temperature, inplace=True)
            g = z.sub_(lse[:, None]).exp_()  # softmax(z), in place of z
            del z, lse
            # g = dCE/dz = softmax(z) - onehot(label), scaled by (1 - r) / n_lab
            g.scatter_add_(1, lab, torch.full_like(lab, -1.0, dtype=g.dtype))
            g.mul_(inv_n * (1.0 - kd_ratio))
            if masked:
                ce_tok = torch.where(m, ce_tok, 0.0)
            ce_sum = ce_sum + ce_tok.sum()

            if use_kd:
                c_ids = ids[start:end]
                t_top = t_lp[start:end].float()
                if masked:
                    # Unlabelled rows hold padding: valid distinct ids keep the gathers in range;
                    # whatever their (maybe non-finite) values give is dropped by the wheres below.
                    arange = torch.arange(c_ids.size(1), device=c_ids.device).expand_as(c_ids)
                    c_ids = torch.where(m[:, None], c_ids, arange)
                kd_tok, g_u = _topk_value_and_grad(
                    s_logp,
                    c_ids,
                    t_top.clamp_min(_LOG_MIN),
                    tail=tail,
                    divergence=divergence,
                    beta=beta,
                    skew_alpha=skew_alpha,
                )
                del s_logp
                if masked:
                    kd_tok = torch.where(m, kd_tok, 0.0)
                kd_sum = kd_sum + kd_tok.sum()
                # + r T^2 dKD/du / T / n_lab
                g[:, :vocab].add_(g_u.mul_(inv_n * (kd_ratio * temperature)))
                del g_u
            if masked:
                g = torch.where(m[:, None], g, 0.0)

            if need_h:
                grad_h[start:end] = g.to(w_s.dtype) @ w_s
            if need_w:
                grad_w.addmm_(g.t(), hs.float())
            del g

        return _FusedHead.finish(
            ctx,
            ce_sum=ce_sum,
            kd_sum=kd_sum,
            inv_n=inv_n,
            t2=temperature * temperature,
            kd_ratio=kd_ratio,
            grad_h=grad_h,
            grad_w=grad_w,
            weight_dtype=w_s.dtype,
            num_other_inputs=14,
        )


def fused_linear_topk_kd_loss(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    labels: Tensor,
    *,
    divergence: str = "forward_kl",
    temperature: float = 1.0,
    kd_ratio: float = 0.5,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    tail: str = "bucket",
    beta: float = 0.5,
    skew_alpha: float = 0.1,
    vocab: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused output projection + CE + KD against a stored top-k teacher, without full logits.

    Chunked over labelled tokens like :func:`fused_linear_kd_loss`; the tail treatment is in the
    module docstring.

    Args:
        student_hidden: ``[N, Ds]`` or ``[B, S, Ds]`` student hidden states after the final norm.
        student_weight: ``[Vs, Ds]`` student output projection.
        teacher_ids: ``[N, k]`` or ``[B, S, k]`` integer teacher top-k ids (distinct per row),
            aligned with the positions; rows at unlabelled positions are ignored whatever they
            hold.
        teacher_logprobs: same shape, any float dtype: the teacher's ``log_softmax(z_t / T)`` at
            ``teacher_ids`` (T the run's temperature).
        labels: ``[N]`` or ``[B, S]`` target ids aligned with the positions (already shifted).
        divergence: one of ``DIVERGENCES``.
        temperature: softmax temperature T of the student's KD side (CE uses T = 1).
        kd_ratio: r in ``loss = (1 - r) ce + r kd``.
        ignore_index: label value of unlabelled positions.
        chunk_size: tokens per chunk.
        tail: ``"bucket"`` or ``"renorm"`` (module docstring).
        beta: JSD mixture weight.
        skew_alpha: skew-KL mixture weight.
        vocab: the student's softmax for the KD term runs over the first ``min(Vs, vocab)``
            entries (the vocab shared with the teacher); None: all ``Vs``.

    Returns:
        ``(loss, ce, kd)`` fp32 scalars; ce and kd are means over labelled positions (kd includes
        T^2) and are detached. With no labelled position all three are 0 and ``loss`` still
        backpropagates (zero gradients).

    Raises:
        ValueError: unknown ``divergence`` or ``tail``, non-positive ``chunk_size``, mismatched
            shapes, non-integer ids, k larger than the vocab, or a labelled position's teacher id
            outside ``[0, vocab)``.
    """
    _check_divergence(divergence)
    if tail not in TAILS:
        raise ValueError(f"unknown tail {tail!r}; choose one of {', '.join(TAILS)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if teacher_ids.dtype.is_floating_point or teacher_ids.dtype.is_complex:
        raise ValueError(f"teacher_ids must be integer, got {teacher_ids.dtype}")
    if not teacher_logprobs.dtype.is_floating_point:
        raise ValueError(f"teacher_logprobs must be floating point, got {teacher_logprobs.dtype}")
    v = student_weight.size(0) if vocab is None else min(student_weight.size(0), int(vocab))
    n = labels.numel()
    if (
        student_hidden.shape[:-1].numel() != n
        or teacher_ids.shape != teacher_logprobs.shape
        or teacher_ids.shape[:-1].numel() != n
    ):
        raise ValueError(
            f"positions differ: student_hidden {tuple(student_hidden.shape)}, teacher_ids "
            f"{tuple(teacher_ids.shape)}, teacher_logprobs {tuple(teacher_logprobs.shape)}, "
            f"labels {tuple(labels.shape)}"
        )
    k = teacher_ids.size(-1)
    if not 1 <= k <= v:
        raise ValueError(f"top-k size {k} must be between 1 and the vocab size {v}")
    h_s, flat, mask, n_lab, masked, (ids, t_lp) = _labelled_rows(
        student_hidden, labels, ignore_index, teacher_ids, teacher_logprobs.detach()
    )
    ids = ids.long()
    if not masked and bool(((ids < 0) | (ids >= v)).any()):
        raise ValueError(f"teacher_ids hold ids outside [0, {v}) at labelled positions")
    return _FusedLinearTopK.apply(
        h_s,
        student_weight,
        ids,
        t_lp,
        flat,
        mask,
        n_lab,
        masked,
        v,
        tail,
        divergence,
        float(temperature),
        float(kd_ratio),
        int(chunk_size),
        float(beta),
        float(skew_alpha),
    )


def fused_linear_ce_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int = 1024,
) -> Tensor:
    """Fused output projection + cross-entropy, chunked over labelled tokens, without full logits.

    Args:
        hidden: ``[N, D]`` or ``[B, S, D]`` hidden states after the final norm.
        weight: ``[V, D]`` output projection.
        labels: ``[N]`` or ``[B, S]`` target ids aligned with the positions (already shifted).
        ignore_index: label value of unlabelled positions.
        chunk_size: tokens per chunk.

    Returns:
        Scalar fp32 mean CE over labelled positions (0 with zero gradients if none).

    Raises:
        ValueError: non-positive ``chunk_size`` or mismatched shapes.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1].numel() != labels.numel():
        raise ValueError(
            f"positions differ: hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)}"
        )
    h, flat, mask, n_lab, masked, _ = _labelled_rows(hidden, labels, ignore_index)
    loss, _, _ = _FusedLinearTopK.apply(
        h,
        weight,
        None,
        None,
        flat,
        mask,
        n_lab,
        masked,
        weight.size(0),
        "bucket",
        "forward_kl",
        1.0,
        0.0,
        int(chunk_size),
        0.5,
        0.1,
    )
    return loss
