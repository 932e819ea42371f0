"""Held-out evaluation: loss, CE, KD and top-1 agreement, token-weighted over a whole data set.

Every number is an exact sum of per-token quantities over all labelled positions of the set (all
batches, all ranks), divided once by the number of those positions: never a mean of batch means.
So the result does not depend on the evaluation batch size or on the number of ranks (up to
floating-point summation order; the sums are kept in fp64). The definitions are the training
loss's (:mod:`kd.losses`):

* ``val_ce_loss``: cross-entropy of the student over its full vocabulary;
* ``val_kd_loss``: ``T^2`` times the divergence (``kd_loss.divergence``, the true divergence as
  training logs it) between ``softmax(teacher / T)`` and ``softmax(student / T)`` over the shared
  first ``min(Vs, Vt)`` vocab entries; absent, with ``val_top1_agreement``, when the loss has no
  KD term (no teacher, or ``kd_ratio: 0``: the teacher's forward does not run on the validation
  set, :attr:`kd.config.run.LossSettings.needs_teacher_logits`);
* ``val_loss``: ``(1 - kd_ratio) * val_ce_loss + kd_ratio * val_kd_loss``;
* ``val_top1_agreement``: the fraction of labelled positions where the student's and the
  teacher's argmax over the shared vocab agree;
* ``val_<term>``: each extra loss term the teacher reports (:attr:`kd.teachers.Teacher.terms`,
  several teachers: ``val_kd_loss/<name>``), ``T^2`` times its sum over the positions it counts
  at, divided by their number. A signal with such terms computes the per-position values itself
  (``token_divergences``, :class:`kd.teachers.TeacherSignal`).

Logits are computed chunk by chunk over the labelled positions only (``loss_chunk_size`` rows at a
time, as the fused loss does), so no ``[batch, seq, vocab]`` tensor is built. No autograd; the
student is in eval mode during the evaluation and back in its previous mode after it.

The teacher's outputs on the validation set do not change during training, but they are
recomputed at every evaluation rather than cached: what the KD term and the agreement need per
labelled token is the teacher's full distribution over the shared vocab, ``V`` floats per token
(0.6 MB per token at V = 152k in fp32: 600 GB for a set of a million labelled tokens), which no
device holds; recomputing costs one teacher forward per validation batch, without autograd.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from kd import data, losses, models
from kd.config.run import LossSettings, RunConfig, ValidationSettings
from kd.config.schema import VAL_METRICS
from kd.runtime import distributed
from kd.runtime.distributed import WorldInfo
from kd.teachers import Teacher, TeacherInput, TeacherSignal, as_teacher
from kd.teachers.base import asks_signal
from kd.training.train import shift_labels

log = logging.getLogger("kd")

__all__ = ["BestTracker", "ValStats", "Validator", "batch_sums", "evaluate", "token_sums"]

# Entries of the sums tensor (fp64): CE, divergence (without T^2), argmax agreements, positions.
_CE, _KD, _AGREE, _COUNT = range(4)


@dataclass(frozen=True)
class ValStats:
    """One evaluation over the whole validation set (all ranks).

    Attributes:
        loss: ``(1 - kd_ratio) * ce_loss + kd_ratio * kd_loss``.
        ce_loss: the student's cross-entropy per labelled token.
        kd_loss: ``T^2`` times the divergence to the teacher per labelled token; None without a
            KD term (no teacher, or ``kd_ratio: 0``).
        top1_agreement: fraction of labelled positions where student and teacher argmax agree
            over the shared vocab; None without a KD term.
        num_tokens: labelled positions evaluated.
        seconds: wall time of the evaluation.
        terms: the teacher's extra terms, by name (``val_`` is prepended in :meth:`metrics`).
    """

    loss: float
    ce_loss: float
    kd_loss: float | None
    top1_agreement: float | None
    num_tokens: int
    seconds: float
    terms: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float | int]:
        """The metric row: ``val_loss``, ``val_ce_loss``, ``val_kd_loss`` and
        ``val_top1_agreement`` (with a KD term), ``val_num_tokens``, ``val_seconds``."""
        row: dict[str, float | int] = {
            name: value
            for name in VAL_METRICS
            if (value := self.value(name)) is not None  # type: ignore[assignment]
        }
        row.update({f"val_{name}": value for name, value in self.terms.items()})
        row["val_num_tokens"] = self.num_tokens
        row["val_seconds"] = self.seconds
        return row

    def value(self, metric: str) -> float | None:
        """The value of ``metric`` (one of :data:`kd.config.schema.VAL_METRICS`)."""
        return {
            "val_loss": self.loss,
            "val_ce_loss": self.ce_loss,
            "val_kd_loss": self.kd_loss,
            "val_top1_agreement": self.top1_agreement,
        }[metric]


def token_sums(
    student: nn.Module,
    teacher: Teacher | nn.Module | None,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    settings: LossSettings,
    route: Any = None,
) -> torch.Tensor:
    """Sums over the labelled positions of one batch: CE, divergence, argmax agreements, count,
    then (sum, positions) of each extra term of the teacher (:attr:`kd.teachers.Teacher.terms`).

    A signal with extra terms gives their sums per chunk of logits (``token_divergences``:
    several teachers' divergences, ``T^2`` included) or per batch (``term_sums(labels,
    ignore_index) -> {name: (sum, positions)}``: the hidden-state loss).

    Both models must be in hidden-output mode (:func:`kd.models.set_hidden_output`); call it
    under ``torch.no_grad()``. The divergence sum is without the ``T^2`` factor.

    Args:
        student: the student decoder.
        teacher: the teacher (a :class:`kd.teachers.Teacher` or a bare decoder), or None (then
            the divergence and agreement sums are 0). It is asked for its signal only as a
            training step asks it (:func:`kd.teachers.base.asks_signal`), and its logits only
            when the loss has a KD term (``settings.needs_teacher_logits``).
        tokens: ``[b, s]`` input ids.
        labels: ``[b, s]`` shifted labels (:func:`kd.training.train.shift_labels`).
        settings: the loss settings (divergence, temperature, chunk size, ignore index).
        route: each example's teacher (:attr:`kd.teachers.TeacherInput.route`), or None.

    Returns:
        fp64 ``[4 + 2 * terms]``: (CE sum, divergence sum, agreements, labelled positions), then
        each term's (sum, positions).
    """
    flat = labels.reshape(-1)
    mask: torch.Tensor | None = flat != settings.ignore_index
    idx: torch.Tensor | None = None
    if is_fake(flat):
        # Fake tensors (memory planner): selecting rows by mask has a data-dependent shape, so
        # keep every position (the worst case the planner plans for anyway) and weight by mask.
        rows = flat.numel()
    else:
        idx = mask.nonzero().squeeze(1)
        rows = idx.numel()
        mask = None

    def labelled(x: torch.Tensor) -> torch.Tensor:
        return x if idx is None else x.index_select(0, idx)

    h_s = student(tokens)
    h_s = labelled(h_s.reshape(-1, h_s.size(-1)))  # [n, d_s]
    signal, h_t = None, None
    teacher = as_teacher(teacher)
    asked = asks_signal(teacher, settings)
    names = teacher.terms if asked else ()
    if asked:
        signal = teacher.signal(TeacherInput(tokens, route=route))
        if settings.needs_teacher_logits:
            h_t = signal.labelled_hidden(idx)  # [n, d_t]
    target = labelled(flat)
    sums = torch.zeros(4 + 2 * len(names), dtype=torch.float64, device=flat.device)
    sums[_COUNT] = rows if mask is None else mask.sum()
    for start in range(0, rows, settings.chunk_size):
        end = start + settings.chunk_size
        # One chunk per call: its logits and log-probs are freed before the next chunk's exist.
        sums += _chunk_sums(
            student,
            signal,
            h_s[start:end],
            None if h_t is None else h_t[start:end],
            target[start:end],
            None if mask is None else mask[start:end],
            settings=settings,
            names=names,
        )
    term_sums = getattr(signal, "term_sums", None)
    if term_sums is not None:
        for name, (total, positions) in term_sums(labels, settings.ignore_index).items():
            i = names.index(name)
            sums[4 + 2 * i] += total.double()
            sums[5 + 2 * i] += positions
    return sums


def _chunk_sums(
    student: nn.Module,
    teacher: TeacherSignal | None,
    h_s: torch.Tensor,
    h_t: torch.Tensor | None,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    settings: LossSettings,
    names: tuple[str, ...] = (),
) -> torch.Tensor:
    """fp64 ``[4 + 2 * terms]``: the CE, divergence and agreement sums of ``n`` rows (count 0),
    then each term's sum and positions.

    Args:
        student: the student decoder.
        teacher: the teacher's signal for the batch, or None.
        h_s: ``[n, d_s]`` the student's hidden states of the rows.
        h_t: ``[n, d_t]`` the teacher's, or None.
        target: ``[n]`` the rows' labels.
        weight: ``[n]`` bool: the labelled rows (None: all of them).
        settings: the loss settings.
        names: the teacher's extra terms.
    """
    sums = torch.zeros(4 + 2 * len(names), dtype=torch.float64, device=target.device)
    s_logits = models.logits_from_hidden(student, h_s)  # [n, Vs] fp32
    ce = F.cross_entropy(s_logits, target, reduction="none")
    sums[_CE] += _weighted(ce, weight).double().sum()
    if teacher is None or h_t is None:
        return sums
    own = getattr(teacher, "token_divergences", None)
    if own is not None:  # a signal with extra terms computes its own (several teachers)
        kd, t_top, terms = own(s_logits, h_t, settings=settings)
        sums[_AGREE] += _weighted(s_logits.argmax(-1) == t_top, weight).sum()
        sums[_KD] += _weighted(kd, weight).double().sum()
        for i, name in enumerate(names):
            values, where = terms[name]
            counted = weight if where is None else (where if weight is None else where & weight)
            sums[4 + 2 * i] += _weighted(values, counted).double().sum() * settings.temperature**2
            sums[5 + 2 * i] += values.numel() if counted is None else counted.sum()
        return sums
    t_logits = teacher.logits(h_t)  # [n, Vt] fp32
    s_logp, t_logp = losses.shared_vocab_logprobs(
        s_logits, t_logits, temperature=settings.temperature
    )
    vocab = s_logp.size(-1)
    agree = s_logits[:, :vocab].argmax(-1) == t_logits[:, :vocab].argmax(-1)
    sums[_AGREE] += _weighted(agree, weight).sum()
    del s_logits, t_logits
    kd = losses.per_token_divergence(
        s_logp, t_logp, settings.divergence, settings.beta, settings.skew_alpha
    )
    sums[_KD] += _weighted(kd, weight).double().sum()
    return sums


def _weighted(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``values`` at labelled positions, 0 elsewhere (``mask`` None: every row is labelled)."""
    return values if mask is None else torch.where(mask, values, torch.zeros_like(values))


