"""Which models a config names and how: a Hugging Face folder or a torchtune builder with its
checkpointer; no teacher (plain fine-tuning)."""

from __future__ import annotations

from typing import Any

from kd.config import schema
from kd.config.run import CHECKPOINTER_OF
from kd.config.schema import Problem

# Model key -> its checkpointer key (torchtune builders; a Hugging Face model's folder is its own).


HF_MODEL_PREFIX = "kd.hf."


def is_hf_model_node(node: Any) -> bool:
    """Whether a model node uses the transformers backend (``_component_: kd.hf.*``)."""
    return isinstance(node, dict) and str(node.get("_component_", "")).startswith(HF_MODEL_PREFIX)


def hf_checkpointers(data: dict[str, Any], problems: list[Problem]) -> frozenset[str]:
    """The checkpointer keys a config needs not have (their model is a Hugging Face folder); a
    checkpointer set for such a model is a problem (which weights would load is ambiguous)."""
    optional = set()
    for model_key, ckpt_key in CHECKPOINTER_OF.items():
        node = data.get(model_key)
        if not is_hf_model_node(node):
            continue
        optional.add(ckpt_key)
        if data.get(ckpt_key) not in (None, schema.MISSING):
            problems.append(
                Problem(
                    ckpt_key,
                    f"{model_key} is {node['_component_']}, which loads the weights of "
                    f"{model_key}.path; remove {ckpt_key} (it is for torchtune builders)",
                )
            )
        path = node.get("path")
        if not isinstance(path, str) or not path.strip():
            problems.append(
                Problem(
                    f"{model_key}.path",
                    "required: the local Hugging Face folder (config.json + *.safetensors) "
                    f"that {node['_component_']} loads",
                )
            )
    return frozenset(optional)
