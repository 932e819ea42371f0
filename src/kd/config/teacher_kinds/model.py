"""The model kind: a local ``teacher_model`` (either backend), its weights optionally int8
(``teacher_quantization``) or parked in host memory (``teacher_offload``).

Selected by ``teacher_model`` when no other kind's section names the teacher. It has no section;
its checks are ``teacher_model: null`` (plain fine-tuning), ``teacher_offload`` and
``teacher_device`` (top-level keys of :class:`kd.config.run.RunConfig`). Its source is
:class:`kd.teachers.build.ModelTeacherSource`; its teacher :class:`kd.teachers.ModelTeacher`.
"""

from __future__ import annotations

from typing import Any

from kd.config.checks.teacher import is_hf_model_node
from kd.config.checks.values import DEVICE_RE, fmt
from kd.config.run import RunConfig
from kd.config.schema import Problem
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan

__all__ = [
    "KIND",
    "check_teacher",
    "check_teacher_device",
    "check_teacher_offload",
    "offload_accepted",
    "plan_local_model",
    "teacher_device_under_torchrun",
    "torchrun_problem",
]


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


def check_teacher_offload(data: dict[str, Any], problems: list[Problem]) -> None:
    """``teacher_offload`` parks a local teacher model (``teacher_model``, or the members of
    ``teachers:`` that have one) that is neither quantized, compiled, another tokenizer's, a
    source of stored logits nor the student itself."""
    mode = data.get("teacher_offload", "none")
    if mode in (None, "none"):
        return
    fix = "set teacher_offload=none"
    members = (
        data.get("teachers", {}).get("members") if isinstance(data.get("teachers"), dict) else None
    )
    local = data.get("teacher_model") is not None and data.get("teacher_logits") is None
    crossed = data.get("cross_tokenizer") is not None
    if isinstance(members, list):
        own = [
            m
            for m in members
            if isinstance(m, dict)
            and m.get("teacher_model") is not None
            and m.get("teacher_logits") is None
        ]
        local = local or bool(own)
        # a member with another tokenizer is loaded resident (kd.teachers.cross)
        crossed = crossed or any(m.get("cross_tokenizer") is not None for m in own)
    reasons = []
    if not local or data.get("self_teacher") is not None:
        reasons.append("needs a local teacher model (teacher_model) to park")
    if data.get("teacher_quantization", "none") != "none":
        reasons.append("does not park an int8 teacher (teacher_quantization)")
    if data.get("compile"):
        reasons.append("does not park compiled layers (compile)")
    if crossed:
        reasons.append("does not park a teacher with another tokenizer (cross_tokenizer)")
    if reasons:
        problems.append(Problem("teacher_offload", f"{mode} {reasons[0]}; {fix}"))


def offload_accepted(run: RunConfig) -> bool:
    """Whether ``run`` with ``teacher_offload: park`` passes :func:`check_teacher_offload` and
    :func:`check_teacher_device` (``kd plan --fit`` suggests parking only then)."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.create(run.yaml), resolve=True)
    assert isinstance(data, dict)
    data["teacher_offload"] = "park"
    problems: list[Problem] = []
    check_teacher_offload(data, problems)
    check_teacher_device(data, problems)
    return not problems


def teacher_device_under_torchrun(name: str) -> str:
    """The line ``teacher_device`` is refused with under torchrun."""
    return (
        f"teacher_device: {name} puts the teacher on its own device in one process; under "
        "torchrun the teacher is sharded over the ranks' devices (FSDP2): remove "
        "teacher_device, or run on one process"
    )


def own_device(run: RunConfig) -> bool:
    """Whether ``teacher_device`` names a device other than the student's (``cuda`` is
    ``cuda:0``)."""
    if run.teacher_device is None:
        return False

    def split(name: str) -> tuple[str, int]:
        kind, _, index = name.partition(":")
        return kind, int(index or 0)

    return split(run.teacher_device) != split(run.device)


def torchrun_problem(run: RunConfig) -> str | None:
    """The line a run under torchrun refuses a local teacher's one-device keys with, before any
    weight is read (:meth:`kd.teachers.build.ModelTeacherSource.check`); ``kd plan --world-size
    N`` refuses them with it too. None when none is set."""
    if run.teacher_quantization != "none":
        return (
            f"teacher_quantization: {run.teacher_quantization} runs on one device (an "
            "FSDP2-sharded teacher is not quantized); set teacher_quantization=none, or run on "
            "one device"
        )
    if run.teacher_offload != "none":
        return (
            f"teacher_offload: {run.teacher_offload} runs on one device (an FSDP2-sharded teacher "
            "keeps only its shard); set teacher_offload=none (fsdp.cpu_offload keeps the shards "
            "in host memory), or run on one device"
        )
    if run.teacher_device is not None:
        return teacher_device_under_torchrun(run.teacher_device)
    return None


def check_teacher_device(data: dict[str, Any], problems: list[Problem]) -> None:
    """``teacher_device`` names a device and puts one local teacher model (``teacher_model``,
    neither parked, nor the student itself, nor one of several) there: what it runs that is not a
    plain forward (sampling, hidden-state hooks, another tokenizer) stays on one device."""
    where = data.get("teacher_device")
    if where is None:
        return
    fix = "remove teacher_device"
    if not isinstance(where, str) or not DEVICE_RE.match(where):
        problems.append(
            Problem(
                "teacher_device",
                f"{where!r} is not a device kd runs on; set it to cuda:N or cpu, or {fix}",
            )
        )
        return
    local = data.get("teacher_model") is not None and data.get("teacher_logits") is None
    on_policy = data.get("on_policy")
    reasons = []
    if not local or data.get("self_teacher") is not None or data.get("teachers") is not None:
        reasons.append("needs one local teacher model (teacher_model; not self_teacher, teachers:)")
    if data.get("teacher_offload", "none") not in (None, "none"):
        reasons.append("and teacher_offload both say where the teacher's weights wait; pick one")
    if isinstance(on_policy, dict) and on_policy.get("seq_kd"):
        reasons.append("does not sample from the teacher (on_policy.seq_kd)")
    if data.get("hidden_states") is not None:
        reasons.append("does not match hidden states across devices (hidden_states)")
    if data.get("cross_tokenizer") is not None:
        reasons.append("does not run a teacher with another tokenizer (cross_tokenizer)")
    if reasons:
        problems.append(Problem("teacher_device", f"{where} {reasons[0]}; {fix}"))


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
    ),
)
