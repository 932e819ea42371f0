"""The foreign-files kind: another tool's stored top-k log-probs (``teacher_logits:`` with
``format: axolotl`` or ``distillkit``), read and aligned by
:class:`kd.teachers.foreign_store.ForeignStoreReader`.

It shares the store's section (declared in :mod:`kd.config.teacher_kinds.store`), source (:class:`kd.teachers.build.StoredTeacherSource`), teacher
(:class:`kd.teachers.StoreTeacher`), planner inputs and stand-in.
"""

from __future__ import annotations

from kd.config.run import RunConfig
from kd.config.teacher_kinds import store
from kd.config.teacher_kinds.base import TeacherKind

__all__ = ["KIND"]


def _selects(run: RunConfig) -> bool:
    s = run.teacher_logits
    return s is not None and s.format != "kd" and run.cross_tokenizer is None


KIND = TeacherKind(
    name="foreign",
    section=store.SECTION,
    selects=_selects,
    source="kd.teachers.build:StoredTeacherSource",
    refuse=store.refuse_stored,
    precedence=11,
    replaces_teacher_model=True,
    checks=(store.check_teacher_logits,),
    on_policy=store.NO_ON_POLICY,
    validation=store.NO_VALIDATION,
    settings=store.TeacherLogitsSettings,
    section_help=store.SECTION_HELP,
    member=True,
    plan=store.plan_stored,
    stand_in="kd.memory.stand_ins:store",
    doc="docs/stored_logits.md",
    teacher="kd.teachers.files.StoreTeacher",
    modules=(
        "teachers/build.py",
        "teachers/foreign_store.py",
        "teachers/distillkit_compressed.py",
    ),
)
