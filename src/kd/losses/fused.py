"""The fused linear path: per chunk of labelled tokens both models' logits, the loss and the
gradient w.r.t. the student's chunk logits, folded at once into d(hidden) and d(weight); no
full-vocab logits of either model (:func:`fused_linear_kd_loss`; :func:`kd.losses.topk.fused_linear_ce_loss` is the top-k path
with no teacher entry).
Conventions: :mod:`kd.losses`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from kd.losses.divergences import (
    _LOG_MIN,
    _check_divergence,
    _divergence_value_and_grad,
    _log_softmax_fp32,
    mix_ce_kd,
)


class _FusedHead(torch.autograd.Function):
    """The fused losses' common ends: forward already folded every chunk's d(logits) into
    d(hidden) and d(weight), so :meth:`finish` saves them and backward only rescales them."""

    @staticmethod
    def finish(
        ctx: torch.autograd.function.FunctionCtx,
        *,
        ce_sum: Tensor,
        kd_sum: Tensor,
        inv_n: Tensor,
        t2: float,
        kd_ratio: float,
        grad_h: Tensor | None,
        grad_w: Tensor | None,
        weight_dtype: torch.dtype,
        num_other_inputs: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(loss, ce, kd)`` from the chunk sums; saves the gradients for :meth:`backward`."""
        ce = ce_sum * inv_n
        kd = kd_sum * inv_n * t2
        loss = mix_ce_kd(ce, kd, kd_ratio)
        if grad_w is not None and weight_dtype != torch.float32:
            grad_w = grad_w.to(weight_dtype)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.num_other_inputs = num_other_inputs  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(ce, kd)
        return loss, ce, kd

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_loss: Tensor,
        _grad_ce: Tensor,
        _grad_kd: Tensor,
    ) -> tuple[Tensor | None, ...]:
        if getattr(ctx, "kd_used", False):
            raise RuntimeError(
                "the fused KD / CE loss supports one backward per forward (no retain_graph)"
            )
        ctx.kd_used = True  # type: ignore[attr-defined]
        grad_h, grad_w = ctx.saved_tensors  # type: ignore[attr-defined]
        # In place: the saved gradients are used exactly once (no double backward / retain_graph).
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss.to(grad_w.dtype))
        return (grad_h, grad_w) + (None,) * ctx.num_other_inputs  # type: ignore[attr-defined]


