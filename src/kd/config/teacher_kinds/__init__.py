"""The teacher-kind registry: every kind of teacher kd knows, each declared in one module.

Each module here declares one :class:`TeacherKind` (:mod:`kd.config.teacher_kinds.base`): its config
section (its settings dataclass and help line), its checks, what it refuses of on-policy
distillation and validation, whether it may be a member of ``teachers:``, its planner inputs, its
tracer stand-in and its source (the last two by reference, imported by the layer that builds them).
Registering a kind adds its section to the schema tables (:func:`kd.config.schema.add_section`)
and to :class:`kd.config.run.RunConfig` (:data:`kd.config.run.KIND_SECTIONS`); importing
:mod:`kd.config` registers the built-in kinds below, so neither module names a kind.
:func:`kd.teachers.build.teacher_source`,
:mod:`kd.config.validate`, ``kd plan`` (:func:`kd.memory.plan.inputs_from_run`) and the memory
tracer (:func:`kd.memory.fake_step.build_fake_step`) loop over :func:`kinds`; nothing outside
these modules asks which teacher keys a config sets.

Adding a built-in kind: its module here and its line in ``_BUILT_IN`` (or :func:`register` at
runtime), its :class:`kd.teachers.Teacher` and source, its tests and a doc page
(``docs/teachers.md``). No torch is imported here.
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
    "in_use",
    "kinds",
    "nested_problems",
    "no_quantization",
    "refusal",
    "refuse",
    "register",
    "replacing_sections",
    "resolve",
    "schema_checks",
    "selected",
    "unregister",
]

# The built-in kinds in registry order: the order of their config checks (and of kd's docs).
_BUILT_IN: tuple[TeacherKind, ...] = (
    store.KIND,
    foreign.KIND,
    served.KIND,
    self_teacher.KIND,
    several.KIND,
    cross_tokenizer.KIND,
    hidden_states.KIND,
    model.KIND,
)
_KINDS: dict[str, TeacherKind] = {}


def kinds() -> tuple[TeacherKind, ...]:
    """Every registered kind, in registry order."""
    return tuple(_KINDS.values())


def register(kind: TeacherKind) -> None:
    """Add ``kind`` (a built-in kind, a kind defined outside kd, or a test's). A kind with
    ``settings`` adds its section to the config schema and to the run config, unless a kind
    registered before declared that section with the same settings.

    Raises:
        ValueError: a kind of that name is registered already, or its section is another
            kind's with other settings.
    """
    if kind.name in _KINDS:
        raise ValueError(f"teacher kind {kind.name!r} is registered already")
    if kind.settings is not None:
        assert kind.section is not None and kind.section_help is not None, kind.name
        held = KIND_SECTIONS.get(kind.section)
        if held is None:
            schema.add_section(kind.section, kind.section_help, kind.settings)
            KIND_SECTIONS[kind.section] = kind.settings
        elif held is not kind.settings:
            raise ValueError(f"section {kind.section!r} is declared already by other settings")
    _KINDS[kind.name] = kind


def unregister(name: str) -> None:
    """Remove the kind ``name`` (and the section it added, unless another kind shares it)."""
    kind = _KINDS.pop(name)
    shared = any(k.section == kind.section for k in _KINDS.values())
    if kind.settings is not None and kind.section is not None and not shared:
        schema.remove_section(kind.section)
        KIND_SECTIONS.pop(kind.section, None)


for _kind in _BUILT_IN:
    register(_kind)


def selected(run: RunConfig) -> TeacherKind | None:
    """The kind of ``run``'s teacher (the first by precedence that selects it), or None."""
    for kind in sorted(_KINDS.values(), key=lambda k: k.precedence):
        if kind.selects(run):
            return kind
    return None


def refuse(run: RunConfig) -> None:
    """What ``run``'s kind refuses that the schema pass lets through (:attr:`TeacherKind.refuse`;
    without a teacher, ``teacher_quantization``): weight-free, so ``kd run`` (before building the
    teacher), ``kd validate`` and ``kd plan`` refuse the same runs.

    Raises:
        KDUserError: the kind refuses ``run``.
    """
    kind = selected(run)
    if kind is None:
        no_quantization(run, "this run has no teacher_model")
    elif kind.refuse is not None:
        kind.refuse(run)


def in_use(run: RunConfig) -> TeacherKind | None:
    """The selected kind (:func:`selected`) when the run asks its teacher anything, else None.

    A run asks its teacher when its loss has a KD term (``kd_ratio`` above 0:
    :attr:`kd.config.run.LossSettings.needs_teacher_logits`), when the kind's signal adds a term
    of its own (:attr:`TeacherKind.own_loss`: hidden-state targets), or when the teacher samples
    the completions it trains on (:attr:`kd.config.run.RunConfig.teacher_samples`: ``seq_kd``).
    Otherwise (``kd_ratio: 0``, nothing sampled by the teacher) the run is plain fine-tuning:
    the recipe loads no teacher (:func:`kd.teachers.build.teacher_source`), the plan and the
    tracer count none (:func:`kd.memory.plan.teacher_plan`,
    :func:`kd.memory.fake_step.build_fake_step`).
    """
    kind = selected(run)
    if kind is None or run.loss.needs_teacher_logits or kind.own_loss or run.teacher_samples:
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


def refusal(data: dict[str, Any], feature: str) -> str | None:
    """Why ``feature`` (``on_policy`` or ``validation``) cannot run beside the sections ``data``
    (plain containers) sets: the first kind, in registry order, whose section is set and that
    refuses it (:attr:`TeacherKind.on_policy`, :attr:`TeacherKind.validation`), or None."""
    for kind in _KINDS.values():
        reason = getattr(kind, feature)
        if reason is not None and kind.section and isinstance(data.get(kind.section), dict):
            return str(reason)
    return None


def replacing_sections(data: dict[str, Any]) -> list[str]:
    """The sections set in ``data`` (plain containers) that stand in for ``teacher_model``."""
    return [
        k.section
        for k in _KINDS.values()
        if k.replaces_teacher_model and k.section and isinstance(data.get(k.section), dict)
    ]
