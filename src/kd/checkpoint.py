"""Student checkpoints: Hugging Face format weights, atomic step checkpoints, resume.

Layout under ``output_dir``::

    step_000010/                 one folder per save; complete iff kd_checkpoint.json exists
      model.safetensors          HF key names (transformers loads the folder)
      config.json, tokenizer...  copied from the student's checkpoint_dir
      adapter_model.safetensors  LoRA only: PEFT key names ...
      adapter_config.json        ... and PEFT config
      recipe_state.pt            optimizer, LR scheduler, dataloader, RNG, counters (weights_only)
      config.yaml                resolved config snapshot
      kd_checkpoint.json         written last: step, epoch, file sizes / sha256, config hash
    final/                       the same HF files at the end of training, no recipe_state.pt

A save writes into ``.tmp_<name>_<pid>/``, fsyncs every file and the folder, renames it into place
and fsyncs ``output_dir``; so a ``kill -9`` at any moment leaves either the old set of checkpoints or
the old set plus the new one, never a half-written folder that looks complete. Nothing is unpickled
on load: weights come from safetensors, recipe state from ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import kd
from kd.errors import KDUserError

logger = logging.getLogger("kd")


def _tt() -> Any:
    """kd._torchtune, imported on first use: the step-checkpoint mechanics do not need torchtune
    (a multi-second import), only the weight-name conversions do."""
    from kd import _torchtune

    return _torchtune


MARKER_FILE = "kd_checkpoint.json"
RECIPE_STATE_FILE = "recipe_state.pt"
CONFIG_SNAPSHOT_FILE = "config.yaml"
MODEL_FILE = "model.safetensors"
MODEL_INDEX_FILE = "model.safetensors.index.json"
HF_CONFIG_FILE = "config.json"
ADAPTER_MODEL_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
FINAL_DIRNAME = "final"

_STEP_DIR_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp_"
# Files up to this size get a sha256 in the marker (configs, tokenizer, tiny models); larger
# weight files only a size, because hashing many GB at every save and resume is too slow.
_HASH_LIMIT_BYTES = 16 * 2**20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# kd's own files: never copied from a source folder that is itself a kd checkpoint.
_KD_FILES = frozenset({MARKER_FILE, RECIPE_STATE_FILE, CONFIG_SNAPSHOT_FILE, ADAPTER_CONFIG_FILE})
_PEFT_PREFIX = "base_model.model."
# torchtune adapter leaf -> PEFT adapter leaf.
_TUNE_TO_PEFT_LEAF = {
    ".lora_a.weight": ".lora_A.weight",
    ".lora_b.weight": ".lora_B.weight",
    ".magnitude": ".lora_magnitude_vector",
}
_IO_ERROR_HINTS = (
    "no space left",
    "disk quota",
    "os error",
    "file write failed",
    "input/output error",
)

# Top-level config keys that do not change the training trajectory: resuming with a different
# value is allowed (a resumed job may land on a GPU with less memory, or train for longer).
BENIGN_CONFIG_KEYS: frozenset[str] = frozenset(
    {
        "output_dir",
        "log_every_n_steps",
        "log_peak_memory_stats",
        "metric_logger",
        "save_every_n_steps",
        "keep_last_n",
        "max_steps_per_epoch",
        "epochs",
        "resume_from_checkpoint",
        "memory",
        "device",
        "compile",
        "enable_activation_checkpointing",
        "fused_loss",
        "loss_chunk_size",
        "optimizer_in_cpu",
        "fsdp",
        "max_bad_steps",
        "trust_remote_components",
    }
)
# Leaves inside checkpointer nodes that name where to write, not what to train.
_BENIGN_CHECKPOINTER_LEAVES = frozenset(
    {"output_dir", "recipe_checkpoint", "resume_from_checkpoint"}
)


# ----------------------------------------------------------------------------------------------
# Weight names: torchtune <-> Hugging Face <-> PEFT
# ----------------------------------------------------------------------------------------------


def _model_type_name(model_type: Any) -> str:
    """``"QWEN2"`` for ``"qwen2"``, ``"QWEN2"`` or ``ModelType.QWEN2``."""
    return str(getattr(model_type, "name", model_type)).upper()


def _head_args(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """num_heads, num_kv_heads, dim, head_dim of torchtune's converters, from an HF config.json."""
    try:
        num_heads = int(hf_config["num_attention_heads"])
        dim = int(hf_config["hidden_size"])
    except KeyError as e:
        raise KDUserError(
            f"config.json: missing {e.args[0]}; the student's checkpoint_dir must hold a Hugging Face "
            "decoder config (num_attention_heads, hidden_size)"
        ) from e
    return {
        "num_heads": num_heads,
        "num_kv_heads": int(hf_config.get("num_key_value_heads") or num_heads),
        "dim": dim,
        "head_dim": hf_config.get("head_dim"),
    }


