"""Several teachers (``teachers:``): each member is an ordinary teacher config, checked as one.

A member of ``teachers.members`` holds the keys a one-teacher config puts at the top level
(``teacher_model`` + ``teacher_checkpointer``, ``teacher_logits``, ``teacher_server``, and
``cross_tokenizer`` for a teacher with another tokenizer) plus its ``name`` and ``weight``.
:func:`member_data` makes the one-teacher config of a member (the run's config with the member's
teacher keys in place of the top-level ones), so every check, the
:class:`kd.config.run.RunConfig` and the teacher source of a member are those of a run with that
one teacher: nothing about a teacher is special-cased for several.

This module imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from kd.config import schema
from kd.config.checks.keys import close_key
from kd.config.checks.values import check_value, fmt
from kd.config.declare import Key
from kd.config.run import RunConfig, run_config
from kd.config.schema import Problem

__all__ = [
    "MEMBER_KEYS",
    "MEMBER_WEIGHT",
    "TEACHER_KEYS",
    "Member",
    "check_teachers",
    "member_data",
    "member_problems",
    "members_of",
]

# The top-level keys that name a run's one teacher (and its tokenizer's alignment); a member
# holds its own.
TEACHER_KEYS: tuple[str, ...] = (
    "teacher_model",
    "teacher_checkpointer",
    "teacher_logits",
    "teacher_server",
    "cross_tokenizer",
)
MEMBER_KEYS: tuple[str, ...] = ("name", "weight", *TEACHER_KEYS)
# A member's weight: relative (its share is weight / the sum of weights), so a bound far above any
# useful ratio keeps the shares finite and every member's share above float32's resolution.
MEMBER_WEIGHT = Key(
    1.0,
    (int, float),
    "the member's weight (combine: weights and mix; its share is weight / the sum of weights)",
    min=0.0,
    max=1e6,
)
# Run-wide keys a member's teacher may refuse (a teacher with another tokenizer refuses these).
_RUN_KEYS = ("validation", "on_policy")
# The keys of which a member sets one: its teacher.
_NAMING_KEYS = ("teacher_model", "teacher_logits", "teacher_server")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def member_data(data: dict[str, Any], member: dict[str, Any]) -> dict[str, Any]:
    """The one-teacher config of ``member``: ``data`` without ``teachers``, the member's teacher
    keys in place of the top-level ones (absent ones null)."""
    out = {k: v for k, v in data.items() if k != "teachers" and k not in TEACHER_KEYS}
    for key in TEACHER_KEYS:
        out[key] = member.get(key)
    return out


@dataclass(frozen=True)
class Member:
    """One named teacher: its weight and the run config a one-teacher run of it would have."""

    name: str
    weight: float
    run: RunConfig


def members_of(run: RunConfig) -> list[Member]:
    """The members of ``run.teachers`` (none without it), each with its one-teacher
    :class:`RunConfig`."""
    if run.teachers is None:
        return []
    data = OmegaConf.to_container(OmegaConf.create(run.yaml), resolve=True)
    assert isinstance(data, dict)
    out = []
    for node in run.teachers.members:
        member = OmegaConf.to_container(node, resolve=True)
        assert isinstance(member, dict)
        sub = run_config(OmegaConf.create(member_data(data, member)))
        weight = float(member.get("weight", MEMBER_WEIGHT.default))
        out.append(Member(str(member["name"]), weight, sub))
    return out


def _members(data: dict[str, Any]) -> list[dict[str, Any]]:
    node = data.get("teachers")
    members = node.get("members") if isinstance(node, dict) else None
    return [m for m in members if isinstance(m, dict)] if isinstance(members, list) else []


def member_problems(
    data: dict[str, Any], check: Callable[[dict[str, Any]], list[Problem]]
) -> list[Problem]:
    """``check``'s problems of each member's one-teacher config that concern its teacher keys,
    named ``teachers.members[i].<key>``."""
    problems = []
    for i, member in enumerate(_members(data)):
        for p in check(member_data(data, member)):
            head = p.key.split(".", 1)[0]
            if head in _RUN_KEYS and "cross_tokenizer" in p.message:
                # a run-wide key the member's cross_tokenizer refuses (check_cross_tokenizer)
                who = f"teachers.members[{i}] ({member.get('name')})"
                problems.append(Problem(p.key, f"{who}: {p.message}"))
            elif head in TEACHER_KEYS:
                problems.append(Problem(f"teachers.members[{i}].{p.key}", p.message))
            elif head == "validation" and "teacher" in p.message:
                problems.append(Problem(p.key, f"teachers.members[{i}]: {p.message}"))
    return problems


def _unknown_member_key(where: str, key: str) -> tuple[Problem, str | None]:
    """A key a member does not hold, with the key meant: a member key spelled alike
    (``teacher_modle``; returned too), or a run-wide key that belongs at the top level."""
    meant = close_key(key, MEMBER_KEYS, ("member", "teacher"))
    if meant is not None:
        fix = f"did you mean {meant}?"
    elif key in schema.TOP_LEVEL:
        fix = f"{key} is set for the whole run, not per teacher; move it to the top level"
    else:
        fix = f"remove it (a member holds {', '.join(MEMBER_KEYS)})"
    return Problem(f"{where}.{key}", f"unknown key; {fix}"), meant


def _member_shape_problems(i: int, member: Any, names: set[str], combine: Any) -> list[Problem]:
    """One member's own keys: a dict with a unique name, a weight in [0, 1e6] (under
    ``combine: route``, none but 1) and one teacher."""
    where = f"teachers.members[{i}]"
    if not isinstance(member, dict):
        return [Problem(where, "is not a mapping; give {name, weight, teacher_model | ...}")]
    problems = []
    meant_teacher = False  # an unknown key that means a teacher key (one line, not two)
    for key in member:
        if key not in MEMBER_KEYS:
            problem, meant = _unknown_member_key(where, str(key))
            meant_teacher |= meant in _NAMING_KEYS
            problems.append(problem)
    name = member.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        problems.append(
            Problem(
                f"{where}.name",
                f"{fmt(name)} is not a teacher name; give 1-64 letters, digits, _ . or -",
            )
        )
    elif name in names:
        problems.append(Problem(f"{where}.name", f"{name} names two teachers; rename one"))
    else:
        names.add(name)
    if "weight" in member:
        weight = member["weight"]
        message = check_value(f"{where}.weight", weight, MEMBER_WEIGHT)
        if message is None and combine == "route" and weight != MEMBER_WEIGHT.default:
            message = (
                f"{fmt(weight)} is not used by combine: route (each row learns from the one "
                "teacher it names, at full weight); remove the weight, or use combine: weights"
            )
        if message is not None:
            problems.append(Problem(f"{where}.weight", message))
    if not meant_teacher and not any(member.get(k) is not None for k in _NAMING_KEYS):
        problems.append(
            Problem(where, "names no teacher; set teacher_model, teacher_logits or teacher_server")
        )
    return problems


def check_teachers(data: dict[str, Any], problems: list[Problem]) -> None:
    """``teachers:``: its members' own keys, nothing of one teacher (nor ``self_teacher``) at
    the top level beside it, weights summing to a positive number (under ``combine: route`` none
    but 1), a route field exactly with ``combine: route``, full distributions for ``combine:
    mix``, and with ``on_policy`` members that score (and, routed under ``seq_kd``, sample)
    completions made during training. Each member's teacher keys are checked by
    :func:`member_problems` (the validation passes call it)."""
    node = data.get("teachers")
    if not isinstance(node, dict):
        return
    for key in TEACHER_KEYS:  # null (a template's teacher keys set to null) is no teacher
        if data.get(key) is not None:
            which = "the entry" if key != "cross_tokenizer" else "the entry of the teacher"
            problems.append(
                Problem(key, f"is set beside teachers; move it into {which} of teachers.members")
            )
    if isinstance(data.get("self_teacher"), dict):
        problems.append(
            Problem(
                "self_teacher",
                "is set beside teachers (the student as its own teacher, and other teachers); "
                "remove self_teacher or teachers",
            )
        )
    members = node.get("members")
    if not isinstance(members, list) or not members:
        problems.append(
            Problem("teachers.members", "needs at least one {name, weight, teacher_model | ...}")
        )
        return
    names: set[str] = set()
    combine = node.get("combine", "weights")
    for i, member in enumerate(members):
        problems += _member_shape_problems(i, member, names, combine)
    weights = [m.get("weight", MEMBER_WEIGHT.default) for m in members if isinstance(m, dict)]
    numbers = [w for w in weights if check_value("weight", w, MEMBER_WEIGHT) is None]
    if combine != "route" and len(numbers) == len(weights) and sum(numbers) <= 0:
        problems.append(
            Problem(
                "teachers.members",
                f"the weights sum to {fmt(sum(numbers))}; give at least one teacher a weight > 0",
            )
        )
    field = node.get("route_field")
    if combine == "route" and not field:
        problems.append(
            Problem("teachers.route_field", "is required by combine: route; name the data field")
        )
    if combine != "route" and field:
        problems.append(
            Problem(
                "teachers.route_field", f"is only read by combine: route (not {combine}); remove it"
            )
        )
    problems += _on_policy_problems(data, members, combine)
    if combine == "mix":
        _check_mix(members, problems)


def _check_mix(members: list[Any], problems: list[Problem]) -> None:
    """``combine: mix`` needs every member's full distribution over the student's vocabulary."""
    for i, m in enumerate(members):
        if not isinstance(m, dict):
            continue
        if m.get("cross_tokenizer") is not None:
            problems.append(
                Problem(
                    f"teachers.members[{i}].cross_tokenizer",
                    "cannot be mixed by combine: mix (the teachers' distributions are over "
                    "different vocabularies, not mixable before the divergence); use combine: "
                    "weights (or route)",
                )
            )
        elif m.get("teacher_logits") or m.get("teacher_server"):
            problems.append(
                Problem(
                    f"teachers.members[{i}]",
                    "gives top-k log-probs, but combine: mix needs every teacher's full "
                    "distribution; use combine: weights, or a teacher_model",
                )
            )


def _on_policy_problems(data: dict[str, Any], members: list[Any], combine: Any) -> list[Problem]:
    """With ``on_policy``: every member scores completions made during training (no stored
    log-probs hold them), and under ``seq_kd`` with ``combine: route`` each row's own member
    samples them (a model)."""
    node = data.get("on_policy")
    if not isinstance(node, dict):
        return []
    problems = []
    for i, m in enumerate(members):
        if not isinstance(m, dict):
            continue
        if m.get("teacher_logits"):
            problems.append(
                Problem(
                    f"teachers.members[{i}].teacher_logits",
                    "holds stored log-probs, but on_policy scores completions sampled during "
                    "training; use a teacher_model for this member, or remove on_policy",
                )
            )
        elif combine == "route" and node.get("seq_kd") and m.get("teacher_server"):
            problems.append(
                Problem(
                    f"teachers.members[{i}].teacher_server",
                    "cannot sample its rows' completions (on_policy.seq_kd); use a "
                    "teacher_model for this member, or set on_policy.seq_kd=false",
                )
            )
    return problems


def check_cross_tokenizer(data: dict[str, Any], problems: list[Problem]) -> None:
    """``cross_tokenizer:``: a Hugging Face ``teacher_model`` (its folder holds its tokenizer)
    that runs during training; nothing that compares the two models position by position.
    Beside ``teachers:`` it is refused by :func:`check_teachers` (it belongs in a member, whose
    one-teacher config :func:`member_problems` checks with this function)."""
    if not isinstance(data.get("cross_tokenizer"), dict) or isinstance(data.get("teachers"), dict):
        return  # beside teachers: check_teachers says to move it into a member
    node = data.get("teacher_model")
    stored = isinstance(data.get("teacher_logits"), dict)  # the teacher only names the store's
    hf = isinstance(node, dict) and str(node.get("_component_", "")).startswith("kd.hf.")
    served = isinstance(data.get("teacher_server"), dict)  # refused below, in its own line
    if not hf and not (stored and node is None) and not served:
        problems.append(
            Problem(
                "cross_tokenizer",
                "needs teacher_model: {_component_: kd.hf.causal_lm, path: FOLDER} (the folder "
                "holds the teacher's own tokenizer); set teacher_model so, or remove "
                "cross_tokenizer",
            )
        )
    fmt = data["teacher_logits"].get("format", "kd") if stored else "kd"
    if fmt != "kd":
        problems.append(
            Problem(
                "teacher_logits.format",
                f"{fmt} files hold no teacher token ids and offsets, which cross_tokenizer "
                "needs; write kd's store with kd run teacher_logits (format: kd), or remove "
                "cross_tokenizer",
            )
        )
    if stored and data["teacher_logits"].get("tail") == "renorm":
        problems.append(
            Problem(
                "teacher_logits.tail",
                "renorm is not used with cross_tokenizer (the mass outside the stored top-k is "
                "spread evenly over the teacher's other ids); remove teacher_logits.tail",
            )
        )
    for key, why in (
        ("teacher_server", "a served teacher scores the student's tokens"),
        ("validation", "its metrics compare the models position by position"),
        ("on_policy", "completions are scored on the student's tokens"),
    ):
        if isinstance(data.get(key), (dict, list)):
            problems.append(
                Problem(key, f"cannot be used with cross_tokenizer ({why}); remove one of them")
            )
