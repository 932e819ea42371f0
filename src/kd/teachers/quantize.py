"""An opt-in int8 weight-only teacher (``teacher_quantization: int8``), and what it costs the signal.

The frozen teacher's decoder-layer linears are quantized in place by torchao's own API
(``quantize_`` with ``Int8WeightOnlyConfig``: int8 weights with one scale per output channel,
dequantized in each matmul); embeddings, norms and the output projection keep the run's dtype (the
fused loss reads the output weight itself). The weights of those linears take about half of their
bf16 memory (a quarter of fp32); the teacher's outputs change, which is why kd never does it
unless the config asks (``teacher_quantization`` defaults to ``none``).

:func:`signal_report` measures that change on the user's own rows: the mean KL divergence from the
unquantized teacher's next-token distribution to the int8 teacher's, and how often their top-1
tokens agree, over the labelled positions (``scripts/int8_teacher_report.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kd import models

__all__ = ["SignalReport", "quantize_int8", "signal_report"]


def quantize_int8(model: nn.Module) -> nn.Module:
    """Quantize the linears of ``model``'s decoder layers to int8 weight-only, in place.

    Args:
        model: a prepared (frozen) teacher of either backend, on its device, not sharded.

    Returns:
        ``model``.
    """
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    for layer in models.decoder_layers(model):
        quantize_(layer, Int8WeightOnlyConfig(version=2))
    return model


@dataclasses.dataclass(frozen=True)
class SignalReport:
    """The int8 teacher against the unquantized one on the same rows.

    Attributes:
        rows: rows compared.
        positions: labelled positions compared (the positions the loss reads).
        mean_kl: mean KL(unquantized || int8) per position, in nats, at the run's temperature.
        max_kl: the largest per-position KL.
        top1_agreement: fraction of positions whose most likely token is the same.
    """

    rows: int
    positions: int
    mean_kl: float
    max_kl: float
    top1_agreement: float

    def line(self) -> str:
        """One line for the user."""
        return (
            f"int8 teacher vs unquantized on {self.rows} rows ({self.positions} labelled "
            f"positions): mean KL {self.mean_kl:.3g} nats (max {self.max_kl:.3g}), top-1 "
            f"agreement {100 * self.top1_agreement:.2f}%"
        )


def signal_report(
    reference: nn.Module,
    quantized: nn.Module,
    rows: Sequence[dict[str, Any]],
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> SignalReport:
    """Compare two teachers' next-token distributions on ``rows``' labelled positions.

    Args:
        reference: the unquantized teacher (hidden-output mode, as the recipe loads it).
        quantized: the int8 teacher, the same otherwise.
        rows: tokenized dataset rows (``tokens`` and ``labels``, labels not shifted).
        temperature: the run's softmax temperature.
        ignore_index: label value of unlabelled positions.

    Returns:
        The report (positions 0 when no row has a labelled token).
    """
    total_kl, max_kl, agree, positions = 0.0, 0.0, 0, 0
    device = next(reference.parameters()).device
    with torch.no_grad():
        for row in rows:
            tokens = torch.as_tensor(list(row["tokens"]), dtype=torch.long, device=device)[None]
            labels = torch.as_tensor(list(row["labels"]), dtype=torch.long, device=device)
            keep = labels[1:] != ignore_index
            if tokens.shape[1] < 2 or not bool(keep.any()):
                continue
            ref = _log_probs(reference, tokens, keep, temperature)
            q = _log_probs(quantized, tokens, keep, temperature)
            kl = (ref.exp() * (ref - q)).sum(-1)
            total_kl += float(kl.sum())
            max_kl = max(max_kl, float(kl.max()))
            agree += int((ref.argmax(-1) == q.argmax(-1)).sum())
            positions += int(keep.sum())
    mean = total_kl / positions if positions else math.nan
    top1 = agree / positions if positions else math.nan
    return SignalReport(len(rows), positions, mean, max_kl, top1)


def _log_probs(
    model: nn.Module, tokens: torch.Tensor, keep: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Log-softmax at ``temperature`` of ``model``'s next-token logits at the kept positions."""
    hidden = model(tokens)[0, :-1][keep]
    logits = models.logits_from_hidden(model, hidden).float() / temperature
    return torch.log_softmax(logits, dim=-1)
