"""The cross-tokenizer kind: a teacher with another tokenizer (``cross_tokenizer:``), either a
Hugging Face ``teacher_model`` that scores its own tokens, or kd's store of such a teacher
(beside ``teacher_logits:``; format 2: its ids, spans, log-probs and vocabulary). The loss is
GOLD's character-span alignment and hybrid ULD loss (:mod:`kd.cross_tokenizer`); see
``docs/cross_tokenizer.md``.

Its sources are :class:`kd.teachers.cross.CrossTokenizerSource` (a model) and
:class:`kd.teachers.cross_stored.CrossStoredSource` (a store).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kd.config.teachers import check_cross_tokenizer
from kd.teachers.kinds.base import StandIn, TeacherKind, TeacherPlan, no_quantization
from kd.teachers.kinds.model import plan_local_model, quantize_stand_in
from kd.teachers.kinds.store import check_one_store

if TYPE_CHECKING:
    from kd.config.run import RunConfig

__all__ = ["KIND", "cross_model_stand_in"]


def _selects(run: RunConfig) -> bool:
    if run.cross_tokenizer is None:
        return False
    # A store of such a teacher; else a teacher model that no served or self teacher replaces.
    return run.teacher_logits is not None or (
        run.has_teacher and run.teacher_server is None and run.self_teacher is None
    )


def _make(run: RunConfig, build: Any) -> Any:
    if run.teacher_logits is not None:  # the teacher's own tokens and offsets, stored
        check_one_store(run)
        no_quantization(run, "this run reads stored teacher logits (teacher_logits)")
        from kd.teachers.cross_stored import CrossStoredSource

        return CrossStoredSource(run)
    no_quantization(run, "this run's teacher has another tokenizer")
    from kd.teachers.cross import CrossTokenizerSource

    return CrossTokenizerSource(run)


def _store_size(p: TeacherPlan) -> int:
    """The teacher's distribution size behind a cross-tokenizer store: its manifest's, else
    the configured ``teacher_model``'s (the store is not written yet), else the student's (with
    a note)."""
    from kd.teachers.stored_logits import read_manifest

    run = p.run
    assert run.teacher_logits is not None
    folder = Path(run.teacher_logits.path).expanduser()
    manifest = read_manifest(folder) if folder.is_dir() else None
    cross = manifest.get("cross_tokenizer") if manifest is not None else None
    if isinstance(cross, dict) and isinstance(cross.get("teacher_size"), int):
        return int(cross["teacher_size"])
    if run.components["teacher_model"] is not None:
        return p.shape_of(run, "teacher_model", "teacher_checkpointer")[0].vocab_size
    p.notes.append(
        f"teacher_logits: {folder} holds no cross-tokenizer store yet and no teacher_model names "
        "its teacher: its distribution is planned at the student's size"
    )
    return p.student.vocab_size


def _plan(p: TeacherPlan) -> None:
    p.cross = True
    if p.run.teacher_logits is None:
        plan_local_model(p)
        return
    p.stored_topk = p.run.teacher_logits.k
    p.cross_vocab = _store_size(p)


def cross_model_stand_in(s: StandIn) -> None:
    """The tracer's teacher model scoring its own tokens (:class:`FakeCrossTeacher`)."""
    from kd import models
    from kd.memory.fake_cross import FakeCrossTeacher
    from kd.memory.loss_head import cross_matched

    planned = s.planned
    sizes = (models.vocab_size(s.student), models.vocab_size(s.teacher))
    s.signal_teacher = FakeCrossTeacher(
        s.teacher,
        sizes=sizes,
        matched=cross_matched(planned.student, planned.teacher, planned.knobs),
        matched_weight=s.run.cross_tokenizer.matched_weight,  # type: ignore[union-attr]
    )


def _stand_in(s: StandIn) -> None:
    run = s.run
    assert run.cross_tokenizer is not None
    if run.teacher_logits is None:
        quantize_stand_in(s)
        cross_model_stand_in(s)
        return
    from kd import models
    from kd.memory.fake_cross import FakeCrossStore
    from kd.memory.loss_head import cross_matched, cross_teacher

    planned = s.planned
    crossed = cross_teacher(planned.student, None, planned.knobs)
    assert crossed is not None
    s.signal_teacher = FakeCrossStore(
        sizes=(models.vocab_size(s.student), crossed.vocab_size),
        matched=cross_matched(planned.student, crossed, planned.knobs),
        matched_weight=run.cross_tokenizer.matched_weight,
    )


KIND = TeacherKind(
    name="cross_tokenizer",
    section="cross_tokenizer",
    selects=_selects,
    make=_make,
    precedence=5,
    checks=(check_cross_tokenizer,),
    member=True,
    plan=_plan,
    stand_in=_stand_in,
    doc="docs/cross_tokenizer.md",
    teacher="kd.teachers.cross.CrossTokenizerTeacher",
    modules=(
        "teachers/cross.py",
        "teachers/cross_stored.py",
        "teachers/cross_chat.py",
        "cross_tokenizer.py",
        "config/teachers.py",
        "recipes/teacher_logits.py",
    ),
)
