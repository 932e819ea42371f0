"""The transformers backend: any causal LM of a local Hugging Face folder (:mod:`kd.hf.model`
builds, loads and adapts it; LoRA through peft)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kd.backends.base import WeightsSource
from kd.hf import model as hf

__all__ = ["TransformersBackend"]


class TransformersBackend:
    """transformers ``PreTrainedModel`` causal LMs (see :class:`kd.backends.base.Backend`)."""

    # Its weights folder is the Hugging Face folder of the model, tokenizer files included.
    folder_is_model = True
    name = "transformers"

    def is_decoder(self, model: Any) -> bool:
        return True  # kd.hf.causal_lm checks the architecture when it builds the model

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return hf.decoder_layers(model)

    def input_embeddings(self, model: nn.Module) -> nn.Module:
        return hf.input_embeddings(model)

    def output_weight(self, model: nn.Module) -> torch.Tensor:
        return hf.output_weight(model)

    def is_tied(self, model: nn.Module) -> bool:
        return hf.is_tied(model)

    def has_plain_output(self, model: nn.Module) -> bool:
        return hf.has_plain_output(model)

    def set_hidden_output(self, model: nn.Module, enabled: bool) -> None:
        hf.set_hidden_output(model, enabled)

    def logits_from_hidden(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return hf.logits_from_hidden(model, hidden)

    def is_lora(self, model: nn.Module) -> bool:
        return hf.is_lora(model)

    def setup_lora_trainable(self, model: nn.Module) -> None:
        hf.setup_lora_trainable(model)

    def adapters_disabled(self, model: nn.Module) -> AbstractContextManager[None]:
        return hf.adapters_disabled(model)

    def attention_shape(self, model: nn.Module) -> tuple[int, int, int] | None:
        return hf.attention_shape(model)

    def max_seq_len(self, model: nn.Module) -> int | None:
        return hf.max_seq_len(model)

    def weights_source(
        self, model: nn.Module, *, key: str, node: Mapping[str, Any], ckpt_node: Mapping[str, Any]
    ) -> WeightsSource:
        folder = Path(str(node["path"])).expanduser()
        files = [p.name for p in hf.weight_files(folder, key=key)]
        return WeightsSource(key, "path", folder, files, self.name, str(model.config.model_type))

    def load_weights(
        self, model: nn.Module, source: WeightsSource, build_checkpointer: Callable[[], Any]
    ) -> None:
        hf.load_folder_weights(model, source.folder, key=source.key)

    def export_student(
        self,
        dest: Path,
        student: nn.Module,
        full: dict[str, torch.Tensor],
        source: Any,
        *,
        adapter_only: bool = False,
    ) -> None:
        """Write the student's folder: merged weights, and its PEFT adapter when LoRA
        (``adapter_only``: the adapter alone, nothing merged)."""
        from kd.checkpoint.hf_folder import write_hf_folder

        lora = source.lora
        adapter_state = adapter_config = None
        if lora is not None:
            adapter_state = hf.peft_adapter_state_dict(full)
            adapter_config = hf.peft_adapter_config(student, base=source.source_dir)
        write_hf_folder(
            dest,
            {}
            if adapter_only
            else hf.hf_state_dict(
                student,
                full,
                lora_alpha=lora.alpha if lora else None,
                rank=lora.rank if lora else None,
            ),
            source_dir=source.source_dir,
            adapter_state=adapter_state,
            adapter_config=adapter_config,
            extra_files=source.tokenizer_files,
            adapter_only=adapter_only,
        )

    def saved_student_weights(
        self, student: nn.Module, ckpt: Path, source: Any
    ) -> dict[str, torch.Tensor]:
        """A step checkpoint's weights in the student's own parameter names."""
        from kd.checkpoint.hf_folder import load_hf_weights

        return hf.to_model_names(student, load_hf_weights(ckpt))

    def install_decode_attention(self, model: nn.Module) -> None:
        from kd.backends import decode_attention

        decode_attention.install_transformers(model)

    def kv_cache_steps(
        self, model: nn.Module, mask: torch.Tensor, *, width: int, total: int, static: bool = False
    ) -> _TransformersSteps:
        return _TransformersSteps(model, mask, width=width, total=total, static=static)


class _TransformersSteps:
    """transformers' cache (``DynamicCache``, filled by the decoder; ``static``: a
    ``StaticCache`` preallocated over ``total`` positions) with the 2-D padding mask and position
    ids of left-padded prompts."""

    def __init__(
        self, model: nn.Module, mask: torch.Tensor, *, width: int, total: int, static: bool = False
    ):
        from transformers import DynamicCache, StaticCache

        self.model, self.mask = model, mask.long()
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache_key = cache_keyword(model)
        config = getattr(model, "config", None)
        self.static = static
        self.cache = (
            StaticCache(config=config, max_cache_len=total)
            if static
            else DynamicCache(config=config)
        )

    def capturable(self) -> bool:
        """Whether :meth:`decode` may be replayed from a CUDA graph: a preallocated cache with no
        sliding-window layer. Such a layer (transformers' ``StaticSlidingWindowLayer``) keeps a
        Python count of its length that reaches the step's tensors (and picks a branch once its
        window is full), which a graph captured at one step replays stale at the next
        (``tests/unit/rollouts/test_graphs.py``)."""
        return self.static and not any(
            getattr(layer, "is_sliding", False) for layer in self.cache.layers
        )

    def select(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` of the batch (finished rows leave)."""
        if self.static:  # transformers' static layers cannot select rows: their tensors shrink
            for layer in self.cache.layers:
                if getattr(layer, "is_initialized", False):
                    layer.keys = layer.keys.index_select(0, index)
                    layer.values = layer.values.index_select(0, index)
                    layer.batch_size = int(index.numel())
        else:
            self.cache.batch_select_indices(index)
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)

    def __enter__(self) -> Callable[[torch.Tensor, int], torch.Tensor]:
        return self.forward

    def __exit__(self, *exc: object) -> None:
        del self.cache

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        end = start + x.shape[1]
        extra = {}
        if self.static:  # the cache's write positions; the whole mask (one shape every step)
            extra["cache_position"] = torch.arange(start, end, device=x.device)
        return self.model(
            x,
            attention_mask=self.mask if self.static else self.mask[:, :end],
            position_ids=self.positions[:, start:end],
            use_cache=True,
            **{self.cache_key: self.cache},
            **extra,
        )

    def decode(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One position ``pos`` (``[1]`` int64, on the device) of the ``[b, 1]`` tokens ``x``
        over the ``StaticCache`` (``static``): :meth:`forward` with the position read from a
        tensor, never a Python int, so that a CUDA graph (``kd.rollouts.graphs``) replays it at
        every position."""
        if not self.static:
            raise ValueError("decode needs the preallocated cache (static=True)")
        return self.model(
            x,
            attention_mask=self.mask,
            position_ids=self.positions.index_select(1, pos),
            use_cache=True,
            cache_position=pos,
            **{self.cache_key: self.cache},
        )


def cache_keyword(model: nn.Module) -> str:
    """The keyword the model's ``forward`` takes its KV cache by: ``cache`` since transformers
    5.2x (``past_key_values`` is deprecated there and goes in 5.40), ``past_key_values`` before
    (read from the signature of the model's class under any peft wrapper: kd's hidden-output
    mode replaces the instance's ``forward`` and passes the keywords on to the decoder)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_keyword_of(type(base))


@functools.cache
def _cache_keyword_of(cls: type) -> str:
    """:func:`cache_keyword` of a model class (read once per class, not at every rollout)."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
