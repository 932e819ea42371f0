"""Weight names: torchtune <-> Hugging Face <-> PEFT adapter, with the q/k RoPE row permutation.

Which name map applies, and whether q/k rows are permuted, is a fact of the model family
(:mod:`kd.families`), looked up by the torchtune ``ModelType`` name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kd import families
from kd.checkpoint.layout import ADAPTER_MODEL_FILE
from kd.errors import KDUserError

_PEFT_PREFIX = "base_model.model."
# torchtune adapter leaf -> PEFT adapter leaf.
_TUNE_TO_PEFT_LEAF = {
    ".lora_a.weight": ".lora_A.weight",
    ".lora_b.weight": ".lora_B.weight",
    ".magnitude": ".lora_magnitude_vector",
}


def _tt() -> Any:
    """kd._torchtune, imported on first use: the step-checkpoint mechanics do not need torchtune
    (a multi-second import), only the weight-name conversions do."""
    from kd import _torchtune

    return _torchtune


def _model_type_name(model_type: Any) -> str:
    """``"QWEN2"`` for ``"qwen2"``, ``"QWEN2"`` or ``ModelType.QWEN2``."""
    return str(getattr(model_type, "name", model_type)).upper()


def _is_qwen2(model_type: Any) -> bool:
    return families.architecture_of_model_type(_model_type_name(model_type)) == families.QWEN2


def _permutes_qk(model_type: Any) -> bool:
    return families.permutes_qk(_model_type_name(model_type))


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
    if _is_qwen2(model_type):
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
        state_dict: HF names, e.g. from :func:`kd.checkpoint.load_hf_weights`.
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
    if _is_qwen2(model_type):
        return _tt().qwen2_hf_to_tune(state_dict, **args, tie_word_embeddings=tied)
    return _tt().hf_to_tune(state_dict, **args)


def _hf_to_tune_keys(model_type: str) -> dict[str, str | None]:
    return _tt().QWEN2_HF_TO_TUNE_KEYS if _is_qwen2(model_type) else _tt().HF_TO_TUNE_KEYS


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
    permute = _permutes_qk(model_type)
    out: dict[str, torch.Tensor] = {}
    for key, value in adapter_state_dict.items():
        leaf = next((s for s in _TUNE_TO_PEFT_LEAF if key.endswith(s)), None)
        if leaf is None:
            raise ValueError(f"not a LoRA/DoRA adapter key: {key}")
        module = key[: -len(leaf)]
        hf_module = _tt().get_mapped_key(module + ".weight", tune_to_hf_keys)[: -len(".weight")]
        if permute and leaf != ".lora_a.weight":
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
    permute = _permutes_qk(model_type)
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
        if permute and tune_leaf != ".lora_a.weight":
            if module.endswith("q_proj"):
                value = _rows_hf_to_tune(value, args["num_heads"], head_dim)
            elif module.endswith("k_proj"):
                value = _rows_hf_to_tune(value, args["num_kv_heads"], head_dim)
        out[module + tune_leaf] = value
    return out
