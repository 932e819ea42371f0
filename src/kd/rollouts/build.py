"""The one place ``on_policy.sampler`` is read: :func:`sampler_for` builds the run's sampler."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kd.config.run import RunConfig
from kd.errors import KDUserError
from kd.rollouts.base import Sampler
from kd.runtime.distributed import WorldInfo

__all__ = ["SAMPLER_BUILDERS", "sampler_for"]


def _local(run: RunConfig, **kw: Any) -> Sampler:
    from kd.rollouts.local import LocalSampler
    from kd.rollouts.plan import copy_dtype

    assert run.on_policy is not None
    return LocalSampler(
        run.on_policy,
        compile=run.compile,
        copy_dtype=copy_dtype(run.on_policy, dtype=run.dtype),
        **kw,
    )


def _served(run: RunConfig, *, student: Any, student_vocab: int | None, **kw: Any) -> Sampler:
    from kd.rollouts.served import served_sampler

    return served_sampler(run, student=student, student_vocab=student_vocab, **kw)


# on_policy.sampler -> its builder, called as builder(run, tokenizer=..., seed=..., vocab_limit=...,
# world=..., device=..., output_dir=...; served: student=, student_vocab=). Every value of
# kd.config.on_policy_settings.SAMPLERS has one.
SAMPLER_BUILDERS: dict[str, Callable[..., Sampler]] = {"local": _local, "served": _served}


def sampler_for(
    run: RunConfig,
    *,
    tokenizer: object,
    seed: int,
    vocab_limit: int,
    world: WorldInfo,
    device: torch.device,
    output_dir: Path,
    student: Any = None,
    student_vocab: int | None = None,
) -> Sampler:
    """The run's sampler (``on_policy.sampler``); builds nothing heavy (no weight, no thread, no
    connection): :meth:`Sampler.check` and :meth:`Sampler.sample` do the work.

    Args:
        run: the run (``run.on_policy`` set).
        tokenizer: the run's tokenizer (pad and stop ids).
        seed: the run's seed (each row's generator derives from it).
        vocab_limit: ids from here on are never sampled.
        world: this process's place in the job.
        device: the training device (completions come back there).
        output_dir: the run's folder (a served sampler writes the weights it pushes there).
        student: where the student came from (:class:`kd.runtime.checkpoints.StudentSource`: a
            served sampler exports it as checkpoints do); None where no weight is pushed.
        student_vocab: the student's output rows (a served sampler keeps the rows no tokenizer
            has out of its samples).

    Raises:
        KDUserError: a sampler this build of kd does not have.
    """
    assert run.on_policy is not None
    kind = run.on_policy.sampler
    builder = SAMPLER_BUILDERS.get(kind)
    if builder is None:
        raise KDUserError(
            f"on_policy.sampler: {kind} is not available in this installation of kd; "
            f"use one of {', '.join(sorted(SAMPLER_BUILDERS))}"
        )
    served = {"student": student, "student_vocab": student_vocab} if kind == "served" else {}
    return builder(
        run,
        **served,
        tokenizer=tokenizer,
        seed=seed,
        vocab_limit=vocab_limit,
        world=world,
        device=device,
        output_dir=output_dir,
    )
