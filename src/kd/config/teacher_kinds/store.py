"""The store kind: kd's own store of a teacher's top-k log-probs (``teacher_logits:`` with
``format: kd``), written by ``kd run teacher_logits`` or a served teacher's write-through.

This module declares the ``teacher_logits:`` section (its keys, help line and checks; the foreign
kind shares it) and what a run reading stored log-probs refuses: on-policy distillation and
validation, which need a teacher that runs.

Its source is :class:`kd.teachers.build.StoredTeacherSource`; its teacher
:class:`kd.teachers.StoreTeacher` over :class:`kd.teachers.store_reader.StoreReader`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kd.config import schema
from kd.config.checks.values import fmt
from kd.config.declare import MAY_CHANGE, MISSING, MUST_MATCH, setting, settings
from kd.config.run import TOPK_TAIL, TOPK_TAILS, RunConfig
from kd.config.schema import Problem, Section
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan, no_quantization
from kd.errors import KDUserError

__all__ = [
    "KIND",
    "SECTION",
    "SECTION_HELP",
    "TeacherLogitsSettings",
    "check_one_store",
    "check_teacher_logits",
    "plan_stored",
    "refuse_stored",
]

SECTION = "teacher_logits"


@settings
class TeacherLogitsSettings:
    """Stored teacher top-k log-probs (``teacher_logits:``; :mod:`kd.teachers.store_format`):
    ``kd run teacher_logits`` writes them, ``kd run kd`` then trains from them without the
    teacher."""

    path: Path = setting(
        "teacher_logits.path",
        MISSING,
        "folder of the store (manifest.json + Parquet shards) kd run teacher_logits writes",
        resume=MUST_MATCH,
    )
    k: int = setting(
        "teacher_logits.k",
        64,
        "top-k teacher log-probs stored (precompute) or used (training, <= the stored k)",
        min=1,
        max=4096,
        resume=MUST_MATCH,
    )
    tail: str = setting(
        "teacher_logits.tail",
        TOPK_TAIL,
        "the teacher mass outside the top-k: one tail bucket, or renormalise the top-k",
        choices=TOPK_TAILS,
        resume=MUST_MATCH,
    )
    format: str = setting(
        "teacher_logits.format",
        "kd",
        "what path holds: kd's store (kd run teacher_logits), axolotl's top-k KD dataset "
        "(target_token_ids / target_logprobs) or DistillKit's rows (token_ids / top_values, or "
        "compressed with compression_config.yaml beside them); "
        "the foreign files train with dataset kd.data.pretokenized_dataset of the same file",
        choices=("kd", "axolotl", "distillkit"),
        resume=MUST_MATCH,
    )
    source_temperature: float | None = setting(
        "teacher_logits.source_temperature",
        None,
        "axolotl / distillkit: the temperature the file's log-probs were taken at, re-tempered "
        "to temperature over the top-k (needs tail renorm); null = the run's temperature",
        min_exclusive=0,
        resume=MUST_MATCH,
    )
    alignment: str = setting(
        "teacher_logits.alignment",
        "auto",
        "axolotl / distillkit: which token the file's entry j predicts: next (token j + 1: kd, "
        "axolotl main), current (token j: axolotl 0.19, raw vLLM prompt log-probs) or auto "
        "(detected from the rows, refused when unclear)",
        choices=("auto", "next", "current"),
        resume=MUST_MATCH,
    )
    rows_per_shard: int = setting(
        "teacher_logits.rows_per_shard",
        1024,
        "dataset rows per Parquet shard the precompute writes (training reads any)",
        min=1,
        resume=MAY_CHANGE,
    )


SECTION_HELP = Section(
    "stored teacher top-k log-probs: {path, k, tail, format, source_temperature, "
    "rows_per_shard}; `kd run teacher_logits` writes them, `kd run kd` then trains from "
    "them without the teacher; null = the teacher runs online",
    MUST_MATCH,
    optional=True,
    words=("teacher_logits", "logits", "topk", "stored", "offline"),
    after="validation",
)


# What a run reading stored log-probs cannot do (kd.config.checks.features words the problem).
NO_ON_POLICY = (
    "needs the online teacher (it scores the student's own completions, which no stored logits "
    "hold); remove on_policy, or set teacher_logits to null"
)
NO_VALIDATION = (
    "needs the online teacher (val_kd_loss and val_top1_agreement compare the student with the "
    "teacher's full distribution on held-out rows, which teacher_logits does not hold); remove "
    "validation, or set teacher_logits to null"
)


def check_teacher_logits(data: dict[str, Any], problems: list[Problem]) -> None:
    """A source temperature belongs to another tool's file, and re-tempering it leaves the
    mass outside the top-k unknown, so only ``tail: renorm`` is exact then."""
    node = data.get(SECTION)
    if not isinstance(node, dict) or node.get("source_temperature") is None:
        return
    source = node["source_temperature"]
    if node.get("format", TeacherLogitsSettings.format) == "kd":
        problems.append(
            Problem(
                "teacher_logits.source_temperature",
                "is for another tool's file (format axolotl or distillkit); kd's store records "
                "its temperature itself: remove source_temperature",
            )
        )
        return
    temperature = data.get("temperature", schema.TOP_LEVEL["temperature"].default)
    if (
        node.get("tail", TeacherLogitsSettings.tail) == "bucket"
        and isinstance(source, (int, float))
        and isinstance(temperature, (int, float))
        and float(source) != float(temperature)
    ):
        problems.append(
            Problem(
                "teacher_logits.tail",
                f"bucket needs the teacher mass outside the top-k, which re-tempering from "
                f"source_temperature {fmt(source)} to temperature {fmt(temperature)} leaves "
                "unknown; set teacher_logits.tail=renorm",
            )
        )


def check_one_store(run: RunConfig) -> None:
    """A run trains from one store: ``teacher_logits.path`` or ``teacher_server.store``.

    Raises:
        KDUserError: both are set.
    """
    served = run.teacher_server
    if run.teacher_logits is not None and served is not None and served.store is not None:
        raise KDUserError(
            f"teacher_server.store: {served.store} beside teacher_logits.path "
            f"{run.teacher_logits.path}: train from one store; set teacher_server.store=null "
            "(train from teacher_logits.path), or teacher_logits=null (write through the server)"
        )


def refuse_stored(run: RunConfig) -> None:
    """One store, and no int8 (nothing to quantize)."""
    check_one_store(run)
    no_quantization(run, "this run reads stored teacher logits (teacher_logits)")


def _selects(run: RunConfig) -> bool:
    s = run.teacher_logits
    return s is not None and s.format == "kd" and run.cross_tokenizer is None


def plan_stored(p: TeacherPlan) -> None:
    """No teacher forward: the top-k read per micro-batch."""
    assert p.run.teacher_logits is not None
    p.stored_topk = p.run.teacher_logits.k


KIND = TeacherKind(
    name="store",
    section=SECTION,
    selects=_selects,
    source="kd.teachers.build:StoredTeacherSource",
    refuse=refuse_stored,
    precedence=10,
    replaces_teacher_model=True,
    checks=(check_teacher_logits,),
    on_policy=NO_ON_POLICY,
    validation=NO_VALIDATION,
    settings=TeacherLogitsSettings,
    section_help=SECTION_HELP,
    member=True,
    plan=plan_stored,
    stand_in="kd.memory.stand_ins:store",
    doc="docs/stored_logits.md",
    teacher="kd.teachers.files.StoreTeacher",
    modules=(
        "teachers/build.py",
        "teachers/files.py",
        "teachers/store_format.py",
        "teachers/store_manifest.py",
        "teachers/store_writer.py",
        "teachers/store_reader.py",
        "teachers/store_folder.py",
        "recipes/teacher_logits.py",
    ),
)
