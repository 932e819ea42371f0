"""The training step shared by every recipe (single device and FSDP2).

Normalisation is over the *whole accumulated batch*: the recipe first counts the labelled tokens of
all micro-batches of one optimizer step (all-reduced across ranks), then each micro-batch contributes
``mean_loss * local_tokens / total_tokens``. So batch b x accumulation k gives exactly the update of
batch b*k x accumulation 1. (torchtune 0.6.1's ``recipes/knowledge_distillation_single_device.py``
backpropagates a mean-reduced loss and then scales the gradients by ``1 / num_tokens`` again,
unlike its fine-tuning recipes, which first multiply the loss by the micro-batch's token count.)
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kd import data
from kd.config.run import LossSettings
from kd.errors import KDUserError
from kd.metrics import PhaseTimer
from kd.runtime import distributed
from kd.teachers import FixedTopKTeacher, Teacher, TeacherInput, as_teacher
from kd.teachers.base import asks_signal
from kd.teachers.signals import student_ce

__all__ = [
    "batch_input",
    "train_step",
    "LossSettings",
    "build_lr_scheduler",
    "build_optimizer",
    "MicroStepResult",
    "StepStats",
    "compute_loss",
    "count_tokens",
    "cpu_offload_optimizer",
    "grad_norm",
    "micro_step",
    "optimizer_step",
    "shift_labels",
    "step_grad_norm",
    "skip_or_stop",
    "step_metrics",
    "with_after_step",
]

log = logging.getLogger("kd")


@dataclass(frozen=True)
class StepStats:
    """One optimizer step, reduced over micro-batches and ranks.

    Attributes:
        loss: token-weighted mean loss of the step (all ranks).
        ce_loss: its cross-entropy part.
        kd_loss: its divergence part (the true divergence, before ``kd_ratio``); None when the
            loss has no KD term (``kd_ratio: 0``: no teacher logits were computed).
        grad_norm: total gradient norm before clipping.
        num_tokens: labelled tokens of the step (all ranks).
        stepped: False when the gradients were non-finite and the optimizer did not step.
        seconds: wall time of the step.
        phases: seconds of the step's parts (``generate``: sampling completions, on-policy;
            ``teacher``: the teacher's forward passes); the rest is the student's.
        sampled: (micro-batches, completion tokens of all ranks) sampled, per sampling model
            (``student``, ``teacher``); empty off-policy.
        terms: the teacher's extra loss terms (:attr:`kd.teachers.Teacher.terms`, e.g.
            ``kd_loss/<name>`` per teacher), token-weighted like ``kd_loss``; logged as named.
    """

    loss: float
    ce_loss: float
    kd_loss: float | None
    grad_norm: float
    num_tokens: int
    stepped: bool
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    sampled: dict[str, tuple[int, int]] = field(default_factory=dict)
    terms: dict[str, float] = field(default_factory=dict)


def step_metrics(stats: StepStats, *, on_policy: bool) -> dict[str, Any]:
    """One step's metrics: losses (``kd_loss`` only when the loss has a KD term), gradient norm,
    tokens and their rate, and the step's time by part (sampling on-policy, the teacher, and the
    rest: the student's forward + backward + optimizer step); on-policy also the sampled
    micro-batches and tokens per sampling model."""
    generate_s = stats.phases.get("generate", 0.0)
    teacher_s = stats.phases.get("teacher", 0.0)
    kd = {} if stats.kd_loss is None else {"kd_loss": stats.kd_loss}
    row: dict[str, Any] = {
        "loss": stats.loss,
        "ce_loss": stats.ce_loss,
        **kd,
        "grad_norm": stats.grad_norm,
        "num_tokens": stats.num_tokens,
        "tokens_per_second": stats.num_tokens / max(stats.seconds, 1e-9),
        **stats.terms,
    }
    if on_policy:
        row["time_generate_s"] = generate_s
    row["time_teacher_s"] = teacher_s
    row["time_student_s"] = max(stats.seconds - generate_s - teacher_s, 0.0)
    if on_policy:
        for source in ("student", "teacher"):
            count, tokens = stats.sampled.get(source, (0, 0))
            row[f"sampled_batches_{source}"] = count
            row[f"sampled_tokens_{source}"] = tokens
        if generate_s > 0:
            total = sum(tokens for _, tokens in stats.sampled.values())
            row["generate_tokens_per_second"] = total / generate_s
    return row


def with_after_step(stats: StepStats, seconds: float, on_policy: Any = None) -> StepStats:
    """``stats`` with the work after its optimizer step (the teacher and the sampler taking the
    new weights: ``seconds``) added to its seconds, and the on-policy component's part of it
    (``on_policy.after_s``: the wait for rollouts sampled ahead, the sampling copy's refresh) to
    its ``generate`` phase (``teacher`` stays its forward passes)."""
    phases = dict(stats.phases)
    if on_policy is not None:
        phases["generate"] = phases.get("generate", 0.0) + on_policy.after_s
    return replace(stats, seconds=stats.seconds + seconds, phases=phases)


@dataclass
class MicroStepResult:
    """Detached contributions of one micro-batch, already scaled by ``local / total`` tokens."""

    loss: torch.Tensor
    ce: torch.Tensor
    kd: torch.Tensor
    num_tokens: torch.Tensor
    terms: dict[str, torch.Tensor] = field(default_factory=dict)


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Align labels with positions: position i predicts token i+1. ``[b, s] -> [b, s]``."""
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def count_tokens(labels: Iterable[torch.Tensor], ignore_index: int = -100) -> torch.Tensor:
    """Labelled positions over several (shifted) label tensors, as a 0-d int64 tensor."""
    total = torch.zeros((), dtype=torch.int64)
    for lab in labels:
        total = total + (lab != ignore_index).sum().to(total.device)
    return total


def compute_loss(
    student: nn.Module,
    teacher: Teacher | nn.Module | None,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    settings: LossSettings,
    teacher_input: TeacherInput | None = None,
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    timer: PhaseTimer | None = None,
    terms: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward the student, ask the teacher, and return ``(loss, ce, kd)``, each a mean over
    labelled positions.

    The student runs first (its activations are what backward keeps), then the teacher answers
    the batch without autograd (:meth:`kd.teachers.Teacher.signal`) and its signal computes the
    loss (:meth:`kd.teachers.TeacherSignal.loss`): whatever the kind of teacher, this function
    never asks. Without a teacher (plain fine-tuning), or when the step asks it nothing
    (:func:`kd.teachers.base.asks_signal`: ``kd_ratio: 0``, a teacher that only samples
    ``seq_kd`` completions), the teacher's forward does not run, the loss is the student's CE
    (:func:`kd.teachers.signals.student_ce`) and kd is 0. Models are in hidden-output mode
    (:func:`kd.models.set_hidden_output`).

    Args:
        student: the trainable decoder.
        teacher: a :class:`kd.teachers.Teacher`, a bare teacher decoder (taken as a
            :class:`kd.teachers.ModelTeacher`), or None.
        tokens: input ids ``[b, s]``.
        labels: shifted labels ``[b, s]`` (:func:`shift_labels`).
        settings: loss settings.
        teacher_input: the batch as the teacher sees it (dataset rows and unshifted labels, which
            files of top-k log-probs need); None: ``tokens`` alone.
        teacher_topk: fixed top-k ``(ids [b, s, k], logprobs [b, s, k])`` aligned with ``labels``
            instead of ``teacher`` (a :class:`kd.teachers.FixedTopKTeacher`).
        timer: adds the teacher's time to its ``teacher`` phase.
        terms: filled with the signal's extra loss terms (:class:`kd.teachers.TeacherSignal`),
            when given.

    Raises:
        ValueError: both ``teacher`` and ``teacher_topk``, or a top-k teacher with a student whose
            output projection is not a plain linear (the top-k loss needs it).
    """
    if teacher_topk is not None:
        if teacher is not None:
            raise ValueError("compute_loss takes a teacher model or teacher_topk, not both")
        teacher = FixedTopKTeacher(*teacher_topk)
    teacher = as_teacher(teacher)
    s_hidden = student(tokens)  # [b, s, d_s]
    if not asks_signal(teacher, settings):  # no teacher, or kd_ratio 0: no teacher forward
        ce = student_ce(student, s_hidden, labels, settings=settings)
        return ce, ce.detach(), torch.zeros_like(ce).detach()
    timing = timer.phase("teacher") if timer is not None else contextlib.nullcontext()
    with timing:
        signal = teacher.signal(
            teacher_input if teacher_input is not None else TeacherInput(tokens)
        )
    out = signal.loss(student, s_hidden, labels, settings=settings)
    if terms is not None:
        terms.update(getattr(signal, "terms", {}))
    return out


def micro_step(
    student: nn.Module,
    teacher: Teacher | nn.Module | None,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    settings: LossSettings,
    num_tokens_total: torch.Tensor | int,
    grad_scale: float = 1.0,
    teacher_input: TeacherInput | None = None,
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    timer: PhaseTimer | None = None,
) -> MicroStepResult:
    """Forward and backward of one micro-batch, scaled for exact accumulation.

    No ``.item()`` and no data-dependent branches, so the memory planner can trace it under
    FakeTensorMode.

    Args:
        student: trainable decoder in hidden-output mode.
        teacher: the teacher (:func:`compute_loss`), or None.
        tokens: ``[b, s]`` input ids.
        labels: ``[b, s]`` shifted labels.
        settings: loss settings.
        num_tokens_total: labelled tokens of the whole optimizer step (all micro-batches, all ranks).
        grad_scale: extra factor on the backward only (FSDP averages gradients over ranks; the
            distributed recipe passes the world size to turn that average back into a sum).
        teacher_input: the batch as the teacher sees it (:func:`compute_loss`).
        teacher_topk: fixed top-k tensors instead of ``teacher`` (:func:`compute_loss`).
        timer: times the teacher (:func:`compute_loss`).
    """
    local = (labels != settings.ignore_index).sum()
    total = torch.as_tensor(num_tokens_total, device=local.device).clamp(min=1)
    scale = local.to(torch.float32) / total.to(torch.float32)
    terms: dict[str, torch.Tensor] = {}
    loss, ce, kd = compute_loss(
        student,
        teacher,
        tokens,
        labels,
        settings=settings,
        teacher_input=teacher_input,
        teacher_topk=teacher_topk,
        timer=timer,
        terms=terms,
    )
    scaled = loss * scale.to(loss.device)
    (scaled * grad_scale).backward()
    return MicroStepResult(
        loss=scaled.detach(),
        ce=(ce.detach() * scale.to(ce.device)),
        kd=(kd.detach() * scale.to(kd.device)),
        num_tokens=local.detach(),
        terms={k: v.detach() * scale.to(v.device) for k, v in terms.items()},
    )


def batch_input(batch: dict[str, torch.Tensor]) -> TeacherInput:
    """A loader's micro-batch as the step trains on it: its host tensors (a file, store or served
    teacher reads their values on the host, with no device round trip; a model teacher moves them
    to its own device), its dataset rows and its route."""
    rows = batch.get("rows")
    return TeacherInput(
        tokens=batch["tokens"],
        labels=batch["labels"],
        rows=rows.tolist() if rows is not None else None,
        route=batch.get("route"),
    )


def train_step(
    student: nn.Module,
    teacher: Teacher | None,
    inputs: list[TeacherInput],
    *,
    settings: LossSettings,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    clip_grad_norm: float | None,
    extra: nn.Module | None,
    world: distributed.WorldInfo,
    device: torch.device,
    timer: PhaseTimer,
    sampled: dict[str, tuple[int, int]],
    started: float,
) -> StepStats:
    """One optimizer step over this rank's micro-batches ``inputs``.

    The labelled tokens of all micro-batches on all ranks are counted first, so each micro-batch
    contributes ``mean_loss * local / total`` and accumulation is exact; the summed terms are
    all-reduced; :func:`optimizer_step` never applies NaN/inf gradients, so the weights stay
    those of the last good step whatever the loop decides.

    Args:
        student: the trained model.
        teacher: the run's teacher, or None (CE only).
        inputs: the micro-batches as the step trains on them.
        settings: the loss settings.
        optimizer: the student's optimizer.
        lr_scheduler: stepped after the optimizer, or None.
        clip_grad_norm: ``clip_grad_norm``.
        extra: trainable parameters the teacher's loss adds (``Teacher.bind_student``), or None.
        world: this process's place in the job (FSDP's average becomes the sum).
        device: where the student trains.
        timer: the step's phase timer (on-policy sampling already counted in it).
        sampled: on-policy counts per source, for the step's metrics.
        started: ``time.perf_counter()`` when the step began.
    """
    labels = [shift_labels(inp.labels) for inp in inputs]
    total = distributed.all_reduce_sum(count_tokens(labels).to(device))
    names = teacher.terms if asks_signal(teacher, settings) else ()
    sums = torch.zeros(3 + len(names), device=device)
    for inp, lab in zip(inputs, labels, strict=True):
        r = micro_step(
            student,
            teacher,
            inp.tokens.to(device),
            lab.to(device),
            settings=settings,
            num_tokens_total=total,
            grad_scale=float(world.world_size),
            teacher_input=inp,
            timer=timer,
        )
        terms = [r.terms.get(n, torch.zeros_like(r.kd)) for n in names]
        sums += torch.stack([r.loss, r.ce, r.kd, *terms]).float()
        if teacher is not None:
            teacher.release()  # before the backward of the next micro-batch peaks
    sums = distributed.all_reduce_sum(sums)
    norm, stepped = optimizer_step(student, optimizer, clip_grad_norm=clip_grad_norm, extra=extra)
    if lr_scheduler is not None:
        lr_scheduler.step()
    loss, ce, kd, *term_sums = (float(x) for x in sums)
    return StepStats(
        loss=loss,
        ce_loss=ce,
        kd_loss=kd if teacher is not None and settings.needs_teacher_logits else None,
        grad_norm=float(norm),
        num_tokens=int(total),
        stepped=stepped,
        seconds=time.perf_counter() - started,
        phases=dict(timer.seconds),
        sampled=sampled,
        terms=dict(zip(names, term_sums, strict=True)),
    )


def grad_norm(parameters: Iterable[torch.Tensor], *, max_norm: float | None) -> torch.Tensor:
    """Total L2 norm of the gradients; clips them to ``max_norm`` when given.

    FSDP2 gradients (DTensor shards) are reduced from their local shards: a sum of squares per rank
    and one all-reduce. torch's generic norm over DTensors can gather whole gradients (a trace of
    the 8B template showed a transient of the full unsharded gradient size per rank).
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if grads and isinstance(grads[0], DTensor):
        return _sharded_grad_norm(grads, max_norm=max_norm)
    if max_norm is not None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return torch.nn.utils.get_total_norm(grads)


