"""Several teachers (``teachers:``): ordinary teachers, composed.

Each member of ``teachers.members`` is built by the source a one-teacher config of it would get
(:func:`kd.teachers.build.teacher_source` on :func:`members_of`'s per-member
:class:`kd.config.run.RunConfig`): a local model of either backend, stored top-k log-probs or a
served model. :class:`MultiTeacher` asks each for its signal and :class:`MultiSignal` combines
them per ``teachers.combine``:

* ``weights``: ``loss = sum_i w_i loss_i / sum_i w_i``: each member's own loss (its CE is the
  same) so the KD term is the weighted sum of per-teacher divergences. One member of any weight
  is exactly that member's loss (the factor is 1.0).
* ``mix``: one divergence to the mixture ``p = sum_i w_i p_i / sum_i w_i`` of the members' full
  distributions (local models only), computed chunk by chunk over the labelled positions under
  :func:`torch.utils.checkpoint.checkpoint` (only a chunk's ``[c, V]`` logits exist at a time).
* ``route``: each row learns from the member its data field ``teachers.route_field`` names
  (:attr:`kd.teachers.TeacherInput.route`); each member answers only its rows; rows naming no
  teacher learn from CE alone (weight 1, as plain fine-tuning). Each part is weighted by its share
  of the batch's labelled positions, so the loss is the token mean over the batch.

Per-teacher divergences are reported as the signal's extra terms ``kd_loss/<name>``
(:attr:`MultiSignal.terms`; ``val_kd_loss/<name>`` in validation). In ``route`` training rows
they are each member's divergence summed over its positions over all labelled positions (they add
up to ``kd_loss``); validation reports each member's mean over its own positions. A member's own
parts of its divergence are reported under its name (:func:`member_term`: a cross-tokenizer
member ``x``'s ``kd_loss/matched`` is ``kd_loss/x/matched``), scaled as its ``kd_loss/<name>``.

A teacher with another tokenizer (a member's ``cross_tokenizer:``, :mod:`kd.teachers.cross`) is
an ordinary member of ``weights`` and ``route``: its signal's loss is GOLD's over the student's
states of the rows it is given. ``mix`` refuses it (kd.config.teachers: distributions over
different vocabularies are not mixed), and so does validation (as for one such teacher).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kd import losses, models
from kd.config.run import VALIDATION_DATASET, LossSettings, RunConfig
from kd.config.teachers import Member, members_of
from kd.data import build_dataset, filled_fields, raw_row, row_field
from kd.errors import KDUserError, one_line
from kd.runtime import distributed
from kd.teachers.base import Teacher, TeacherInput, TeacherSignal

__all__ = [
    "Member",
    "MultiSignal",
    "MultiTeacher",
    "MultiTeacherSource",
    "member_term",
    "members_of",
]


def member_term(name: str, term: str) -> str | None:
    """The name under which member ``name``'s extra term ``term`` is reported: a part of its
    divergence ``kd_loss/<x>`` (a cross-tokenizer teacher's matched and unmatched parts) is
    ``kd_loss/<name>/<x>``; other terms (a hidden-state loss) are not reported (None)."""
    head, sep, rest = term.partition("/")
    return f"kd_loss/{name}/{rest}" if sep and head == "kd_loss" else None


def routes_of(dataset: Any, name: str, teachers: Sequence[str], *, key: str) -> list[str | None]:
    """Every row's teacher (field ``name``; None or empty: none), each a member's name.

    Raises:
        KDUserError: a row names no member, or no row fills the field.
    """
    out: list[str | None] = []
    for i in range(len(dataset)):
        value = row_field(dataset, i, name)
        if value in (None, ""):
            out.append(None)
            continue
        if value not in teachers:
            raise KDUserError(
                f"{key}: row {i + 1} has {name}={value!r}, which names no teacher of "
                f"teachers.members ({', '.join(teachers)}); fix the row or add a member of that "
                "name (rows without the field learn from CE only)"
            )
        out.append(str(value))
    if out and all(r is None for r in out):
        raise KDUserError(_no_route_message(dataset, name, key))
    return out


def _no_route_message(dataset: Any, name: str, key: str) -> str:
    """The line for a route field no row fills (every row would learn from CE alone)."""
    have = ", ".join(filled_fields(raw_row(dataset, 0))) or "none kd can read"
    nested = (
        " (kd reads a top-level field of each row, not a nested one; give each row its own "
        "field naming its teacher)"
        if "." in name
        else ""
    )
    return (
        f"teachers.route_field: no row of {key} has a value in field {one_line(repr(name))}, so "
        "every row "
        f"would learn from CE only{nested}; set teachers.route_field to the field naming each "
        f"row's teacher (row 1 has: {one_line(have)[:200]})"
    )


class MultiTeacherSource:
    """``teachers:``: each member built by its own one-teacher source.

    Args:
        run: the run (``run.teachers`` set).
        make_source: the one-teacher source of a member's run
            (:func:`kd.teachers.build.teacher_source`).
    """

    reads: tuple[str, ...] = ()

    def __init__(self, run: RunConfig, make_source: Callable[[RunConfig], Any]):
        assert run.teachers is not None
        self.run = run
        self.settings = run.teachers
        self.members = members_of(run)
        self.sources = [make_source(m.run) for m in self.members]
        self.route_field = self.settings.route_field if self.settings.combine == "route" else None
        self._checked: list[tuple[Any, Any]] = []

    @property
    def needs_rows(self) -> bool:
        """Whether a member reads batches' row indices (a member may learn so in its check: a
        cross-tokenizer teacher of chat rows)."""
        return any(s.needs_rows for s in self.sources)

    def check(self, ctx: Any, facts: Any, dataset: Sequence[Any]) -> None:
        """Each member's weight-free checks, as a one-teacher run of it would make them; with
        ``combine: route`` every row's field (the training rows' and the validation rows') names
        a member or none, and some row names one."""
        from kd.runtime.run_context import RunContext

        tokenizer = ctx.tokenizer()
        self._checked = []
        for member, source in zip(self.members, self.sources, strict=True):
            sub = RunContext(member.run, ctx.world)
            sub._tokenizer = tokenizer  # the run's, checked once
            sub_facts = sub.inspect_models(tokenizer, read=tuple(source.reads))
            try:
                source.check(sub, sub_facts, dataset)
            except KDUserError as e:
                raise KDUserError(f"teachers.members {member.name}: {e}") from None
            self._checked.append((sub, sub_facts))
        if self.route_field is not None:
            names = [m.name for m in self.members]
            routes_of(dataset, self.route_field, names, key="dataset")
            if self.run.validation is not None:  # its rows are routed too (raw rows: no tokens)
                held_out = build_dataset(
                    self.run.validation.dataset,
                    tokenizer,
                    trust=self.run.trust_remote_components,
                    key=VALIDATION_DATASET,
                )
                routes_of(held_out, self.route_field, names, key=VALIDATION_DATASET)

    def load(self, ctx: Any, facts: Any, *, run_dir: Any = None) -> MultiTeacher:
        assert self._checked, "check() inspects every member"
        teachers = [
            source.load(sub, sub_facts, run_dir=run_dir)
            for source, (sub, sub_facts) in zip(self.sources, self._checked, strict=True)
        ]
        return MultiTeacher(
            teachers,
            names=[m.name for m in self.members],
            weights=[m.weight for m in self.members],
            combine=self.settings.combine,
        )


class MultiTeacher(Teacher):
    """Several loaded teachers, combined per ``combine`` (see the module docstring).

    Args:
        teachers: the members' teachers.
        names: their names.
        weights: their weights (``weights`` and ``mix``; their sum must be > 0).
        combine: ``weights``, ``mix`` or ``route``.
    """

    def __init__(
        self,
        teachers: Sequence[Teacher],
        *,
        names: Sequence[str],
        weights: Sequence[float],
        combine: str,
    ):
        if combine != "route" and sum(weights) <= 0:
            raise ValueError(f"teacher weights must sum to a positive number, got {weights}")
        self.teachers = list(teachers)
        self.names = list(names)
        total = sum(weights) if combine != "route" else 1.0
        self.weights = [float(w) / total for w in weights]
        self.combine = combine
        own = (
            member_term(n, term) for n, t in zip(names, teachers, strict=True) for term in t.terms
        )
        self.terms = tuple(f"kd_loss/{n}" for n in self.names) + tuple(t for t in own if t)
        self.generator: nn.Module | None = None

    def signal(self, batch: TeacherInput) -> MultiSignal:
        if self.combine != "route":
            parts = [t.signal(batch) for t in self.teachers]
            return MultiSignal(
                self, parts, rows=[None] * len(parts), batch_shape=batch.tokens.shape
            )
        if batch.route is None:
            raise ValueError("combine: route needs the batch's route (TeacherInput.route)")
        parts, rows = [], []
        for name, teacher in zip(self.names, self.teachers, strict=True):
            sel = [i for i, r in enumerate(batch.route) if r == name]
            rows.append(torch.tensor(sel, dtype=torch.long, device=batch.tokens.device))
            if sel:
                parts.append(teacher.signal(_subset(batch, sel)))
                continue
            if distributed.is_distributed():
                # Every rank asks every member for each micro-batch (a sharded teacher's
                # forward and a served one's agreement are collectives): a member no row of
                # this rank names still runs, and its answer is not used.
                teacher.signal(batch)
            parts.append(None)
        route = [self.names.index(r) if r is not None else -1 for r in batch.route]
        return MultiSignal(self, parts, rows=rows, batch_shape=batch.tokens.shape, route=route)

    def generator_for(self, route: str | None) -> nn.Module | None:
        """``route``: the generator of the member the row names (None for a row naming none);
        the others have no one model that samples."""
        if self.combine != "route" or route not in self.names:
            return None
        return self.teachers[self.names.index(route)].generator

    def bind_student(self, student: nn.Module) -> None:
        for t in self.teachers:
            t.bind_student(student)

    def release(self) -> None:
        for t in self.teachers:
            t.release()

    def after_step(self, step: int) -> None:
        for t in self.teachers:
            t.after_step(step)

    def state_dict(self) -> dict[str, Any]:
        """The members' own states, by name (members without state are left out)."""
        states = {n: t.state_dict() for n, t in zip(self.names, self.teachers, strict=True)}
        return {n: state for n, state in states.items() if state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, t in zip(self.names, self.teachers, strict=True):
            t.load_state_dict(dict(state.get(name, {})))

    def close(self) -> None:
        for t in self.teachers:
            t.close()

    def check_loaded(self) -> None:
        for t in self.teachers:
            t.check_loaded()

    def look_ahead(
        self, batches: Iterator[dict[str, torch.Tensor]]
    ) -> Iterator[dict[str, torch.Tensor]]:
        for t in self.teachers:
            batches = t.look_ahead(batches)
        return batches


def _subset(batch: TeacherInput, sel: list[int]) -> TeacherInput:
    """The rows ``sel`` of ``batch``."""
    index = torch.tensor(sel, dtype=torch.long, device=batch.tokens.device)
    return TeacherInput(
        tokens=batch.tokens.index_select(0, index),
        labels=(
            None
            if batch.labels is None
            else batch.labels.index_select(0, index.to(batch.labels.device))
        ),
        rows=None if batch.rows is None else [batch.rows[i] for i in sel],
        route=None if batch.route is None else [batch.route[i] for i in sel],
    )


def _ce_only(student: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, s: LossSettings):
    """The plain fine-tuning loss (CE) of rows that name no teacher."""
    if s.fused and models.has_plain_output(student):
        return losses.fused_linear_ce_loss(
            hidden,
            models.output_weight(student),
            labels,
            ignore_index=s.ignore_index,
            chunk_size=s.chunk_size,
        )
    return losses.ce_loss(models.logits_from_hidden(student, hidden), labels, s.ignore_index)


@dataclass
class MultiSignal:
    """The members' signals for one micro-batch, combined by their teacher's ``combine``.

    Attributes:
        owner: the :class:`MultiTeacher` (names, weights, combine).
        parts: each member's signal (``route``: over its rows only; None when it has none).
        rows: ``route``: each member's batch rows (``[r_i]`` int64); else None each.
        batch_shape: ``(b, s)`` of the batch.
        route: ``route``: each row's member index (-1: none).
        terms: after :meth:`loss`, ``kd_loss/<name>`` per member (detached, see the module
            docstring).
    """

    owner: MultiTeacher
    parts: list[TeacherSignal | None]
    rows: list[torch.Tensor | None]
    batch_shape: Sequence[int]
    route: list[int] | None = None
    terms: dict[str, torch.Tensor] = field(default_factory=dict)

    def loss(
        self,
        student: nn.Module,
        student_hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        settings: LossSettings,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        combine = self.owner.combine
        if combine == "weights":
            return self._weighted(student, student_hidden, labels, settings)
        if combine == "mix":
            return self._mixed(student, student_hidden, labels, settings)
        return self._routed(student, student_hidden, labels, settings)

    def _weighted(self, student, hidden, labels, settings):  # type: ignore[no-untyped-def]
        total = ce = kd = None
        for name, w, part in zip(self.owner.names, self.owner.weights, self.parts, strict=True):
            assert part is not None
            loss_i, ce_i, kd_i = part.loss(student, hidden, labels, settings=settings)
            self._report(name, part, kd_i, 1.0)
            total = w * loss_i if total is None else total + w * loss_i
            kd = w * kd_i if kd is None else kd + w * kd_i
            ce = ce_i if ce is None else ce
        assert total is not None and ce is not None and kd is not None
        return total, ce, kd

    def _report(
        self, name: str, part: TeacherSignal, kd: torch.Tensor, scale: float | torch.Tensor
    ) -> None:
        """``kd_loss/<name>`` and the member's own terms (:func:`member_term`), times ``scale``."""
        self.terms[f"kd_loss/{name}"] = (scale * kd).detach()
        for term, value in getattr(part, "terms", {}).items():
            if (reported := member_term(name, term)) is not None:
                self.terms[reported] = (scale * value).detach()

    def _routed(self, student, hidden, labels, settings):  # type: ignore[no-untyped-def]
        ign = settings.ignore_index
        n_all = (labels != ign).sum().clamp_min(1).to(torch.float32)
        zero = hidden.sum() * 0.0  # keeps the graph when no row is routed anywhere
        total, ce, kd = zero, zero.detach(), zero.detach()
        assert self.route is not None
        for name, part, rows in zip(self.owner.names, self.parts, self.rows, strict=True):
            if part is None or rows is None or rows.numel() == 0:
                self.terms[f"kd_loss/{name}"] = zero.detach()
                continue
            rows = rows.to(labels.device)  # made where the batch's tokens were (the loader's)
            lab = labels.index_select(0, rows)
            share = (lab != ign).sum().to(torch.float32) / n_all
            loss_i, ce_i, kd_i = part.loss(
                student, hidden.index_select(0, rows), lab, settings=settings
            )
            total = total + share * loss_i
            ce, kd = ce + share * ce_i.detach(), kd + share * kd_i.detach()
            self._report(name, part, kd_i, share)
        none = [i for i, r in enumerate(self.route) if r < 0]
        if none:
            rows = torch.tensor(none, dtype=torch.long, device=labels.device)
            lab = labels.index_select(0, rows)
            share = (lab != ign).sum().to(torch.float32) / n_all
            ce_0 = _ce_only(student, hidden.index_select(0, rows), lab, settings)
            total, ce = total + share * ce_0, ce + share * ce_0.detach()
        return total, ce, kd

    def _mixed(self, student, hidden, labels, settings):  # type: ignore[no-untyped-def]
        """One divergence to the weighted mixture, chunk by chunk over labelled positions."""
        flat = labels.reshape(-1)
        idx = (flat != settings.ignore_index).nonzero().squeeze(1)
        n = max(idx.numel(), 1)
        h_s = hidden.reshape(-1, hidden.size(-1)).index_select(0, idx)
        target = flat.index_select(0, idx)
        h_t = [p.labelled_hidden(idx) for p in self.parts]  # type: ignore[union-attr]
        t2 = settings.temperature**2
        ce_sum = kd_sum = hidden.sum() * 0.0
        member_sums = [torch.zeros((), device=hidden.device) for _ in self.parts]
        for start in range(0, idx.numel(), settings.chunk_size):
            end = start + settings.chunk_size
            chunk_t = [h[start:end] for h in h_t]
            ce_c, kd_c = checkpoint(
                self._mix_chunk,
                student,
                h_s[start:end],
                target[start:end],
                chunk_t,
                settings,
                use_reentrant=False,
            )
            ce_sum, kd_sum = ce_sum + ce_c, kd_sum + kd_c
            with torch.no_grad():
                s_logits = models.logits_from_hidden(student, h_s[start:end])
                for i, (lp, _) in enumerate(self._member_logprobs(s_logits, chunk_t, settings)):
                    member_sums[i] += lp
        ce, kd = ce_sum / n, kd_sum / n * t2
        for name, s in zip(self.owner.names, member_sums, strict=True):
            self.terms[f"kd_loss/{name}"] = (s / n * t2).detach()
        loss = losses.mix_ce_kd(ce, kd, settings.kd_ratio)
        return loss, ce.detach(), kd.detach()

    def _member_logprobs(
        self, s_logits: torch.Tensor, chunk_t: list[torch.Tensor], settings: LossSettings
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per member: (its divergence summed over the chunk, its log-probs over the shared
        vocab); no gradient."""
        for part, h in zip(self.parts, chunk_t, strict=True):
            assert part is not None
            s_logp, t_logp = losses.shared_vocab_logprobs(
                s_logits, part.logits(h), temperature=settings.temperature
            )
            div = losses.per_token_divergence(
                s_logp, t_logp, settings.divergence, settings.beta, settings.skew_alpha
            )
            yield div.sum(), t_logp

    def _mix_chunk(
        self,
        student: nn.Module,
        hs: torch.Tensor,
        target: torch.Tensor,
        chunk_t: list[torch.Tensor],
        settings: LossSettings,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = models.logits_from_hidden(student, hs)  # [c, Vs] fp32
        with torch.no_grad():
            t_logits = [p.logits(h) for p, h in zip(self.parts, chunk_t, strict=True)]  # type: ignore[union-attr]
            vocab = min([z.size(-1), *(t.size(-1) for t in t_logits)])
            t_logp = _mixture_logp(t_logits, self.owner.weights, vocab, settings.temperature)
        ce = F.cross_entropy(z, target, reduction="sum")
        s_logp = torch.log_softmax(z[:, :vocab] / settings.temperature, dim=-1)
        kd = losses.per_token_divergence(
            s_logp, t_logp, settings.divergence, settings.beta, settings.skew_alpha
        )
        return ce, kd.sum()

    # ---- evaluation (kd.training.evaluate) ------------------------------------------------
    def labelled_hidden(self, index: torch.Tensor | None) -> torch.Tensor:
        """Every member's states at ``index`` side by side, then each position's member (route:
        its row's member index; else -1): ``[n, sum d_i + 1]``."""
        b, s = self.batch_shape[0], self.batch_shape[1]
        cols = []
        for part, rows in zip(self.parts, self.rows, strict=True):
            if rows is None:
                assert part is not None
                cols.append(part.labelled_hidden(index))
                continue
            h = part.labelled_hidden(None) if part is not None else None
            d = h.size(-1) if h is not None else 1
            full = torch.zeros(b, s, d, device=rows.device, dtype=torch.float32)
            if h is not None:
                full[rows] = h.reshape(rows.numel(), s, d).float()
            full = full.reshape(b * s, d)
            cols.append(full if index is None else full.index_select(0, index))
        route = torch.tensor(self.route or [-1] * b, dtype=torch.float32, device=cols[0].device)
        pos = route.repeat_interleave(s)[:, None]
        if index is not None:
            pos = pos.index_select(0, index)
        self._dims = [c.size(-1) for c in cols]
        dtype = torch.promote_types(cols[0].dtype, torch.float32)
        return torch.cat([c.to(dtype) for c in cols] + [pos.to(dtype)], dim=-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The weighted mixture's log-probs (as logits) of rows of :meth:`labelled_hidden`."""
        chunk_t = self._split(hidden)[0]
        t_logits = [
            p.logits(h.to(_dtype(p))) if p is not None else None
            for p, h in zip(self.parts, chunk_t, strict=True)
        ]
        present = [t for t in t_logits if t is not None]
        vocab = min(t.size(-1) for t in present)
        weights = [w for w, t in zip(self.owner.weights, t_logits, strict=True) if t is not None]
        if self.owner.combine == "route":
            weights = [1.0 / len(present)] * len(present)
        return _mixture_logp(present, weights, vocab, 1.0)

    def _split(self, hidden: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        parts = list(torch.split(hidden[:, :-1], self._dims, dim=-1))
        return parts, hidden[:, -1].round().long()

    def token_divergences(
        self, s_logits: torch.Tensor, hidden: torch.Tensor, *, settings: LossSettings
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
        """For evaluation: per position the divergence (without ``T^2``), the teacher's argmax,
        and each member's divergence with the positions it counts at (None: all)."""
        chunk_t, route = self._split(hidden)
        terms: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        divs, logits = [], []
        for name, part, h in zip(self.owner.names, self.parts, chunk_t, strict=True):
            if part is None:  # route: a member with no row in this batch
                t_logits = torch.zeros_like(s_logits)
            else:
                t_logits = part.logits(h.to(_dtype(part)))
            s_logp, t_logp = losses.shared_vocab_logprobs(
                s_logits, t_logits, temperature=settings.temperature
            )
            div = losses.per_token_divergence(
                s_logp, t_logp, settings.divergence, settings.beta, settings.skew_alpha
            )
            divs.append(div)
            logits.append(t_logits)
            mask = route == len(divs) - 1 if self.owner.combine == "route" else None
            terms[f"kd_loss/{name}"] = (div, mask)
        vocab = min([s_logits.size(-1), *(t.size(-1) for t in logits)])
        if self.owner.combine == "route":
            kd = torch.zeros_like(divs[0])
            top = torch.full_like(route, -1)
            for i, (div, t) in enumerate(zip(divs, logits, strict=True)):
                kd = torch.where(route == i, div, kd)
                top = torch.where(route == i, t[:, :vocab].argmax(-1), top)
            return kd, top, terms
        mixed = _mixture_logp(logits, self.owner.weights, vocab, settings.temperature)
        if self.owner.combine == "weights":
            kd = sum(w * d for w, d in zip(self.owner.weights, divs, strict=True))
        else:
            s_logp = torch.log_softmax(s_logits[:, :vocab].float() / settings.temperature, -1)
            kd = losses.per_token_divergence(
                s_logp, mixed, settings.divergence, settings.beta, settings.skew_alpha
            )
        return kd, mixed.argmax(-1), terms  # type: ignore[return-value]


def _dtype(part: Any) -> torch.dtype:
    model = getattr(part, "model", None)
    return models.output_weight(model).dtype if model is not None else torch.float32


def _mixture_logp(
    t_logits: Sequence[torch.Tensor], weights: Sequence[float], vocab: int, temperature: float
) -> torch.Tensor:
    """``log sum_i w_i softmax(z_i / T)`` over the first ``vocab`` entries (fp32)."""
    mixed = None
    for z, w in zip(t_logits, weights, strict=True):
        if w <= 0:
            continue
        term = torch.log_softmax(z[:, :vocab].float() / temperature, dim=-1) + torch.log(
            torch.tensor(float(w), device=z.device)
        )
        mixed = term if mixed is None else torch.logaddexp(mixed, term)
    assert mixed is not None
    return mixed
