"""The store kind: kd's own store of a teacher's top-k log-probs (``teacher_logits:`` with
``format: kd``), written by ``kd run teacher_logits`` or a served teacher's write-through.

Its source is :class:`kd.teachers.build.StoredTeacherSource`; its teacher
:class:`kd.teachers.FileTeacher` over :class:`kd.teachers.stored_logits.TeacherLogitsReader`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kd.config.checks.features import check_teacher_logits
from kd.errors import KDUserError
from kd.teachers.kinds.base import StandIn, TeacherKind, TeacherPlan, no_quantization

if TYPE_CHECKING:
    from kd.config.run import RunConfig

__all__ = ["KIND", "check_one_store", "make_stored", "topk_stand_in"]

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


def make_stored(run: RunConfig, build: Any) -> Any:
    """The source of a store or another tool's file (also beside ``teacher_server``: the store
    it filled)."""
    check_one_store(run)
    no_quantization(run, "this run reads stored teacher logits (teacher_logits)")
    from kd.teachers.build import StoredTeacherSource

    return StoredTeacherSource(run)


def _selects(run: RunConfig) -> bool:
    s = run.teacher_logits
    return s is not None and s.format == "kd" and run.cross_tokenizer is None


def plan_stored(p: TeacherPlan) -> None:
    """No teacher forward: the top-k read per micro-batch."""
    assert p.run.teacher_logits is not None
    p.stored_topk = p.run.teacher_logits.k


def topk_stand_in(s: StandIn, *, k: int, tail: str) -> None:
    """A fake ``[b, s, k]`` int64 ids and float16 log-probs batch, as a store's reader and a
    server's client return it, answered with the section's tail treatment
    (:class:`kd.teachers.FixedTopKTeacher`), as the run's file or served teacher does."""
    import torch

    from kd import models
    from kd.teachers import FixedTopKTeacher

    knobs = s.planned.knobs
    shape = (knobs.batch_size, knobs.seq_len, k)
    s.topk = (
        torch.randint(0, models.vocab_size(s.student), shape),  # [b, s, k] int64 ids
        torch.zeros(shape, dtype=torch.float16),  # [b, s, k] log-probs
    )
    s.signal_teacher = FixedTopKTeacher(*s.topk, tail=tail)


def _stand_in(s: StandIn) -> None:
    settings = s.run.teacher_logits
    assert settings is not None
    topk_stand_in(s, k=settings.k, tail=settings.tail)


KIND = TeacherKind(
    name="store",
    section=SECTION,
    selects=_selects,
    make=make_stored,
    precedence=10,
    replaces_teacher_model=True,
    checks=(check_teacher_logits,),
    member=True,
    plan=plan_stored,
    stand_in=_stand_in,
    doc="docs/stored_logits.md",
    teacher="kd.teachers.files.FileTeacher",
    modules=(
        "teachers/build.py",
        "teachers/files.py",
        "teachers/stored_logits.py",
        "teachers/store_folder.py",
        "config/checks/features.py",
        "recipes/teacher_logits.py",
    ),
)
