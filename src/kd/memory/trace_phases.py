"""The fake training step traced phase by phase: what both memory traces record.

:mod:`kd.memory.trace` (one device, MemTracker) and :mod:`kd.memory.trace_fsdp` (rank 0 of N
FSDP2 ranks, FSDPMemTracker) run the step :func:`kd.memory.fake_step.build_fake_step` builds
inside a tracker; this module holds what both record: the phase recorder
(:func:`trace_step_phases`: forward, backward, optimizer step) and its tracker helpers, and the
calls the recipe makes between steps, on-policy sampling (:func:`trace_generation`) and one
validation batch (:func:`trace_evaluation`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from kd.config.run import RunConfig
from kd.memory.fake_step import HOST, FakeStep, fake_friendly_kv_cache
from kd.memory.knobs import GenerationKnobs


@dataclass
class TraceResult:
    """Allocated bytes per phase of one traced training step.

    Attributes:
        phase_peaks: generation (when traced) / forward / backward / optimizer_step
            (/ evaluation, when traced) -> peak allocated bytes.
        subphases: finer peaks: student_forward, teacher_forward, loss_forward, backward,
            optimizer_step (forward = the max of the first three); student_generation and
            teacher_generation (generation = the larger).
        currents: allocated bytes at the boundaries (after_student_forward, after_teacher_forward,
            before_backward, after_backward).
        subphase_categories: sub-phase -> tracker category -> bytes at that sub-phase's peak.
        categories: phase -> MemTracker category (Parameter, Gradient, Optstate, Activation,
            Temp, Buffer, Other) -> bytes at that phase's peak.
        wall_s: seconds the trace took.
    """

    phase_peaks: dict[str, int]
    subphases: dict[str, int] = field(default_factory=dict)
    currents: dict[str, int] = field(default_factory=dict)
    subphase_categories: dict[str, dict[str, int]] = field(default_factory=dict)
    categories: dict[str, dict[str, int]] = field(default_factory=dict)
    wall_s: float = 0.0


class FrozenSafeMemTracker(MemTracker):
    """MemTracker that installs gradient hooks only on parameters that require grad, and keeps
    only the global peak.

    torch's tracker calls ``param.register_hook`` on every parameter of every module it sees run,
    which raises for the frozen teacher and LoRA base weights. It also updates per-module peaks
    after every op by walking every module seen so far, which makes a real-size trace (1000+
    modules) quadratic; the plan needs only the global peak.
    """

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        if not install_grad_hooks or all(p.requires_grad for p in module.parameters()):
            return super()._track_module_params_and_buffers(module, install_grad_hooks)
        totals = super()._track_module_params_and_buffers(module, False)
        trainable = [p for p in module.parameters() if p.requires_grad]
        if trainable:
            holder = nn.Module()
            holder.trainable = nn.ParameterList(trainable)
            super()._track_module_params_and_buffers(holder, True)
        return totals


def snapshot(mt: MemTracker, kind: str) -> dict[str, int]:
    """Tracker category -> bytes of the first device in ``mt``'s ``kind`` snapshot.

    Args:
        mt: a MemTracker (or FSDPMemTracker).
        kind: ``"current"`` or ``"peak"``.
    """
    snap = mt.get_tracker_snapshot(kind)
    # The device's: not the host copies the trace keeps apart (HOST).
    dev = next((v for d, v in snap.items() if torch.device(d) != HOST), {})
    return {str(getattr(k, "value", k)): int(v) for k, v in dev.items()}


def take_phase_peak(mt: MemTracker) -> dict[str, int]:
    """The tracker's peak since the last call, then restart the peak from the current usage."""
    peak = snapshot(mt, "peak")
    current = mt.get_tracker_snapshot("current")
    mt._peak_mem_snap = current
    mt._peak_mem = {d: v["Total"] for d, v in current.items()}
    return peak


