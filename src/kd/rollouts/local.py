"""The local sampler (``on_policy.sampler: local``): the student samples in this process.

Each call runs :func:`kd.rollouts.sampling.rollout` (either backend's KV cache, one generator per
dataset row seeded by ``(seed, epoch, row)``): today's sampler, bit for bit, when nothing new is
switched on. With ``on_policy.batch_rollouts`` (on one device) it runs
:func:`kd.rollouts.decode.fast_rollout` instead: groups of similar length, a preallocated cache,
finished rows leaving the batch. With ``on_policy.async_steps: 1`` it samples with a frozen copy
of the student (made at the first :meth:`LocalSampler.after_step`, brought up to date at each),
so the next step's completions can be sampled on a background thread while the student trains.

With ``on_policy.sampling_dtype`` other than the student's ``dtype`` (bf16 for an fp32 student)
it samples with a copy of the student's weights in that dtype (:func:`sampling_copy`), made by
the first :meth:`LocalSampler.after_step` (before the first rollout) and brought up to date by a
cast copy at each later one (:func:`update_copy`); with ``async_steps: 1`` the same copy is the
frozen one. Its KV cache and logits are in its dtype; the draw
(:func:`kd.rollouts.sampling.sample_next`) is in fp32. A LoRA student's copy keeps its adapters
unmerged (base and adapters cast alike): the copy is the student's own module tree, so one path
serves full and LoRA students of both backends, compiled layers stay compiled, each step copies
only the trainable tensors (the adapters), and it computes the LoRA student's function
``W x + s B A x`` at the copy's precision. Buffers (RoPE tables) are the student's own, shared,
as in a student built in that dtype. Nothing of it is in the resume state: it is rebuilt from
the weights.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kd import models
from kd.backends import backend_of, decode_attention
from kd.config.on_policy_settings import OnPolicySettings
from kd.errors import KDUserError
from kd.rollouts import graphs, sampling
from kd.rollouts.base import Completions, Prompts
from kd.rollouts.decode import fast_rollout, length_groups
from kd.rollouts.plan import torchrun_problem
from kd.rollouts.prompts import merge_completions, select_rows
from kd.runtime import distributed
from kd.runtime.distributed import WorldInfo

__all__ = ["LocalSampler", "frozen_copy", "sampling_copy", "update_copy"]


class LocalSampler:
    """The student in this process samples its own completions.

    Args:
        settings: ``on_policy:``.
        tokenizer: the run's tokenizer (pad and stop ids).
        seed: the run's seed (per-row generators).
        vocab_limit: ids from here on are never sampled.
        world: this process's place in the job (every rank samples its rows together).
        device: the training device.
        output_dir: the run's folder (unused: nothing is written).
        compile: ``compile: true`` (the decoding step is compiled with ``batch_rollouts``).
        copy_dtype: the dtype of the sampling copy (``on_policy.sampling_dtype`` when it is not
            the student's ``dtype``: :func:`kd.rollouts.plan.copy_dtype`); None: the student's.
    """

    kind = "local"

    def __init__(
        self,
        settings: OnPolicySettings,
        *,
        tokenizer: object,
        seed: int,
        vocab_limit: int,
        world: WorldInfo,
        device: torch.device,
        output_dir: Path | None = None,
        compile: bool = False,
        copy_dtype: str | None = None,
    ):
        from kd.data import pad_id_of

        self.settings = settings
        self.seed = seed
        self.vocab_limit = vocab_limit
        self.world = world
        self.device = device
        self.compile = compile
        self.pad_id = pad_id_of(tokenizer)
        self.stop_ids = sampling.stop_token_ids(tokenizer)
        self.version = 0
        self.copy_dtype = models.DTYPES[copy_dtype] if copy_dtype is not None else None
        # The frozen copy (async_steps: 1) and / or the copy in copy_dtype (sampling_dtype).
        self._policy: nn.Module | None = None

    def check(self) -> None:
        """The settings this sampler cannot honour on this job."""
        if self.world.distributed:  # the line kd plan --world-size N refuses them with too
            refused = torchrun_problem(self.settings, copies=self.copy_dtype is not None)
            if refused is not None:
                raise KDUserError(refused)
        if self.settings.cuda_graphs and self.device.type != "cuda":
            raise KDUserError(
                f"on_policy.cuda_graphs needs a CUDA device, and this run's is {self.device}; "
                "set on_policy.cuda_graphs=false"
            )

    def sample(
        self,
        prompts: Prompts,
        *,
        rows: Sequence[int],
        epoch: int,
        step: int,
        student: nn.Module,
    ) -> Completions:
        """Completions of ``prompts`` by ``student`` (see :meth:`kd.rollouts.base.Sampler.sample`)."""
        op = self.settings
        model = self._policy if self._policy is not None else student
        generators = (
            sampling.row_generators(self.seed, epoch, rows, device=self.device)
            if op.temperature > 0
            else None
        )
        how: dict[str, Any] = {  # what both decoding loops sample with
            "max_new_tokens": op.max_new_tokens,
            "temperature": op.temperature,
            "top_p": op.top_p,
            "stop_ids": self.stop_ids,
            "pad_id": self.pad_id,
            "vocab_limit": self.vocab_limit,
        }
        if op.batch_rollouts and not self.world.distributed:
            done = fast_rollout(
                model,
                prompts,
                **how,
                generators=generators,
                group_size=op.rollout_batch_size,
                compile=self.compile,
                graphs=self.capture() if op.cuda_graphs else None,
            )
            return replace(done, version=self.version)
        # Under torchrun a step's rows (batch_rollouts) are sampled in groups of at most
        # rollout_batch_size rows too, as the plan counts them: every rank has as many rows
        # (full micro-batches, the same coins), so as many groups, each a collective rollout.
        size = op.rollout_batch_size if op.batch_rollouts else None
        groups = length_groups(prompts.lengths.tolist(), size) if size else [list(range(len(rows)))]
        whole = len(groups) == 1
        parts: list[tuple[list[int], Completions]] = []
        for group in groups:
            done = sampling.rollout(
                model,
                prompts if whole else select_rows(prompts, group),
                **how,
                generators=(
                    generators if whole or generators is None else [generators[i] for i in group]
                ),
                all_done=(
                    (lambda here: not distributed.any_rank(not here, device=self.device))
                    if self.world.distributed
                    else None
                ),
            )
            parts.append((group, done))
        if not whole:
            done = merge_completions(parts, len(rows), width=op.max_new_tokens, pad_id=self.pad_id)
        return replace(done, version=self.version)

    def capture(self) -> graphs.Capture:
        """How this rollout's decode steps are captured (``on_policy.cuda_graphs``): CUDA graphs
        sharing one memory pool, freed with the rollout."""
        return graphs.cuda_capture(torch.cuda.graph_pool_handle())

    def idle(self, step: int) -> None:
        """Nothing to give back: the KV cache and the decode's buffers live only while
        :meth:`sample` runs."""

    def after_step(self, student: nn.Module, step: int) -> None:
        """The weights are step ``step``'s now: the student samples itself, or (``async_steps``,
        ``sampling_dtype``) its copy is made or takes the student's new weights, cast to the
        copy's dtype (no sampling is in flight: the on-policy component waited for it)."""
        if self._policy is not None:
            update_copy(self._policy, student)
        elif self.settings.async_steps > 0 or self.copy_dtype is not None:
            # The first call (OnPolicyBatches.start, before the first rollout): made here.
            self._policy = sampling_copy(student, self.copy_dtype)
        self.version = step

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "version" in state:
            self.version = int(state["version"])

    def close(self) -> None:
        """Drop the frozen copy."""
        self._policy = None


