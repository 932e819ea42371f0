"""The torchtune backend: models of torchtune builders (``TransformerDecoder``), loaded through
torchtune checkpointers (every torchtune import goes through :mod:`kd._torchtune`)."""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kd import _torchtune as tt
from kd.backends.base import CHECKPOINTER_OF, WeightsSource
from kd.errors import KDUserError, brief

__all__ = ["TorchtuneBackend", "load_checkpointer_weights", "load_weights"]

MODEL_KEY = tt.MODEL_KEY  # the model weights' key in a torchtune checkpointer's state


def _unembed_hidden(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    # Replaces TransformerDecoder.unembed for this instance: final norm only, no projection and no
    # fp32 upcast of [b, s, v] logits.
    return self.norm(h)


def load_weights(
    model: nn.Module, state_dict: dict[str, torch.Tensor], *, lora: bool, source: str
) -> None:
    """Load a torchtune-format state dict into ``model``.

    A LoRA student loads its base weights (adapters start from their init); anything else must match
    exactly. Mismatches are user errors (wrong checkpoint or wrong builder for it).
    """
    try:
        if lora:
            missing, unexpected = model.load_state_dict(state_dict, strict=False)
            lora_names = {n for n in missing if "lora" in n or "magnitude" in n}
            missing = [n for n in missing if n not in lora_names]
            if missing or unexpected:
                raise RuntimeError(f"missing {missing[:3]}, unexpected {list(unexpected)[:3]}")
        else:
            model.load_state_dict(state_dict, strict=True)
    except RuntimeError as e:
        # torch's first line is a generic header; the key names follow it.
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        first = " ".join(lines[1:] or lines)[:300]
        raise KDUserError(
            f"{source}: the checkpoint does not match the model builder ({first}); check that "
            f"{source}.checkpoint_dir holds weights of the model named in the builder"
        ) from e


def load_checkpointer_weights(
    model: nn.Module, build_checkpointer: Callable[[], Any], *, key: str, folder: Any
) -> None:
    """Load ``model``'s weights through a torchtune checkpointer (:func:`load_weights`).

    Args:
        model: the built model.
        build_checkpointer: builds the checkpointer of ``key`` (raising :class:`KDUserError`).
        key: the checkpointer key (``checkpointer``, ``teacher_checkpointer``), named in errors.
        folder: its ``checkpoint_dir``, named in errors.

    Raises:
        KDUserError: the checkpointer cannot be built, its weights do not match the model, or
            reading them failed (truncated or foreign files: whatever torchtune or safetensors
            raise becomes one line naming ``key``). Out-of-memory errors pass through.
    """
    try:
        checkpointer = build_checkpointer()
        state = checkpointer.load_checkpoint()[MODEL_KEY]
        load_weights(model, state, lora=TorchtuneBackend().is_lora(model), source=key)
    except (KDUserError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - torchtune/safetensors raise many types
        raise KDUserError(
            f"{key}: cannot load the weights in {folder} ({brief(e)}); check that "
            f"{key}.checkpoint_files are complete safetensors of the model its "
            "builder names (re-download truncated files)"
        ) from e


def peft_adapter_config(lora: Any) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` fields of a torchtune LoRA student
    (:class:`kd.config.run.LoraSettings`)."""
    return {
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": tt.get_lora_module_names(
            list(lora.attn_modules), lora.apply_to_mlp, lora.apply_to_output
        ),
        "peft_type": "LORA",
    }


class TorchtuneBackend:
    """torchtune ``TransformerDecoder`` models (see :class:`kd.backends.base.Backend`)."""

    # A checkpointer's folder holds weights; the tokenizer is the config's (family rule).
    folder_is_model = False
    name = "torchtune"

    def is_decoder(self, model: Any) -> bool:
        return isinstance(model, nn.Module) and hasattr(model, "output")

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.layers

    def input_embeddings(self, model: nn.Module) -> nn.Module:
        return model.tok_embeddings

    def output_weight(self, model: nn.Module) -> torch.Tensor:
        out = model.output
        if isinstance(out, tt.TiedLinear):
            return out.tied_module.weight
        return out.weight

    def is_tied(self, model: nn.Module) -> bool:
        return isinstance(model.output, tt.TiedLinear)

    def has_plain_output(self, model: nn.Module) -> bool:
        # A LoRA output projection (apply_lora_to_output) needs the adapter path for its logits.
        out = model.output
        return isinstance(out, tt.TiedLinear) or type(out) is nn.Linear

    def set_hidden_output(self, model: nn.Module, enabled: bool) -> None:
        if enabled:
            model.unembed = types.MethodType(_unembed_hidden, model)
        elif "unembed" in model.__dict__:
            del model.__dict__["unembed"]

    def logits_from_hidden(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return model.output(hidden).float()

    def is_lora(self, model: nn.Module) -> bool:
        return any(isinstance(m, tt.LoRALinear) for m in model.modules())

    def adapters_disabled(self, model: nn.Module) -> AbstractContextManager[None]:
        # torchtune's own switch (the DPO recipes' reference model): LoRALinear.disabled.
        return tt.disable_adapter(model)

    def setup_lora_trainable(self, model: nn.Module) -> None:
        tt.set_trainable_params(model, tt.get_adapter_params(model))

    def attention_shape(self, model: nn.Module) -> tuple[int, int, int] | None:
        layers = getattr(model, "layers", None)
        attn = getattr(layers[0], "attn", None) if layers is not None and len(layers) else None
        values = [getattr(attn, name, None) for name in ("num_heads", "num_kv_heads", "head_dim")]
        if all(isinstance(v, int) for v in values):
            return values[0], values[1], values[2]
        return None

    def max_seq_len(self, model: nn.Module) -> int | None:
        value = getattr(model, "max_seq_len", None)
        return value if isinstance(value, int) else None

    def weights_source(
        self, model: nn.Module, *, key: str, node: Mapping[str, Any], ckpt_node: Mapping[str, Any]
    ) -> WeightsSource:
        return WeightsSource(
            CHECKPOINTER_OF[key],
            "checkpoint_dir",
            Path(str(ckpt_node.get("checkpoint_dir"))).expanduser(),
            ckpt_node.get("checkpoint_files"),
            self.name,
            str(ckpt_node.get("model_type")),
        )

    def load_weights(
        self, model: nn.Module, source: WeightsSource, build_checkpointer: Callable[[], Any]
    ) -> None:
        load_checkpointer_weights(model, build_checkpointer, key=source.key, folder=source.folder)

    def export_student(
        self,
        dest: Path,
        student: nn.Module,
        full: dict[str, torch.Tensor],
        source: Any,
        *,
        adapter_only: bool = False,
    ) -> None:
        """Write the student as a Hugging Face folder: torchtune names converted, a LoRA student's
        adapters merged into copies of the base weights and saved as a PEFT adapter too
        (``adapter_only``: the PEFT adapter alone)."""
        from kd.checkpoint.hf_folder import save_hf_model

        lora = source.lora
        save_hf_model(
            dest,
            full,
            model_type=source.model_type,
            source_dir=source.source_dir,
            adapter_state_dict=tt.get_adapter_state_dict(full) if lora else None,
            adapter_config=peft_adapter_config(lora) if lora else None,
            extra_files=source.tokenizer_files,
            adapter_only=adapter_only,
        )

    def saved_student_weights(
        self, student: nn.Module, ckpt: Path, source: Any
    ) -> dict[str, torch.Tensor]:
        """A step checkpoint's (HF-named) weights in the student's torchtune names."""
        from kd.checkpoint.convert import hf_to_tune_state_dict
        from kd.checkpoint.hf_folder import load_hf_weights, read_hf_config

        return hf_to_tune_state_dict(
            load_hf_weights(ckpt),
            model_type=source.model_type,
            hf_config=read_hf_config(source.source_dir),
        )

    def install_decode_attention(self, model: nn.Module) -> None:
        from kd.backends import decode_attention

        decode_attention.install_torchtune(model)

    def kv_cache_steps(
        self, model: nn.Module, mask: torch.Tensor, *, width: int, total: int
    ) -> _TorchtuneSteps:
        return _TorchtuneSteps(model, mask, width=width, total=total)


class _TorchtuneSteps:
    """torchtune's KV cache (``local_kv_cache``) and padding masks: ``forward(x, start)`` runs
    positions ``start .. start + len(x)`` of the ``[b, total]`` sequence."""

    def __init__(self, model: nn.Module, mask: torch.Tensor, *, width: int, total: int):
        self.model = model
        dtype = _cache_dtype(model)
        self.positions = tt.get_position_ids_from_padding_mask(mask)
        self.prefill_mask = tt.get_causal_mask_from_padding_mask(
            mask[:, :width], target_seq_len=total
        )
        self.cache = tt.local_kv_cache(
            model,
            batch_size=mask.shape[0],
            device=mask.device,
            dtype=dtype,
            decoder_max_seq_len=total,
        )
        self.keys = torch.arange(total, device=mask.device)
        # The decode steps' masks are additive (0 where a row attends, -inf elsewhere), in the
        # model's dtype: attention turns a boolean mask into this in every layer (three more
        # device operations a layer at every token); here it is made once a token. The same
        # scores, bit for bit. The prefill keeps its boolean [b, width, total] mask.
        self.bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        self.bias.masked_fill_(~mask, float("-inf"))

    def __enter__(self) -> Callable[[torch.Tensor, int], torch.Tensor]:
        self.cache.__enter__()
        for module in self._caches():
            module.update = types.MethodType(_cache_update, module)
        return self.forward

    def __exit__(self, *exc: object) -> None:
        for module in self._caches():
            module.__dict__.pop("update", None)
        self.cache.__exit__(*exc)

    def _caches(self) -> list[nn.Module]:
        from torchtune.modules.kv_cache import KVCache

        return [m for m in self.model.modules() if isinstance(m, KVCache)]

    def select(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` of the batch (finished rows leave): the cache's, masks' and
        positions' rows (torchtune's caches take exactly their batch size)."""
        for module in self._caches():
            module.k_cache = module.k_cache.index_select(0, index)
            module.v_cache = module.v_cache.index_select(0, index)
            module.batch_size = int(index.numel())
        self.bias = self.bias.index_select(0, index)
        self.positions = self.positions.index_select(0, index)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        n = x.shape[1]
        if start == 0:
            attn = self.prefill_mask
        else:  # [b, 1, total]: the real tokens up to this position attend
            attn = self.bias.masked_fill(self.keys > start, float("-inf"))[:, None, :]
        return self.model(x, input_pos=self.positions[:, start : start + n], mask=attn)

    def capturable(self) -> bool:
        """:meth:`decode` may always be replayed from a CUDA graph (torchtune's caches are plain
        preallocated tensors with a device write position)."""
        return True

    def decode(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One position ``pos`` (``[1]`` int64, on the device) of the ``[b, 1]`` tokens ``x``:
        :meth:`forward` with the position read from a tensor, never a Python int, so that a CUDA
        graph (``kd.rollouts.graphs``) replays it at every position."""
        attn = self.bias.masked_fill(self.keys > pos, float("-inf"))[:, None, :]
        return self.model(x, input_pos=self.positions.index_select(1, pos), mask=attn)


def _cache_update(
    self: nn.Module, k_val: torch.Tensor, v_val: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtune's ``KVCache.update`` (the same writes, the same tensors returned) without its
    bounds check, whose read of ``cache_pos[0]`` makes the host wait for the device in every
    layer at every decoded token (24 waits a token for a 24-layer model on a GPU), and in three
    device operations instead of about ten (two ``index_copy_`` and the position's ``add_``: on a
    GPU, where decoding a small model is paced by kernel launches, each one counts). kd sizes the
    cache for the whole rollout (``total``: the prompt and every new token), so no write passes
    its end. The positions stay a device tensor, as torchtune's (compile-friendly)."""
    n = k_val.shape[2]
    at = self.cache_pos[:n]
    self.k_cache.index_copy_(2, at, k_val)
    self.v_cache.index_copy_(2, at, v_val)
    self.cache_pos.add_(n)
    return self.k_cache, self.v_cache


def _cache_dtype(model: nn.Module) -> torch.dtype:
    """The KV cache's dtype: the model's floating parameters'."""
    return next(p for p in model.parameters() if p.is_floating_point()).dtype