def _tied(hf_config: Mapping[str, Any]) -> bool:
    # Qwen2Config and LlamaConfig default to untied; save_pretrained may omit a default value.
    return bool(hf_config.get("tie_word_embeddings", False))


def tune_to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], *, model_type: str, hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Rename (and for Llama-style RoPE, permute q/k rows of) a torchtune state dict to HF names.

    Args:
        state_dict: torchtune names (``layers.0.attn.q_proj.weight``), no LoRA keys.
        model_type: torchtune ``ModelType`` name (``QWEN2``, ``LLAMA3``, ``LLAMA3_2``...).
        hf_config: the model's HF ``config.json`` as a dict.

    Returns:
        HF names (``model.layers.0.self_attn.q_proj.weight``). With ``tie_word_embeddings`` there is
        no ``lm_head.weight`` (transformers ties it); without, ``lm_head.weight`` is always present
        (copied from the embedding if the torchtune model was tied).
    """
    args = _head_args(hf_config)
    tied = _tied(hf_config)
    if _model_type_name(model_type) == "QWEN2":
        out = _tt().qwen2_tune_to_hf(state_dict, **args, tie_word_embeddings=tied)
    else:
        out = _tt().tune_to_hf(state_dict, **args)
    if tied:
        out.pop("lm_head.weight", None)
    elif "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def hf_to_tune_state_dict(
    state_dict: dict[str, torch.Tensor], *, model_type: str, hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`tune_to_hf_state_dict`.

    Args:
        state_dict: HF names, e.g. from :func:`load_hf_weights`.
        model_type: torchtune ``ModelType`` name.
        hf_config: the model's HF ``config.json`` as a dict.

    Returns:
        torchtune names; ``lm_head.weight`` is dropped when the config ties embeddings (torchtune's
        tied builders have no ``output.weight``).
    """
    args = _head_args(hf_config)
    tied = _tied(hf_config)
    if tied:
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    if _model_type_name(model_type) == "QWEN2":
        return _tt().qwen2_hf_to_tune(state_dict, **args, tie_word_embeddings=tied)
    return _tt().hf_to_tune(state_dict, **args)


def _hf_to_tune_keys(model_type: str) -> dict[str, str | None]:
    return (
        _tt().QWEN2_HF_TO_TUNE_KEYS
        if _model_type_name(model_type) == "QWEN2"
        else _tt().HF_TO_TUNE_KEYS
    )


def _permutes_qk(model_type: str) -> bool:
    # torchtune's Llama-family RoPE is interleaved, HF's is half-split, so q/k output rows are
    # permuted on conversion. Qwen2 in torchtune uses HF's layout: no permutation (torchtune's own
    # tune_to_peft_adapter_weights permutes anyway, which breaks Qwen2 adapters; hence ours).
    return _model_type_name(model_type) != "QWEN2"