@contextlib.contextmanager
def split_at_backward(on_backward_start: Any, on_backward_end: Any) -> Iterator[None]:
    """Call hooks right before and after ``Tensor.backward`` (micro_step's forward/backward split)."""
    original = torch.Tensor.backward

    def wrapped(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        on_backward_start()
        original(self, *args, **kwargs)
        on_backward_end()

    torch.Tensor.backward = wrapped  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.backward = original  # type: ignore[method-assign]


class _Evaluation(nn.Module):
    """:func:`kd.training.evaluate.batch_sums` as a module call.

    The trackers refuse a second top-level call of a module (they take it for the next training
    iteration); the evaluation calls the models again after the step, and the output projection
    once per chunk. Inside this parent those calls are nested ones, which they accept. The models
    are held in a plain tuple: no parameter of theirs is registered here.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module | None) -> None:
        super().__init__()
        self.models = (student, teacher)

    def forward(self, batch: dict[str, torch.Tensor], settings: Any) -> torch.Tensor:
        from kd.training import evaluate

        student, teacher = self.models
        device = batch["tokens"].device
        return evaluate.batch_sums(student, teacher, batch, settings=settings, device=device)


def trace_evaluation(mt: Any, step: FakeStep, *, settings: Any, eval_batch: int) -> dict[str, int]:
    """One validation batch as the recipe evaluates it between steps, inside tracker ``mt``.

    The gradients are gone (``kd.training.train.optimizer_step`` sets them to None; so does this, for a
    trace without a traced optimizer); the student is in eval mode and both models run under
    ``no_grad`` through :func:`kd.training.evaluate.batch_sums`, the function :func:`kd.training.evaluate.evaluate`
    calls per batch (fake tensors keep every position: every one labelled, the worst case).

    Args:
        mt: the tracker, entered, holding the step's models and optimizer.
        step: the traced step (:func:`kd.memory.fake_step.build_fake_step`); its optimizer step has run.
        settings: ``kd.training.train.LossSettings``.
        eval_batch: sequences of the validation batch.

    Returns:
        Tracker category -> bytes at the evaluation's peak.
    """
    from kd import models

    for p in step.trainable:
        p.grad = None
    shape = (eval_batch, step.tokens.size(-1))
    vocab = models.vocab_size(step.student)
    take_phase_peak(mt)
    was_training = step.student.training
    step.student.eval()
    try:
        with torch.no_grad():
            batch = {
                "tokens": torch.randint(0, vocab, shape),  # [b, s]
                "labels": torch.randint(0, vocab, shape),  # [b, s]
            }
            _Evaluation(step.student, step.teacher)(batch, settings)
            del batch
    finally:
        step.student.train(was_training)
    return take_phase_peak(mt)


class _Rollout(nn.Module):
    """:func:`kd.rollouts.sampling.rollout` as a module call (the trackers accept the model's many calls
    nested in it; see :class:`_Evaluation`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.models = (model,)

    def forward(self, prompts: Any, **kwargs: Any) -> Any:
        from kd.rollouts import sampling

        return sampling.rollout(self.models[0], prompts, **kwargs)


def sampler_copy(step: FakeStep) -> nn.Module | None:
    """The local sampler's copy of the student (:func:`kd.rollouts.local.sampling_copy`), made
    as the run makes it before its first rollout, so every phase holds it: the frozen copy of
    ``async_steps: 1`` and / or the copy in ``on_policy.sampling_dtype``; None when the sampler
    keeps none (or on several ranks, where the recipe refuses one)."""
    g = step.knobs.generation
    if g is None or not g.student_copy or step.knobs.world_size > 1:
        return None
    from kd.models import DTYPES
    from kd.rollouts.local import sampling_copy
    from kd.rollouts.plan import DTYPE_BYTES

    names = [n for n, size in DTYPE_BYTES.items() if size == g.copy_dtype_bytes]
    return sampling_copy(step.student, DTYPES[names[0]] if names else None)


def trace_generation(
    mt: Any,
    step: FakeStep,
    *,
    generation: GenerationKnobs,
    student_copy: nn.Module | None = None,
) -> dict[str, dict[str, int]]:
    """On-policy sampling as the recipe runs it at the start of a step, inside tracker ``mt``.

    Each model of ``generation.models`` samples ``generation.new_tokens`` tokens after a fake
    batch of left-padded prompts ``[b, s - new_tokens]`` (``b, s`` of the step's micro-batch:
    prompt and completion fill ``tokenizer.max_seq_len``) through :func:`kd.rollouts.sampling.rollout`
    (prefill with the KV cache, then one token per step; every step runs, since fake tensors
    cannot tell where a completion stops). The gradients are gone (the previous step's
    ``optimizer_step`` set them to None). Sampling uses one CPU generator per row with the
    config's temperature and top-p; the vocabulary is limited below the output size, as the
    tokenizer's usually is, so the sampler's masked copy of the logits is traced too.

    Under FSDP2 each rollout starts as the recipe's does: the teacher's root freed (the recipe
    releases it after each micro-step and after the teacher samples) and, when the teacher
    samples, the student's root too unless the step has several micro-batches (an earlier one
    may have been the student's, whose gathered root stays until its backward).

    Args:
        mt: the tracker, entered, holding the step's models and optimizer.
        step: the traced step (:func:`kd.memory.fake_step.build_fake_step`).
        generation: what samples, how many rows and tokens.
        student_copy: what samples for the student when the sampler keeps a copy of it
            (:func:`sampler_copy`); None: the student.

    Returns:
        ``{model}_generation`` -> tracker category -> bytes at that model's sampling peak.
    """
    from kd import models
    from kd.runtime import distributed
    from kd.training import on_policy

    for p in step.trainable:
        p.grad = None
    g = generation
    batch, seq_len = step.tokens.shape
    prompt_len = seq_len - g.new_tokens
    out: dict[str, dict[str, int]] = {}
    with torch.no_grad(), fake_friendly_kv_cache():
        for name in g.models:
            model = step.student if name == "student" else step.teacher
            if name == "student" and student_copy is not None:
                model = student_copy
            if model is None:
                raise ValueError(f"trace_generation: no {name} model to sample with")
            if name == "teacher" and step.knobs.grad_accum == 1:
                # One micro-batch per step: the teacher samples at the start of a step, after the
                # last backward resharded the student's root (its rollout above left it gathered).
                distributed.reshard(step.student)
            vocab = models.vocab_size(model)
            take_phase_peak(mt)
            prompts = on_policy.Prompts(
                tokens=torch.randint(0, vocab, (batch, prompt_len)),  # [b, P]
                mask=torch.ones(batch, prompt_len, dtype=torch.bool),  # [b, P]
                lengths=torch.full((batch,), prompt_len),  # [b]
            )
            done = _Rollout(model)(
                prompts,
                max_new_tokens=g.new_tokens,
                temperature=g.temperature,
                top_p=g.top_p,
                stop_ids=[0, 1],
                pad_id=0,
                vocab_limit=vocab - 1,
                generators=(
                    [torch.Generator().manual_seed(i) for i in range(batch)]
                    if g.temperature > 0
                    else None
                ),
                stop_early=False,
            )
            del prompts, done
            if name == "teacher":
                distributed.reshard(model)  # the recipe frees the teacher's gathered root
            out[f"{name}_generation"] = take_phase_peak(mt)
    return out


@dataclass
class _PhaseRecorder:
    """Peaks per phase and sub-phase, and allocated bytes at the boundaries, of one traced step.

    Each mark reads tracker ``mt``'s peak since the last mark (:func:`take_phase_peak`).
    """

    mt: Any
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    subphases: dict[str, dict[str, int]] = field(default_factory=dict)
    currents: dict[str, int] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.subphases[name] = take_phase_peak(self.mt)

    def now(self, name: str) -> None:
        self.currents[name] = snapshot(self.mt, "current").get("Total", 0)

    def start_backward(self) -> None:
        """The loss forward ends; forward's peak is the largest of its sub-phases."""
        self.now("before_backward")
        self.mark("loss_forward")
        self.phases["forward"] = max(
            (
                self.subphases[k]
                for k in ("student_forward", "teacher_forward", "loss_forward")
                if k in self.subphases
            ),
            key=lambda d: d.get("Total", 0),
        )

    def end_backward(self) -> None:
        self.now("after_backward")
        self.mark("backward")
        self.phases["backward"] = self.subphases["backward"]

    def after_forward(self, name: str) -> Any:
        """A forward hook marking the end of model ``name``'s forward."""

        def hook(*_: Any) -> None:  # returns None: the module's output is kept
            self.mark(f"{name}_forward")
            self.now(f"after_{name}_forward")

        return hook

    def result(self) -> TraceResult:
        return TraceResult(
            phase_peaks={p: v.get("Total", 0) for p, v in self.phases.items()},
            subphases={p: v.get("Total", 0) for p, v in self.subphases.items()},
            subphase_categories=self.subphases,
            currents=self.currents,
            categories=self.phases,
            wall_s=0.0,
        )


def _after_the_step(
    rec: _PhaseRecorder, step: FakeStep, run: RunConfig, student_copy: nn.Module | None
) -> None:
    """Between steps: on-policy sampling as at the start of the next step, then one validation
    batch, each when the run has it."""
    if step.knobs.generation is not None:
        if step.teacher_topk is not None:
            # A step samples all its micro-batches before the first micro-step asks the store or
            # the server: no top-k tensors exist during the rollouts.
            step.teacher_topk = step.signal_teacher = None
        sampled = trace_generation(
            rec.mt, step, generation=step.knobs.generation, student_copy=student_copy
        )
        rec.subphases.update(sampled)
        rec.phases["generation"] = max(sampled.values(), key=lambda d: d.get("Total", 0))
    if step.knobs.eval_batch is not None:
        rec.phases["evaluation"] = trace_evaluation(
            rec.mt, step, settings=run.loss, eval_batch=step.knobs.eval_batch
        )


def trace_step_phases(
    mt: Any, step: FakeStep, run: RunConfig, *, grad_scale: float = 1.0
) -> TraceResult:
    """Run one micro-step and the optimizer step of ``run`` inside tracker ``mt``; peaks per
    phase.

    Shared by the one-device trace (MemTracker) and the FSDP2 trace (FSDPMemTracker): forward
    (student, teacher, loss sub-phases), backward, optimizer step (gradient norm, optional clip,
    step), then, with ``on_policy``, on-policy sampling as at the start of the next step
    (:func:`trace_generation`), then, with ``validation``, one validation batch
    (:func:`trace_evaluation`).

    Args:
        mt: a MemTracker or FSDPMemTracker already tracking ``step``'s models and tensors.
        step: the models, optimizer and micro-batch (:func:`kd.memory.fake_step.build_fake_step`).
        run: the run configuration (its loss settings and ``clip_grad_norm``).
        grad_scale: ``kd.training.train.micro_step``'s ``grad_scale`` (the world size under FSDP2).

    Returns:
        Peaks per phase and sub-phase (``wall_s`` left at 0 for the caller).
    """
    from kd.teachers import as_teacher
    from kd.training import train

    rec = _PhaseRecorder(mt)
    hooks = [step.student.register_forward_hook(rec.after_forward("student"))]
    if step.teacher is not None:
        hooks.append(step.teacher.register_forward_hook(rec.after_forward("teacher")))
    try:
        with mt:
            copy = sampler_copy(step)  # made before the first step, kept throughout
            take_phase_peak(mt)
            with split_at_backward(rec.start_backward, rec.end_backward):
                train.micro_step(
                    step.student,
                    step.signal_teacher or step.teacher,
                    step.tokens,
                    step.labels,
                    settings=run.loss,
                    num_tokens_total=step.num_tokens_total,
                    grad_scale=grad_scale,
                )
            if step.teacher is not None:  # as the recipe: the sharded teacher's root is freed
                as_teacher(step.signal_teacher or step.teacher).release()
            for h in hooks:  # the sub-phase marks would cut the evaluation's peak
                h.remove()
            # As the recipe's optimizer_step: the projections of hidden_states (replicated on
            # every rank) are averaged and normed beside the student's (sharded) gradients.
            extra = getattr(step.signal_teacher, "projections", None)
            train.step_grad_norm(
                step.student, clip_grad_norm=run.optimizer.clip_grad_norm, extra=extra
            )
            if step.optimizer is not None:
                step.optimizer.step()
            rec.phases["optimizer_step"] = take_phase_peak(mt)
            if step.optimizer is not None:
                step.optimizer.zero_grad(set_to_none=True)
            _after_the_step(rec, step, run, copy)
    finally:
        for h in hooks:
            h.remove()
    return rec.result()
