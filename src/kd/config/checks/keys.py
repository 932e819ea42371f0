"""The keys of a config and its sections: unknown keys (with the key meant), missing ones, values."""

from __future__ import annotations

import difflib
from typing import Any

from kd.config import schema
from kd.config.checks.components import component_values
from kd.config.checks.values import check_value, number_problem
from kd.config.compat import TORCHTUNE_KD_LOSSES
from kd.config.schema import Key, Problem


def _strip_word(name: str, words: tuple[str, ...]) -> list[str]:
    """``name`` without one of ``words`` in front or at the end (``eval_every_n_steps`` ->
    ``every_n_steps``, ``dataset_val`` -> ``dataset``)."""
    out = []
    for word in words:
        if name.startswith(f"{word}_"):
            out.append(name[len(word) + 1 :])
        if name.endswith(f"_{word}"):
            out.append(name[: -len(word) - 1])
    return out


def close_key(
    name: str, keys: list[str] | tuple[str, ...], words: tuple[str, ...] = ()
) -> str | None:
    """The one of ``keys`` that ``name`` (as written, or without one of ``words`` in front or at
    the end) most likely means, or None (a close spelling: ``teacher_modle`` ->
    ``teacher_model``)."""
    for rest in [name, *_strip_word(name, words)]:
        close = difflib.get_close_matches(rest, list(keys), n=1, cutoff=0.8)
        if close:
            return close[0]
    return None


def _in_section(name: str, section: str) -> str | None:
    """The key of ``section`` that ``name`` (with or without the section's word) means."""
    meant = close_key(name, list(schema.SECTIONS[section]), schema.SECTION_WORDS[section])
    return f"{section}.{meant}" if meant is not None else None


def suggest_key(name: str, section: str | None) -> str | None:
    """The dotted key an unknown key most likely means, or None.

    A section's key written at the top level, with or without the section's word
    (``eval_every_n_steps``, ``every_n_steps`` -> ``validation.every_n_steps``; words in
    :data:`kd.config.schema.SECTION_WORDS`), wins over a top-level key spelled alike
    (``log_every_n_steps``); otherwise the closest key of the same level, and for a key inside a
    section a top-level key of that name (``memory.batch_size`` -> ``batch_size``).

    Args:
        name: the unknown key (its last part).
        section: the section it is in (``validation``), or None at the top level.
    """
    if section is None:
        for other in schema.SECTIONS:
            for rest in _strip_word(name, schema.SECTION_WORDS[other]):
                meant = _in_section(rest, other)
                if meant is not None:
                    return meant
        in_sections = [f"{s}.{k}" for s, keys in schema.SECTIONS.items() for k in keys if k == name]
        if len(in_sections) == 1:
            return in_sections[0]
        close = difflib.get_close_matches(name, list(schema.TOP_LEVEL), n=1)
        return close[0] if close else None
    if section not in schema.SECTIONS:
        return None
    meant = _in_section(name, section)
    if meant is None and name in schema.TOP_LEVEL:
        return f"{name} (a top-level key)"
    return meant


def check_keys(
    data: dict[str, Any],
    keys: dict[str, Key],
    prefix: str,
    problems: list[Problem],
    required: bool = True,
    optional: frozenset[str] = frozenset(),
) -> None:
    """Check the keys of one level (``keys`` under ``prefix``): unknown ones with the key
    meant, ``???`` values, each value against its Key, and (``required``) missing required keys
    except those in ``optional``."""
    for name, value in data.items():
        dotted = f"{prefix}{name}"
        if name not in keys:
            if prefix == "kd_loss." and name == "_component_":
                continue  # reported by check_kd_loss_component
            meant = suggest_key(str(name), prefix.rstrip(".") or None)
            fix = f"did you mean {meant}?" if meant else "remove it (kd does not use it)"
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


def check_component_numbers(data: dict[str, Any], problems: list[Problem]) -> None:
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


def check_kd_loss_component(section: str, node: dict[str, Any], problems: list[Problem]) -> None:
    """A ``kd_loss._component_`` that compat could not map to a divergence."""
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


def check_loss(value: Any, problems: list[Problem]) -> None:
    """``loss:`` must be null: kd computes CE itself (compat maps torchtune's CE losses)."""
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


def check_component_args(data: dict[str, Any], problems: list[Problem]) -> None:
    """The arguments of component nodes that kd reads itself (:data:`schema.COMPONENT_ARGS`)."""
    for dotted, key in schema.COMPONENT_ARGS.items():
        name, arg = dotted.split(".", 1)
        node = data.get(name)
        if isinstance(node, dict) and arg in node:
            message = check_value(dotted, node[arg], key)
            if message:
                problems.append(Problem(dotted, message))
