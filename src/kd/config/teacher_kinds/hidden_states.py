"""The hidden-states kind: a local ``teacher_model`` whose mapped layer outputs the student's
are matched to (``hidden_states:``; hidden-state distillation), through learned width
projections the recipe trains with the student.

Its source is :class:`kd.teachers.build.ModelTeacherSource`; its teacher
:class:`kd.teachers.hidden_states.HiddenStateTeacher` over a :class:`kd.teachers.ModelTeacher`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kd.config.checks.features import check_hidden_states
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan
from kd.config.teacher_kinds.model import plan_local_model

if TYPE_CHECKING:
    from kd.config.run import RunConfig

__all__ = ["KIND"]


def _selects(run: RunConfig) -> bool:
    return run.hidden_states is not None and run.has_teacher


def _plan(p: TeacherPlan) -> None:
    plan_local_model(p)
    hs = p.run.hidden_states
    assert hs is not None
    p.hidden_map, p.hidden_loss = hs.layer_map, hs.loss


KIND = TeacherKind(
    name="hidden_states",
    section="hidden_states",
    selects=_selects,
    source="kd.teachers.build:ModelTeacherSource",
    precedence=50,
    checks=(check_hidden_states,),
    plan=_plan,
    stand_in="kd.memory.stand_ins:hidden_states",
    doc="docs/hidden_states.md",
    teacher="kd.teachers.hidden_states.HiddenStateTeacher",
    modules=(
        "teachers/build.py",
        "teachers/hidden_states.py",
        "config/checks/features.py",
    ),
)
