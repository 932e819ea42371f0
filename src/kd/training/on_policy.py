"""On-policy distillation (GKD): the student learns on its own completions, scored by the teacher.

Generalised Knowledge Distillation (Agarwal et al. 2024), with TRL ``GKDTrainer``'s knobs
(``on_policy:``, :class:`kd.config.on_policy_settings.OnPolicySettings`): for each micro-batch a coin with
probability ``lmbda`` decides whether the student samples completions of the batch's prompts; the
teacher then scores those sequences in the ordinary training step and the loss covers the sampled
tokens only. With ``seq_kd`` the other micro-batches train on the teacher's completions instead of
the dataset's. This module owns the mechanics, the recipe the order:

1. :func:`prompts_of`: the prompt part of each row of a collated batch (the tokens before the
   row's last labelled span: the whole conversation before the last answer, as TRL takes
   ``messages[:-1]``), left-padded.
2. :func:`kd.rollouts.sampling.rollout`: batched sampling with a KV cache, torchtune's (``local_kv_cache`` and its
   padding masks) for torchtune models, transformers' cache for the transformers backend, through
   the model's own ``__call__`` (FSDP2's hooks gather sharded weights). One sampler serves both:
   temperature, top-p, the shared vocabulary, one ``torch.Generator`` per dataset row.
3. :func:`training_batch`: prompt + completion (up to and including the first stop token) as a
   right-padded ``(tokens, labels)`` batch with labels on the completion only.

Determinism: the coin of micro-batch ``i`` of step ``s`` is drawn from ``(seed, s, i)`` (the same
on every rank, so all ranks generate or none), and row ``r``'s tokens in epoch ``e`` from
``(seed, e, r)``: a resumed run, or the same rows on another number of ranks, sample the same
tokens. Under FSDP2 every rank keeps stepping until the last rank's rows are done (each step runs
collectives).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kd import models
from kd.config.on_policy_settings import OnPolicySettings
from kd.config.run import RunConfig
from kd.errors import KDUserError
from kd.metrics import PhaseTimer
from kd.rollouts import sampling
from kd.rollouts.base import Completions, Prompts, Sampler
from kd.rollouts.build import sampler_for
from kd.rollouts.prompts import (
    concat_prompts,
    merge_completions,
    prompts_of,
    select_rows,
    training_batch,
    with_dataset_rows,
)
from kd.rollouts.sampling import derive_seed, row_generators, stop_token_ids
from kd.runtime import distributed
from kd.runtime.distributed import WorldInfo
from kd.runtime.run_context import ModelFacts, RunContext
from kd.teachers import Teacher

log = logging.getLogger("kd")

__all__ = [
    "Completions",
    "OnPolicyBatches",
    "Prompts",
    "coin",
]


def coin(seed: int, step: int, micro: int, p: float) -> bool:
    """Whether micro-batch ``micro`` of optimizer step ``step`` comes out true with probability
    ``p``: the same answer on every rank, in a resumed run, and for any world size."""
    if p <= 0.0:
        return False
    if p >= 1.0:
        return True
    gen = torch.Generator().manual_seed(derive_seed(seed, step, micro, 0x6B64))
    return bool(torch.rand((), generator=gen) < p)


@dataclass(frozen=True)
class _Micro:
    """What micro-batch ``index`` of a step trains on: ``source`` (``student``, ``teacher``, or
    None: the dataset's tokens), its prompts and dataset rows."""

    index: int
    source: str | None
    prompts: Prompts | None = None
    rows: tuple[int, ...] = ()


@dataclass
class _Ahead:
    """The student's completions of a step sampled ahead (``async_steps: 1``): a background
    future while they are sampled, then per micro-batch index."""

    step: int
    rows: dict[int, tuple[int, ...]]
    future: Future[dict[int, Completions]] | None = None
    done: dict[int, Completions] | None = None


def run_sampler(
    run: RunConfig, ctx: RunContext, facts: ModelFacts, tokenizer: object, output_dir: Path
) -> Sampler:
    """The run's sampler of the student's completions (``on_policy.sampler``,
    :func:`kd.rollouts.build.sampler_for`): it draws only ids every model and the tokenizer know,
    and a served one writes the student as :meth:`RunContext.student_source` says."""
    return sampler_for(
        run,
        tokenizer=tokenizer,
        seed=int(run.seed or 0),
        vocab_limit=vocab_limit(facts),
        world=ctx.world,
        device=ctx.device,
        output_dir=output_dir,
        student=ctx.student_source(facts),
        student_vocab=facts.student_vocab,
    )


def vocab_limit(facts: ModelFacts) -> int:
    """On-policy sampling draws only ids every model and the tokenizer know."""
    return min(facts.tokenizer_max + 1, facts.shared_vocab)


class OnPolicyBatches:
    """The on-policy component of a run: per optimizer step, for each micro-batch the dataset's
    ``(tokens, labels)`` or a model's completions of its prompts. The student's completions come
    from the run's :class:`~kd.rollouts.base.Sampler` (``on_policy.sampler``), the teacher's
    (``seq_kd``) from :func:`rollout` on its model.

    The recipe calls :meth:`start` once before the first step, :meth:`step_inputs` at the start
    of each step, :meth:`after_step` once its optimizer step is applied, and
    :meth:`look_ahead` on the loader's micro-batches (``async_steps: 1`` samples the next step's
    prompts while this one trains).

    Args:
        settings: ``on_policy:``.
        sampler: what samples the student (:func:`kd.rollouts.build.sampler_for`).
        tokenizer: the run's tokenizer (pad, stop ids, the assistant header of its chat template).
        seed: the run's seed (the coin and the per-row generators derive from it).
        max_seq_len: ``tokenizer.max_seq_len`` (prompts are cut to leave room to sample).
        vocab_limit: ids from here on are never sampled (the vocabulary every model and the
            tokenizer share).
        world: this process's place in the job (every rank samples, or none).
        device: where the models run.
    """

    def __init__(
        self,
        settings: OnPolicySettings,
        *,
        sampler: Sampler,
        tokenizer: object,
        seed: int,
        max_seq_len: int | None,
        vocab_limit: int,
        world: WorldInfo,
        device: torch.device,
    ):
        from kd.data import pad_id_of

        self.settings = settings
        self.sampler = sampler
        self.seed = seed
        self.max_seq_len = max_seq_len
        self.vocab_limit = vocab_limit
        self.world = world
        self.device = device
        self.pad_id = pad_id_of(tokenizer)
        self.stop_ids = stop_token_ids(tokenizer)
        self.header = models.assistant_header(tokenizer)
        self._said: set[str] = set()  # the sources whose first sampling was announced
        self._ahead: _Ahead | None = None  # the next step's completions (async_steps: 1)
        self._upcoming: list[dict[str, torch.Tensor]] | None = None  # the next step's batches
        self._pool: ThreadPoolExecutor | None = None
        self._wait = 0.0  # this step's seconds spent waiting for the student's completions
        self.after_s = 0.0
        """Seconds the last :meth:`after_step` took (the wait, the sampler's new weights)."""
        self._versions: list[int] = []  # the weight versions this step's completions came from
        # The step's own row: the sampler's lag and wait (asynchronous or served sampling).
        self.reports_lag = settings.async_steps > 0 or sampler.kind != "local"

    @classmethod
    def for_run(
        cls,
        run: RunConfig,
        ctx: RunContext,
        facts: ModelFacts,
        tokenizer: object,
        output_dir: Path,
        *,
        state: dict[str, Any],
    ) -> OnPolicyBatches:
        """The run's component (``run.on_policy`` set), its sampler built by :func:`run_sampler`
        and its resume ``state`` (:meth:`state_dict` of the checkpoint; empty on a fresh run)
        restored."""
        assert run.on_policy is not None
        made = cls(
            run.on_policy,
            sampler=run_sampler(run, ctx, facts, tokenizer, output_dir),
            tokenizer=tokenizer,
            seed=int(run.seed or 0),
            max_seq_len=run.max_seq_len,
            vocab_limit=vocab_limit(facts),
            world=ctx.world,
            device=ctx.device,
        )
        made.load_state_dict(state)
        return made

    # ---------------------------------------------------------------- the recipe's calls
    def start(self, student: nn.Module, step: int) -> None:
        """Before the first step (``step``: the steps already done): the sampler's first sync."""
        self.sampler.after_step(student, step)

    def look_ahead(
        self, batches: Iterator[dict[str, torch.Tensor]], *, per_step: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        """``batches`` unchanged; with ``async_steps: 1`` the next step's micro-batches are read
        one step early, so :meth:`step_inputs` can start sampling their prompts."""
        if self.settings.async_steps == 0:
            yield from batches
            return
        group = list(itertools.islice(batches, per_step))
        while group:
            following = list(itertools.islice(batches, per_step))
            self._upcoming = following if len(following) == per_step else None
            yield from group
            group = following
        self._upcoming = None

    def step_inputs(
        self,
        batches: Sequence[dict[str, torch.Tensor]],
        *,
        step: int,
        epoch: int,
        student: nn.Module,
        teacher: Teacher | None,
        timer: PhaseTimer,
        sampled: dict[str, tuple[int, int]],
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """The micro-batches of optimizer step ``step``, each as ``(tokens, labels)`` (labels not
        shifted) of the student's (probability ``lmbda``) or, with ``seq_kd``, the teacher's
        completions of its prompts; None for one that trains on the dataset's own tokens.

        When the batch carries each row's teacher (``"route"``, ``teachers.route_field``), a
        ``seq_kd`` row is completed by the teacher it names, and rows naming none keep the
        dataset's tokens and labels (they learn from CE alone, as off-policy).

        Adds the sampled micro-batches and the completion tokens trained on (all ranks) to
        ``sampled[source]`` and the sampling time to the ``generate`` phase of ``timer``.
        Collective when distributed (the coin is the same on every rank).
        """
        self._wait, self._versions = 0.0, []
        micros = [self._decide(b, step=step, index=i) for i, b in enumerate(batches)]
        ready = self._take_ahead(step, micros, timer)
        if self.settings.batch_rollouts:  # the step's student prompts in one generation
            todo = [m for m in micros if m.source == "student" and m.index not in ready]
            if todo:
                with timer.phase("generate"):
                    t0 = time.perf_counter()
                    ready.update(
                        self._sample_students(todo, epoch=epoch, step=step, student=student)
                    )
                    self._wait += time.perf_counter() - t0
        made = [
            self._made(
                m,
                b,
                ready,
                epoch=epoch,
                step=step,
                student=student,
                teacher=teacher,
                timer=timer,
                sampled=sampled,
            )
            for m, b in zip(micros, batches, strict=True)
        ]
        self.sampler.idle(step)  # the step's rollouts are sampled: it trains next
        self._sample_ahead(step + 1, epoch=epoch, student=student)
        return made

    def after_step(self, student: nn.Module, step: int) -> None:
        """Optimizer step ``step`` is applied and counted: the next step's sampling (if any)
        ends first, then the sampler takes the new weights
        (:meth:`kd.rollouts.base.Sampler.after_step`). A failure of that sampling is raised at
        the next step's start (:meth:`step_inputs`), before anything changes the weights."""
        start = time.perf_counter()
        ahead = self._ahead
        if ahead is not None and ahead.future is not None:
            wait([ahead.future])
            self._wait += time.perf_counter() - start
            if ahead.future.exception() is None:
                ahead.done, ahead.future = ahead.future.result(), None
        self.sampler.after_step(student, step)
        self.after_s = time.perf_counter() - start

    def step_metrics(self, step: int) -> dict[str, float]:
        """This step's rollout metrics: seconds it waited for the student's completions and how
        many optimizer steps behind the trained weights they were sampled (the most over its
        micro-batches); empty unless sampling is asynchronous or not local."""
        if not self.reports_lag:
            return {}
        lag = max((step - 1 - v for v in self._versions), default=0)
        return {"time_wait_rollout_s": self._wait, "rollout_version_lag": lag}

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state and the next step's completions sampled ahead (complete: saved
        after :meth:`after_step`), so a resumed run trains on the same ones."""
        state: dict[str, Any] = {"sampler": self.sampler.state_dict()}
        ahead = self._ahead
        if ahead is not None and ahead.done is not None:
            state["ahead"] = {
                "step": ahead.step,
                "micro": {
                    int(i): {
                        "rows": list(ahead.rows[i]),
                        "tokens": c.tokens.cpu(),
                        "lengths": c.lengths.cpu(),
                        "steps": c.steps,
                        "version": c.version,
                    }
                    for i, c in ahead.done.items()
                },
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (empty: a checkpoint saved without one)."""
        self.sampler.load_state_dict(dict(state.get("sampler") or {}))
        ahead = state.get("ahead")
        if ahead:
            micro = ahead["micro"]
            self._ahead = _Ahead(
                step=int(ahead["step"]),
                rows={int(i): tuple(int(r) for r in m["rows"]) for i, m in micro.items()},
                done={
                    int(i): Completions(
                        tokens=m["tokens"].to(self.device),
                        lengths=m["lengths"].to(self.device),
                        steps=int(m["steps"]),
                        version=int(m["version"]),
                    )
                    for i, m in micro.items()
                },
            )

    def close(self) -> None:
        """Stop the background sampling (its result is dropped) and close the sampler."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.sampler.close()

    # ---------------------------------------------------------------- mechanics
    def _decide(self, batch: dict[str, torch.Tensor], *, step: int, index: int) -> _Micro:
        """Micro-batch ``index`` of step ``step``: who completes it (the coin), its prompts."""
        op = self.settings
        if coin(self.seed, step, index, op.lmbda):
            source = "student"
        elif op.seq_kd:
            source = "teacher"
        else:
            return _Micro(index, None)
        rows = tuple(int(r) for r in batch["rows"].tolist())
        limit = self.max_seq_len
        # The prompts are cut from the batch where the loader made it (the host: no device
        # round trip per row), then sent to the device.
        prompts = prompts_of(
            batch["tokens"],
            batch["labels"],
            pad_id=self.pad_id,
            max_len=None if limit is None else limit - op.max_new_tokens,
            rows=rows,
            header=self.header,
        ).to(self.device)
        return _Micro(index, source, prompts, rows)

    def _sample_students(
        self, micros: Sequence[_Micro], *, epoch: int, step: int, student: nn.Module
    ) -> dict[int, Completions]:
        """The student's completions of ``micros``' prompts: one sampler call per micro-batch,
        or one for all of them with ``batch_rollouts`` (split back afterwards)."""
        if not self.settings.batch_rollouts or len(micros) == 1:
            return {
                m.index: self.sampler.sample(
                    m.prompts, rows=m.rows, epoch=epoch, step=step, student=student
                )
                for m in micros
                if m.prompts is not None
            }
        parts = [m.prompts for m in micros if m.prompts is not None]
        done = self.sampler.sample(
            concat_prompts(parts, pad_id=self.pad_id),
            rows=[r for m in micros for r in m.rows],
            epoch=epoch,
            step=step,
            student=student,
        )
        out: dict[int, Completions] = {}
        start = 0
        for m in micros:
            n = len(m.rows)
            out[m.index] = Completions(
                tokens=done.tokens[start : start + n],
                lengths=done.lengths[start : start + n],
                steps=done.steps,
                version=done.version,
            )
            start += n
        return out

    def _take_ahead(
        self, step: int, micros: Sequence[_Micro], timer: PhaseTimer
    ) -> dict[int, Completions]:
        """The completions of this step sampled ahead, when they are this step's (the same
        micro-batches and rows); anything else sampled ahead is dropped."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.step != step:
            return {}
        if ahead.future is not None:
            with timer.phase("generate"):
                t0 = time.perf_counter()
                ahead.done = ahead.future.result()
                self._wait += time.perf_counter() - t0
        wanted = {m.index: m.rows for m in micros if m.source == "student"}
        if wanted != ahead.rows or ahead.done is None:
            log.warning(
                "on_policy: the completions sampled ahead for step %d are not that step's "
                "prompts; sampling them again",
                step,
            )
            return {}
        return dict(ahead.done)

    def _sample_ahead(self, step: int, *, epoch: int, student: nn.Module) -> None:
        """``async_steps: 1``: start sampling step ``step``'s student prompts in the background
        (the next step's micro-batches, read ahead by :meth:`look_ahead`)."""
        upcoming, self._upcoming = self._upcoming, None
        if self.settings.async_steps == 0 or upcoming is None:
            return
        micros = [self._decide(b, step=step, index=i) for i, b in enumerate(upcoming)]
        todo = [m for m in micros if m.source == "student"]
        if not todo:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kd-rollout")
        future = self._pool.submit(
            self._sample_students, todo, epoch=epoch, step=step, student=student
        )
        self._ahead = _Ahead(step=step, rows={m.index: m.rows for m in todo}, future=future)

    def _made(
        self,
        m: _Micro,
        batch: dict[str, torch.Tensor],
        ready: dict[int, Completions],
        *,
        epoch: int,
        step: int,
        student: nn.Module,
        teacher: Teacher | None,
        timer: PhaseTimer,
        sampled: dict[str, tuple[int, int]],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Micro-batch ``m`` as the step trains on it (see :meth:`step_inputs`)."""
        op, source, prompts = self.settings, m.source, m.prompts
        if source is None or prompts is None:
            return None
        rows = list(m.rows)
        # Each row's teacher (teachers.route_field), when the batch carries one: a completion
        # is scored by the teacher its row names; rows naming none keep their own tokens (CE).
        route: list[str | None] | None = batch.get("route")  # type: ignore[assignment]
        self._announce(source, len(rows))
        everyone = list(range(len(rows)))
        parts: list[tuple[list[int], Completions]] = []
        if source == "student":
            done = ready.get(m.index)
            if done is None:
                with timer.phase("generate"):
                    t0 = time.perf_counter()
                    done = self.sampler.sample(
                        prompts, rows=rows, epoch=epoch, step=step, student=student
                    )
                    self._wait += time.perf_counter() - t0
            self._versions.append(done.version)
            parts.append((everyone, done))
        else:
            generators = (
                row_generators(self.seed, epoch, rows, device=self.device)
                if op.temperature > 0
                else None
            )
            with timer.phase("generate"):
                for model, sel, used in self._teacher_samplers(teacher, route, len(rows)):
                    done = sampling.rollout(
                        model,
                        prompts if sel == everyone else select_rows(prompts, sel),
                        max_new_tokens=op.max_new_tokens,
                        temperature=op.temperature,
                        top_p=op.top_p,
                        stop_ids=self.stop_ids,
                        pad_id=self.pad_id,
                        vocab_limit=self.vocab_limit,
                        generators=None if generators is None else [generators[i] for i in sel],
                        all_done=(
                            (lambda here: not distributed.any_rank(not here, device=self.device))
                            if self.world.distributed
                            else None
                        ),
                    )
                    if used:
                        parts.append((sel, done))
            if teacher is not None:
                teacher.release()
        keep = [] if route is None else [i for i, r in enumerate(route) if r is None]
        done = merge_completions(
            parts, len(rows), width=op.max_new_tokens, pad_id=self.pad_id, drop=keep
        )
        # The completion tokens trained on, of all ranks: the same count on any world size.
        count, tokens = sampled.get(source, (0, 0))
        new = int(distributed.all_reduce_sum(done.lengths.sum()))
        sampled[source] = (count + 1, tokens + new)
        made = training_batch(prompts, done, pad_id=self.pad_id)
        if keep:
            made = with_dataset_rows(made, batch, keep, pad_id=self.pad_id)
        return made

    def _announce(self, source: str, prompts: int) -> None:
        """Once per source: sampling is most of an on-policy step's time."""
        if source in self._said:
            return
        self._said.add(source)
        log.info(
            "on_policy: the %s samples up to %d tokens per prompt (%d prompts a micro-batch); "
            "sampling takes most of a step (metrics.jsonl: time_generate_s)",
            source,
            self.settings.max_new_tokens,
            prompts,
        )

    def _teacher_samplers(
        self, teacher: Teacher | None, route: Sequence[str | None] | None, b: int
    ) -> list[tuple[nn.Module, list[int], bool]]:
        """The teacher models that sample (``seq_kd``): each with the rows it completes and
        whether its completions are used.

        Without routes the teacher's generator completes every row. With them (``combine:
        route``) each row's own teacher completes it and rows naming none are not sampled;
        under torchrun every rank samples with each teacher that any rank's rows name (the
        sampling runs collectives), with all its rows, unused, where none of them names it.

        Raises:
            KDUserError: a teacher that would sample is not a model.
        """
        everyone = list(range(b))
        names: list[str | None] = [None]
        if route is not None:
            here = sorted({r for r in route if r is not None})
            texts = distributed.all_gather_text("\n".join(here), device=self.device)
            names = sorted({n for t in texts if t for n in t.split("\n")})
        out: list[tuple[nn.Module, list[int], bool]] = []
        for name in names:
            model = teacher.generator_for(name) if teacher is not None else None
            if model is None:
                which = "this teacher is" if name is None else f"teacher {name} is"
                raise KDUserError(
                    f"on_policy.seq_kd: true samples the teacher's completions, but {which} "
                    "not a model that can sample; set on_policy.seq_kd=false"
                )
            sel = everyone if route is None else [i for i, r in enumerate(route) if r == name]
            out.append((model, sel or everyone, bool(sel)))
        return out
