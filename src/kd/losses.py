"""Knowledge-distillation losses: divergences, the logits path and the fused linear path.

Conventions shared by every function here:

* ``p = softmax(teacher / T)`` and ``q = softmax(student / T)`` over the first ``min(Vs, Vt)`` vocab
  entries (Qwen-style padded embeddings differ only in never-used rows past the tokenizer).
* All softmax / divergence / CE math runs in fp32, whatever the input dtype.
* Reductions are means over positions whose label is not ``ignore_index``; the KD term is scaled by
  ``T^2`` (Hinton et al.) so its gradient magnitude does not shrink with the temperature.
* Divergences (``DIVERGENCES``):

  - ``forward_kl``: KL(p||q). This is the true KL; torchtune's ``ForwardKLLoss`` returns the soft
    cross-entropy H(p, q) = KL(p||q) + H(p), which has the same gradient but never reaches 0.
  - ``reverse_kl``: KL(q||p).
  - ``symmetric_kl``: 0.5 (KL(p||q) + KL(q||p)).
  - ``jsd``: beta KL(p||m) + (1 - beta) KL(q||m) with m = beta p + (1 - beta) q. At the edges, where
    that formula is identically 0, we follow TRL's ``generalized_jsd_loss``: beta == 0 gives KL(p||q)
    and beta == 1 gives KL(q||p).
  - ``tvd``: 0.5 sum |p - q|.
  - ``skew_forward_kl``: KL(p || a p + (1 - a) q), a = skew_alpha (DistiLLM).
  - ``skew_reverse_kl``: KL(q || a q + (1 - a) p).

The fused path (:func:`fused_linear_kd_loss`) never materializes full-vocab logits of either model:
per chunk of labelled tokens it computes both models' logits, the loss and the gradient w.r.t. the
student's chunk logits, and immediately folds that gradient into d(hidden) and d(weight). Backward
then only rescales those two tensors. :func:`fused_linear_ce_loss` is the same without a teacher.

Offline teacher (:func:`fused_linear_topk_kd_loss`): per labelled position only the teacher's top-k
ids ``i_1..i_k`` and log-probs ``log p_j = log_softmax(z_t / T)[i_j]`` are known. With the
student's full-vocab ``q = softmax(z_s / T)`` (over the first ``vocab`` entries), ``q_j = q[i_j]``
and the student tail ``q_tail = 1 - sum_j q_j`` (computed as a logsumexp over the other vocab
entries, so it stays exact when tiny), the divergence is taken over k+1 categories:

* ``tail="bucket"``: teacher ``[p_1..p_k, p_tail]``, ``p_tail = max(1 - sum_j p_j, 0)`` floored
  at the smallest normal float32 (fp16-stored log-probs can sum to >= 1; a zero ``p_tail`` would
  make reverse-type divergences ~1e38 where the true value is moderate; the floor changes
  forward-type values by < 1e-35), student ``[q_1..q_k, q_tail]``. Any divergence of
  ``DIVERGENCES`` applies unchanged to these two (k+1)-vectors.
* ``tail="renorm"``: teacher ``p'_j = p_j / sum_i p_i`` on the k ids, 0 elsewhere. For
  ``forward_kl``, ``jsd``, ``tvd``, ``skew_forward_kl`` and ``skew_reverse_kl`` this is exactly the
  full-vocab divergence against ``p'``: a vocab entry with p = 0 contributes a term linear in its q
  (0, ``-(1 - beta) log(1 - beta) q``, ``q / 2``, 0, ``-log(a) q``), so the tail entries lump
  into one category ``(p_tail = 0, q_tail)``. ``reverse_kl`` and ``symmetric_kl`` are infinite
  against a teacher with zeros, so for them the student is renormalised over the same k ids too
  (k categories, ``q'_j = q_j / sum_i q_i``; the student's tail mass then gets no gradient). So
  are ``jsd`` with beta = 1 (which is ``reverse_kl``) and ``skew_reverse_kl`` with a = 0, which
  are treated the same way.

When k equals the vocab size there is no tail and both modes compare the k entries (bucket: the
teacher as stored; renorm: renormalised). CE is from the labels at T = 1 over the student's full
vocab, as everywhere. Teacher ids must be distinct within a row (top-k ids are).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from kd.config.run import DIVERGENCES  # the one list, beside the kd_loss.divergence key

__all__ = [
    "DIVERGENCES",
    "mix_ce_kd",
    "ce_loss",
    "fused_linear_ce_loss",
    "fused_linear_kd_loss",
    "fused_linear_topk_kd_loss",
    "kd_loss",
    "per_token_divergence",
    "shared_vocab_logprobs",
]


def mix_ce_kd(ce: Tensor, kd: Tensor, kd_ratio: float) -> Tensor:
    """The training objective ``(1 - r) * CE + r * KD`` (``r`` = ``kd_ratio``): the one place
    it is written; every signal, the fused losses and the evaluation call it."""
    return (1.0 - kd_ratio) * ce + kd_ratio * kd


# Log-probs are clamped to this so that -inf logits (masked vocab entries) give p = 0 and finite
# products p * (log p - log q) instead of 0 * inf = nan.
_LOG_MIN = torch.finfo(torch.float32).min


def _check_divergence(divergence: str) -> None:
    if divergence not in DIVERGENCES:
        raise ValueError(
            f"unknown divergence {divergence!r}; choose one of {', '.join(DIVERGENCES)}"
        )


def _log(x: float) -> float:
    """log(x) with log(0) = -inf, so mixture weights of 0 drop a term out of a logaddexp."""
    return math.log(x) if x > 0.0 else -math.inf


def _log_softmax_fp32(
    logits: Tensor, vocab: int, temperature: float, *, inplace: bool = False
) -> Tensor:
    """fp32 log_softmax(logits[..., :vocab] / T), clamped to a finite minimum.

    ``inplace`` clamps the fresh output in place (only outside autograd: log_softmax saves it).
    """
    x = logits[..., :vocab].float()
    if temperature != 1.0:
        x = x / temperature
    out = torch.log_softmax(x, dim=-1)
    return out.clamp_min_(_LOG_MIN) if inplace else out.clamp_min(_LOG_MIN)


def shared_vocab_logprobs(
    student_logits: Tensor, teacher_logits: Tensor, *, temperature: float
) -> tuple[Tensor, Tensor]:
    """The two distributions the KD term compares: fp32 ``log_softmax(logits / T)`` of both
    models over their shared first ``min(Vs, Vt)`` vocab entries (the teacher's detached).

    Args:
        student_logits: ``[..., Vs]`` any float dtype.
        teacher_logits: ``[..., Vt]`` same leading shape.
        temperature: softmax temperature T (> 0) of both models.

    Returns:
        ``(log q, log p)``, each ``[..., min(Vs, Vt)]`` fp32, clamped to a finite minimum.
    """
    vocab = min(student_logits.size(-1), teacher_logits.size(-1))
    return (
        _log_softmax_fp32(student_logits, vocab, temperature),
        _log_softmax_fp32(teacher_logits.detach(), vocab, temperature),
    )


def per_token_divergence(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    divergence: str,
    beta: float,
    skew_alpha: float,
) -> Tensor:
    """Divergence between teacher and student distributions, per position (differentiable).

    Args:
        student_logprobs: ``[..., V]`` log q (log_softmax of tempered student logits).
        teacher_logprobs: ``[..., V]`` log p, same shape.
        divergence: one of ``DIVERGENCES``.
        beta: JSD mixture weight in [0, 1].
        skew_alpha: skew-KL mixture weight in [0, 1].

    Returns:
        ``[...]`` fp32 divergence per position (no T^2 factor, no masking).

    Raises:
        ValueError: unknown ``divergence``.
    """
    _check_divergence(divergence)
    s = student_logprobs.float()
    t = teacher_logprobs.float()
    if divergence == "jsd" and beta == 0.0:
        divergence = "forward_kl"
    elif divergence == "jsd" and beta == 1.0:
        divergence = "reverse_kl"

    if divergence == "forward_kl":
        return (t.exp() * (t - s)).sum(-1)
    if divergence == "reverse_kl":
        return (s.exp() * (s - t)).sum(-1)
    if divergence == "symmetric_kl":
        return 0.5 * ((t.exp() * (t - s)).sum(-1) + (s.exp() * (s - t)).sum(-1))
    if divergence == "jsd":
        log_m = torch.logaddexp(t + _log(beta), s + _log(1.0 - beta))
        kl_pm = (t.exp() * (t - log_m)).sum(-1)
        kl_qm = (s.exp() * (s - log_m)).sum(-1)
        return beta * kl_pm + (1.0 - beta) * kl_qm
    if divergence == "tvd":
        return 0.5 * (t.exp() - s.exp()).abs().sum(-1)
    if divergence == "skew_forward_kl":
        log_m = torch.logaddexp(t + _log(skew_alpha), s + _log(1.0 - skew_alpha))
        return (t.exp() * (t - log_m)).sum(-1)
    # skew_reverse_kl
    log_m = torch.logaddexp(s + _log(skew_alpha), t + _log(1.0 - skew_alpha))
    return (s.exp() * (s - log_m)).sum(-1)


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    # where (not multiply) so a non-finite value at an ignored position cannot leak in; the
    # clamp makes an all-masked batch give 0 / 1 = 0 with zero (finite) gradients.
    total = torch.where(mask, values, values.new_zeros(())).sum()
    return total / mask.sum().clamp_min(1).to(values.dtype)


def kd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    *,
    divergence: str = "forward_kl",
    temperature: float = 1.0,
    ignore_index: int = -100,
    beta: float = 0.5,
    skew_alpha: float = 0.1,
) -> Tensor:
    """KD loss from full logits (the unfused path).

    Args:
        student_logits: ``[..., Vs]`` any float dtype.
        teacher_logits: ``[..., Vt]`` same leading shape; only the first ``min(Vs, Vt)`` entries of
            both are compared.
        labels: ``[...]`` target ids; positions equal to ``ignore_index`` are excluded.
        divergence: one of ``DIVERGENCES``.
        temperature: softmax temperature T (> 0) of both models.
        ignore_index: label value of unlabelled positions.
        beta: JSD mixture weight.
        skew_alpha: skew-KL mixture weight.

    Returns:
        Scalar fp32: T^2 times the mean divergence over labelled positions (0 if none).

    Raises:
        ValueError: unknown ``divergence``.
    """
    _check_divergence(divergence)
    s, t = shared_vocab_logprobs(student_logits, teacher_logits, temperature=temperature)
    per_tok = per_token_divergence(s, t, divergence, beta, skew_alpha)
    return _masked_mean(per_tok, labels != ignore_index) * (temperature * temperature)


def ce_loss(student_logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Cross-entropy over the student's full vocabulary, fp32, mean over labelled positions.

    Args:
        student_logits: ``[..., V]``.
        labels: ``[...]``; ``ignore_index`` positions are excluded.
        ignore_index: label value of unlabelled positions.

    Returns:
        Scalar fp32 (0 if no position is labelled).
    """
    logits = student_logits.reshape(-1, student_logits.size(-1)).float()
    flat = labels.reshape(-1)
    total = F.cross_entropy(logits, flat, ignore_index=ignore_index, reduction="sum")
    return total / (flat != ignore_index).sum().clamp_min(1).to(total.dtype)


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot product ``[n, V] x [n, V] -> [n]`` without an [n, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _divergence_value_and_grad(
    s: Tensor, t: Tensor, divergence: str, beta: float, skew_alpha: float
) -> tuple[Tensor, Tensor]:
    """Per-token divergence and its gradient w.r.t. the tempered student logits u (s = log_softmax(u)).

    Closed forms, with q = exp(s), p = exp(t), and h = dL/ds taken with s as a free variable, so
    dL/du = h - q * sum(h) (the log_softmax backward):
      forward_kl  dL/du = q - p
      reverse_kl  dL/du = q (s - t - KL(q||p))
      jsd         h = (1 - beta) q (s - log m)              (m = beta p + (1 - beta) q)
      tvd         h = 0.5 q sign(q - p)
      skew fwd    h = -(1 - a) p q / m                      (m = a p + (1 - a) q)
      skew rev    h = q (s - log m) + q (1 - a q / m)       (m = a q + (1 - a) p)
    ``s`` and ``t`` are consumed (overwritten) to keep the number of [n, V] buffers low.

    Args:
        s: ``[n, V]`` fp32 student log-probs (finite).
        t: ``[n, V]`` fp32 teacher log-probs (finite).
        divergence: one of ``DIVERGENCES``.
        beta: JSD mixture weight.
        skew_alpha: skew-KL mixture weight.

    Returns:
        ``([n] divergence, [n, V] gradient w.r.t. u)``, both fp32.
    """
    if divergence == "jsd" and beta == 0.0:
        divergence = "forward_kl"
    elif divergence == "jsd" and beta == 1.0:
        divergence = "reverse_kl"

    if divergence == "forward_kl":
        p = torch.exp(t)
        value = _rowdot(p, t) - _rowdot(p, s)
        del t
        return value, s.exp_().sub_(p)
    if divergence in ("reverse_kl", "symmetric_kl"):
        q = torch.exp(s)
        diff = s.sub_(t)  # log q - log p, in place of s
        p = t.exp_()
        rkl = _rowdot(q, diff)
        fkl = -_rowdot(p, diff) if divergence == "symmetric_kl" else None
        grad = diff.sub_(rkl[:, None]).mul_(q)  # q (log q - log p - KL(q||p))
        if fkl is None:
            return rkl, grad
        return 0.5 * (fkl + rkl), grad.add_(q).sub_(p).mul_(0.5)
    if divergence == "tvd":
        q = torch.exp(s)
        diff = s.exp_().sub_(t.exp_())  # q - p, in place of s
        value = 0.5 * diff.abs().sum(-1)
        h = diff.sign_().mul_(q).mul_(0.5)
    elif divergence == "jsd":
        log_m = torch.logaddexp(t + _log(beta), s + _log(1.0 - beta))
        kl_pm = _rowdot(torch.exp(t), t.sub_(log_m))
        del t
        q = torch.exp(s)
        s_minus_m = s.sub_(log_m)
        del log_m
        value = beta * kl_pm + (1.0 - beta) * _rowdot(q, s_minus_m)
        h = s_minus_m.mul_(q).mul_(1.0 - beta)
    elif divergence == "skew_forward_kl":
        a = skew_alpha
        log_m = torch.logaddexp(t + _log(a), s + _log(1.0 - a))
        q = torch.exp(s)
        value = _rowdot(torch.exp(t), t - log_m)
        # -(1 - a) p q / m = -(1 - a) exp(t + s - log m)
        h = t.add_(s).sub_(log_m).exp_().mul_(-(1.0 - a))
        del log_m
    else:  # skew_reverse_kl
        a = skew_alpha
        log_m = torch.logaddexp(s + _log(a), t + _log(1.0 - a))
        del t
        q = torch.exp(s)
        s_minus_m = s.sub_(log_m)
        del log_m
        value = _rowdot(q, s_minus_m)
        # a q / m = exp(log a + s - log m); exp(-inf) = 0 covers a = 0
        aqm = torch.exp(s_minus_m + _log(a))
        h = s_minus_m.add_(1.0).sub_(aqm).mul_(q)
        del aqm
    h_sum = h.sum(-1, keepdim=True)
    return value, h.sub_(q * h_sum)


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
    # s becomes the tail-only log-probs: -inf on the ids (an empty tail gives -inf everywhere).
    s_tail_only = s.scatter_(1, ids, -math.inf)
    s_tail = torch.logsumexp(s_tail_only, dim=-1).clamp_min(_LOG_MIN)
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
        h = s_tail_only.zero_()
    else:
        # q_j / q_tail on the tail, 0 on the ids (exp(-inf) = 0), times b.
        h = s_tail_only.sub_(s_tail[:, None]).exp_().mul_(grad_tail[:, None])
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
