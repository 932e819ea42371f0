"""Shapes of transformers-backend models (``kd.hf.*``) from their ``config.json``.

``kd plan`` sizes a Hugging Face folder before its weights exist, from ``config.json`` alone and
without importing torch or transformers, for the architectures in :data:`ARCHITECTURES`: their
parameter counts are exact (a unit test builds each on the meta device) and the planner's
activation terms follow their transformers modules (:mod:`kd.memory.estimate`). Defaults are those
of transformers' config classes, for keys a ``config.json`` leaves out.

Another ``model_type`` transformers can build is counted on the meta device
(:func:`count_params_with_transformers`, which imports torch and transformers: a few seconds) and
planned with Llama-like layers; the plan says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kd import folders
from kd.memory.shapes import (
    FULL,
    RMS,
    RMS_1P,
    SLIDING,
    TRANSFORMERS,
    LoraSpec,
    ModelShape,
    ShapeError,
    _dim,
)

_ATTN = ("q_proj", "k_proj", "v_proj", "output_proj")
_MLP = ("w1", "w2", "w3")


@dataclass(frozen=True)
class Architecture:
    """What a transformers ``model_type`` builds, beyond the Llama layer every one here shares.

    Attributes:
        head_dim: default ``head_dim`` when config.json has none (None: hidden_size / heads).
        tied: default ``tie_word_embeddings``.
        attention_bias: ``attention_bias`` puts a bias on q, k, v and o; ``qkv`` always on q, k, v
            (Qwen2); ``none`` never.
        qk_norm: RMSNorm over each head of q and k.
        norm: ``rms`` or ``rms_1p``.
        sandwich_norms: norms after attention and after the MLP too.
        embed_scale: the embedding is scaled by sqrt(hidden_size).
        sliding: how the sliding-window layers are chosen when config.json has no ``layer_types``:
            ``none``, ``all`` (when ``sliding_window`` is set: Mistral), ``qwen``
            (``use_sliding_window`` and layers from ``max_window_layers`` on), ``pattern`` (every
            ``sliding_window_pattern``-th layer is full: Gemma 3).
        sliding_window: default ``sliding_window``.
        rope_per_kind: one rotary table per layer kind (Gemma 3's local and global RoPE).
    """

    head_dim: int | None = None
    tied: bool = False
    attention_bias: str = "attention_bias"
    qk_norm: bool = False
    norm: str = RMS
    sandwich_norms: bool = False
    embed_scale: bool = False
    sliding: str = "none"
    sliding_window: int | None = None
    rope_per_kind: bool = False


# Read from transformers 5's configuration_*.py and modeling_*.py of each model_type.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(),
    "mistral": Architecture(attention_bias="none", sliding="all", sliding_window=4096),
    "qwen2": Architecture(attention_bias="qkv", sliding="qwen", sliding_window=4096),
    "qwen3": Architecture(head_dim=128, qk_norm=True, sliding="qwen", sliding_window=4096),
    "gemma3_text": Architecture(
        head_dim=256,
        tied=True,
        qk_norm=True,
        norm=RMS_1P,
        sandwich_norms=True,
        embed_scale=True,
        sliding="pattern",
        sliding_window=4096,
        rope_per_kind=True,
    ),
}


def _layer_types(cfg: dict[str, Any], arch: Architecture, layers: int) -> tuple[int | None, tuple]:
    """(sliding window, per-layer kinds) as transformers' config class derives them."""
    window = cfg.get("sliding_window", arch.sliding_window)
    if arch.sliding == "qwen" and not cfg.get("use_sliding_window", False):
        window = None
    given = cfg.get("layer_types")
    if isinstance(given, list) and len(given) == layers:
        kinds = tuple(SLIDING if str(k) == SLIDING else FULL for k in given)
    elif arch.sliding == "all" and window is not None:
        kinds = (SLIDING,) * layers
    elif arch.sliding == "qwen" and window is not None:
        first = int(cfg.get("max_window_layers", 28))
        kinds = tuple(SLIDING if i >= first else FULL for i in range(layers))
    elif arch.sliding == "pattern":
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        kinds = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))
    else:
        kinds = (FULL,) * layers
    if window is None:
        kinds = (FULL,) * layers
    return (int(window) if window is not None else None), kinds


