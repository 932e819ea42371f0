"""Model backends: torchtune builders and transformers, each behind one adapter.

:func:`backend_of` is the one place kd tells the two apart; every other module calls the
adapter it returns (:class:`kd.backends.base.Backend`).
"""

from __future__ import annotations

from typing import Any

from kd.backends.base import CHECKPOINTER_OF, Backend, WeightsSource
from kd.backends.torchtune import TorchtuneBackend
from kd.backends.transformers import TransformersBackend
from kd.hf.model import is_hf_model

__all__ = [
    "BACKENDS",
    "CHECKPOINTER_OF",
    "Backend",
    "TORCHTUNE",
    "TRANSFORMERS",
    "WeightsSource",
    "backend_named",
    "backend_of",
]

TORCHTUNE = TorchtuneBackend()
TRANSFORMERS = TransformersBackend()
BACKENDS: dict[str, Backend] = {b.name: b for b in (TORCHTUNE, TRANSFORMERS)}


def backend_of(model: Any) -> Backend:
    """The backend that built ``model`` (a transformers ``PreTrainedModel``, also after FSDP2 or
    peft changed it; anything else is a torchtune builder's)."""
    return TRANSFORMERS if is_hf_model(model) else TORCHTUNE


def backend_named(name: str) -> Backend:
    """The backend of a :class:`WeightsSource`'s ``backend`` name."""
    return BACKENDS[name]
