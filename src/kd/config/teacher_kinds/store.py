"""The store kind: kd's own store of a teacher's top-k log-probs (``teacher_logits:`` with
``format: kd``), written by ``kd run teacher_logits`` or a served teacher's write-through.

Its source is :class:`kd.teachers.build.StoredTeacherSource`; its teacher
:class:`kd.teachers.StoreTeacher` over :class:`kd.teachers.store_reader.TeacherLogitsReader`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kd.config.checks.features import check_teacher_logits
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan, no_quantization
from kd.errors import KDUserError

if TYPE_CHECKING:
    from kd.config.run import RunConfig

__all__ = ["KIND", "check_one_store", "plan_stored", "refuse_stored"]

SECTION = "teacher_logits"


def check_one_store(run: RunConfig) -> None:
    """A run trains from one store: ``teacher_logits.path`` or ``teacher_server.store``.

    Raises:
        KDUserError: both are set.
    """
    served = run.teacher_server
    if run.teacher_logits is not None and served is not None and served.store is not None:
        raise KDUserError(
            f"teacher_server.store: {served.store} beside teacher_logits.path "
            f"{run.teacher_logits.path}: train from one store; set teacher_server.store=null "
            "(train from teacher_logits.path), or teacher_logits=null (write through the server)"
        )


def refuse_stored(run: RunConfig) -> None:
    """One store, and no int8 (nothing to quantize)."""
    check_one_store(run)
    no_quantization(run, "this run reads stored teacher logits (teacher_logits)")


def _selects(run: RunConfig) -> bool:
    s = run.teacher_logits
    return s is not None and s.format == "kd" and run.cross_tokenizer is None


def plan_stored(p: TeacherPlan) -> None:
    """No teacher forward: the top-k read per micro-batch."""
    assert p.run.teacher_logits is not None
    p.stored_topk = p.run.teacher_logits.k


KIND = TeacherKind(
    name="store",
    section=SECTION,
    selects=_selects,
    source="kd.teachers.build:StoredTeacherSource",
    refuse=refuse_stored,
    precedence=10,
    replaces_teacher_model=True,
    checks=(check_teacher_logits,),
    member=True,
    plan=plan_stored,
    stand_in="kd.memory.stand_ins:store",
    doc="docs/stored_logits.md",
    teacher="kd.teachers.files.StoreTeacher",
    modules=(
        "teachers/build.py",
        "teachers/files.py",
        "teachers/store_format.py",
        "teachers/store_manifest.py",
        "teachers/store_writer.py",
        "teachers/store_reader.py",
        "teachers/store_folder.py",
        "config/checks/features.py",
        "recipes/teacher_logits.py",
    ),
)
