"""The rollout interface: what an on-policy run needs from whatever samples the student.

On-policy distillation (``on_policy:``, :mod:`kd.training.on_policy`) trains on the student's own
completions of its prompts. *Who* samples them is a :class:`Sampler`, chosen once by
``on_policy.sampler`` (:func:`kd.rollouts.build.sampler_for`) and held by the recipe's on-policy
component (:class:`kd.training.on_policy.OnPolicyBatches`) without asking which kind it holds, the
way the recipe holds a teacher:

- ``local`` (:class:`kd.rollouts.local.LocalSampler`): the student in this process, with a KV
  cache (today's sampler; ``on_policy.batch_rollouts`` and ``on_policy.async_steps`` make it fast).
- ``served``: a vLLM or SGLang server holding a copy of the student, its weights pushed by
  :meth:`Sampler.after_step` (the served sampler's own module and settings).

The contract, in the order a run calls it:

1. :meth:`Sampler.check` in ``kd validate`` / ``preload`` (no weight: a server is probed here).
2. :meth:`Sampler.load_state_dict` on resume (the state :meth:`Sampler.state_dict` saved).
3. Per optimizer step ``s``: :meth:`Sampler.sample` once or more (the prompts of step ``s``'s
   on-policy micro-batches; with ``on_policy.async_steps: 1`` those of step ``s + 1`` are asked
   from a background thread while step ``s`` trains, so ``sample`` must be callable from a thread
   other than the main one), then :meth:`Sampler.after_step` once the optimizer step is applied
   (no ``sample`` call is in flight then: the component waits for it first).
4. :meth:`Sampler.state_dict` when a step checkpoint is written; :meth:`Sampler.close` at the end.

Every :class:`~kd.rollouts.base.Completions` carries the weight ``version`` it was sampled with:
the number of optimizer steps applied to those weights. A synchronous local sampler samples step
``s`` with version ``s - 1`` (lag 0); the component logs the lag (``rollout_version_lag``).

What the planner counts for a sampler (a KV cache on the training device, or none) is
:mod:`kd.rollouts.plan` (no torch, as the planner).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from kd.errors import KDUserError

__all__ = ["Completions", "Prompts", "RolloutStopped", "Sampler"]


@dataclass(frozen=True)
class Prompts:
    """A batch of prompts, left-padded.

    Attributes:
        tokens: ``[b, P]`` ids, padding on the left.
        mask: ``[b, P]`` True on real tokens.
        lengths: ``[b]`` real tokens per prompt.
        truncated: prompts that lost their first tokens to fit ``max_len``.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    truncated: int = 0

    def to(self, device: torch.device) -> Prompts:
        """The prompts with ``tokens`` and ``mask`` (what the models read) on ``device``;
        ``lengths`` stay where they are (the host, where the training batch is assembled)."""
        return replace(self, tokens=self.tokens.to(device), mask=self.mask.to(device))


@dataclass(frozen=True)
class Completions:
    """Sampled continuations of :class:`Prompts`.

    Attributes:
        tokens: ``[b, N]`` sampled ids; positions after a row's end hold the pad id.
        lengths: ``[b]`` tokens of each completion, its stop token included.
        steps: decoding steps run (the longest completion over all ranks).
        version: the weight version that sampled them: optimizer steps applied to those weights
            (-1: not a student's rollout, e.g. the teacher's for ``seq_kd``).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    steps: int
    version: int = -1


class RolloutStopped(KDUserError):
    """A sampler cannot produce completions mid-run (a server stayed down, refused a request, or
    answered something malformed): the recipe saves the steps completed, then stops with this
    one line (exit 2), as for :class:`kd.teachers.TeacherStopped`; resume continues.

    Args:
        message: the line.
        collective: under torchrun, every rank raised it at the same step (so the ranks can save
            together); False: this rank alone may have.
    """

    def __init__(self, message: str, *, collective: bool = False):
        super().__init__(message)
        self.collective = collective


@runtime_checkable
class Sampler(Protocol):
    """What samples the student's completions (``on_policy.sampler``).

    Attributes:
        kind: the ``on_policy.sampler`` value it implements (``local``, ``served``).
        version: the weight version :meth:`sample` samples with now (optimizer steps applied).
    """

    kind: str
    version: int

    def check(self) -> None:
        """Everything that needs no weight, before the run loads any (``kd validate`` runs it):
        a server is reachable and serves this student. Raises ``KDUserError``."""
        ...

    def sample(
        self,
        prompts: Prompts,
        *,
        rows: Sequence[int],
        epoch: int,
        step: int,
        student: nn.Module,
    ) -> Completions:
        """Completions of ``prompts`` (``on_policy.max_new_tokens``, temperature, top-p, the
        tokenizer's stop ids) for optimizer step ``step``.

        Args:
            prompts: left-padded prompts, on the training device.
            rows: each prompt's dataset row: row ``r`` of epoch ``e`` samples from a generator
                seeded by ``(seed, e, r)`` (:func:`kd.rollouts.sampling.row_generators`), or
                the server's per-request ``seed`` derived the same way.
            epoch: the epoch of ``step``.
            step: the optimizer step the completions train (1-based).
            student: the live student (a local sampler may sample with it; a served one ignores
                it).

        Returns:
            Completions on the training device, ``version`` set.

        Raises:
            RolloutStopped: the completions cannot be had (the run saves and stops).
        """
        ...

    def idle(self, step: int) -> None:
        """Step ``step``'s rollouts are all sampled and the step is about to train: a sampler
        holding device memory it needs only to sample gives it back until its next
        :meth:`sample` or :meth:`after_step` (a served one with ``on_policy.server_sleep`` puts
        its server to sleep; the local one holds none between steps). Raises
        ``RolloutStopped``."""
        ...

    def after_step(self, student: nn.Module, step: int) -> None:
        """Optimizer step ``step`` was applied to ``student``: a sampler holding its own copy of
        the weights (a server, a background copy) brings it up to date here when due, and sets
        :attr:`version`. Collective when distributed (rank 0 pushes, every rank agrees)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs (tensors on the CPU, plain values; loaded with
        ``weights_only=True``)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state (empty: a checkpoint written without one)."""
        ...

    def close(self) -> None:
        """Release threads, connections and copies of weights."""
        ...
