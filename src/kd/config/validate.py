"""Check a loaded config completely before any weight is loaded; report every problem at once.

Two passes: the schema pass imports neither torch nor torchtune, so a mistake in keys, values or
files answers in a fraction of a second; the component pass (signature binding) runs only when the
schema pass is clean.
"""

from __future__ import annotations

import difflib
import errno
import glob
import inspect
import math
import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kd import families
from kd.config import schema
from kd.config.allowlist import component_nodes, tree_problems
from kd.config.compat import TORCHTUNE_KD_LOSSES
from kd.config.instantiate import locate_target, unknown_kwargs
from kd.config.run import COMPONENT_KEYS, DATASET_KEYS, VALIDATION_DATASET
from kd.config.schema import Key, Problem
from kd.errors import ConfigError

# `dataset.source` values that load local files named by `dataset.data_files` (Hugging Face
# `load_dataset` builders).
FILE_SOURCES: frozenset[str] = frozenset({"json", "csv", "text", "parquet", "arrow"})

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")

# Integers every key (and every argument torch receives) must fit in.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def validate_config(
    cfg: DictConfig, *, check_paths: bool = True, check_components: bool = True
) -> None:
    """Check keys, types, ranges, choices, components and files of a loaded config.

    Nothing is built and no weight is read. The checks run in two passes so a mistake answers
    fast: :func:`schema_problems` (keys, values, ``_component_`` paths against what each key may
    build, model families, files) imports neither torch nor torchtune and raises first; only when it is
    clean does :func:`component_problems` import the ``_component_`` targets to bind their
    signatures (every problem of that pass is then reported together).

    Args:
        cfg: a config from :func:`kd.config.load_config` (defaults merged, interpolations resolved).
        check_paths: also check that input files exist and ``output_dir`` is writable.
        check_components: also import the ``_component_`` targets and bind their signatures
            (imports torch and torchtune); False keeps validation free of those imports.

    Raises:
        ConfigError: with every problem of the first pass that found any, each naming the key
            and the fix.
    """
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raise ConfigError(
            [Problem(str(key), f"cannot be resolved ({e}); fix the reference")]
        ) from e
    assert isinstance(data, dict)
    problems = schema_problems(data, check_paths=check_paths)
    if not problems and check_components:
        problems = component_problems(data)
    if problems:
        raise ConfigError(problems)


def schema_problems(data: dict[str, Any], *, check_paths: bool = True) -> list[Problem]:
    """Problems a config's values show by themselves, without importing any ``_component_``.

    Unknown and missing keys, types, ranges and choices, unsupported loss nodes, a null teacher
    with ``kd_ratio`` above 0, the device, ``_component_`` entries that are missing or that their
    key may not build (:mod:`kd.config.allowlist`), models of different tokenizer families and
    (with ``check_paths``) missing input files and an unusable ``output_dir``. Imports neither
    torch nor torchtune.

    Args:
        data: the resolved config as plain containers (``OmegaConf.to_container``).
        check_paths: also check that input files exist and ``output_dir`` is writable.

    Returns:
        Every problem found, each naming the key and the fix.
    """
    problems: list[Problem] = []
    optional = _hf_checkpointers(data, problems)
    if isinstance(data.get("teacher_logits"), dict):
        # Training from stored teacher logits needs no teacher (the precompute does: it says so).
        optional |= {"teacher_model", "teacher_checkpointer"}
    if isinstance(data.get("teacher_server"), dict):
        optional |= {"teacher_model", "teacher_checkpointer"}  # the server is the teacher
    _check_keys(data, schema.TOP_LEVEL, "", problems, optional=optional)
    _check_component_numbers(data, problems)
    for name, section in schema.SECTIONS.items():
        node = data.get(name)
        if isinstance(node, dict):
            _check_kd_loss_component(name, node, problems)
            _check_keys(node, section, f"{name}.", problems)
    for dotted, key in schema.COMPONENT_ARGS.items():
        name, arg = dotted.split(".", 1)
        node = data.get(name)
        if isinstance(node, dict) and arg in node:
            message = check_value(dotted, node[arg], key)
            if message:
                problems.append(Problem(dotted, message))
    _check_loss(data.get("loss"), problems)
    _check_teacher(data, problems)
    _check_validation(data, problems)
    _check_teacher_logits(data, problems)
    _check_teacher_server(data, problems)
    _check_on_policy(data, problems)
    _check_output_dir(data, problems)
    device = data.get("device")
    if isinstance(device, str) and not _DEVICE_RE.match(device):
        problems.append(
            Problem(
                "device",
                f"{device!r} is not a device kd runs on; set device to cuda, cuda:N or cpu",
            )
        )
    _check_component_targets(data, problems)
    _check_families(data, problems)
    if check_paths:
        _check_paths(data, problems)
    return problems


