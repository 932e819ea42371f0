"""What a teacher kind declares, in one module of :mod:`kd.config.teacher_kinds`.

A :class:`TeacherKind` is everything kd knows about one kind of teacher outside its teacher
class: the config section that names it (its settings dataclass, each key declared once, and its
help line: :mod:`kd.config.run` and :mod:`kd.config.schema` know no kind, the registry adds the
section to both), when a run selects it, its weight-free config checks, what it refuses of
on-policy distillation and validation,
whether it may be a member of ``teachers:``, what it tells the memory planner
(:class:`TeacherPlan`), its stand-in in the memory tracer (:class:`StandIn`) and its source (the
:class:`kd.teachers.build.TeacherSource` that checks and loads it). The source and the stand-in are
named by reference (``"module:attribute"``, as a config names a ``_component_``) and imported
only when a run builds them, by the layers that own them (:mod:`kd.teachers.build`,
:mod:`kd.memory.fake_step`): the registry sits in the config layer, which every layer may import,
and imports none of them. No torch here: ``kd validate`` and ``kd plan`` read the registry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kd.errors import KDUserError

if TYPE_CHECKING:
    from kd.config.run import RunConfig
    from kd.config.schema import Problem, Section

__all__ = [
    "SchemaCheck",
    "StandIn",
    "TeacherKind",
    "TeacherPlan",
    "no_quantization",
    "resolve",
]

SchemaCheck = Callable[[dict[str, Any], "list[Problem]"], None]


@dataclass
class TeacherPlan:
    """What the selected kind tells :func:`kd.memory.plan.inputs_from_run` (no torch).

    Attributes:
        run: the run.
        student: the student's :class:`kd.memory.shapes.ModelShape`.
        shape_of: ``(run, key, checkpointer_key) -> (ModelShape, notes)``: a model key's shape.
        notes: the plan's notes (a kind appends its own).
        seq_len: the planned sequence length.
        dtype_bytes: bytes per weight of the run's dtype.
        int8_bytes: ``(shape, dtype_bytes) -> bytes per weight`` of an int8 teacher.
        store_manifest: ``folder -> manifest or None`` of kd's store in a folder.
        teacher: the shape planned as the teacher's forward, or None (no teacher forward).
        stored_topk: k of a top-k signal read from a store or a server, or None.
        teacher_samples: the teacher model may sample ``seq_kd`` completions.
        bytes_per_param: bytes per teacher weight when not the run's dtype (None: the dtype).
        self_copy: the teacher is a frozen copy of the student's initial weights.
        other_params: resident parameters of further teachers (``teachers:``).
        other_head_params: their output projections' parameters.
        hidden_map: ``hidden_states.layer_map`` pairs.
        hidden_loss: ``hidden_states.loss``.
        cross: the loss is the cross-tokenizer aligned loss.
        cross_vocab: the teacher's distribution size for it (0/None: the planned teacher's).
        offload: ``teacher_offload`` of a local teacher model.
        line: the plan table's teacher line (None: the teacher's weights).
    """

    run: RunConfig
    student: Any
    shape_of: Callable[..., tuple[Any, list[str]]]
    notes: list[str]
    seq_len: int
    dtype_bytes: int
    int8_bytes: Callable[[Any, int], float]
    store_manifest: Callable[[Any], dict[str, Any] | None]
    teacher: Any = None
    stored_topk: int | None = None
    teacher_samples: bool = True
    bytes_per_param: float | None = None
    self_copy: bool = False
    other_params: int = 0
    other_head_params: int = 0
    hidden_map: tuple[str, ...] = ()
    hidden_loss: str = "cosine"
    cross: bool = False
    cross_vocab: int | None = None
    offload: str = "none"
    line: str | None = None


@dataclass
class StandIn:
    """The memory tracer's step being built (:func:`kd.memory.fake_step.build_fake_step`): a
    kind sets the stand-in of its teacher's signal.

    Attributes:
        run: the run.
        planned: the run's :class:`kd.memory.plan.PlanInputs`.
        student: the prepared fake student.
        teacher: the prepared fake teacher model (``teacher_model``), or None.
        shard: FSDP2 settings, or None on one device.
        trainable: the parameters the optimizer steps (a kind may add its own).
        signal_teacher: the teacher answering the step's signal (None: ``teacher``).
        topk: fake ``(ids, logprobs)`` a top-k teacher answers, or None.
    """

    run: RunConfig
    planned: Any
    student: Any
    teacher: Any
    shard: Any
    trainable: list[Any]
    signal_teacher: Any = None
    topk: tuple[Any, Any] | None = None


@dataclass(frozen=True)
class TeacherKind:
    """One kind of teacher, declared once.

    Attributes:
        name: the kind's one name (docs, logs, errors).
        section: the config section (or key) whose presence names it; None for the kind chosen
            by ``teacher_model`` alone.
        selects: whether a run's teacher is this kind (the registry asks the kinds by
            ``precedence``, lowest first; the first that answers yes is the run's).
        source: its :class:`kd.teachers.build.TeacherSource`: a reference
            ``"module:Class"`` (built as ``Class(run)``; a kind with ``nested`` configs as
            ``Class(run, teacher_source)``, which builds the members), a function of the run
            returning such a reference, or (a kind defined outside kd) the class itself.
        precedence: the order kinds are asked in.
        refuse: raises :class:`kd.errors.KDUserError` for a run this kind cannot take that the
            schema pass lets through (checked before its source is built).
        replaces_teacher_model: with the section set, ``teacher_model`` and
            ``teacher_checkpointer`` may be left out (the section is the teacher).
        checks: weight-free schema checks (``(data, problems) -> None``), run in registry order.
        nested: ``(data, check) -> problems`` of the one-teacher configs the section holds
            (``teachers:``' members), each checked by ``check``.
        member: it may be a member of ``teachers:`` (a one-teacher config).
        plan: fills the :class:`TeacherPlan` of a run that selects it.
        stand_in: sets the tracer's :class:`StandIn` of a run that selects it: a reference
            ``"module:function"`` or (a kind defined outside kd) the function.
        on_policy: why a run whose config sets ``section`` cannot distil on-policy (the rest of
            the problem line on ``on_policy``; :func:`kd.config.checks.features.check_on_policy`),
            or None.
        validation: the same for ``validation``
            (:func:`kd.config.checks.features.check_validation`), or None.
        settings: the settings dataclass of ``section`` (its keys, each declared once with
            :func:`kd.config.declare.setting`): read into ``run.kind_settings[section]``, and
            answered as ``run.<section>``. Kinds sharing a section name the same class.
        section_help: the schema's :class:`kd.config.schema.Section` of ``section`` (its help
            line, words, and where it goes in the tables).
        teacher: the dotted path of its :class:`kd.teachers.Teacher` class.
        modules: its own implementation modules (paths under ``src/kd``): the only modules
            besides this package that may read its section (a guard test checks).
        doc: the doc page of the kind.
        own_loss: its signal adds a loss term of its own whatever ``kd_ratio`` (hidden-state
            targets: ``weight * hidden_loss``), so the teacher runs with ``kd_ratio: 0`` too
            (:func:`kd.config.teacher_kinds.in_use`).
    """

    name: str
    section: str | None
    selects: Callable[[RunConfig], bool]
    source: str | Callable[..., Any]
    precedence: int
    refuse: Callable[[RunConfig], None] | None = None
    replaces_teacher_model: bool = False
    checks: tuple[SchemaCheck, ...] = ()
    nested: Callable[[dict[str, Any], Callable[..., list[Problem]]], list[Problem]] | None = None
    member: bool = False
    plan: Callable[[TeacherPlan], None] | None = None
    stand_in: str | Callable[[StandIn], None] | None = None
    on_policy: str | None = None
    validation: str | None = None
    settings: type | None = None
    section_help: Section | None = None
    teacher: str = ""
    modules: tuple[str, ...] = ()
    doc: str = "docs/teachers.md"
    own_loss: bool = False


def resolve(ref: str | Any) -> Any:
    """The object a ``"module:attribute"`` reference names (anything else as it is)."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def no_quantization(run: RunConfig, why: str) -> None:
    """``teacher_quantization`` applies to a local ``teacher_model`` only.

    Raises:
        KDUserError: it is set and ``why`` says why this run's teacher is not one.
    """
    quantization = run.teacher_quantization
    if quantization != "none":
        raise KDUserError(
            f"teacher_quantization: {quantization} quantizes a local teacher_model, "
            f"and {why}; set teacher_quantization=none"
        )
