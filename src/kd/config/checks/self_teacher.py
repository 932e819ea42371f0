"""Rules of ``self_teacher:`` (self-distillation): the student is the only model, and the context
template renders with nothing but the row's fields."""

from __future__ import annotations

import string
from typing import Any

from kd.config.checks.values import fmt
from kd.config.schema import Problem

_DROP = "remove teacher_model and teacher_checkpointer (the student is its own teacher)"


def template_fields(template: str) -> list[str]:
    """The row fields a context template names, in order (each once).

    Args:
        template: ``self_teacher.context``: ``str.format`` syntax, plain field names only.

    Raises:
        ValueError: the template does not parse, or a placeholder is more than a plain field name
            (attribute or index access, a conversion, a format spec, a positional ``{}``).
    """
    fields: list[str] = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            shown = (
                "{"
                + name
                + (f"!{conversion}" if conversion else "")
                + (f":{spec}" if spec else "")
                + "}"
            )
            raise ValueError(
                f"placeholder {shown} is not a plain field name (write {{field}}; {{{{ and }}}} "
                "for literal braces)"
            )
        if name not in fields:
            fields.append(name)
    return fields


def check_self_teacher(data: dict[str, Any], problems: list[Problem]) -> None:
    """``self_teacher`` names no other teacher, its template renders, and what needs another
    teacher or rows the teacher cannot render (held-out data) is refused."""
    node = data.get("self_teacher")
    if not isinstance(node, dict):
        return
    for key in ("teacher_model", "teacher_checkpointer"):
        if data.get(key) is not None and data.get(key) != "???":
            problems.append(Problem(key, f"is set beside self_teacher; {_DROP}"))
    for key in ("teacher_logits", "teacher_server"):
        if isinstance(data.get(key), dict):
            problems.append(
                Problem(
                    key, f"is set beside self_teacher (two teachers); remove {key} or self_teacher"
                )
            )
    context = node.get("context")
    if isinstance(context, str):
        try:
            template_fields(context)
        except ValueError as e:
            problems.append(
                Problem(
                    "self_teacher.context",
                    f"{fmt(context[:60])} does not render: {e}; fix the template",
                )
            )
    if isinstance(data.get("validation"), dict):
        problems.append(
            Problem(
                "validation",
                "is not supported with self_teacher (the teacher's context comes from the "
                "training rows); remove validation (scripts/self_distillation.py measures the "
                "held-out KL)",
            )
        )
    on_policy = data.get("on_policy")
    if isinstance(on_policy, dict) and on_policy.get("seq_kd"):
        problems.append(
            Problem(
                "on_policy.seq_kd",
                "samples the teacher's completions, but a self teacher only scores the "
                "student's; set on_policy.seq_kd=false",
            )
        )