def component_problems(data: dict[str, Any]) -> list[Problem]:
    """Problems found by importing each ``_component_`` target (torch, torchtune...).

    The target must exist and every other key of its node must bind to its signature; a
    checkpointer's ``model_type`` must be a torchtune ``ModelType`` of its model's family. Run it
    on a config whose :func:`schema_problems` are empty; a refused target is never imported.

    Args:
        data: the resolved config as plain containers (``OmegaConf.to_container``).

    Returns:
        Every problem found, each naming the key and the fix.
    """
    problems: list[Problem] = []
    trust = data.get("trust_remote_components") is True
    for name, value in component_values(data):
        for top, top_node in _component_nodes(name, value, []):
            for dotted, node in component_nodes(top, top_node):
                target = node.get("_component_")
                if target is None:
                    continue
                obj, reason = locate_target(target, key=dotted, trust=trust)
                if reason is not None:
                    problems.append(Problem(f"{dotted}._component_", reason))
                    continue
                kwargs = {k: v for k, v in node.items() if k != "_component_"}
                for arg, close in unknown_kwargs(obj, kwargs):
                    fix = f"did you mean {dotted}.{close}?" if close else "remove it"
                    problems.append(
                        Problem(f"{dotted}.{arg}", f"not an argument of {target}; {fix}")
                    )
                problems += _argument_type_problems(dotted, target, obj, kwargs)
    _check_model_types(data, problems)
    return problems


def _argument_type_problems(
    dotted: str, target: str, obj: Any, kwargs: dict[str, Any]
) -> list[Problem]:
    """Arguments whose default is a number or a bool given text, a list or a mapping
    (``optimizer.lr: abc``): caught now rather than when the component is built after the
    weights are loaded."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return []
    problems = []
    for name, value in kwargs.items():
        param = params.get(name)
        if param is None or not isinstance(value, str | list | dict):
            continue
        default = param.default
        if isinstance(default, bool):
            wanted = "true or false"
        elif isinstance(default, int | float):
            wanted = "a number"
        else:
            continue
        if isinstance(value, str) and _non_finite_text(value):
            found = f"{value} is not a finite number (NaN and infinity are not allowed)"
        else:
            found = f"{_fmt(value)} is not {wanted} (the default of {target}'s {name} is {default})"
        problems.append(Problem(f"{dotted}.{name}", f"{found}; set {dotted}.{name} to {wanted}"))
    return problems


def _fmt(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else repr(x) if isinstance(x, str) else str(x)


def _expected(key: Key) -> str:
    """What a key accepts, for the end of a message ("an integer >= 1")."""
    if key.node:
        return "a mapping of its keys (or remove it to use the defaults)"
    if key.choices is not None:
        return "one of " + ", ".join(str(c) for c in key.choices)
    if key.types == (bool,):
        return "true or false"
    if key.types == (str,):
        return "a string"
    if key.types == (list,):
        return "a list"
    noun = "an integer" if key.types == (int,) else "a number"
    if key.min is not None and key.max is not None:
        return f"{noun} between {_fmt(key.min)} and {_fmt(key.max)}"
    if key.min_exclusive is not None:
        return f"{noun} greater than {_fmt(key.min_exclusive)}"
    if key.min is not None:
        return f"{noun} >= {_fmt(key.min)}"
    return noun


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    # bool is a subclass of int in Python, but `batch_size: true` is a mistake.
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def number_problem(value: Any) -> str | None:
    """What makes a number unusable in any key, or None: NaN, infinity, an integer beyond 64 bits.

    NaN compares false with every bound, so a range check alone would let it through.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{_fmt(value)} is not a finite number (NaN and infinity are not allowed)"
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        return f"{value} is beyond the 64-bit integer range"
    return None


def _non_finite_text(value: str) -> bool:
    """``nan``, ``inf``, ``-inf``: YAML reads them as strings (only ``.nan``/``.inf`` are floats)."""
    try:
        return not math.isfinite(float(value))
    except ValueError:
        return False