class _FusedLinearKD(_FusedHead):
    """Chunked linear + CE + KD with the gradient computed in forward (the Liger approach).

    Inputs are already restricted to the positions to train on (rows of ``h_s`` / ``h_t``); ``mask``
    marks which of them are labelled (all of them on the real-tensor path) and ``n_lab`` is their
    count as a tensor, so nothing here reads a tensor value into Python.
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
        h_t: Tensor,
        w_t: Tensor,
        labels: Tensor,
        mask: Tensor,
        n_lab: Tensor,
        masked: bool,
        divergence: str,
        temperature: float,
        kd_ratio: float,
        chunk_size: int,
        beta: float,
        skew_alpha: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        n_tok = h_s.size(0)
        v_s = w_s.size(0)
        vocab = min(v_s, w_t.size(0))
        w_t_shared = w_t[:vocab]  # a view: the teacher never computes logits past the shared vocab
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        # d(hidden) rows are independent per chunk: write them straight in the input dtype.
        grad_h = torch.zeros_like(h_s) if need_h else None
        # d(weight) sums over all chunks: accumulate in fp32, cast once at the end.
        grad_w = torch.zeros(w_s.shape, dtype=torch.float32, device=w_s.device) if need_w else None
        ce_sum = torch.zeros((), dtype=torch.float32, device=h_s.device)
        kd_sum = torch.zeros((), dtype=torch.float32, device=h_s.device)
        inv_n = 1.0 / n_lab.to(torch.float32)
        t2 = temperature * temperature

        for start in range(0, n_tok, chunk_size):
            end = min(start + chunk_size, n_tok)
            hs = h_s[start:end]
            m = mask[start:end]
            # Unlabelled rows only exist on the fake-tensor path; clamp their label to a valid id.
            lab = (
                torch.where(m, labels[start:end], 0)[:, None] if masked else labels[start:end, None]
            )

            # Teacher first, so its bf16 / unnormalized temporaries are freed before the student's.
            t_logp = _log_softmax_fp32(
                h_t[start:end].to(w_t.dtype) @ w_t_shared.t(), vocab, temperature, inplace=True
            )

            z = (hs.to(w_s.dtype) @ w_s.t()).float()  # [n, Vs] student logits, fp32
            if temperature == 1.0 and vocab == v_s:
                # The divergence and CE share one log_softmax.
                s_logp = torch.log_softmax(z, dim=-1).clamp_min_(_LOG_MIN)
                del z
                ce_tok = -s_logp.gather(1, lab).squeeze(1)
                g = torch.exp(s_logp)
            else:
                s_logp = _log_softmax_fp32(z, vocab, temperature, inplace=True)
                lse = torch.logsumexp(z, dim=-1)
                ce_tok = lse - z.gather(1, lab).squeeze(1)
                g = z.sub_(lse[:, None]).exp_()  # softmax(z), in place of z
                del z, lse
            # g = dCE/dz = softmax(z) - onehot(label)
            g.scatter_add_(1, lab, torch.full_like(lab, -1.0, dtype=g.dtype))

            kd_tok, g_u = _divergence_value_and_grad(s_logp, t_logp, divergence, beta, skew_alpha)
            del s_logp, t_logp
            if masked:
                ce_tok = torch.where(m, ce_tok, 0.0)
                kd_tok = torch.where(m, kd_tok, 0.0)
            ce_sum = ce_sum + ce_tok.sum()
            kd_sum = kd_sum + kd_tok.sum()

            # d loss / d z = [(1 - r) dCE/dz + r T^2 dKD/du / T] / n_lab, zero on unlabelled rows.
            g.mul_(inv_n * (1.0 - kd_ratio))
            g[:, :vocab].add_(g_u.mul_(inv_n * (kd_ratio * temperature)))
            del g_u
            if masked:
                g.mul_(m.to(g.dtype)[:, None])

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
            t2=t2,
            kd_ratio=kd_ratio,
            grad_h=grad_h,
            grad_w=grad_w,
            weight_dtype=w_s.dtype,
            num_other_inputs=12,
        )


def fused_linear_kd_loss(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    labels: Tensor,
    *,
    divergence: str = "forward_kl",
    temperature: float = 1.0,
    kd_ratio: float = 0.5,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    beta: float = 0.5,
    skew_alpha: float = 0.1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused output projection + CE + KD, chunked over labelled tokens, without full logits.

    Memory of the loss is O(chunk_size x V) temporaries plus d(hidden) ``[N_lab, Ds]`` and d(weight)
    ``[Vs, Ds]`` (the latter in fp32 while accumulating), independent of batch x sequence.

    Args:
        student_hidden: ``[N, Ds]`` or ``[B, S, Ds]`` student hidden states after the final norm.
        student_weight: ``[Vs, Ds]`` student output projection.
        teacher_hidden: ``[N, Dt]`` or ``[B, S, Dt]`` teacher hidden states (no gradient flows back).
        teacher_weight: ``[Vt, Dt]`` teacher output projection (may be bf16; logits are upcast).
        labels: ``[N]`` or ``[B, S]`` target ids aligned with the positions (already shifted).
        divergence: one of ``DIVERGENCES``.
        temperature: softmax temperature T of the KD term (CE uses T = 1).
        kd_ratio: r in ``loss = (1 - r) ce + r kd``.
        ignore_index: label value of unlabelled positions.
        chunk_size: tokens per chunk.
        beta: JSD mixture weight.
        skew_alpha: skew-KL mixture weight.

    Returns:
        ``(loss, ce, kd)`` fp32 scalars; ce and kd are means over labelled positions (kd includes
        T^2) and are detached (log them; backpropagate ``loss``). With no labelled position all
        three are 0 and ``loss`` still backpropagates (zero gradients).

    Raises:
        ValueError: unknown ``divergence``, non-positive ``chunk_size`` or mismatched shapes.
    """
    _check_divergence(divergence)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    h_s = student_hidden.reshape(-1, student_hidden.size(-1))
    h_t = teacher_hidden.detach().reshape(-1, teacher_hidden.size(-1))
    flat = labels.reshape(-1)
    if not (h_s.size(0) == h_t.size(0) == flat.size(0)):
        raise ValueError(
            f"positions differ: student_hidden {tuple(student_hidden.shape)}, "
            f"teacher_hidden {tuple(teacher_hidden.shape)}, labels {tuple(labels.shape)}"
        )
    mask = flat != ignore_index
    if is_fake(flat) or is_fake(h_s):
        # Fake tensors (memory planner): selecting rows by mask has a data-dependent shape, so
        # keep every position (the worst case the planner plans for anyway) and weight by mask.
        n_lab = mask.sum().clamp_min(1)
        masked = True
    else:
        idx = mask.nonzero().squeeze(1)
        h_s = h_s.index_select(0, idx)
        h_t = h_t.index_select(0, idx)
        flat = flat.index_select(0, idx)
        mask = mask.index_select(0, idx)
        n_lab = torch.tensor(max(idx.numel(), 1), device=flat.device)
        masked = False
    return _FusedLinearKD.apply(
        h_s,
        student_weight,
        h_t,
        teacher_weight.detach(),
        flat,
        mask,
        n_lab,
        masked,
        divergence,
        float(temperature),
        float(kd_ratio),
        int(chunk_size),
        float(beta),
        float(skew_alpha),
    )


def _labelled_rows(
    hidden: Tensor, labels: Tensor, ignore_index: int, *extra: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool, list[Tensor]]:
    """Flatten positions and keep the labelled ones (all of them, weighted by the mask, on fake
    tensors, where selecting rows would have a data-dependent shape).

    Returns:
        ``(hidden [N', D], labels [N'], mask [N'], n_lab, masked, extra rows)``.
    """
    h = hidden.reshape(-1, hidden.size(-1))
    flat = labels.reshape(-1)
    mask = flat != ignore_index
    rows = [e.reshape(flat.size(0), -1) for e in extra]
    if is_fake(flat) or is_fake(h):
        return h, flat, mask, mask.sum().clamp_min(1), True, rows
    idx = mask.nonzero().squeeze(1)
    rows = [r.index_select(0, idx) for r in rows]
    n_lab = torch.tensor(max(idx.numel(), 1), device=flat.device)
    return (
        h.index_select(0, idx),
        flat.index_select(0, idx),
        mask.index_select(0, idx),
        n_lab,
        False,
        rows,
    )
