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
then only rescales those two tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

__all__ = [
    "DIVERGENCES",
    "ce_loss",
    "fused_linear_kd_loss",
    "kd_loss",
    "per_token_divergence",
    "shared_vocab_logprobs",
]

# Must equal kd.config.schema.DIVERGENCES (a unit test checks it); kept literal so importing the
# losses does not import the config package.
DIVERGENCES: tuple[str, ...] = (
    "forward_kl",
    "reverse_kl",
    "symmetric_kl",
    "jsd",
    "tvd",
    "skew_forward_kl",
    "skew_reverse_kl",
)

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


class _FusedLinearKD(torch.autograd.Function):
    """Chunked linear + CE + KD with the gradient computed in forward (the Liger approach).

    Inputs are already restricted to the positions to train on (rows of ``h_s`` / ``h_t``); ``mask``
    marks which of them are labelled (all of them on the real-tensor path) and ``n_lab`` is their
    count as a tensor, so nothing here reads a tensor value into Python.
    """

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

        ce = ce_sum * inv_n
        kd = kd_sum * inv_n * t2
        loss = (1.0 - kd_ratio) * ce + kd_ratio * kd
        if need_w and w_s.dtype != torch.float32:
            grad_w = grad_w.to(w_s.dtype)
        ctx.save_for_backward(grad_h, grad_w)
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
                "fused_linear_kd_loss supports one backward per forward (no retain_graph)"
            )
        ctx.kd_used = True
        grad_h, grad_w = ctx.saved_tensors
        # In place: the saved gradients are used exactly once (no double backward / retain_graph).
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss.to(grad_w.dtype))
        return (grad_h, grad_w) + (None,) * 12


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
