"""The features of `kd` a newcomer finds from the command line, each with its doc page.

``kd --help``, ``kd run --help`` and ``kd ls`` print :func:`feature_lines`; ``kd init --help`` and
the config ``kd init`` writes name the same pages. Every optional config section
(:data:`kd.config.schema.SECTIONS`) belongs to one feature here (a test checks it), so a section
added without a way to find it fails the tests.

This module must stay cheap to import (``kd --help`` uses it): no torch, no omegaconf.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

__all__ = ["FEATURES", "FEATURES_HEADING", "Feature", "doc_of", "feature_lines"]


@dataclass(frozen=True)
class Feature:
    """One feature and how to turn it on.

    Attributes:
        name: what it is called, in a few words.
        how: how to turn it on (a config section, a ``kd init`` flag, a recipe).
        doc: its page, relative to the repository root.
        sections: the config sections (or top-level keys) that belong to it.
    """

    name: str
    how: str
    doc: str
    sections: tuple[str, ...] = ()


FEATURES: tuple[Feature, ...] = (
    Feature("your own models", "kd init --teacher DIR --student DIR", "docs/your_own_models.md"),
    Feature(
        "validation, best, early stopping",
        "validation: keep_best: early_stopping:",
        "docs/your_own_models.md",
        ("validation", "keep_best", "early_stopping"),
    ),
    Feature(
        "several teachers",
        "teachers: (weights | mix | route)",
        "docs/multi_teacher.md",
        ("teachers",),
    ),
    Feature(
        "teacher with another tokenizer",
        "kd init --cross-tokenizer; cross_tokenizer:",
        "docs/multi_teacher.md",
        ("cross_tokenizer",),
    ),
    Feature(
        "served teacher (vLLM, SGLang)",
        "teacher_server:",
        "docs/served_teacher.md",
        ("teacher_server",),
    ),
    Feature(
        "stored teacher logits",
        "kd run teacher_logits; teacher_logits:",
        "docs/stored_logits.md",
        ("teacher_logits",),
    ),
    Feature(
        "on-policy distillation (GKD)",
        "on_policy:",
        "docs/on_policy.md",
        ("on_policy",),
    ),
    Feature(
        "fast local on-policy sampling",
        "on_policy: {batch_rollouts, cuda_graphs, sampling_dtype, async_steps}",
        "docs/on_policy.md",
    ),
    Feature(
        "on-policy rollouts from a vLLM / SGLang server",
        "on_policy: {sampler: served, server_sleep}",
        "docs/served_sampler.md",
    ),
    Feature(
        "hidden-state distillation",
        "hidden_states:",
        "docs/hidden_states.md",
        ("hidden_states",),
    ),
    Feature(
        "self-distillation",
        "kd init --self; self_teacher:",
        "docs/self_distillation.md",
        ("self_teacher",),
    ),
    Feature(
        "int8 teacher",
        "teacher_quantization: int8",
        "docs/int8_teacher.md",
        ("teacher_quantization",),
    ),
    Feature(
        "offloading (activations, teacher; teacher on its own GPU)",
        "enable_activation_offloading: teacher_offload: park | stream teacher_device: cuda:1",
        "docs/offloading.md",
        ("enable_activation_offloading", "teacher_offload", "teacher_device"),
    ),
    Feature(
        "task accuracy (lm-evaluation-harness)",
        "kd eval --model DIR ... --tasks T; eval:",
        "docs/eval.md",
        ("eval",),
    ),
    Feature(
        "divergences, the fused loss",
        "kd_loss: (7 divergences)",
        "docs/loss_benchmark.md",
        ("kd_loss",),
    ),
    Feature(
        "memory plan, several GPUs",
        "kd plan --fit; memory: fsdp:",
        "docs/memory_accuracy.md",
        ("memory", "fsdp"),
    ),
    Feature("a toy run on a CPU", "kd demo", "docs/demo.md"),
    Feature("error messages, their fixes", "kd: error: ...", "docs/errors.md"),
)


def doc_of(section: str) -> str:
    """The doc page of a config section (or top-level key).

    Raises:
        KeyError: no feature declares ``section``.
    """
    for feature in FEATURES:
        if section in feature.sections:
            return feature.doc
    raise KeyError(section)


FEATURES_HEADING = "features (how to turn each on; its page under docs/ in the kd repository):"


def feature_lines(indent: str = "  ", width: int | None = None) -> list[str]:
    """One line per feature, ``<name>  <how to turn it on>  <doc page>``, when that table fits
    ``width`` columns (default: a terminal's width, ``$COLUMNS`` else no limit when the output is
    not a terminal); else two lines a feature: ``<name>``, then ``<how>  <doc page>`` indented."""
    if width is None and ("COLUMNS" in os.environ or sys.stdout.isatty()):
        width = shutil.get_terminal_size().columns
    name_width = max(len(f.name) for f in FEATURES) + 2
    how_width = max(len(f.how) for f in FEATURES) + 2
    table = [
        f"{indent}{f.name:<{name_width}}{f.how:<{how_width}}{f.doc}".rstrip() for f in FEATURES
    ]
    if width is None or max(len(line) for line in table) <= width:
        return table
    lines: list[str] = []
    for f in FEATURES:
        lines += [f"{indent}{f.name}", f"{indent}    {f.how}  {f.doc}"]
    return lines