def batch_sums(
    student: nn.Module,
    teacher: Teacher | nn.Module | None,
    batch: dict[str, torch.Tensor],
    *,
    settings: LossSettings,
    device: torch.device,
) -> torch.Tensor:
    """:func:`token_sums` of one collated batch, then the sharded models' gathered parameters
    freed. Call it under ``torch.no_grad()`` with the student in eval mode (:func:`evaluate`
    does; the memory planner traces it as the evaluation phase).

    Args:
        student: the student decoder in hidden-output mode.
        teacher: the teacher (or a bare teacher decoder), or None.
        batch: ``{"tokens", "labels"}`` ``[b, s]`` as collated (labels not shifted).
        settings: the loss settings.
        device: where the models run.

    Returns:
        fp64 ``[4 + 2 * terms]`` sums (:func:`token_sums`).
    """
    labels = shift_labels(batch["labels"], settings.ignore_index)
    sums = token_sums(
        student,
        teacher,
        batch["tokens"].to(device),
        labels.to(device),
        settings=settings,
        route=batch.get("route"),
    )
    # Sharded models keep their root (and, with reshard_after_forward false, every layer)
    # gathered after a forward that no backward follows: free them.
    distributed.reshard(student)
    teacher = as_teacher(teacher)
    if teacher is not None:
        teacher.release()
    return sums


