"""``kd init --self``: the ``self_teacher:`` section of a self-distillation config (one model
folder: the student is its own teacher, seeing each row with a privileged context)."""

from __future__ import annotations

from kd.config.teacher_kinds.self_teacher import template_fields
from kd.errors import KDUserError, one_line
from kd.scaffold.data import DataFormat

# Row fields that usually hold privileged information, in the order kd init looks for them.
CONTEXT_FIELDS: tuple[str, ...] = (
    "reference",
    "context",
    "solution",
    "document",
    "hint",
    "explanation",
)


def context_template(flag: str | None, data: DataFormat) -> str:
    """``self_teacher.context``: ``--context``, else a reference-like field of the data's rows
    (:data:`CONTEXT_FIELDS`), else empty.

    Raises:
        KDUserError: ``--context`` does not render, or names a field the first rows lack.
    """
    if flag is None:
        found = [name for name in CONTEXT_FIELDS if name in data.columns]
        return f"Reference: {{{found[0]}}}\n" if found else ""
    try:
        fields = template_fields(flag)
    except ValueError as e:
        raise KDUserError(f"--context: {one_line(flag[:60])} does not render: {e}") from None
    missing = [f for f in fields if f not in data.columns]
    if missing:
        raise KDUserError(
            f"--context: the data's rows have no field {missing[0]!r} (they have: "
            f"{', '.join(data.columns)}); name one of them, or add it to every row"
        )
    return flag


def self_section(context: str) -> list[str]:
    """The ``self_teacher:`` lines (``context`` as a double-quoted YAML string)."""
    import json

    note = "" if context else '  (empty: set it, e.g. "Reference: {reference}\\n")'
    return [
        "# Self-distillation (docs/self_distillation.md): the student is its own teacher, seeing",
        "# each row with a privileged context it never sees itself. A LoRA student's teacher is",
        "# its base model (adapters off, no copy); a full fine-tune's a frozen copy of its",
        "# initial weights.",
        "self_teacher:",
        f"  context: {json.dumps(context)}  # a template over the row's fields{note}",
        "  place: system  # system: a system message first; user: before the last user message",
        "  weights: initial  # initial: the student's initial weights; live: its current ones",
        "",
    ]
