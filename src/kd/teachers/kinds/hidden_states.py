"""The hidden-states kind: a local ``teacher_model`` whose mapped layer outputs the student's
are matched to (``hidden_states:``; hidden-state distillation), through learned width
projections the recipe trains with the student.

Its source is :class:`kd.teachers.build.ModelTeacherSource`; its teacher
:class:`kd.teachers.hidden.HiddenStateTeacher` over a :class:`kd.teachers.ModelTeacher`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kd.config.checks.features import check_hidden_states
from kd.teachers.kinds.base import StandIn, TeacherKind, TeacherPlan
from kd.teachers.kinds.model import plan_local_model, quantize_stand_in

if TYPE_CHECKING:
    from kd.config.run import RunConfig

__all__ = ["KIND"]


def _selects(run: RunConfig) -> bool:
    return run.hidden_states is not None and run.has_teacher


def _make(run: RunConfig, build: Any) -> Any:
    from kd.teachers.build import ModelTeacherSource

    return ModelTeacherSource(run)


def _plan(p: TeacherPlan) -> None:
    plan_local_model(p)
    hs = p.run.hidden_states
    assert hs is not None
    p.hidden_map, p.hidden_loss = hs.layer_map, hs.loss


def _stand_in(s: StandIn) -> None:
    """The teacher's hooks and the projections (trained with the student)."""
    quantize_stand_in(s)
    from kd.teachers import ModelTeacher
    from kd.teachers.hidden import HiddenStateTeacher

    assert s.run.hidden_states is not None
    s.signal_teacher = HiddenStateTeacher(ModelTeacher(s.teacher), s.run.hidden_states)
    s.trainable += list(s.signal_teacher.bind_student(s.student).parameters())


KIND = TeacherKind(
    name="hidden_states",
    section="hidden_states",
    selects=_selects,
    make=_make,
    precedence=50,
    checks=(check_hidden_states,),
    plan=_plan,
    stand_in=_stand_in,
    doc="docs/hidden_states.md",
    teacher="kd.teachers.hidden.HiddenStateTeacher",
    modules=(
        "teachers/build.py",
        "teachers/hidden.py",
        "config/checks/features.py",
    ),
)
