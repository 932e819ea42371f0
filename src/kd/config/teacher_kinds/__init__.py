"""The teacher-kind registry: every kind of teacher kd knows, each declared in one module.

Each module here declares one :class:`TeacherKind` (:mod:`kd.config.teacher_kinds.base`): its config
section, its checks, whether it may be a member of ``teachers:``, its planner inputs, its tracer
stand-in and its source (the last two by reference, imported by the layer that builds them).
:func:`kd.teachers.build.teacher_source`,
:mod:`kd.config.validate`, ``kd plan`` (:func:`kd.memory.plan.inputs_from_run`) and the memory
tracer (:func:`kd.memory.fake_step.build_fake_step`) loop over :func:`kinds`; nothing outside
these modules asks which teacher keys a config sets.

Adding a kind: its module here (or :func:`register` at runtime, with its own section), its
:class:`kd.teachers.Teacher`, its tests and a doc page (``docs/teachers.md``). No torch is
imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kd.config import schema
from kd.config.run import KIND_SECTIONS
from kd.config.teacher_kinds import (
    cross_tokenizer,
    foreign,
    hidden_states,
    model,
    self_teacher,
    served,
    several,
    store,
)
from kd.config.teacher_kinds.base import (
    StandIn,
    TeacherKind,
    TeacherPlan,
    no_quantization,
    resolve,
)

if TYPE_CHECKING:
    from kd.config.run import RunConfig
    from kd.config.schema import Problem

__all__ = [
    "StandIn",
    "TeacherKind",
    "TeacherPlan",
    "kinds",
    "nested_problems",
    "no_quantization",
    "register",
    "replacing_sections",
    "resolve",
    "schema_checks",
    "selected",
    "unregister",
]

# Registry order: the order of their config checks (and of kd's docs).
_KINDS: dict[str, TeacherKind] = {
    k.name: k
    for k in (
        store.KIND,
        foreign.KIND,
        served.KIND,
        self_teacher.KIND,
        several.KIND,
        cross_tokenizer.KIND,
        hidden_states.KIND,
        model.KIND,
    )
}


def kinds() -> tuple[TeacherKind, ...]:
    """Every registered kind, in registry order."""
    return tuple(_KINDS.values())


def register(kind: TeacherKind) -> None:
    """Add ``kind`` (a kind defined outside kd, or a test's). A kind with its own
    ``settings`` adds its section to the config schema.

    Raises:
        ValueError: a kind of that name is registered already.
    """
    if kind.name in _KINDS:
        raise ValueError(f"teacher kind {kind.name!r} is registered already")
    if kind.settings is not None:
        assert kind.section is not None and kind.section_help is not None, kind.name
        schema.add_section(kind.section, kind.section_help, kind.settings)
        KIND_SECTIONS[kind.section] = kind.settings
    _KINDS[kind.name] = kind


def unregister(name: str) -> None:
    """Remove the kind ``name`` (and the section it added)."""
    kind = _KINDS.pop(name)
    if kind.settings is not None and kind.section is not None:
        schema.remove_section(kind.section)
        KIND_SECTIONS.pop(kind.section, None)


def selected(run: RunConfig) -> TeacherKind | None:
    """The kind of ``run``'s teacher (the first by precedence that selects it), or None."""
    for kind in sorted(_KINDS.values(), key=lambda k: k.precedence):
        if kind.selects(run):
            return kind
    return None


def schema_checks(data: dict[str, Any], problems: list[Problem]) -> None:
    """Every kind's weight-free checks of a config (each function once, registry order)."""
    done: set[Any] = set()
    for kind in _KINDS.values():
        for check in kind.checks:
            if check not in done:
                done.add(check)
                check(data, problems)


def nested_problems(
    data: dict[str, Any], check: Callable[[dict[str, Any]], list[Problem]]
) -> list[Problem]:
    """Problems of the one-teacher configs a kind's section holds (``teachers:``' members),
    each found by ``check`` (a validation pass)."""
    out: list[Problem] = []
    for kind in _KINDS.values():
        if kind.nested is not None:
            out += kind.nested(data, check)
    return out


def replacing_sections(data: dict[str, Any]) -> list[str]:
    """The sections set in ``data`` (plain containers) that stand in for ``teacher_model``."""
    return [
        k.section
        for k in _KINDS.values()
        if k.replaces_teacher_model and k.section and isinstance(data.get(k.section), dict)
    ]
