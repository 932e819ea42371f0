"""``_component_`` nodes: what each key may build (as text), model families, and the signature
binding that imports each target (:func:`component_problems`, run last)."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from kd import families
from kd.config import schema
from kd.config.allowlist import component_nodes, target_problem, tree_problems
from kd.config.checks.signatures import static_signature
from kd.config.checks.values import fmt, non_finite_text
from kd.config.instantiate import locate_target, unknown_kwargs
from kd.config.run import COMPONENT_KEYS, DATASET_KEYS, VALIDATION_DATASET
from kd.config.schema import Key, Problem


def check_component_targets(data: dict[str, Any], problems: list[Problem]) -> None:
    """Each component node (and each nested one) names a ``_component_`` its key may build.

    Checked as text against :mod:`kd.config.allowlist` (nothing is imported), together with the
    values torchtune would import (a tokenizer's string ``prompt_template``).
    """
    trust = data.get("trust_remote_components") is True
    for name, value in component_values(data):
        for dotted, node in key_nodes(name, value, problems):
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


def key_nodes(name: str, value: Any, problems: list[Problem]) -> list[tuple[str, dict[str, Any]]]:
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
        for top, top_node in key_nodes(name, value, []):
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
    """Arguments whose default is a number or a bool given text, a list or a mapping, found by
    importing the target (those :func:`check_static_arguments` could not read)."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return []
    defaults = {name: p.default for name, p in params.items()}
    return argument_type_problems(dotted, target, defaults, kwargs)


def argument_type_problems(
    dotted: str, target: str, defaults: dict[str, Any], kwargs: dict[str, Any]
) -> list[Problem]:
    """Arguments whose default is a number or a bool given text, a list or a mapping
    (``optimizer.lr: abc``): caught now rather than when the component is built after the
    weights are loaded.

    Args:
        dotted: the node's key.
        target: the node's ``_component_``.
        defaults: the target's parameters and their defaults.
        kwargs: the node's other keys.
    """
    problems = []
    for name, value in kwargs.items():
        if name not in defaults or not isinstance(value, str | list | dict):
            continue
        default = defaults[name]
        if isinstance(default, bool):
            wanted = "true or false"
        elif isinstance(default, int | float):
            wanted = "a number"
        else:
            continue
        if isinstance(value, str) and non_finite_text(value):
            found = f"{value} is not a finite number (NaN and infinity are not allowed)"
        else:
            found = f"{fmt(value)} is not {wanted} (the default of {target}'s {name} is {default})"
        problems.append(Problem(f"{dotted}.{name}", f"{found}; set {dotted}.{name} to {wanted}"))
    return problems


def check_static_arguments(data: dict[str, Any], problems: list[Problem]) -> None:
    """:func:`argument_type_problems` of every allowed node whose target's signature can be read
    from source without importing it (:mod:`kd.config.checks.signatures`), so that
    ``optimizer.lr: abc`` is reported at once, beside missing files."""
    trust = data.get("trust_remote_components") is True
    for name, value in component_values(data):
        for top, top_node in key_nodes(name, value, []):
            for dotted, node in component_nodes(top, top_node):
                target = node.get("_component_")
                if not isinstance(target, str) or target_problem(dotted, target, trust=trust):
                    continue
                signature = static_signature(target)
                if signature is None:
                    continue
                defaults = {p.name: p.default for p in signature.parameters if p.keyword}
                kwargs = {k: v for k, v in node.items() if k != "_component_"}
                if not signature.var_keyword:
                    problems += _static_unknown_arguments(dotted, target, list(defaults), kwargs)
                problems += argument_type_problems(dotted, target, defaults, kwargs)


def _static_unknown_arguments(
    dotted: str, target: str, names: list[str], kwargs: dict[str, Any]
) -> list[Problem]:
    """Keys of a node that are no keyword parameter of its target's source signature (which
    takes no ``**kwargs``): the component pass's line (``optimizer.lrr``), without importing it."""
    problems = []
    for arg in kwargs:
        if arg not in names:
            close = difflib.get_close_matches(arg, names, n=1)
            fix = f"did you mean {dotted}.{close[0]}?" if close else "remove it"
            problems.append(Problem(f"{dotted}.{arg}", f"not an argument of {target}; {fix}"))
    return problems


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


def target_of(data: dict[str, Any], name: str) -> Any:
    """The ``_component_`` of the node ``data[name]``, or None."""
    node = data.get(name)
    return node.get("_component_") if isinstance(node, dict) else None


def check_families(data: dict[str, Any], problems: list[Problem]) -> None:
    """Teacher, student and tokenizer of different families use different token ids."""
    student = target_of(data, "model")
    family = model_family(student)
    if family is None:
        return
    for name, what in (("teacher_model", "teacher"), ("tokenizer", "tokenizer")):
        target = target_of(data, name)
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
                    f"{fmt(value)} is not a torchtune model type; {hint}set it to one of "
                    + ", ".join(names),
                )
            )
            continue
        builder = target_of(data, model)
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
