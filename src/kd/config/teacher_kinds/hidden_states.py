"""The hidden-states kind: a local ``teacher_model`` whose mapped layer outputs the student's
are matched to (``hidden_states:``; hidden-state distillation), through learned width
projections the recipe trains with the student.

Its source is :class:`kd.teachers.build.ModelTeacherSource`; its teacher
:class:`kd.teachers.hidden_states.HiddenStateTeacher` over a :class:`kd.teachers.ModelTeacher`.
"""

from __future__ import annotations

from typing import Any

from kd.config.declare import MISSING, MUST_MATCH, setting, settings
from kd.config.run import RunConfig
from kd.config.schema import Problem, Section
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan
from kd.config.teacher_kinds.model import plan_local_model

__all__ = ["KIND", "SECTION", "SECTION_HELP", "HiddenStateSettings", "check_hidden_states"]

SECTION = "hidden_states"


@settings
class HiddenStateSettings:
    """Hidden-state distillation (``hidden_states:``; :mod:`kd.teachers.hidden_states`): the student's
    mapped layer outputs are matched to the teacher's, through a learned projection when the
    widths differ; the loss adds ``weight * hidden_loss``."""

    layer_map: tuple[str, ...] = setting(
        "hidden_states.layer_map",
        MISSING,
        "pairs 'student:teacher' of points matched: a decoder layer's output by index (0 = first "
        "layer), embed (the token embeddings) or norm (the final norm's output); kd init proposes "
        "it",
        resume=MUST_MATCH,
    )
    loss: str = setting(
        "hidden_states.loss",
        "cosine",
        "per position: cosine (1 - cosine similarity), mse (mean squared error per dimension) or "
        "nmse (squared error over the teacher's squared norm); averaged over pairs and labelled "
        "positions",
        choices=("mse", "nmse", "cosine"),
        resume=MUST_MATCH,
    )
    weight: float = setting(
        "hidden_states.weight",
        1.0,
        "loss = (1 - kd_ratio) * CE + kd_ratio * KD + weight * hidden_loss",
        min=0.0,
        resume=MUST_MATCH,
    )


SECTION_HELP = Section(
    "hidden-state distillation: {layer_map, loss, weight}; needs a teacher model (not stored "
    "or served logits); null = logits only",
    MUST_MATCH,
    optional=True,
    words=("hidden_states", "hidden", "hs", "intermediate", "layer_map"),
    after="cross_tokenizer",
)


def check_hidden_states(data: dict[str, Any], problems: list[Problem]) -> None:
    """Hidden-state distillation reads the teacher's layers: it needs a teacher model that runs
    (stored top-k log-probs and a served teacher hold no hidden states)."""
    if not isinstance(data.get(SECTION), dict):
        return
    fix = "remove hidden_states, or distil from a local teacher_model"
    if isinstance(data.get("teachers"), dict):
        problems.append(
            Problem(
                "hidden_states",
                "is not supported with teachers: (it matches one teacher's layers to the "
                "student's); remove hidden_states, or distil from one teacher_model",
            )
        )
    elif isinstance(data.get("teacher_logits"), dict):
        problems.append(
            Problem(
                "hidden_states",
                f"needs the teacher's hidden states, which teacher_logits "
                f"(stored top-k log-probs) does not hold; {fix} (teacher_logits: null)",
            )
        )
    elif isinstance(data.get("teacher_server"), dict):
        problems.append(
            Problem(
                "hidden_states",
                f"needs the teacher's hidden states, which a served teacher "
                f"(teacher_server) does not answer; {fix}",
            )
        )
    elif "teacher_model" in data and data["teacher_model"] is None:
        problems.append(
            Problem("hidden_states", f"needs a teacher, but teacher_model is null; {fix}")
        )
    elif isinstance(data.get("cross_tokenizer"), dict):
        problems.append(
            Problem(
                "hidden_states",
                "matches positions of one tokenization, but cross_tokenizer gives the teacher "
                "another; remove hidden_states, or cross_tokenizer (a teacher sharing the "
                "student's tokenizer)",
            )
        )


def _selects(run: RunConfig) -> bool:
    return run.hidden_states is not None and run.has_teacher


def _plan(p: TeacherPlan) -> None:
    plan_local_model(p)
    hs = p.run.hidden_states
    assert hs is not None
    p.hidden_map, p.hidden_loss = hs.layer_map, hs.loss


KIND = TeacherKind(
    name="hidden_states",
    section=SECTION,
    selects=_selects,
    source="kd.teachers.build:ModelTeacherSource",
    precedence=50,
    checks=(check_hidden_states,),
    settings=HiddenStateSettings,
    section_help=SECTION_HELP,
    plan=_plan,
    stand_in="kd.memory.stand_ins:hidden_states",
    doc="docs/hidden_states.md",
    own_loss=True,
    teacher="kd.teachers.hidden_states.HiddenStateTeacher",
    modules=(
        "teachers/build.py",
        "teachers/hidden_states.py",
    ),
)
