"""The self kind: the student teaches itself, seeing each row with a privileged context
(``self_teacher:``; self-distillation): its section, the rules of its section (the student is
the only model, the context template renders with nothing but the row's fields) and its plan. Its
weights are the student's with LoRA adapters off, its live weights, or a frozen copy of its
initial weights (a full fine-tune).

Its source is :class:`kd.teachers.build.SelfTeacherSource`; its teacher
:class:`kd.teachers.self_teacher.SelfTeacher`.
"""

from __future__ import annotations

import string
from dataclasses import replace
from typing import Any

from kd.config.checks.values import fmt
from kd.config.declare import MUST_MATCH, setting, settings
from kd.config.run import RunConfig
from kd.config.schema import Problem, Section
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan, no_quantization

__all__ = [
    "KIND",
    "SECTION",
    "SECTION_HELP",
    "SelfTeacherSettings",
    "check_self_teacher",
    "template_fields",
]

SECTION = "self_teacher"


@settings
class SelfTeacherSettings:
    """Self-distillation (``self_teacher:``; :mod:`kd.teachers.self_teacher`): the student is
    its own teacher, seeing each row with a privileged context the student never sees, in place
    of ``teacher_model`` and ``teacher_checkpointer``."""

    context: str = setting(
        "self_teacher.context",
        "",
        "the teacher's privileged context: a template over the row's fields ({reference} is the "
        "row's reference field; {{ and }} are braces), e.g. a reference solution, a system prompt "
        "or few-shot examples; empty = none (the teacher sees what the student sees)",
        resume=MUST_MATCH,
    )
    place: str = setting(
        "self_teacher.place",
        "system",
        "where the context goes: system (a system message before the conversation, joined to "
        "the row's own) or user (before the text of the last user message)",
        choices=("system", "user"),
        resume=MUST_MATCH,
    )
    weights: str = setting(
        "self_teacher.weights",
        "initial",
        "initial: the student's initial weights (a LoRA student with its adapters off, no copy; "
        "a full fine-tune: a frozen copy loaded beside it); live: the student's current weights "
        "(no copy, the teacher moves as the student learns)",
        choices=("initial", "live"),
        resume=MUST_MATCH,
    )


SECTION_HELP = Section(
    "self-distillation: the student is its own teacher with a privileged context: "
    "{context, place, weights}; in place of teacher_model and teacher_checkpointer; "
    "null = none",
    MUST_MATCH,
    optional=True,
    words=("self_teacher", "self", "self_distillation", "opsd", "context"),
    after="teacher_server",
)


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
    node = data.get(SECTION)
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


def _selects(run: RunConfig) -> bool:
    return run.self_teacher is not None and run.teacher_logits is None


def _refuse(run: RunConfig) -> None:
    no_quantization(run, "this run's teacher is the student itself (self_teacher)")


def _plan(p: TeacherPlan) -> None:
    """The student's own forward without grad; no weights unless a frozen copy; a longer
    input (prompt + context + completion)."""
    run, student = p.run, p.student
    assert run.self_teacher is not None
    p.teacher = replace(student, lora=None)
    p.teacher_samples = False  # the student samples; its teacher is no other model
    copy = student.lora is None and run.self_teacher.weights == "initial"
    p.self_copy = copy
    if not copy:
        p.bytes_per_param = 0.0
    p.offload = run.teacher_offload
    longer = (
        f"its input (prompt + context + completion) is at most {p.seq_len} tokens (kd validate "
        "refuses longer rows), planned as the teacher forward and logits"
    )
    if not copy:
        which = (
            "the LoRA student with adapters off" if student.lora else "the student's live weights"
        )
        p.line = f"self: {which}, no teacher weights; {longer}"
        return
    size = student.total_params() * p.dtype_bytes / 2**30
    p.line = (
        f"self: a frozen copy of the student's initial weights ({size:.2f} GiB; a LoRA student, "
        f"whose teacher is its base with adapters off, or self_teacher.weights=live would "
        f"remove it); {longer}"
    )


KIND = TeacherKind(
    name="self",
    section=SECTION,
    selects=_selects,
    source="kd.teachers.build:SelfTeacherSource",
    refuse=_refuse,
    precedence=30,
    replaces_teacher_model=True,
    checks=(check_self_teacher,),
    settings=SelfTeacherSettings,
    section_help=SECTION_HELP,
    plan=_plan,
    doc="docs/self_distillation.md",
    teacher="kd.teachers.self_teacher.SelfTeacher",
    modules=(
        "teachers/build.py",
        "teachers/self_teacher.py",
        "teachers/privileged.py",
    ),
)
