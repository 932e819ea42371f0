"""Which models a config names and how: a Hugging Face folder or a torchtune builder with its
checkpointer; no teacher (plain fine-tuning)."""

from __future__ import annotations

from typing import Any

from kd.config import schema
from kd.config.checks.values import fmt
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


def check_teacher(data: dict[str, Any], problems: list[Problem]) -> None:
    """``teacher_model: null`` is plain fine-tuning: only with ``kd_ratio: 0``."""
    if isinstance(data.get("teacher_logits"), dict):
        return  # the stored logits teach; a teacher node, if any, only identifies them
    if isinstance(data.get("teacher_server"), dict):
        return  # the server teaches (check_teacher_server)
    if isinstance(data.get("self_teacher"), dict):
        return  # the student teaches itself (check_self_teacher)
    if isinstance(data.get("teachers"), dict):
        return  # the members teach; top-level teacher keys, null or not, are check_teachers'
    if "teacher_model" in data and data["teacher_model"] is None:
        ratio = data.get("kd_ratio")
        if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio != 0:
            problems.append(
                Problem(
                    "teacher_model",
                    f"null means no teacher, but kd_ratio is {fmt(ratio)}; set teacher_model to a "
                    "builder, or kd_ratio=0 for plain fine-tuning",
                )
            )
    elif (
        "teacher_checkpointer" in data
        and data["teacher_checkpointer"] is None
        and not is_hf_model_node(data.get("teacher_model"))
    ):
        problems.append(
            Problem(
                "teacher_checkpointer",
                "null, but teacher_model is set; set teacher_checkpointer to the teacher's "
                "checkpointer (or teacher_model to null with kd_ratio=0)",
            )
        )