def check_value(dotted: str, value: Any, key: Key) -> str | None:
    """The problem with ``value`` for ``key``, as a message ending in the fix, or None.

    ``dotted`` names the key (or the flag, e.g. ``--budget-gib``) in the fix.
    """
    fix = f"set {dotted} to {_expected(key)}"
    if value is None:
        return None if key.nullable else f"null is not allowed; {fix}"
    if key.node:
        if key.node_list and isinstance(value, list):
            if value:
                return None  # each entry is checked by _component_nodes
            return f"an empty list; set {dotted} to a node with _component_, or a list of them"
        if not isinstance(value, dict):
            return f"expected a mapping, got {_fmt(value)}; write {dotted}: as a block of keys"
        return None
    if key.types and not _type_ok(value, key.types):
        if isinstance(value, str) and float in key.types and _non_finite_text(value):
            return f"{value} is not a finite number (NaN and infinity are not allowed); {fix}"
        return f"{_fmt(value)} is not {_expected(Key(None, key.types))}; {fix}"
    problem = number_problem(value)
    if problem is not None:
        return f"{problem}; {fix}"
    if key.choices is not None and value not in key.choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in key.choices], n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return f"{_fmt(value)} is not allowed; {hint}{fix}"
    if isinstance(value, (int, float)):
        if key.min is not None and key.max is not None and not key.min <= value <= key.max:
            return f"{_fmt(value)} is outside [{_fmt(key.min)}, {_fmt(key.max)}]; set {dotted} to a value between {_fmt(key.min)} and {_fmt(key.max)}"
        if key.min is not None and value < key.min:
            return f"{_fmt(value)} is below the minimum {_fmt(key.min)}; {fix}"
        if key.max is not None and value > key.max:
            return f"{_fmt(value)} is above the maximum {_fmt(key.max)}; {fix}"
        if key.min_exclusive is not None and value <= key.min_exclusive:
            return f"{_fmt(value)} must be greater than {_fmt(key.min_exclusive)}; {fix}"
    return None


def _check_keys(
    data: dict[str, Any],
    keys: dict[str, Key],
    prefix: str,
    problems: list[Problem],
    required: bool = True,
    optional: frozenset[str] = frozenset(),
) -> None:
    for name, value in data.items():
        dotted = f"{prefix}{name}"
        if name not in keys:
            if prefix == "kd_loss." and name == "_component_":
                continue  # reported by _check_kd_loss_component
            close = difflib.get_close_matches(str(name), list(keys), n=1)
            fix = f"did you mean {prefix}{close[0]}?" if close else "remove it (kd does not use it)"
            problems.append(Problem(dotted, f"unknown key; {fix}"))
            continue
        if value == schema.MISSING:
            if keys[name].default is not schema.MISSING:
                problems.append(
                    Problem(dotted, "is ??? (unset); set it or remove the line to use the default")
                )
            continue  # a required key left at ??? is reported below as missing
        message = check_value(dotted, value, keys[name])
        if message:
            problems.append(Problem(dotted, message))
    if not required:
        return
    for name, key in keys.items():
        if name in optional:
            continue
        if key.default is schema.MISSING and (name not in data or data[name] == schema.MISSING):
            problems.append(
                Problem(f"{prefix}{name}", f"required key is missing; add it ({key.help})")
            )


