"""Hugging Face model folders: write the student (merged weights, PEFT adapter), read weights back.

A folder written here loads with ``transformers.AutoModelForCausalLM.from_pretrained`` (and, for
LoRA, ``peft.PeftModel.from_pretrained``): ``model.safetensors`` in HF names, ``config.json`` with
the saved dtype, the tokenizer and other non-weight files of the source folder.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kd.checkpoint.convert import (
    peft_to_tune_adapter_state_dict,
    tune_to_hf_state_dict,
    tune_to_peft_adapter_state_dict,
)
from kd.checkpoint.layout import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_MODEL_FILE,
    CONFIG_SNAPSHOT_FILE,
    HF_CONFIG_FILE,
    MARKER_FILE,
    MODEL_FILE,
    MODEL_INDEX_FILE,
    RECIPE_STATE_FILE,
)
from kd.errors import KDUserError

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# kd's own files: never copied from a source folder that is itself a kd checkpoint.
_KD_FILES = frozenset({MARKER_FILE, RECIPE_STATE_FILE, CONFIG_SNAPSHOT_FILE, ADAPTER_CONFIG_FILE})


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """The ``config.json`` of an HF model folder, as a dict."""
    path = Path(model_dir) / HF_CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise KDUserError(
            f"{path}: not found; checkpointer.checkpoint_dir must be a Hugging Face model folder"
        ) from e
    except (OSError, ValueError) as e:
        raise KDUserError(
            f"{path}: unreadable ({e}); restore the file from the model's source"
        ) from e


def _prepare(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    # safetensors needs contiguous CPU tensors that share no storage with another entry.
    return t.to("cpu").contiguous()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")


def save_hf_model(
    dest: Path,
    state_dict: dict[str, torch.Tensor],
    *,
    model_type: str,
    source_dir: Path,
    adapter_state_dict: dict[str, torch.Tensor] | None = None,
    adapter_config: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write the student as an HF model folder into the existing folder ``dest``.

    Args:
        dest: an existing (usually temporary) folder.
        state_dict: the student's torchtune state dict on CPU (full tensors, not DTensors). LoRA keys
            (``*.lora_a.weight``, ``*.lora_b.weight``, ``*.magnitude``) are merged into the base
            weights with ``adapter_config["r"]`` and ``["lora_alpha"]``; the input is not modified.
        model_type: torchtune ``ModelType`` name of the student.
        source_dir: the student's original HF folder (``checkpointer.checkpoint_dir``): its
            ``config.json`` and other non-weight files (tokenizer, generation config) are copied.
        adapter_state_dict: LoRA only: adapter params in torchtune names; saved in PEFT format.
        adapter_config: LoRA only: ``{"r", "lora_alpha", "target_modules", ...}`` in torchtune's
            form (target modules ``q_proj``, ``output_proj``, ``w1``...).
        dtype: cast floating tensors to this dtype (None keeps each tensor's dtype).
    """
    from kd import _torchtune as tt  # only writing a model needs torchtune (a multi-second import)

    dest = Path(dest)
    source_dir = Path(source_dir)
    hf_config = read_hf_config(source_dir)

    state_dict = dict(state_dict)
    lora_modules = [k[: -len(".lora_a.weight")] for k in state_dict if k.endswith(".lora_a.weight")]
    if lora_modules:
        if adapter_config is None:
            raise ValueError(
                "state_dict has LoRA params; pass adapter_config with r and lora_alpha"
            )
        # get_merged_lora_ckpt adds B @ A in place: on a live model's state dict that would
        # change the parameters being trained, so merge into copies.
        for module in lora_modules:
            state_dict[f"{module}.weight"] = state_dict[f"{module}.weight"].clone()
        state_dict = tt.get_merged_lora_ckpt(
            state_dict, rank=int(adapter_config["r"]), alpha=float(adapter_config["lora_alpha"])
        )
    hf_state = {
        k: _prepare(v, dtype)
        for k, v in tune_to_hf_state_dict(
            state_dict, model_type=model_type, hf_config=hf_config
        ).items()
    }

    for item in sorted(source_dir.iterdir()):
        name = item.name
        if not item.is_file() or name.startswith(".") or name == HF_CONFIG_FILE:
            continue
        if _is_weight_file(name) or name in _KD_FILES:
            continue
        shutil.copyfile(item, dest / name)

    # config.json says which dtype the weights are in; transformers' dtype="auto" reads it.
    saved_dtype = dtype or next((v.dtype for v in hf_state.values() if v.is_floating_point()), None)
    if saved_dtype is not None:
        dtype_keys = [k for k in ("torch_dtype", "dtype") if k in hf_config] or ["torch_dtype"]
        for k in dtype_keys:
            hf_config[k] = _dtype_name(saved_dtype)
    (dest / HF_CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_file(hf_state, str(dest / MODEL_FILE), metadata={"format": "pt"})

    if adapter_state_dict is not None:
        if adapter_config is None:
            raise ValueError("adapter_state_dict needs adapter_config")
        peft_state = tune_to_peft_adapter_state_dict(
            adapter_state_dict, model_type=model_type, hf_config=hf_config
        )
        save_file(
            {k: _prepare(v, dtype) for k, v in peft_state.items()},
            str(dest / ADAPTER_MODEL_FILE),
            metadata={"format": "pt"},
        )
        peft_config = tt.tune_to_peft_adapter_config(
            copy.deepcopy(dict(adapter_config)), base_model_name_or_path=str(source_dir.resolve())
        )
        peft_config.setdefault("peft_type", "LORA")
        peft_config.setdefault("task_type", "CAUSAL_LM")
        peft_config.setdefault("bias", "none")
        peft_config.setdefault(
            "use_dora", any(k.endswith(".magnitude") for k in adapter_state_dict)
        )
        (dest / ADAPTER_CONFIG_FILE).write_text(
            json.dumps(peft_config, indent=2, sort_keys=True) + "\n"
        )


def load_hf_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The HF-named weights of a checkpoint folder (single file or sharded with an index), on CPU."""
    ckpt = Path(ckpt)
    index = ckpt / MODEL_INDEX_FILE
    try:
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            out: dict[str, torch.Tensor] = {}
            for shard in shards:
                out.update(load_file(str(ckpt / shard)))
            return out
        return load_file(str(ckpt / MODEL_FILE))
    except Exception as e:  # safetensors raises its own error type for corrupt files
        raise KDUserError(
            f"{ckpt}: cannot read the model weights ({e}); delete this folder to resume from an older checkpoint"
        ) from e


def load_adapter_weights(
    ckpt: Path, *, model_type: str, hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The LoRA adapter of a checkpoint folder, in torchtune names (to resume a LoRA run)."""
    path = Path(ckpt) / ADAPTER_MODEL_FILE
    try:
        peft_state = load_file(str(path))
    except Exception as e:
        raise KDUserError(
            f"{path}: cannot read the adapter ({e}); delete this folder to resume from an older checkpoint"
        ) from e
    return peft_to_tune_adapter_state_dict(peft_state, model_type=model_type, hf_config=hf_config)
