"""The backend interface: what kd needs of a model, whichever library built it.

Two backends build kd's models: torchtune builders (:mod:`kd.backends.torchtune`) and transformers
(:mod:`kd.backends.transformers`, any causal LM of a local Hugging Face folder). Each implements
:class:`Backend` once; :func:`kd.backends.backend_of` picks the one that built a model, and no
other module asks which library a model comes from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from kd.config.run import CHECKPOINTER_OF

__all__ = ["CHECKPOINTER_OF", "Backend", "WeightsSource"]


@dataclass(frozen=True)
class WeightsSource:
    """Where a model's weights come from (either backend).

    Attributes:
        key: the config key whose folder it is (``checkpointer``, ``teacher_checkpointer`` for a
            torchtune builder; ``model``, ``teacher_model`` for a Hugging Face folder).
        field: that key's folder argument (``checkpoint_dir`` or ``path``), named in errors.
        folder: the Hugging Face folder (config.json, safetensors, tokenizer files).
        files: the weight files: the checkpointer's ``checkpoint_files`` as given, or the folder's
            safetensors names.
        backend: the backend's name (``torchtune`` or ``transformers``).
        model_type: the torchtune ``ModelType`` name, or config.json's ``model_type``.
    """

    key: str
    field: str
    folder: Path
    files: Any
    backend: str
    model_type: str


class Backend(Protocol):
    """One library's models, as kd uses them (loading, preparing, the hidden forward, LoRA, the
    KV cache of generation)."""

    name: str
    # Whether a model's weights folder is a whole Hugging Face model folder (config.json and
    # tokenizer files beside the weights), which kd can compare with the run's tokenizer.
    folder_is_model: bool

    def is_decoder(self, model: Any) -> bool:
        """Whether a builder's result is a decoder with an output projection."""
        ...

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The layers FSDP2 shards one by one, activation checkpointing wraps, compile compiles."""
        ...

    def input_embeddings(self, model: nn.Module) -> nn.Module: ...

    def output_weight(self, model: nn.Module) -> torch.Tensor:
        """The output projection weight ``[V, D]`` (the embedding when tied; the base of LoRA)."""
        ...

    def is_tied(self, model: nn.Module) -> bool: ...

    def has_plain_output(self, model: nn.Module) -> bool:
        """Whether the output projection is a plain (or tied) linear the fused loss can use."""
        ...

    def set_hidden_output(self, model: nn.Module, enabled: bool) -> None:
        """Make ``model(tokens)`` return final-norm hidden states ``[b, s, d]``."""
        ...

    def logits_from_hidden(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits ``[..., V]`` in fp32 from hidden states."""
        ...

    def is_lora(self, model: nn.Module) -> bool: ...

    def setup_lora_trainable(self, model: nn.Module) -> None:
        """Only the adapters train."""
        ...

    def adapters_disabled(self, model: nn.Module) -> AbstractContextManager[None]:
        """A context in which ``model``'s LoRA adapters are switched off (its forward is the
        base model's; the self teacher, :mod:`kd.teachers.self_teacher`); trainable flags are
        the same after it."""
        ...

    def attention_shape(self, model: nn.Module) -> tuple[int, int, int] | None:
        """``(num_heads, num_kv_heads, head_dim)``, or None."""
        ...

    def max_seq_len(self, model: nn.Module) -> int | None: ...

    def weights_source(
        self, model: nn.Module, *, key: str, node: Mapping[str, Any], ckpt_node: Mapping[str, Any]
    ) -> WeightsSource:
        """Where a built model's weights are: its own folder (``node`` of model key ``key``), or
        its checkpointer's (``ckpt_node``, of key :data:`CHECKPOINTER_OF` ``[key]``)."""
        ...

    def load_weights(
        self, model: nn.Module, source: WeightsSource, build_checkpointer: Callable[[], Any]
    ) -> None:
        """Load ``model``'s weights from ``source``; a LoRA student's adapters keep their init."""
        ...

    def export_student(
        self,
        dest: Path,
        student: nn.Module,
        full: dict[str, torch.Tensor],
        source: Any,
        *,
        adapter_only: bool = False,
    ) -> None:
        """Write the student (``full``: its full state dict) as a Hugging Face folder ``dest``
        that transformers loads (:class:`kd.runtime.checkpoints.StudentSource` says from what);
        ``adapter_only`` (a LoRA student): its PEFT adapter ``adapter/`` alone."""
        ...

    def saved_student_weights(
        self, student: nn.Module, ckpt: Path, source: Any
    ) -> dict[str, torch.Tensor]:
        """The weights of step checkpoint ``ckpt`` in the student's parameter names."""
        ...

    def install_decode_attention(self, model: nn.Module) -> None:
        """Route ``model``'s one-position low-precision CPU attention to
        :func:`kd.backends.decode_attention.decode_attention` (``model`` is the sampler's own
        copy, never the training student)."""
        ...

    def kv_cache_steps(
        self, model: nn.Module, mask: torch.Tensor, *, width: int, total: int
    ) -> Any:
        """A context manager whose value ``forward(x, start)`` runs positions ``start ..
        start + len(x)`` of a ``[b, total]`` left-padded sequence with a KV cache
        (:func:`kd.rollouts.sampling.rollout`). ``forward.__self__.select(index)`` keeps rows
        ``index`` of the batch, cache included (:func:`kd.rollouts.decode.fast_rollout`: finished
        rows leave); the transformers backend also takes ``static=True`` (a ``StaticCache``).
        With the cache preallocated, ``forward.__self__.decode(x, pos)`` runs the one position
        ``pos`` (a ``[1]`` device tensor) of ``x`` ``[b, 1]``, reading no Python value of it (a
        CUDA graph replays it: :mod:`kd.rollouts.graphs`) when ``forward.__self__.capturable()``
        (a cache whose layers keep no Python state that changes from step to step)."""
        ...
