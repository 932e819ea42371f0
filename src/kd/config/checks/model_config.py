"""The fields of a Hugging Face model folder's ``config.json`` that kd and transformers read.

A bad field is the file's problem, so the message names the field in that file and says to fix
it there: not "use a torchtune builder" (the memory plan's words when it cannot read a size), not
a tokenizer problem (transformers' words when ``max_position_embeddings: "abc"`` stops
``AutoTokenizer``). The fields are given as a dict: the file is read by the one reader of
``config.json`` files (``kd.folders.read_config_json``); nothing here opens a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kd.config.checks.values import fmt
from kd.config.schema import Problem

# Sizes: a whole number >= 1 (the memory plan divides by them; transformers builds tensors of
# them). The first four are required by every decoder config.
_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "head_dim",
    "sliding_window",
    "max_window_layers",
)
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
_NUMBERS = ("rope_theta", "rms_norm_eps")

_ROPE_EXAMPLE = '{"rope_type": "linear", "factor": 8.0}'


def _whole(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return value.is_integer() and value >= 1
    return isinstance(value, int) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _field_problem(name: str, value: Any) -> str | None:
    """What ``value`` of the field ``name`` should be, or None when it is usable (or null)."""
    if value is None:
        return None
    if name in _SIZES and not _whole(value):
        return "a whole number >= 1"
    if name in _FLAGS and not isinstance(value, bool):
        return "true or false"
    if name in _NUMBERS and not (_number(value) and value > 0):
        return "a number > 0"
    return None


def rope_scaling_problem(value: Any) -> str | None:
    """Why ``rope_scaling`` is not a RoPE scaling, or None (null is no scaling)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return f"{fmt(value)}, not a mapping such as {_ROPE_EXAMPLE} (or null)"
    kind = value.get("rope_type", value.get("type"))
    if not isinstance(kind, str):
        return (
            f"{fmt(value)} has no rope_type string; it should be a mapping such as {_ROPE_EXAMPLE}"
        )
    factor = value.get("factor")
    if factor is not None and not (_number(factor) and factor > 0):
        return f"{fmt(value)} has factor {fmt(factor)}; the factor should be a number > 0"
    return None


def config_json_problems(key: str, path: str | Path, fields: dict[str, Any]) -> list[Problem]:
    """Fields of a model's ``config.json`` that neither kd's plan nor transformers can use.

    A multimodal config's ``text_config`` (Gemma 3) is checked the same way.

    Args:
        key: the config key naming the folder (``model.path``, ``teacher_model.path``).
        path: the ``config.json`` file, named in each message.
        fields: its parsed contents.

    Returns:
        One problem per bad field, naming the field in that file and the fix.
    """
    problems = []
    nested = fields.get("text_config")
    scopes = [("", fields)] + ([("text_config.", nested)] if isinstance(nested, dict) else [])
    for prefix, scope in scopes:
        for name in (*_SIZES, *_FLAGS, *_NUMBERS):
            wanted = _field_problem(name, scope.get(name))
            if wanted is not None:
                field = f"{prefix}{name}"
                problems.append(
                    Problem(
                        key,
                        f"{path}: {field} is {fmt(scope[name])}, not {wanted}; fix {field} in "
                        "that file (the model's source has the right value)",
                    )
                )
        rope = rope_scaling_problem(scope.get("rope_scaling"))
        if rope is not None:
            field = f"{prefix}rope_scaling"
            problems.append(
                Problem(
                    key,
                    f"{path}: {field} is {rope}; fix {field} in that file (the model's source has "
                    "the right value)",
                )
            )
    return problems


def model_folder_problems(data: dict[str, Any]) -> list[Problem]:
    """:func:`config_json_problems` of every model folder a config names: a ``kd.hf.*`` model's
    ``path`` and a torchtune checkpointer's ``checkpoint_dir`` (read by
    :func:`kd.folders.read_config_json`; a missing or unreadable folder is left to the folder and
    path checks)."""
    from kd import folders
    from kd.errors import KDUserError

    problems: list[Problem] = []
    for key in ("model", "teacher_model", "checkpointer", "teacher_checkpointer"):
        node = data.get(key)
        if not isinstance(node, dict):
            continue
        component = node.get("_component_")
        hf = isinstance(component, str) and component.startswith("kd.hf.")
        arg = "path" if hf else "checkpoint_dir" if key.endswith("checkpointer") else None
        folder = node.get(arg) if arg is not None else None
        if not isinstance(folder, str) or not folder.strip():
            continue
        named = f"{key}.{arg}"
        try:
            fields = folders.read_config_json(folder, key=named)
            path = Path(folder).expanduser() / folders.CONFIG_JSON
        except (KDUserError, OSError, ValueError, RuntimeError):  # the path checks report it
            continue
        problems += config_json_problems(named, path, fields)
    return problems