def evaluate(
    student: nn.Module,
    teacher: Teacher | nn.Module | None,
    batches: Iterable[dict[str, torch.Tensor]],
    *,
    settings: LossSettings,
    device: torch.device,
) -> ValStats:
    """Evaluate the student (against the teacher) on this rank's batches; sums over all ranks.

    Collective when distributed: every rank calls it with its own share of the set
    (:func:`kd.data.build_eval_loader`), with the same number of batches. Both models must be in
    hidden-output mode, as :mod:`kd.runtime.prepare` leaves them.

    Args:
        student: the student decoder (put in eval mode for the evaluation, then back).
        teacher: the frozen teacher, or None (plain fine-tuning: no ``kd_loss``, no agreement).
        batches: ``{"tokens", "labels"}`` batches ``[b, s]`` as collated (labels not shifted).
        settings: the training loss settings (``val_loss`` uses the same definition).
        device: where the models run.

    Returns:
        The token-weighted metrics of the whole set.
    """
    t0 = time.perf_counter()
    was_training = student.training
    student.eval()
    names = as_teacher(teacher).terms if asks_signal(as_teacher(teacher), settings) else ()
    scored = teacher is not None and settings.needs_teacher_logits  # a KD term: teacher logits
    sums = torch.zeros(4 + 2 * len(names), dtype=torch.float64, device=device)
    try:
        with torch.no_grad():
            for batch in batches:
                sums += batch_sums(student, teacher, batch, settings=settings, device=device)
    finally:
        student.train(was_training)
    ce, kd, agree, count, *extra = distributed.all_reduce_sum(sums).tolist()
    n = max(count, 1.0)
    ce, kd = ce / n, kd / n * settings.temperature**2
    terms = {name: extra[2 * i] / max(extra[2 * i + 1], 1.0) for i, name in enumerate(names)}
    return ValStats(
        loss=losses.mix_ce_kd(ce, kd, settings.kd_ratio),
        ce_loss=ce,
        kd_loss=kd if scored else None,
        top1_agreement=agree / n if scored else None,
        num_tokens=int(count),
        seconds=time.perf_counter() - t0,
        terms=terms,
    )