# What nn.Module keeps of the hooks registered on an instance (register_forward_(pre_)hook).
_FORWARD_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that trains nothing (the async sampler's weights); modules compiled
    in place (``compile: true``) stay compiled, on the copy's own weights (tested)."""
    return sampling_copy(model, None)


def sampling_copy(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """A frozen copy of ``model`` (the sampler's own weights) whose floating-point parameters are
    in ``dtype`` (None: as they are). Each parameter is cast straight into the copy (no second
    full-precision copy on the way); tied parameters stay tied; the buffers (RoPE tables, which
    nothing writes) are the model's own, shared, in the model's dtype as in a model built in
    ``dtype``. The forward hooks registered on ``model`` are not the copy's: they serve the
    training student (a hidden-state teacher's capture, activation offloading, a trace's marks),
    and a copy's rollout firing them would write into the training step's state."""
    with torch.no_grad():
        memo: dict[int, Any] = {
            id(p): nn.Parameter(
                p.detach().to(dtype, copy=True)
                if dtype is not None and p.is_floating_point()
                else p.detach().clone(),
                requires_grad=False,
            )
            for p in model.parameters()
        }
        memo.update({id(b): b for b in model.buffers()})
        made = copy.deepcopy(model, memo).requires_grad_(False)
    for module in made.modules():  # the training student's hooks (hidden-state capture...)
        for hooks in _FORWARD_HOOKS:
            getattr(module, hooks).clear()
    if dtype in decode_attention.LOW_PRECISION and _on_cpu(made):
        backend_of(model).install_decode_attention(made)
    return made


def _on_cpu(model: nn.Module) -> bool:
    return all(p.device.type == "cpu" for p in model.parameters())


def update_copy(mine: nn.Module, student: nn.Module) -> None:
    """``mine`` (:func:`sampling_copy`) takes the student's trainable weights, cast to its dtype
    (the frozen ones have not changed since the copy was made)."""
    with torch.no_grad():
        for own, theirs in zip(mine.parameters(), student.parameters(), strict=True):
            if theirs.requires_grad:
                own.copy_(theirs)
