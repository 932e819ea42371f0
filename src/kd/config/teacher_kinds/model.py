"""The model kind: a local ``teacher_model`` (either backend), its weights optionally int8
(``teacher_quantization``) or parked in host memory (``teacher_offload``).

Selected by ``teacher_model`` when no other kind's section names the teacher. Its source is
:class:`kd.teachers.build.ModelTeacherSource`; its teacher :class:`kd.teachers.ModelTeacher`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kd.config.checks.features import check_teacher_device, check_teacher_offload
from kd.config.checks.teacher import is_hf_model_node
from kd.config.checks.values import fmt
from kd.config.schema import Problem
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan

if TYPE_CHECKING:
    from kd.config.run import RunConfig

__all__ = ["KIND", "check_teacher", "plan_local_model"]


def check_teacher(data: dict[str, Any], problems: list[Problem]) -> None:
    """``teacher_model: null`` is plain fine-tuning: only with ``kd_ratio: 0`` (unless another
    kind's section is the teacher)."""
    from kd.config.teacher_kinds import replacing_sections

    if replacing_sections(data):
        return  # that section teaches; a teacher node, if any, only identifies it
    if "teacher_model" in data and data["teacher_model"] is None:
        ratio = data.get("kd_ratio")
        if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio != 0:
            problems.append(
                Problem(
                    "teacher_model",
                    f"null means no teacher, but kd_ratio is {fmt(ratio)}; set teacher_model to a "
                    "builder, or kd_ratio=0 for plain fine-tuning",
                )
            )
    elif (
        "teacher_checkpointer" in data
        and data["teacher_checkpointer"] is None
        and not is_hf_model_node(data.get("teacher_model"))
    ):
        problems.append(
            Problem(
                "teacher_checkpointer",
                "null, but teacher_model is set; set teacher_checkpointer to the teacher's "
                "checkpointer (or teacher_model to null with kd_ratio=0)",
            )
        )


def _selects(run: RunConfig) -> bool:
    return run.has_teacher


def plan_local_model(p: TeacherPlan) -> None:
    """A local teacher model's planner inputs: its shape, int8 weights, its offload mode."""
    run = p.run
    p.teacher, notes = p.shape_of(run, "teacher_model", "teacher_checkpointer")
    p.notes += notes
    if run.teacher_quantization == "int8":
        p.bytes_per_param = p.int8_bytes(p.teacher, p.dtype_bytes)
    p.offload = run.teacher_offload


KIND = TeacherKind(
    name="model",
    section=None,
    selects=_selects,
    source="kd.teachers.build:ModelTeacherSource",
    precedence=60,
    checks=(check_teacher, check_teacher_offload, check_teacher_device),
    member=True,
    plan=plan_local_model,
    stand_in="kd.memory.stand_ins:model",
    teacher="kd.teachers.model.ModelTeacher",
    modules=(
        "teachers/build.py",
        "teachers/model.py",
        "teachers/quantize.py",
        "teachers/parking.py",
        "teachers/placement.py",
        "config/checks/features.py",
    ),
)