@dataclass
class BestTracker:
    """The best value of a validation metric so far, and evaluations since it last improved.

    Drives ``keep_best`` (write ``best/`` when :meth:`update` says the value improved) and
    ``early_stopping`` (:attr:`should_stop`). Its :meth:`state_dict` goes into step checkpoints,
    so a resumed run keeps both.

    Attributes:
        metric: the metric followed (one of :data:`kd.config.schema.VAL_METRICS`).
        mode: ``min`` or ``max``: which direction is better.
        patience: evaluations without improvement that stop training; None = never.
        best: the best value so far (None before the first evaluation).
        best_step: the step of ``best``.
        bad_evals: evaluations since ``best`` last improved.
        last_step: the step of the latest evaluation.
    """

    metric: str
    mode: str
    patience: int | None = None
    best: float | None = None
    best_step: int | None = None
    bad_evals: int = 0
    last_step: int | None = None

    def update(self, value: float, *, step: int) -> bool:
        """Record the evaluation of ``step``; True when ``value`` is strictly better than the best
        so far (a NaN or infinite value never is)."""
        self.last_step = step
        better = math.isfinite(value) and (
            self.best is None or (value < self.best if self.mode == "min" else value > self.best)
        )
        if better:
            self.best, self.best_step, self.bad_evals = value, step, 0
        else:
            self.bad_evals += 1
        return better

    @property
    def should_stop(self) -> bool:
        """Whether ``patience`` evaluations in a row brought no improvement."""
        return self.patience is not None and self.bad_evals >= self.patience

    def state_dict(self) -> dict[str, Any]:
        """Plain values for the recipe state (``torch.load(weights_only=True)`` reads them)."""
        return {
            "metric": self.metric,
            "mode": self.mode,
            "best": self.best,
            "best_step": self.best_step,
            "bad_evals": self.bad_evals,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> bool:
        """Restore a saved :meth:`state_dict` when it followed the same metric and mode.

        Returns:
            False (nothing restored) for an empty state (a checkpoint from before validation, or
            of a run without it) or one of another metric or mode.
        """
        if not state or (state.get("metric"), state.get("mode")) != (self.metric, self.mode):
            return False
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.best_step = None if state.get("best_step") is None else int(state["best_step"])
        self.bad_evals = int(state.get("bad_evals", 0))
        self.last_step = None if state.get("last_step") is None else int(state["last_step"])
        return True


class Validator:
    """The validation component of a run: evaluates on the held-out set and follows the best
    value (``keep_best``, ``early_stopping``). The recipe creates it once and calls
    :meth:`evaluate` where it evaluates.

    Args:
        settings: ``validation:`` (with ``keep_best`` and ``early_stopping``).
        loss: the training loss settings (``val_loss`` uses the same definition).
        batches: this rank's share of the validation set (:func:`kd.data.build_eval_loader`).
        device: where the models run.
    """

    def __init__(
        self,
        settings: ValidationSettings,
        *,
        loss: LossSettings,
        batches: Iterable[dict[str, torch.Tensor]],
        device: torch.device,
    ):
        self.settings = settings
        self.loss = loss
        self.batches = batches
        self.device = device
        self.tracker = BestTracker(settings.metric, settings.mode, patience=settings.patience)

    @classmethod
    def for_run(
        cls,
        run: RunConfig,
        dataset: Any,
        *,
        pad_id: int,
        world: WorldInfo,
        device: torch.device,
        route_field: str | None,
    ) -> Validator:
        """The validator of ``run`` (``validation:`` set) over this rank's share of ``dataset``
        (:func:`kd.data.build_eval_loader`), its batches carrying ``route_field`` when set."""
        settings = run.validation
        assert settings is not None
        batches = data.build_eval_loader(
            dataset,
            batch_size=settings.batch_size,
            max_batches=settings.max_batches,
            pad_id=pad_id,
            world_size=world.world_size,
            rank=world.rank,
            route_field=route_field,
        )
        return cls(settings, loss=run.loss, batches=batches, device=device)

    def restore(self, state: dict[str, Any], ckpt: Path, *, say: bool) -> None:
        """Follow on from a checkpoint's tracker ``state``; one that holds none starts over
        (said on the ``kd`` logger when ``say``)."""
        if not self.tracker.load_state_dict(state) and say:
            log.info("%s holds no best %s: it starts over", ckpt, self.tracker.metric)

    def run(
        self,
        student: nn.Module,
        teacher: Teacher | None,
        *,
        step: int,
        epoch: int,
        write: Callable[[dict[str, Any]], None] | None,
        save_best: Callable[..., Any],
    ) -> ValStats:
        """:meth:`evaluate` at optimizer step ``step`` (all ranks), its row written by ``write``
        (rank 0's metric sinks; None on the other ranks), and ``save_best(metric=, value=,
        mode=)`` called when the followed metric improved. Collective when distributed."""
        stats, best_due = self.evaluate(student, teacher, step=step)
        if write is not None:
            write({"step": step, "epoch": epoch, **stats.metrics()})
        tracker = self.tracker
        if best_due and tracker.best is not None:
            save_best(metric=tracker.metric, value=tracker.best, mode=tracker.mode)
        return stats

    def due(self, step: int) -> bool:
        """Whether ``validation.every_n_steps`` evaluates after optimizer step ``step``."""
        every = self.settings.every_n_steps
        return every is not None and step % every == 0

    def evaluate(
        self, student: nn.Module, teacher: Teacher | None, *, step: int
    ) -> tuple[ValStats, bool]:
        """``(stats, best_due)``: the metrics of the whole set, and whether ``best/`` is due (the
        followed metric improved at ``step`` and ``keep_best`` is on). Collective."""
        stats = evaluate(student, teacher, self.batches, settings=self.loss, device=self.device)
        value = stats.value(self.tracker.metric)
        improved = self.tracker.update(float("nan") if value is None else value, step=step)
        return stats, improved and self.settings.keep_best and self.tracker.best is not None

    def stop_message(
        self, *, step: int, total_steps: int, best_dir: Path, final: Path | None
    ) -> str:
        """The line early stopping prints: why training stopped, the best value and where it is."""
        tracker = self.tracker
        if tracker.best is None:
            best = "; no evaluation gave a finite value"
        elif self.settings.keep_best:
            best = f"; the best, {tracker.best:.6g} at step {tracker.best_step}, is in {best_dir}"
        else:
            best = f"; the best was {tracker.best:.6g} at step {tracker.best_step}"
        return (
            f"kd: early stopping after step {step} of {total_steps}: "
            f"{tracker.metric} did not improve ({tracker.mode}) for {tracker.bad_evals} "
            f"evaluations (early_stopping.patience={tracker.patience}){best}; saved {final}"
        )
