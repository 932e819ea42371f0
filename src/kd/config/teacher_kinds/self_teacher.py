"""The self kind: the student teaches itself, seeing each row with a privileged context
(``self_teacher:``; self-distillation). Its weights are the student's with LoRA adapters off,
its live weights, or a frozen copy of its initial weights (a full fine-tune).

Its source is :class:`kd.teachers.build.SelfTeacherSource`; its teacher
:class:`kd.teachers.self_teacher.SelfTeacher`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kd.config.checks.self_teacher import check_self_teacher
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan, no_quantization

if TYPE_CHECKING:
    from kd.config.run import RunConfig

__all__ = ["KIND"]


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
    section="self_teacher",
    selects=_selects,
    source="kd.teachers.build:SelfTeacherSource",
    refuse=_refuse,
    precedence=30,
    replaces_teacher_model=True,
    checks=(check_self_teacher,),
    plan=_plan,
    doc="docs/self_distillation.md",
    teacher="kd.teachers.self_teacher.SelfTeacher",
    modules=(
        "teachers/build.py",
        "teachers/self_teacher.py",
        "teachers/privileged.py",
        "config/checks/self_teacher.py",
    ),
)
