"""Whether one value fits its :class:`~kd.config.schema.Key`: type, range, choices, finiteness.

Pure functions of the value: no file, no import of a ``_component_``.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

from kd.config.schema import Key

# The devices kd runs on (``device``, ``teacher_device``).
DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")

# Integers every key (and every argument torch receives) must fit in.

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def fmt(x: Any) -> str:
    """A value as a message quotes it (floats short, strings quoted)."""
    return f"{x:g}" if isinstance(x, float) else repr(x) if isinstance(x, str) else str(x)


def expected(key: Key) -> str:
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
        return f"{noun} between {fmt(key.min)} and {fmt(key.max)}"
    if key.min_exclusive is not None and key.max is not None:
        return f"{noun} greater than {fmt(key.min_exclusive)} and at most {fmt(key.max)}"
    if key.min_exclusive is not None:
        return f"{noun} greater than {fmt(key.min_exclusive)}"
    if key.min is not None:
        return f"{noun} >= {fmt(key.min)}"
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
        return f"{fmt(value)} is not a finite number (NaN and infinity are not allowed)"
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        return f"{value} is beyond the 64-bit integer range"
    return None


def non_finite_text(value: str) -> bool:
    """``nan``, ``inf``, ``-inf``: YAML reads them as strings (only ``.nan``/``.inf`` are floats)."""
    try:
        return not math.isfinite(float(value))
    except ValueError:
        return False


def check_value(dotted: str, value: Any, key: Key) -> str | None:
    """The problem with ``value`` for ``key``, as a message ending in the fix, or None.

    ``dotted`` names the key (or the flag, e.g. ``--budget-gib``) in the fix.
    """
    fix = f"set {dotted} to {expected(key)}"
    if value is None:
        return None if key.nullable else f"null is not allowed; {fix}"
    if key.node:
        if key.node_list and isinstance(value, list):
            if value:
                return None  # each entry is checked by key_nodes
            return f"an empty list; set {dotted} to a node with _component_, or a list of them"
        if not isinstance(value, dict):
            return f"expected a mapping, got {fmt(value)}; write {dotted}: as a block of keys"
        return None
    if key.types and not _type_ok(value, key.types):
        if isinstance(value, str) and float in key.types and non_finite_text(value):
            return f"{value} is not a finite number (NaN and infinity are not allowed); {fix}"
        return f"{fmt(value)} is not {expected(Key(None, key.types))}; {fix}"
    problem = number_problem(value)
    if problem is not None:
        return f"{problem}; {fix}"
    if key.choices is not None and value not in key.choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in key.choices], n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return f"{fmt(value)} is not allowed; {hint}{fix}"
    if isinstance(value, (int, float)):
        if key.min is not None and key.max is not None and not key.min <= value <= key.max:
            return f"{fmt(value)} is outside [{fmt(key.min)}, {fmt(key.max)}]; set {dotted} to a value between {fmt(key.min)} and {fmt(key.max)}"
        if key.min is not None and value < key.min:
            return f"{fmt(value)} is below the minimum {fmt(key.min)}; {fix}"
        if key.max is not None and value > key.max:
            return f"{fmt(value)} is above the maximum {fmt(key.max)}; {fix}"
        if key.min_exclusive is not None and value <= key.min_exclusive:
            return f"{fmt(value)} must be greater than {fmt(key.min_exclusive)}; {fix}"
    return None