def _check_component_numbers(data: dict[str, Any], problems: list[Problem]) -> None:
    """NaN, infinity or an integer beyond 64 bits anywhere in a component node (``optimizer.lr``,
    ``model.vocab_size``...): no builder can use them."""

    def walk(dotted: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{dotted}.{k}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{dotted}[{i}]", v)
        elif dotted not in schema.COMPONENT_ARGS:  # those are checked with their range
            problem = number_problem(value)
            if problem is not None:
                wanted = "a smaller integer" if isinstance(value, int) else "a finite number"
                problems.append(Problem(dotted, f"{problem}; set {dotted} to {wanted}"))

    for name, value in component_values(data):
        if isinstance(value, dict | list):
            walk(name, value)


def _check_kd_loss_component(section: str, node: dict[str, Any], problems: list[Problem]) -> None:
    if section != "kd_loss" or "_component_" not in node:
        return
    known = ", ".join(schema.DIVERGENCES)
    tt = ", ".join(sorted(TORCHTUNE_KD_LOSSES))
    problems.append(
        Problem(
            "kd_loss._component_",
            f"{node['_component_']} is not a KD loss kd supports; set kd_loss to one of {known} "
            f"(torchtune's {tt} are mapped automatically)",
        )
    )


def _check_loss(value: Any, problems: list[Problem]) -> None:
    if value is None:
        return
    target = value.get("_component_") if isinstance(value, dict) else value
    problems.append(
        Problem(
            "loss",
            f"{target} is not used: kd computes (1 - kd_ratio) * CE + kd_ratio * KD itself; "
            "set loss to null (choose the divergence with kd_loss)",
        )
    )


# Model key -> its checkpointer key (torchtune builders; a Hugging Face model's folder is its own).
_CHECKPOINTER_OF = {"model": "checkpointer", "teacher_model": "teacher_checkpointer"}
HF_MODEL_PREFIX = "kd.hf."


def is_hf_model_node(node: Any) -> bool:
    """Whether a model node uses the transformers backend (``_component_: kd.hf.*``)."""
    return isinstance(node, dict) and str(node.get("_component_", "")).startswith(HF_MODEL_PREFIX)


def _hf_checkpointers(data: dict[str, Any], problems: list[Problem]) -> frozenset[str]:
    """The checkpointer keys a config needs not have (their model is a Hugging Face folder); a
    checkpointer set for such a model is a problem (which weights would load is ambiguous)."""
    optional = set()
    for model_key, ckpt_key in _CHECKPOINTER_OF.items():
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


def _check_teacher(data: dict[str, Any], problems: list[Problem]) -> None:
    """``teacher_model: null`` is plain fine-tuning: only with ``kd_ratio: 0``."""
    if isinstance(data.get("teacher_logits"), dict):
        return  # the stored logits teach; a teacher node, if any, only identifies them
    if isinstance(data.get("teacher_server"), dict):
        return  # the server teaches (_check_teacher_server)
    if "teacher_model" in data and data["teacher_model"] is None:
        ratio = data.get("kd_ratio")
        if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio != 0:
            problems.append(
                Problem(
                    "teacher_model",
                    f"null means no teacher, but kd_ratio is {_fmt(ratio)}; set teacher_model to a "
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


def _check_teacher_logits(data: dict[str, Any], problems: list[Problem]) -> None:
    """A source temperature belongs to another tool's file, and re-tempering it leaves the
    mass outside the top-k unknown, so only ``tail: renorm`` is exact then."""
    node = data.get("teacher_logits")
    if not isinstance(node, dict) or node.get("source_temperature") is None:
        return
    source = node["source_temperature"]
    if node.get("format", "kd") == "kd":
        problems.append(
            Problem(
                "teacher_logits.source_temperature",
                "is for another tool's file (format axolotl or distillkit); kd's store records "
                "its temperature itself: remove source_temperature",
            )
        )
        return
    temperature = data.get("temperature", 1.0)
    if (
        node.get("tail", "bucket") == "bucket"
        and isinstance(source, (int, float))
        and isinstance(temperature, (int, float))
        and float(source) != float(temperature)
    ):
        problems.append(
            Problem(
                "teacher_logits.tail",
                f"bucket needs the teacher mass outside the top-k, which re-tempering from "
                f"source_temperature {_fmt(source)} to temperature {_fmt(temperature)} leaves "
                "unknown; set teacher_logits.tail=renorm",
            )
        )


def _check_teacher_server(data: dict[str, Any], problems: list[Problem]) -> None:
    """A served teacher replaces the teacher's nodes and answers top-k log-probs at
    temperature 1: what needs a local teacher's full distribution or its sampling is refused."""
    node = data.get("teacher_server")
    if not isinstance(node, dict):
        return
    drop = "remove teacher_model and teacher_checkpointer (the server is the teacher)"
    if data.get("teacher_model") is not None:
        problems.append(Problem("teacher_model", f"is set beside teacher_server; {drop}"))
    url = node.get("url")
    if isinstance(url, str) and not url.startswith(("http://", "https://")):
        problems.append(
            Problem(
                "teacher_server.url",
                f"{_short(url)!r} is not an http:// or https:// URL; set teacher_server.url to "
                "the server's base URL, e.g. http://127.0.0.1:8000",
            )
        )
    if isinstance(data.get("validation"), dict) and not isinstance(
        data.get("teacher_logits"), dict
    ):
        problems.append(
            Problem(
                "validation",
                "needs a teacher's full distribution (val_kd_loss, val_top1_agreement), which a "
                "served teacher's top-k does not give; remove validation, or use teacher_model",
            )
        )
    on_policy = data.get("on_policy")
    if isinstance(on_policy, dict) and on_policy.get("seq_kd"):
        problems.append(
            Problem(
                "on_policy.seq_kd",
                "samples the teacher's completions, but kd only scores with a served teacher; "
                "set on_policy.seq_kd=false (the student's completions are scored by the server)",
            )
        )
    temperature = data.get("temperature", 1.0)
    if (
        node.get("tail", "bucket") == "bucket"
        and isinstance(temperature, (int, float))
        and not isinstance(temperature, bool)
        and float(temperature) != 1.0
    ):
        problems.append(
            Problem(
                "teacher_server.tail",
                f"bucket needs the teacher mass outside the top-k at temperature "
                f"{_fmt(temperature)}, but the server answers at temperature 1 (kd re-tempers the "
                "top-k); set teacher_server.tail=renorm, or temperature=1",
            )
        )


def _check_on_policy(data: dict[str, Any], problems: list[Problem]) -> None:
    """On-policy distillation needs a teacher that runs (it scores sequences that exist only
    during training) and room in ``tokenizer.max_seq_len`` for the completions."""
    node = data.get("on_policy")
    if not isinstance(node, dict):
        return
    if isinstance(data.get("teacher_logits"), dict):
        problems.append(
            Problem(
                "on_policy",
                "needs the online teacher (it scores the student's own completions, which no "
                "stored logits hold); remove on_policy, or set teacher_logits to null",
            )
        )
    elif (
        "teacher_model" in data
        and data["teacher_model"] is None
        and not isinstance(data.get("teacher_server"), dict)
    ):
        problems.append(
            Problem(
                "on_policy",
                "needs a teacher to score the completions, but teacher_model is null; set "
                "teacher_model, or remove on_policy",
            )
        )
    new = node.get("max_new_tokens")
    tokenizer = data.get("tokenizer")
    limit = tokenizer.get("max_seq_len") if isinstance(tokenizer, dict) else None
    if isinstance(tokenizer, dict) and limit is None:
        problems.append(
            Problem(
                "tokenizer.max_seq_len",
                "is null, but on_policy needs it: prompt + completion must fit the sequence "
                "length the memory plan covers; set tokenizer.max_seq_len (e.g. 2048)",
            )
        )
    if (
        isinstance(new, int)
        and isinstance(limit, int)
        and not isinstance(new, bool)
        and not isinstance(limit, bool)
        and new >= limit
    ):
        problems.append(
            Problem(
                "on_policy.max_new_tokens",
                f"{new} leaves no room for a prompt in tokenizer.max_seq_len {limit} (prompt and "
                f"completion are one sequence); set on_policy.max_new_tokens below {limit}, or "
                "raise tokenizer.max_seq_len",
            )
        )


def _check_validation(data: dict[str, Any], problems: list[Problem]) -> None:
    """``keep_best`` and ``early_stopping`` need ``validation`` (and early stopping evaluations
    during training); the teacher metrics need a teacher."""
    validation = data.get("validation")
    add = "add validation: {dataset: ..., every_n_steps: N}"
    for name, what in (
        ("keep_best", "it keeps the student of the best validation"),
        ("early_stopping", "it counts evaluations without improvement"),
    ):
        if data.get(name) is not None and validation is None:
            problems.append(Problem(name, f"needs validation ({what}); {add}, or remove {name}"))
    if (
        data.get("early_stopping") is not None
        and isinstance(validation, dict)
        and validation.get("every_n_steps") is None
    ):
        problems.append(
            Problem(
                "early_stopping",
                "validation.every_n_steps is null, so validation runs only at the end of "
                "training and cannot stop it early; set validation.every_n_steps, or remove "
                "early_stopping",
            )
        )
    if isinstance(validation, dict) and isinstance(data.get("teacher_logits"), dict):
        problems.append(
            Problem(
                "validation",
                "needs the online teacher (val_kd_loss and val_top1_agreement compare the "
                "student with the teacher's full distribution on held-out rows, which "
                "teacher_logits does not hold); remove validation, or set teacher_logits to null",
            )
        )
    best = data.get("keep_best")
    metric = best.get("metric") if isinstance(best, dict) else None
    if (
        metric in schema.TEACHER_METRICS
        and "teacher_model" in data
        and data["teacher_model"] is None
    ):
        plain = [m for m in schema.VAL_METRICS if m not in schema.TEACHER_METRICS]
        problems.append(
            Problem(
                "keep_best.metric",
                f"{metric} compares the student with the teacher, but teacher_model is null; "
                f"set keep_best.metric to {' or '.join(plain)}",
            )
        )


def _check_output_dir(data: dict[str, Any], problems: list[Problem]) -> None:
    """An empty ``output_dir`` (it would be the working directory) and contradictory outputs keys."""
    output_dir = data.get("output_dir")
    if isinstance(output_dir, str) and not output_dir.strip():
        problems.append(
            Problem(
                "output_dir",
                "is empty; set output_dir to the folder for this run's checkpoints, "
                "metrics.jsonl and final/ (a new or empty one)",
            )
        )
    if data.get("overwrite_output_dir") is True and data.get("resume_from_checkpoint") is True:
        problems.append(
            Problem(
                "overwrite_output_dir",
                "true moves aside the checkpoints resume_from_checkpoint=true continues from; "
                "set one of them to false",
            )
        )


def _check_component_targets(data: dict[str, Any], problems: list[Problem]) -> None:
    """Each component node (and each nested one) names a ``_component_`` its key may build.

    Checked as text against :mod:`kd.config.allowlist` (nothing is imported), together with the
    values torchtune would import (a tokenizer's string ``prompt_template``).
    """
    trust = data.get("trust_remote_components") is True
    for name, value in component_values(data):
        for dotted, node in _component_nodes(name, value, problems):
            if node.get("_component_") is None:
                help_text = _spec(name).help
                problems.append(
                    Problem(
                        f"{dotted}._component_",
                        f"missing; add _component_ with the builder's dotted path ({help_text})",
                    )
                )
            problems += [Problem(k, m) for k, m in tree_problems(dotted, node, trust=trust)]


def component_values(data: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every key that builds a component, with its value: the top-level ``COMPONENT_KEYS`` and
    ``validation.dataset`` (built like ``dataset``) when ``validation`` is a mapping."""
    out = [(name, data.get(name)) for name in COMPONENT_KEYS]
    validation = data.get("validation")
    if isinstance(validation, dict) and "dataset" in validation:
        out.append((VALIDATION_DATASET, validation["dataset"]))
    return out


def _spec(name: str) -> Key:
    """The schema key of a top-level or dotted section key (``validation.dataset``)."""
    section, _, sub = name.partition(".")
    return schema.SECTIONS[section][sub] if sub else schema.TOP_LEVEL[name]


def _component_nodes(
    name: str, value: Any, problems: list[Problem]
) -> list[tuple[str, dict[str, Any]]]:
    """The ``(dotted key, mapping)`` nodes a component key holds; reports non-mapping list entries.

    torchtune allows a list of dataset nodes (concatenated datasets). A missing required node, a
    null optional one and a non-mapping top-level value are reported by the key checks.
    """
    if value is None or value == schema.MISSING:
        return []
    if not (name in DATASET_KEYS and isinstance(value, list)):
        return [(name, value)] if isinstance(value, dict) else []
    nodes = []
    for index, node in enumerate(value):
        dotted = f"{name}[{index}]"
        if isinstance(node, dict):
            nodes.append((dotted, node))
        else:
            problems.append(
                Problem(dotted, "expected a mapping with _component_; fix the list entry")
            )
    return nodes


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def lookup_problem(text: str) -> str | None:
    """Why the path ``text`` cannot even be looked up, or None (a missing path is not a problem
    here): a NUL byte, a name too long for the file system, ``~user`` of an unknown user."""
    if "\0" in text:
        return "it contains a NUL byte"
    expanded = os.path.expanduser(text)
    if text.startswith("~") and expanded == text:
        return f"{text.split('/', 1)[0]} is not a user on this machine"
    try:
        os.stat(expanded)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
            return e.strerror.lower() if e.strerror else str(e)
        return None  # permissions and the like: the checks below name them
    except ValueError as e:
        return str(e)
    return None


def _path_ok(key: str, text: str, problems: list[Problem]) -> bool:
    """Report ``key`` when its path cannot be looked up; True when it can."""
    reason = lookup_problem(text)
    if reason is None:
        return True
    problems.append(Problem(key, f"{_short(text)!r} is not a usable path ({reason}); fix the path"))
    return False


def _check_paths(data: dict[str, Any], problems: list[Problem]) -> None:
    output_dir = data.get("output_dir")
    if isinstance(output_dir, str) and output_dir.strip() and output_dir != schema.MISSING:
        message = writable_dir_problem(output_dir)
        if message:
            problems.append(Problem("output_dir", message))
    for name in ("checkpointer", "teacher_checkpointer"):
        node = data.get(name)
        if isinstance(node, dict):
            _check_checkpointer(name, node, problems)
    for name in _CHECKPOINTER_OF:
        node = data.get(name)
        path = node.get("path") if is_hf_model_node(node) else None
        if isinstance(path, str) and path.strip() and _path_ok(f"{name}.path", path, problems):
            folder = Path(path).expanduser()
            if not (folder / "config.json").is_file():
                what = "does not exist" if not folder.exists() else "has no config.json"
                problems.append(
                    Problem(
                        f"{name}.path",
                        f"{path} {what}; point it at a local Hugging Face model folder "
                        "(config.json + *.safetensors)",
                    )
                )
    tokenizer = data.get("tokenizer")
    if isinstance(tokenizer, dict):
        for sub in ("path", "merges_file", "special_tokens_path"):
            path = tokenizer.get(sub)
            if not isinstance(path, str) or not _path_ok(f"tokenizer.{sub}", path, problems):
                continue
            if not Path(path).expanduser().exists():
                problems.append(
                    Problem(
                        f"tokenizer.{sub}",
                        f"{path} does not exist; download the tokenizer or fix the path",
                    )
                )
    for name, dataset in component_values(data):
        if name not in DATASET_KEYS:
            continue
        nodes = dataset if isinstance(dataset, list) else [dataset]
        for i, node in enumerate(nodes):
            if isinstance(node, dict):
                _check_dataset(
                    name if len(nodes) == 1 and not isinstance(dataset, list) else f"{name}[{i}]",
                    node,
                    problems,
                )


_MAX_SHARDS = 100_000  # checkpoint_files.max_filename beyond this is a typo, not a model


def checkpoint_file_names(files: Any) -> list[str] | None:
    """Entries of ``checkpoint_files``: a list, or torchtune's ``{filename_format, max_filename}``."""
    if isinstance(files, list):
        return [str(f) for f in files]
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict) and "filename_format" in files and "max_filename" in files:
        fmt, last = str(files["filename_format"]), str(files["max_filename"])
        if not (last.isascii() and last.isdigit()) or not 1 <= int(last) <= _MAX_SHARDS:
            return None
        try:
            return [fmt.format(str(i).zfill(len(last)), last) for i in range(1, int(last) + 1)]
        except (IndexError, KeyError, ValueError):
            return None  # not a format string of two positional fields
    return None


def _check_checkpointer(name: str, node: dict[str, Any], problems: list[Problem]) -> None:
    folder = node.get("checkpoint_dir")
    if not isinstance(folder, str):
        problems.append(
            Problem(
                f"{name}.checkpoint_dir",
                "missing; set it to the folder that holds the model's weights",
            )
        )
        return
    if not _path_ok(f"{name}.checkpoint_dir", folder, problems):
        return
    root = Path(folder).expanduser()
    if not root.is_dir():
        problems.append(
            Problem(
                f"{name}.checkpoint_dir",
                f"{folder} does not exist; download the model there or fix the path",
            )
        )
        return
    names = checkpoint_file_names(node.get("checkpoint_files"))
    if names is None:
        problems.append(
            Problem(
                f"{name}.checkpoint_files",
                "expected a list of file names or {filename_format, max_filename} (a format "
                "string with two {} fields and the number of the last shard); fix the entry",
            )
        )
        return
    for i, file_name in enumerate(names):
        if not _path_ok(f"{name}.checkpoint_files[{i}]", str(root / file_name), problems):
            continue
        path = root / file_name
        if not path.is_file():
            problems.append(
                Problem(
                    f"{name}.checkpoint_files[{i}]",
                    f"{path} does not exist; fix the file name or re-download",
                )
            )


def _is_local_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or (
        lookup_problem(source) is None and os.path.exists(source)
    )


def _check_dataset(dotted: str, node: dict[str, Any], problems: list[Problem]) -> None:
    source = node.get("source")
    if not isinstance(source, str):
        return
    files = node.get("data_files")
    if source in FILE_SOURCES:
        if files is None:
            problems.append(
                Problem(
                    f"{dotted}.data_files",
                    f"missing; {dotted}.source is {source}, so set {dotted}.data_files to the file(s)",
                )
            )
            return
        base = Path(".")
    elif _is_local_path(source):
        if not _path_ok(f"{dotted}.source", source, problems):
            return
        base = Path(source).expanduser()
        if not base.exists():
            problems.append(Problem(f"{dotted}.source", f"{source} does not exist; fix the path"))
            return
        if files is None:
            return
        if base.is_file():
            base = base.parent
    else:
        return  # a hub dataset name; nothing local to check
    entries: list[str] = []
    if isinstance(files, str):
        entries = [files]
    elif isinstance(files, list):
        entries = [str(f) for f in files]
    elif isinstance(files, dict):
        for split_files in files.values():
            entries += (
                [split_files]
                if isinstance(split_files, str)
                else [str(f) for f in split_files or []]
            )
    for entry in entries:
        if "://" in entry:
            continue  # remote file; load_dataset fetches it
        if not _path_ok(f"{dotted}.data_files", entry, problems):
            continue
        path = Path(entry).expanduser()
        path = path if path.is_absolute() else base / path
        if not _path_ok(f"{dotted}.data_files", str(path), problems):
            continue
        exists = bool(glob.glob(str(path))) if any(c in entry for c in "*?[") else path.exists()
        if not exists:
            problems.append(Problem(f"{dotted}.data_files", f"{path} does not exist; fix the path"))


def writable_dir_problem(folder: str) -> str | None:
    """Why ``folder`` cannot be used as an output folder, or None. Creates nothing.

    Walks up to the first existing ancestor and checks it is a writable directory.
    """
    reason = lookup_problem(folder)
    if reason is not None:
        return (
            f"{_short(folder)!r} is not a usable path ({reason}); set output_dir to another folder"
        )
    path = Path(folder).expanduser()
    if path.exists():
        if not path.is_dir():
            return f"{folder} is a file; set output_dir to a folder"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{folder} is not writable; set output_dir to a folder you can write to"
        return None
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{folder} cannot be created because {parent} is a file; set output_dir to another folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{folder} cannot be created in {parent} (not writable); set output_dir to a folder you can write to"
    return None


def model_family(target: Any) -> str | None:
    """Tokenizer family of a torchtune builder path (``torchtune.models.qwen2_5.qwen2_5_3b`` ->
    ``qwen2``), or None for builders outside ``torchtune.models`` (nothing is known about them).

    Packages share a family when they share token ids (:attr:`kd.families.Family.tokenizer`); a
    package not in :data:`kd.families.FAMILIES` is its own family."""
    if not isinstance(target, str):
        return None
    parts = target.split(".")
    if len(parts) < 4 or parts[:2] != ["torchtune", "models"]:
        return None
    family = families.family_of_package(parts[2])
    return family.tokenizer if family is not None else parts[2]


def _target(data: dict[str, Any], name: str) -> Any:
    node = data.get(name)
    return node.get("_component_") if isinstance(node, dict) else None


def _check_families(data: dict[str, Any], problems: list[Problem]) -> None:
    """Teacher, student and tokenizer of different families use different token ids."""
    student = _target(data, "model")
    family = model_family(student)
    if family is None:
        return
    for name, what in (("teacher_model", "teacher"), ("tokenizer", "tokenizer")):
        target = _target(data, name)
        other = model_family(target)
        if other is not None and other != family:
            problems.append(
                Problem(
                    f"{name}._component_",
                    f"{target} is a {other} {what} but the student ({student}) is {family}; their "
                    f"vocabularies differ and KD compares token ids, so use a {family} {what} "
                    "(teacher, student and tokenizer of one family)",
                )
            )


def _check_model_types(data: dict[str, Any], problems: list[Problem]) -> None:
    """``checkpointer.model_type`` must name a torchtune ModelType of the builder's family."""
    for name, model in (("checkpointer", "model"), ("teacher_checkpointer", "teacher_model")):
        node = data.get(name)
        if not isinstance(node, dict) or "model_type" not in node:
            continue
        value = node["model_type"]
        key = f"{name}.model_type"
        from kd._torchtune import ModelType  # torchtune is imported by the component checks

        names = list(ModelType.__members__)
        if not isinstance(value, str) or value not in names:
            close = difflib.get_close_matches(str(value).upper(), names, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            problems.append(
                Problem(
                    key,
                    f"{_fmt(value)} is not a torchtune model type; {hint}set it to one of "
                    + ", ".join(names),
                )
            )
            continue
        builder = _target(data, model)
        family = model_family(builder)
        expected = families.tokenizer_of_model_type(value)
        if family is not None and expected is not None and family != expected:
            fit = families.model_types_of_tokenizer(family)
            problems.append(
                Problem(
                    key,
                    f"{value} converts {expected} weights but {model} is {builder}; set it to "
                    + " or ".join(fit),
                )
            )