def _sharded_grad_norm(grads: list[torch.Tensor], *, max_norm: float | None) -> torch.Tensor:
    """L2 norm (and clip, like ``clip_grad_norm_``) of DTensor gradients sharded over one mesh axis."""
    import torch.distributed as dist

    local = [g.to_local() for g in grads]
    squares = [torch.linalg.vector_norm(t, dtype=torch.float32) ** 2 for t in local if t.numel()]
    sq = torch.stack(squares).sum() if squares else torch.zeros((), device=local[0].device)
    dist.all_reduce(sq, group=grads[0].device_mesh.get_group())
    total = sq.sqrt()
    if max_norm is not None:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for t in local:
            t.mul_(coef.to(t.dtype))
    return total


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    clip_grad_norm: float | None,
    extra: nn.Module | None = None,
) -> tuple[torch.Tensor, bool]:
    """Clip (optionally), step and zero the gradients; never steps on NaN/inf gradients.

    ``extra`` (:meth:`kd.teachers.Teacher.bind_student`'s trainable module, replicated on every
    rank) has its gradients averaged over ranks first; the norm and clipping cover its parameters
    with the student's.

    Returns:
        ``(grad_norm, stepped)``; ``stepped`` is False when the norm is NaN/inf (the gradients are
        dropped and the weights left untouched; the recipe decides whether to stop).
    """
    norm = step_grad_norm(model, clip_grad_norm=clip_grad_norm, extra=extra)
    stepped = math.isfinite(float(norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, stepped


def step_grad_norm(
    model: nn.Module, *, clip_grad_norm: float | None, extra: nn.Module | None = None
) -> torch.Tensor:
    """The gradient norm of :func:`optimizer_step` (clipped to ``clip_grad_norm`` when given):
    the student's, or with ``extra`` (replicated on every rank) its gradients averaged over ranks
    first and the norm of both together. No ``.item()``: the memory trace runs it on fake tensors."""
    if extra is None:
        return grad_norm(model.parameters(), max_norm=clip_grad_norm)
    _average_replicated_grads(extra)
    return _joint_grad_norm(model, extra, max_norm=clip_grad_norm)


def _average_replicated_grads(module: nn.Module) -> None:
    """Average the gradients of a module replicated on every rank (nothing on one rank)."""
    import torch.distributed as dist

    if not distributed.is_distributed():
        return
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def _joint_grad_norm(model: nn.Module, extra: nn.Module, *, max_norm: float | None) -> torch.Tensor:
    """The L2 norm of the student's and ``extra``'s gradients together (clipped to ``max_norm``)."""
    student = grad_norm(model.parameters(), max_norm=None)
    grads = [p.grad for p in extra.parameters() if p.grad is not None]
    own = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    total = torch.sqrt(student.float() ** 2 + own.to(student.device).float() ** 2)
    if max_norm is not None:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for p in [*model.parameters(), *extra.parameters()]:
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grad.mul_(coef.to(grad.device, grad.dtype))
    return total


def cpu_offload_optimizer(
    params: list[nn.Parameter], *, component: str, kwargs: dict[str, Any], trust: bool
) -> torch.optim.Optimizer:
    """The configured optimizer with its states and step on the CPU (torchao
    ``CPUOffloadOptimizer``): frees the GPU of the states (AdamW: twice the trainable weights) for
    a host round trip of the gradients.

    Args:
        params: the parameters to train.
        component: the optimizer class (``optimizer._component_``).
        kwargs: its arguments (the rest of the ``optimizer`` node).
        trust: ``trust_remote_components`` (any importable class, not only the allowed ones).

    Raises:
        KDUserError: ``optimizer._component_`` is refused or cannot be imported.
    """
    from torchao.optim import CPUOffloadOptimizer

    from kd.config.instantiate import locate_target

    cls, reason = locate_target(component, key="optimizer", trust=trust)
    if reason is not None:
        raise KDUserError(f"optimizer._component_: {reason}")
    return CPUOffloadOptimizer(params, optimizer_class=cls, **kwargs)


def build_optimizer(
    ctx: Any,
    student: nn.Module,
    *,
    num_training_steps: int,
    extra: nn.Module | None = None,
) -> tuple[torch.optim.Optimizer, Any]:
    """The configured optimizer over the student's trainable parameters (its states on the CPU
    with ``optimizer_in_cpu``) and the LR scheduler (None without ``lr_scheduler``).

    Args:
        ctx: the run (:class:`kd.runtime.run_context.RunContext`: builds ``optimizer``, ``lr_scheduler``).
        student: the prepared student.
        num_training_steps: optimizer steps of the whole run (the schedule's length).
        extra: further trainable parameters (:meth:`kd.teachers.Teacher.bind_student`), trained
            with the student's in the same parameter group.
    """
    run = ctx.run
    trainable = [p for p in student.parameters() if p.requires_grad]
    if extra is not None:
        trainable += [p for p in extra.parameters() if p.requires_grad]
    optimizer = (
        cpu_offload_optimizer(
            trainable,
            component=run.optimizer.component,
            kwargs=run.optimizer.kwargs(),
            trust=run.trust_remote_components,
        )
        if run.optimizer.in_cpu
        else ctx.build("optimizer", trainable, fix="fix the optimizer's arguments")
    )
    return optimizer, build_lr_scheduler(ctx, optimizer, num_training_steps)


def build_lr_scheduler(ctx: Any, optimizer: torch.optim.Optimizer, num_training_steps: int) -> Any:
    """The configured ``lr_scheduler`` over ``optimizer`` for ``num_training_steps`` steps (None
    without one)."""
    return ctx.build(
        "lr_scheduler",
        optimizer,
        fix="fix the scheduler's arguments",
        num_training_steps=num_training_steps,
    )


def next_micro_batches(batches: Iterator[Any], *, count: int, step: int) -> list[Any]:
    """:func:`kd.data.next_micro_batches`, agreed across ranks under torchrun (one all-reduce).

    A bad row is read by one rank only: that rank raised alone, the others waited in the step's
    first collective (gloo: a traceback once its exit broke the connection; NCCL: until its
    timeout), and its line was never printed (only rank 0 prints). Now every rank raises it, as
    ``rank <r>: <line>`` on the ranks that read no bad row.

    Raises:
        KDUserError: reading this rank's micro-batches, or another rank's, failed.
    """
    failure: KDUserError | None = None
    try:
        got = data.next_micro_batches(batches, count=count, step=step)
    except KDUserError as e:
        failure = e
    if distributed.is_distributed():
        cpu = torch.device("cpu")  # gloo: every process group kd starts has it for CPU tensors
        if distributed.any_rank(failure is not None, device=cpu):
            lines = distributed.all_gather_text(
                None if failure is None else str(failure), device=cpu
            )
            rank, line = next((r, x) for r, x in enumerate(lines) if x is not None)
            raise KDUserError(line if failure is not None else f"rank {rank}: {line}") from failure
    if failure is not None:
        raise failure
    return got


def skip_or_stop(
    stats: StepStats,
    *,
    step: int,
    bad_steps: int,
    max_bad_steps: int,
    latest_checkpoint: Path | None,
) -> None:
    """A step with a non-finite loss or gradient norm (the optimizer did not step): log and skip
    it, or stop once more than ``max_bad_steps`` such steps were seen.

    Raises:
        KDUserError: past ``max_bad_steps``; names the last good checkpoint and the fixes.
    """
    if bad_steps <= max_bad_steps:
        log.warning(
            "step %d: non-finite loss (%s) or grad norm (%s); step skipped (%d of "
            "max_bad_steps=%d)",
            step,
            stats.loss,
            stats.grad_norm,
            bad_steps,
            max_bad_steps,
        )
        return
    kept = (
        f"the last good checkpoint is {latest_checkpoint} (resume_from_checkpoint=true continues "
        "from it)"
        if latest_checkpoint is not None
        else "no step checkpoint was saved (save_every_n_steps keeps some)"
    )
    raise KDUserError(
        f"step {step}: non-finite loss ({stats.loss}) or gradient norm ({stats.grad_norm}), "
        f"{bad_steps} such steps with max_bad_steps={max_bad_steps}; stopped without saving and "
        f"{kept}; lower optimizer.lr, set clip_grad_norm, or raise max_bad_steps to skip such steps"
    )
