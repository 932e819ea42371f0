"""Divergences between two distributions over a vocabulary, in fp32: per token
(:func:`per_token_divergence`), the logits-path losses (:func:`kd_loss`, :func:`ce_loss`), and
the value and gradient w.r.t. the student's logits that the fused paths fold chunk by chunk.
Conventions: :mod:`kd.losses`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kd.config.run import DIVERGENCES  # the one list, beside the kd_loss.divergence key


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