def hf_shape(cfg: dict[str, Any], *, name: str) -> ModelShape:
    """The shape of the transformers model a ``config.json`` builds.

    Args:
        cfg: the parsed config.json.
        name: the model's name in messages (its folder).

    Raises:
        ShapeError: a size key is missing or not a whole number >= 1.
        KeyError: a required key is missing (the caller names the file).
    """
    model_type = str(cfg.get("model_type", "llama"))
    arch = ARCHITECTURES.get(model_type, Architecture())
    nh = _dim(cfg, "num_attention_heads")
    h = _dim(cfg, "hidden_size")
    layers = _dim(cfg, "num_hidden_layers")
    head = _dim(cfg, "head_dim") if cfg.get("head_dim") else (arch.head_dim or h // nh)
    if arch.attention_bias == "qkv":
        biases: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    elif arch.attention_bias == "none":
        biases = ()
    else:
        biases = _ATTN if cfg.get("attention_bias", False) else ()
    if cfg.get("mlp_bias", False):
        biases += _MLP
    window, kinds = _layer_types(cfg, arch, layers)
    return ModelShape(
        name=name,
        family=model_type,
        vocab_size=_dim(cfg, "vocab_size"),
        num_layers=layers,
        num_heads=nh,
        num_kv_heads=_dim(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") else nh,
        embed_dim=h,
        intermediate_dim=_dim(cfg, "intermediate_size"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.tied)),
        max_seq_len=_dim(cfg, "max_position_embeddings")
        if cfg.get("max_position_embeddings")
        else 4096,
        backend=TRANSFORMERS,
        head_size=head,
        bias_linears=biases,
        qk_norm=arch.qk_norm,
        norm=arch.norm,
        sandwich_norms=arch.sandwich_norms,
        embed_scale=arch.embed_scale,
        layer_types=kinds,
        sliding_window=window,
        rope_types=len(set(kinds)) if arch.rope_per_kind else 1,
        model_type=model_type,
    )


def shape_of_folder(
    folder: str, *, lora: LoraSpec | None = None, key: str = "model.path"
) -> tuple[ModelShape, list[str]]:
    """The shape of the model in a Hugging Face folder, and notes for the plan.

    Args:
        folder: a local model folder holding ``config.json``.
        lora: the LoRA student's adapters, if any.
        key: the config key naming the folder, for errors.

    Returns:
        The shape, and notes (an architecture planned without a closed form).

    Raises:
        ShapeError: no config.json, or sizes missing or not whole numbers.
        KDUserError: an unreadable config.json, or one that asks for the folder's own code
            (:func:`kd.folders.read_config_json`).
    """
    path = os.path.join(os.path.expanduser(folder), folders.CONFIG_JSON)
    if not os.path.isfile(path):
        raise ShapeError(f"{path}: not a readable JSON config (no such file)")
    cfg = folders.read_config_json(folder, key=key)
    name = os.path.basename(os.path.normpath(os.path.expanduser(folder))) or "model"
    try:
        shape = hf_shape(cfg, name=name)
    except KeyError as e:
        raise ShapeError(f"{path}: missing key {e.args[0]}") from e
    except ShapeError as e:
        raise ShapeError(f"{path}: {e}") from e
    notes: list[str] = []
    if shape.model_type not in ARCHITECTURES:
        from dataclasses import replace

        shape = replace(shape, counted_params=count_params_with_transformers(folder))
        notes.append(
            f"{name}: model_type {shape.model_type!r} has no closed form in kd.memory: its "
            "parameters were counted by transformers on the meta device, its activations are "
            "planned as a Llama layer's; check with kd plan --trace"
        )
    if lora is not None:
        from dataclasses import replace

        shape = replace(shape, lora=lora)
    return shape, notes


def count_params_with_transformers(folder: str) -> int:
    """Parameters of the model a folder's config.json builds, counted on the meta device.

    Imports torch and transformers (seconds); used only for architectures without a closed form.

    Raises:
        ShapeError: transformers cannot build it.
    """
    import torch

    from kd.errors import KDUserError
    from kd.hf.model import build_causal_lm

    try:
        with torch.device("meta"):
            model = build_causal_lm(folder)
    except KDUserError as e:
        raise ShapeError(str(e)) from e
    return sum(p.numel() for p in model.parameters())
