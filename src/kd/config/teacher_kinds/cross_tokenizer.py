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

from kd.config.declare import MUST_MATCH, setting, settings
from kd.config.run import RunConfig
from kd.config.schema import Section
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan, no_quantization
from kd.config.teacher_kinds.model import plan_local_model
from kd.config.teacher_kinds.store import refuse_stored
from kd.config.teachers import check_cross_tokenizer

__all__ = ["KIND", "SECTION", "SECTION_HELP", "CrossTokenizerSettings"]

SECTION = "cross_tokenizer"


@settings
class CrossTokenizerSettings:
    """A teacher with another tokenizer (``cross_tokenizer:``; :mod:`kd.teachers.cross`): GOLD's
    character-span alignment and hybrid ULD loss (:mod:`kd.cross_tokenizer`)."""

    matched_weight: float | None = setting(
        "cross_tokenizer.matched_weight",
        None,
        "weight of the exact part over the token strings both vocabularies share (the rest, "
        "1 - it, is ULD's sorted distance); null = the matched share of the teacher's vocabulary",
        min=0.0,
        max=1.0,
        resume=MUST_MATCH,
    )


SECTION_HELP = Section(
    "a teacher_model (kd.hf.*) with another tokenizer (its folder's): {matched_weight}; "
    "GOLD's character-span alignment and hybrid ULD loss; null = one tokenizer",
    MUST_MATCH,
    optional=True,
    words=("cross_tokenizer", "gold", "uld", "tokenizer"),
    after="teachers",
)


def _selects(run: RunConfig) -> bool:
    if run.cross_tokenizer is None:
        return False
    # A store of such a teacher; else a teacher model that no served or self teacher replaces.
    return run.teacher_logits is not None or (
        run.has_teacher and run.teacher_server is None and run.self_teacher is None
    )


def _source(run: RunConfig) -> str:
    if run.teacher_logits is not None:  # the teacher's own tokens and offsets, stored
        return "kd.teachers.cross_stored:CrossStoredSource"
    return "kd.teachers.cross:CrossTokenizerSource"


def _refuse(run: RunConfig) -> None:
    if run.teacher_logits is not None:
        refuse_stored(run)
    else:
        no_quantization(run, "this run's teacher has another tokenizer")


def _store_size(p: TeacherPlan) -> int:
    """The teacher's distribution size behind a cross-tokenizer store: its manifest's, else
    the configured ``teacher_model``'s (the store is not written yet), else the student's (with
    a note)."""
    run = p.run
    assert run.teacher_logits is not None
    folder = Path(run.teacher_logits.path).expanduser()
    manifest = p.store_manifest(folder) if folder.is_dir() else None
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


KIND = TeacherKind(
    name="cross_tokenizer",
    section=SECTION,
    selects=_selects,
    source=_source,
    refuse=_refuse,
    precedence=5,
    checks=(check_cross_tokenizer,),
    settings=CrossTokenizerSettings,
    section_help=SECTION_HELP,
    member=True,
    plan=_plan,
    stand_in="kd.memory.stand_ins:cross_tokenizer",
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
