"""What the served sampler (:mod:`kd.rollouts.served`) does with the student itself: writes it
as the server loads it (:func:`exporter_of`) and scores a prompt with it for the first rollout's
model check (:func:`scorer_of`, :mod:`kd.rollouts.served_check`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kd.runtime import distributed
from kd.runtime.distributed import WorldInfo

__all__ = ["exporter_of", "scorer_of"]


def exporter_of(source: Any, *, world: WorldInfo) -> Callable[[Path | None, nn.Module], None]:
    """``(folder, student) -> None``: the student written into ``folder`` as the server loads it:
    a full student as an HF folder; a LoRA student as its PEFT adapter ``adapter/`` alone (the
    server holds the base weights, so nothing is merged or written beside it). Collective when
    distributed (the full state dict is gathered; rank 0 writes)."""
    from kd.backends import backend_named

    def export(folder: Path | None, student: nn.Module) -> None:
        full = distributed.full_state_dict(student, world=world)
        if world.is_rank_zero:
            assert folder is not None
            backend_named(source.backend).export_student(
                folder, student, full, source, adapter_only=source.lora is not None
            )

    return export


def scorer_of(source: Any) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """``(student, ids [n]) -> [n - 1]``: the student's top-1 log-prob after each of the first
    ``n - 1`` tokens, in eval mode without gradients, its logits made 256 positions at a time
    (``model(tokens)`` returns final-norm hidden states; the backend's head makes the logits).
    Collective when distributed (a sharded forward)."""
    from kd.backends import backend_named

    backend = backend_named(source.backend)

    def score(student: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        was_training = student.training
        student.eval()
        try:
            with torch.no_grad():
                hidden = student(ids[None])[0, :-1]  # ids: a prompt, on the training device
                tops = [
                    torch.log_softmax(backend.logits_from_hidden(student, h).float(), -1)
                    .max(-1)
                    .values
                    for h in hidden.split(256)
                ]
        finally:
            student.train(was_training)
        return torch.cat(tops)

    return score
