"""The several kind: named teachers combined per example (``teachers:``), each member an
ordinary one-teacher config of a member kind (``TeacherKind.member``), built by
:func:`kd.teachers.build.teacher_source` itself.

Its source is :class:`kd.teachers.multi.MultiTeacherSource`; its teacher
:class:`kd.teachers.multi.MultiTeacher`.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig

from kd.config.declare import MISSING, MUST_MATCH, frozen_node, setting, settings
from kd.config.run import RunConfig
from kd.config.schema import Section
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan, no_quantization
from kd.config.teachers import check_teachers, member_problems, members_of

__all__ = ["COMBINES", "KIND", "SECTION", "SECTION_HELP", "TeachersSettings"]

SECTION = "teachers"


COMBINES: tuple[str, ...] = ("weights", "mix", "route")


def _members(cfg: DictConfig, raw: Any) -> tuple[Any, ...]:
    return tuple(frozen_node(m) for m in raw) if isinstance(raw, (list, ListConfig)) else ()


@settings
class TeachersSettings:
    """Several named teachers (``teachers:``; :mod:`kd.teachers.multi`), each an ordinary teacher
    (its own ``teacher_model`` + ``teacher_checkpointer``, ``teacher_logits`` or
    ``teacher_server``), combined per example."""

    combine: str = setting(
        "teachers.combine",
        "weights",
        "weights: the weighted sum of per-teacher divergences; mix: one divergence to the "
        "weighted mixture of the teachers' distributions; route: each row learns from the "
        "teacher its route_field names (rows naming none: CE only)",
        choices=COMBINES,
        resume=MUST_MATCH,
    )
    route_field: str | None = setting(
        "teachers.route_field",
        None,
        "the data row's field naming its teacher (combine: route)",
        resume=MUST_MATCH,
    )
    members: tuple[Any, ...] = setting(
        "teachers.members",
        MISSING,
        "the teachers: a list of {name, weight, teacher_model + teacher_checkpointer | "
        "teacher_logits | teacher_server, cross_tokenizer (a teacher with another tokenizer)}",
        read=_members,
        resume=MUST_MATCH,
    )


SECTION_HELP = Section(
    "several named teachers: {combine (weights | mix | route), route_field, members: "
    "[{name, weight, teacher_model + teacher_checkpointer | teacher_logits | "
    "teacher_server, cross_tokenizer}]}; in place of the top-level teacher keys; null = one "
    "teacher",
    MUST_MATCH,
    optional=True,
    words=("teachers", "multi", "multi_teacher"),
    after="on_policy",
)


def _selects(run: RunConfig) -> bool:
    return run.teachers is not None


def _refuse(run: RunConfig) -> None:
    no_quantization(run, "the members of teachers: are not quantized")


def _plan(p: TeacherPlan) -> None:
    """The largest local member is planned as the teacher (members run forward one after
    another), the others' parameters stay resident. The cross-tokenizer loss head is the
    planned member's when it has another tokenizer, else the largest distribution of the
    members that have (their losses run one after another, on the student's full logits)."""
    run, notes = p.run, p.notes
    local, crossed = [], []
    for member in members_of(run):
        if member.run.has_teacher:
            shape, member_notes = p.shape_of(member.run, "teacher_model", "teacher_checkpointer")
            local.append(shape)
            if member.run.cross_tokenizer is not None:
                crossed.append((member.name, shape))
            notes += [f"teachers {member.name}: {n}" for n in member_notes]
    if not local:
        return
    largest = max(local, key=lambda m: m.total_params())
    p.teacher, p.offload = largest, run.teacher_offload
    heads = sum(m.vocab_size * m.embed_dim for m in local) - largest.vocab_size * largest.embed_dim
    p.other_head_params = heads
    if len(local) > 1:
        where = (
            "parked in host memory and brought in in turn"
            if run.teacher_offload != "none"
            else "as resident"
        )
        notes.append(
            f"teachers: {len(local)} local teachers; the largest is planned as the teacher, the "
            f"others' weights {where}"
        )
    p.other_params = sum(m.total_params() for m in local) - largest.total_params()
    if not crossed:
        return
    p.cross = True
    if any(shape is largest for _, shape in crossed):
        p.cross_vocab = 0
        return
    name, shape = max(crossed, key=lambda c: c[1].vocab_size)
    notes.append(
        f"teachers {name}: its cross-tokenizer loss ({shape.vocab_size} ids) is planned as the "
        "loss head, beside the largest member's forward"
    )
    p.cross_vocab = shape.vocab_size


KIND = TeacherKind(
    name="several",
    section=SECTION,
    selects=_selects,
    source="kd.teachers.multi:MultiTeacherSource",
    refuse=_refuse,
    precedence=70,
    replaces_teacher_model=True,
    checks=(check_teachers,),
    nested=member_problems,
    settings=TeachersSettings,
    section_help=SECTION_HELP,
    plan=_plan,
    stand_in="kd.memory.stand_ins:several",
    doc="docs/multi_teacher.md",
    teacher="kd.teachers.multi.MultiTeacher",
    modules=(
        "teachers/multi.py",
        "config/teachers.py",
    ),
)