def _rows_tune_to_hf(t: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Permute dim 0 (n_heads * head_dim rows) from interleaved to half-split RoPE order."""
    rest = t.shape[1:]
    return (
        t.reshape(n_heads, head_dim // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(n_heads * head_dim, *rest)
    )


def _rows_hf_to_tune(t: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    rest = t.shape[1:]
    return (
        t.reshape(n_heads, 2, head_dim // 2, *rest)
        .transpose(1, 2)
        .reshape(n_heads * head_dim, *rest)
    )


def tune_to_peft_adapter_state_dict(
    adapter_state_dict: dict[str, torch.Tensor], *, model_type: str, hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """torchtune LoRA/DoRA adapter names -> PEFT names, with the RoPE row permutation where needed.

    ``layers.0.attn.q_proj.lora_a.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.

    Args:
        adapter_state_dict: the adapter params (``get_adapter_state_dict(model.state_dict())``).
        model_type: torchtune ``ModelType`` name.
        hf_config: the model's HF ``config.json`` as a dict.

    Returns:
        PEFT-named tensors; lora_B (out, rank) and magnitude (out,) of q/k are permuted like the
        base weights' rows.
    """
    args = _head_args(hf_config)
    head_dim = args["head_dim"] or args["dim"] // args["num_heads"]
    tune_to_hf_keys = {v: k for k, v in _hf_to_tune_keys(model_type).items() if v is not None}
    out: dict[str, torch.Tensor] = {}
    for key, value in adapter_state_dict.items():
        leaf = next((s for s in _TUNE_TO_PEFT_LEAF if key.endswith(s)), None)
        if leaf is None:
            raise ValueError(f"not a LoRA/DoRA adapter key: {key}")
        module = key[: -len(leaf)]
        hf_module = _tt().get_mapped_key(module + ".weight", tune_to_hf_keys)[: -len(".weight")]
        if _permutes_qk(model_type) and leaf != ".lora_a.weight":
            if module.endswith("q_proj"):
                value = _rows_tune_to_hf(value, args["num_heads"], head_dim)
            elif module.endswith("k_proj"):
                value = _rows_tune_to_hf(value, args["num_kv_heads"], head_dim)
        out[_PEFT_PREFIX + hf_module + _TUNE_TO_PEFT_LEAF[leaf]] = value
    return out


def peft_to_tune_adapter_state_dict(
    adapter_state_dict: dict[str, torch.Tensor], *, model_type: str, hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`tune_to_peft_adapter_state_dict` (used to resume a LoRA run)."""
    args = _head_args(hf_config)
    head_dim = args["head_dim"] or args["dim"] // args["num_heads"]
    hf_to_tune_keys = {k: v for k, v in _hf_to_tune_keys(model_type).items() if v is not None}
    peft_to_tune_leaf = {v: k for k, v in _TUNE_TO_PEFT_LEAF.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in adapter_state_dict.items():
        leaf = next((s for s in peft_to_tune_leaf if key.endswith(s)), None)
        if leaf is None or not key.startswith(_PEFT_PREFIX):
            raise KDUserError(
                f"{ADAPTER_MODEL_FILE}: unexpected key {key}; it is not a PEFT LoRA adapter"
            )
        hf_module = key[len(_PEFT_PREFIX) : -len(leaf)]
        module = _tt().get_mapped_key(hf_module + ".weight", hf_to_tune_keys)[: -len(".weight")]
        tune_leaf = peft_to_tune_leaf[leaf]
        if _permutes_qk(model_type) and tune_leaf != ".lora_a.weight":
            if module.endswith("q_proj"):
                value = _rows_hf_to_tune(value, args["num_heads"], head_dim)
            elif module.endswith("k_proj"):
                value = _rows_hf_to_tune(value, args["num_kv_heads"], head_dim)
        out[module + tune_leaf] = value
    return out


# ----------------------------------------------------------------------------------------------
# HF folder save / load
# ----------------------------------------------------------------------------------------------


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
        state_dict = _tt().get_merged_lora_ckpt(
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
        peft_config = _tt().tune_to_peft_adapter_config(
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


# ----------------------------------------------------------------------------------------------
# Recipe state and RNG
# ----------------------------------------------------------------------------------------------


# Tensor subclasses that may sit in optimizer state (torchao's low-bit AdamW states). They are stored
# as their plain inner tensors plus the class name, so torch.load(weights_only=True) still reads the
# file, and rebuilt exactly on load (bit-identical resume with AdamW8bit too).
_SUBCLASS_KEY = "__kd_tensor_subclass__"
_SUBCLASS_MODULES = ("torchao.optim.",)


def encode_tensor_subclasses(obj: Any) -> Any:
    """Replace allow-listed tensor subclasses by ``{_SUBCLASS_KEY: name, inner..., ctx, size}`` dicts."""
    if isinstance(obj, torch.Tensor) and type(obj) not in (torch.Tensor, torch.nn.Parameter):
        cls = type(obj)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name.startswith(_SUBCLASS_MODULES) and hasattr(obj, "__tensor_flatten__"):
            inner_names, ctx = obj.__tensor_flatten__()
            return {
                _SUBCLASS_KEY: name,
                "inner": {n: getattr(obj, n) for n in inner_names},
                "ctx": list(ctx) if isinstance(ctx, tuple) else ctx,
                "size": list(obj.size()),
                "stride": list(obj.stride()),
            }
        return obj
    if isinstance(obj, dict):
        return {k: encode_tensor_subclasses(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [encode_tensor_subclasses(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(encode_tensor_subclasses(v) for v in obj)
    return obj


def decode_tensor_subclasses(obj: Any) -> Any:
    """Inverse of :func:`encode_tensor_subclasses` (only allow-listed classes are rebuilt)."""
    if isinstance(obj, dict):
        name = obj.get(_SUBCLASS_KEY)
        if isinstance(name, str):
            if not name.startswith(_SUBCLASS_MODULES):
                raise KDUserError(f"recipe state names tensor class {name}, which kd does not load")
            import importlib

            module, _, qual = name.rpartition(".")
            cls = getattr(importlib.import_module(module), qual)
            ctx = obj["ctx"]
            ctx = tuple(ctx) if isinstance(ctx, list) else ctx
            return cls.__tensor_unflatten__(
                obj["inner"], ctx, torch.Size(obj["size"]), tuple(obj["stride"])
            )
        return {k: decode_tensor_subclasses(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tensor_subclasses(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(decode_tensor_subclasses(v) for v in obj)
    return obj


def _check_weights_only(obj: Any, path: str = "recipe_state") -> None:
    """Fail at save time (not hours later at resume) if obj is not weights_only-loadable."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            # DTensor (FSDP) or torchao quantized optimizer states: gather / convert first.
            raise TypeError(
                f"{path}: tensor subclass {type(obj).__name__} cannot be saved in recipe_state.pt"
            )
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{path}: dict key {k!r} of type {type(k).__name__}")
            _check_weights_only(v, f"{path}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_weights_only(v, f"{path}[{i}]")
        return
    raise TypeError(
        f"{path}: {type(obj).__name__} is not loadable with torch.load(weights_only=True)"
    )


def load_recipe_state(ckpt: Path) -> dict[str, Any]:
    """``recipe_state.pt`` of a step checkpoint, loaded with ``weights_only=True`` on CPU."""
    path = Path(ckpt) / RECIPE_STATE_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise KDUserError(
            f"{path}: cannot read the recipe state ({e}); delete {Path(ckpt).name} to resume from an older checkpoint"
        ) from e
    return decode_tensor_subclasses(state)


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and CUDA RNG states as tensors / ints (weights_only-loadable)."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    try:
        import numpy as np
    except ImportError:  # numpy is optional for kd itself
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "name": str(name),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    py = state["python"]
    random.setstate(
        (int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"])
    )
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda") or []
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            logger.warning(
                "checkpoint has CUDA RNG states of %d devices, this process sees %d; CUDA RNG not restored",
                len(cuda_states),
                torch.cuda.device_count(),
            )
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state(
            (
                s["name"],
                s["keys"].numpy().astype(np.uint32),
                s["pos"],
                s["has_gauss"],
                s["cached_gaussian"],
            )
        )


# ----------------------------------------------------------------------------------------------
# Config snapshot compatibility
# ----------------------------------------------------------------------------------------------


def _trajectory_keys(cfg_yaml: str) -> dict[str, Any]:
    """Flattened dotted keys of a config that change the training trajectory."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.create(cfg_yaml), resolve=False)
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            flat[prefix] = node

    walk(container if isinstance(container, dict) else {}, "")
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        if parts[0] in BENIGN_CONFIG_KEYS:
            continue
        if (
            len(parts) == 2
            and parts[0].endswith("checkpointer")
            and parts[1] in _BENIGN_CHECKPOINTER_LEAVES
        ):
            continue
        out[key] = value
    return out


def config_hash(cfg_yaml: str) -> str:
    """sha256 (hex) of the config keys that change the training trajectory (benign keys ignored)."""
    canonical = json.dumps(_trajectory_keys(cfg_yaml), sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_resume_compatible(
    saved_config_yaml: str, current_config_yaml: str, *, checkpoint: Path | None = None
) -> None:
    """Raise KDUserError naming every trajectory key that differs from the checkpoint's config.

    Args:
        saved_config_yaml: ``config.yaml`` of the checkpoint.
        current_config_yaml: the resolved config of this run.
        checkpoint: the checkpoint folder, named in the message.
    """
    saved = _trajectory_keys(saved_config_yaml)
    current = _trajectory_keys(current_config_yaml)
    missing = object()
    problems = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, missing), current.get(key, missing)
        if a != b:
            a_s = "unset" if a is missing else repr(a)
            b_s = "unset" if b is missing else repr(b)
            problems.append(f"{key}: {a_s} in the checkpoint, {b_s} now")
    if not problems:
        return
    where = (
        f"{checkpoint / CONFIG_SNAPSHOT_FILE}"
        if checkpoint is not None
        else "the checkpoint's config.yaml"
    )
    problems.append(
        f"resume_from_checkpoint: the config changed in ways that alter training; resume with {where} "
        "(only paths, logging, memory and saving keys may change), or set output_dir to a new folder"
    )
    raise KDUserError("\n".join(problems))


def load_checkpoint_config(ckpt: Path) -> str:
    """The resolved config snapshot (``config.yaml``) of a checkpoint folder."""
    return (Path(ckpt) / CONFIG_SNAPSHOT_FILE).read_text()


def read_checkpoint_marker(ckpt: Path) -> dict[str, Any]:
    """The parsed ``kd_checkpoint.json`` of a complete checkpoint folder."""
    return json.loads((Path(ckpt) / MARKER_FILE).read_text())


# ----------------------------------------------------------------------------------------------
# Atomic step checkpoints
# ----------------------------------------------------------------------------------------------


def step_dirname(step: int) -> str:
    """``step_000010`` for step 10."""
    return f"step_{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _describe_files(folder: Path) -> dict[str, dict[str, Any]]:
    """{relative name: {"size", "sha256" (small files and recipe_state.pt only)}}."""
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        name = p.relative_to(folder).as_posix()
        entry: dict[str, Any] = {"size": p.stat().st_size}
        if name == RECIPE_STATE_FILE or entry["size"] <= _HASH_LIMIT_BYTES:
            entry["sha256"] = _sha256(p)
        files[name] = entry
    return files


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_tmp(output_dir: Path) -> None:
    """Remove ``.tmp_*`` folders left by killed saves (not those of another live process)."""
    for p in output_dir.glob(_TMP_PREFIX + "*"):
        m = re.search(r"_(\d+)$", p.name)
        pid = int(m.group(1)) if m else None
        if pid is not None and pid != os.getpid() and _pid_alive(pid):
            continue
        logger.info("removing %s left by an interrupted save", p)
        shutil.rmtree(p, ignore_errors=True)


def _discard(folder: Path) -> None:
    """Delete a checkpoint folder so that a kill midway never leaves it looking complete."""
    doomed = folder.parent / f"{_TMP_PREFIX}del_{folder.name}_{os.getpid()}"
    os.rename(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _is_io_error(e: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError):
            return True
        if any(h in str(cur).lower() for h in _IO_ERROR_HINTS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _step_dirs(output_dir: Path) -> list[tuple[int, Path]]:
    out = []
    for p in output_dir.iterdir() if output_dir.is_dir() else ():
        m = _STEP_DIR_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _prune(output_dir: Path, keep_last_n: int, just_written: Path) -> None:
    complete = [p for _, p in _step_dirs(output_dir) if (p / MARKER_FILE).exists()]
    keep = set(complete[-keep_last_n:]) | {just_written}
    if just_written not in complete[-keep_last_n:]:
        logger.warning(
            "%s holds step checkpoints newer than %s from another run; they are kept, and "
            "resume_from_checkpoint would pick the newest step",
            output_dir,
            just_written.name,
        )
    for p in complete:
        if p not in keep:
            _discard(p)


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    epoch: int,
    write_model: Callable[[Path], None],
    recipe_state: dict[str, Any] | None,
    config_yaml: str,
    config_hash: str,
    keep_last_n: int,
) -> Path:
    """Atomically write ``output_dir/step_<step>/`` (or ``output_dir/final/`` when recipe_state is None).

    Args:
        output_dir: the run's output folder (created if missing).
        step: optimizer steps done so far (recorded in the marker; names step folders).
        epoch: the epoch the next step belongs to (recorded in the marker).
        write_model: called with the temporary folder; writes the HF files (e.g. a closure over
            :func:`save_hf_model`).
        recipe_state: optimizer, lr_scheduler, dataloader, rng, counters: plain tensors, dicts,
            lists, numbers and strings only. None writes the ``final/`` folder.
        config_yaml: the resolved config, saved as ``config.yaml``.
        config_hash: :func:`config_hash` of ``config_yaml``, recorded in the marker.
        keep_last_n: complete step folders kept; older ones are removed after the new one is in
            place (``final/`` is never counted or removed).

    Returns:
        The final folder.

    Raises:
        KDUserError: the disk is full or another OS error stopped the write; the temporary folder is
            removed and every existing checkpoint is left as it was.
    """
    output_dir = Path(output_dir)
    name = FINAL_DIRNAME if recipe_state is None else step_dirname(step)
    final = output_dir / name
    tmp = output_dir / f"{_TMP_PREFIX}{name}_{os.getpid()}"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(output_dir)
        tmp.mkdir()
        write_model(tmp)
        if recipe_state is not None:
            recipe_state = encode_tensor_subclasses(recipe_state)
            _check_weights_only(recipe_state)
            with open(tmp / RECIPE_STATE_FILE, "wb") as f:
                torch.save(recipe_state, f)
                f.flush()
                os.fsync(f.fileno())
        _write_text_synced(tmp / CONFIG_SNAPSHOT_FILE, config_yaml)
        for p in tmp.rglob("*"):
            # write_model's files (safetensors, copies) are not fsynced by their writers.
            _fsync_path(p)
        marker = {
            "step": int(step),
            "epoch": int(epoch),
            "files": _describe_files(tmp),
            "config_hash": config_hash,
            "kd_version": kd.__version__,
        }
        # The marker goes last: a folder is complete iff it has one, and everything it lists is
        # already on disk.
        _write_text_synced(tmp / MARKER_FILE, json.dumps(marker, indent=2, sort_keys=True) + "\n")
        _fsync_path(tmp)
        if final.exists():
            # Same step saved again (or a second final/): move the old one aside, then replace.
            old = output_dir / f"{_TMP_PREFIX}old_{name}_{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_path(output_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, KDUserError) and _is_io_error(e):
            reason = " ".join(str(e).split())  # torch's messages span lines
            raise KDUserError(
                f"could not write checkpoint {final}: {reason}; free disk space under {output_dir} or set "
                "output_dir to a disk with room (existing checkpoints are untouched)"
            ) from e
        raise
    if recipe_state is not None:
        try:
            _prune(output_dir, keep_last_n, final)
        except OSError as e:  # the new checkpoint is safe; a failed cleanup must not stop training
            logger.warning("could not remove old checkpoints in %s: %s", output_dir, e)
    logger.info("saved checkpoint %s", final)
    return final


def _problem_with(ckpt: Path) -> str | None:
    """Why a step folder cannot be resumed from, or None if it is complete and intact."""
    marker_path = ckpt / MARKER_FILE
    if not marker_path.exists():
        return f"no {MARKER_FILE} (the save did not finish)"
    try:
        marker = json.loads(marker_path.read_text())
        files = marker["files"]
        int(marker["step"]), int(marker["epoch"])
        sizes = {name: int(entry["size"]) for name, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MARKER_FILE} is unreadable ({type(e).__name__}: {e})"
    if RECIPE_STATE_FILE not in files:
        return f"{MARKER_FILE} lists no {RECIPE_STATE_FILE}"
    for name, size in sizes.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, {size} expected (truncated or overwritten)"
    for name, entry in files.items():
        expected = entry.get("sha256")
        if expected is not None and _sha256(ckpt / name) != expected:
            return f"{name} does not match its sha256 (corrupt)"
    return None


def find_latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete, intact ``step_*`` folder in output_dir, or None.

    Incomplete or corrupt folders newer than it are skipped with a warning on the ``kd`` logger
    naming the folder and the reason.
    """
    for _, ckpt in reversed(_step_dirs(Path(output_dir))):
        problem = _problem_with(ckpt)
        if problem is None:
            return ckpt
        logger.warning("skipping checkpoint %s: %s", ckpt, problem)
    return None
