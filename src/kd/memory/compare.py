"""The online teacher against stored teacher logits, side by side (``kd plan --compare-stored-logits``).

Both plans come from one run: the online one with its teacher model (weights, no-grad forward,
fused loss against its hidden states), the stored one without it (:attr:`TrainKnobs.stored_topk`:
the batch's ``[B, S, k]`` ids and log-probs resident, the chunked top-k loss). For each budget the
knob search of :mod:`kd.memory.fit` says which mode fits, as configured or with which overrides.
Importing it imports neither torch nor torchtune.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kd.memory.estimate import COMPONENTS, GIB
from kd.memory.fit import FitOption, fit_options
from kd.memory.plan import PHASE_LABELS, MemoryPlan, PlanInputs, make_plan

# The budgets compared when none is given: a 40 GiB (A100 40GB) and a 24 GiB (RTX 4090) device.
DEFAULT_BUDGETS_GIB: tuple[float, ...] = (40.0, 24.0)
ONLINE = "online teacher"


def stored_label(k: int) -> str:
    """The stored-logits mode's name in the comparison."""
    return f"stored top-{k}"


def stored_logits_inputs(online: PlanInputs, k: int) -> PlanInputs:
    """The planner inputs of the same run trained from stored teacher logits with top-``k``.

    No teacher model (weights, forward); the knobs carry ``stored_topk``. Validation is refused
    with stored logits (the store holds no held-out rows), so no evaluation phase is planned.

    Args:
        online: the run's inputs with its online teacher.
        k: ``teacher_logits.k``.
    """
    notes = list(online.notes)
    if online.knobs.eval_batch is not None:
        notes.append("validation is refused with stored teacher logits: no evaluation planned")
    return replace(
        online,
        teacher=None,
        knobs=replace(online.knobs, stored_topk=int(k), eval_batch=None),
        notes=notes,
    )


@dataclass
class BudgetVerdict:
    """How one mode meets one budget.

    Attributes:
        mode: :data:`ONLINE` or :func:`stored_label`'s name.
        budget_gib: the budget per device.
        fits_as_is: the plan as configured fits.
        peak_bytes: the planned peak as configured.
        option: the fastest knob setting that fits (or, failing that, the first suggestion); None
            when it fits as configured or nothing fits.
    """

    mode: str
    budget_gib: float
    fits_as_is: bool
    peak_bytes: int
    option: FitOption | None

    def line(self) -> str:
        """One line: fits as configured, fits with overrides, only with a suggestion, or not."""
        head = f"  {self.mode + ':':<17} "
        peak = self.peak_bytes / GIB
        if self.fits_as_is:
            return head + f"fits as configured ({peak:.2f} GiB)"
        if self.option is None:
            return head + f"does not fit ({peak:.2f} GiB); no searched setting or suggestion fits"
        o = self.option
        if o.suggestion:
            words = o.description.split(" (", 1)[0].removeprefix("suggestion: ")
            if o.extra.get("teacher_quantization"):
                words += " (not a kd config key yet)"
            over = f": {' '.join(o.overrides)}" if o.overrides else ""
            return (
                head + f"does not fit ({peak:.2f} GiB); only with {words}, "
                f"{o.peak_bytes / GIB:.2f} GiB{over}"
            )
        return (
            head + f"fits with {' '.join(o.overrides)}  # {o.peak_bytes / GIB:.2f} GiB, "
            f"~{o.relative_time:.2f}x step time: {o.description}"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "budget_gib": self.budget_gib,
            "fits_as_configured": self.fits_as_is,
            "peak_gib": round(self.peak_bytes / GIB, 4),
            "option": self.option.to_json() if self.option is not None else None,
        }


def verdict(
    plan: MemoryPlan,
    mode: str,
    budget_gib: float,
    *,
    device: str,
    dataset_size: int | None,
) -> BudgetVerdict:
    """How ``plan``'s inputs meet ``budget_gib``: as configured, else the fit search's first option.

    Args:
        plan: the mode's plan (its own budget is ignored).
        mode: the mode's name.
        budget_gib: the budget per device.
        device: the run's ``device`` (which offload the recipe accepts).
        dataset_size: examples in the dataset, or None when not known at plan time.
    """
    inp = plan.inputs
    fits = plan.estimate.fits(budget_gib * GIB)
    option = None
    if not fits:
        options = fit_options(
            inp.student,
            inp.teacher,
            inp.knobs,
            budget_bytes=int(budget_gib * GIB),
            device=device,
            dataset_size=dataset_size,
            student_component=inp.student_component,
            optimizer_keys=inp.optimizer_keys,
        )
        option = next((o for o in options if not o.suggestion), None)
        option = option or next(iter(options), None)
    return BudgetVerdict(mode, float(budget_gib), fits, plan.peak_bytes, option)


@dataclass
class Comparison:
    """The two plans of one run and how each meets each budget."""

    online: MemoryPlan
    stored: MemoryPlan
    k: int
    verdicts: list[BudgetVerdict]

    def table(self) -> str:
        """Both plans' components per phase side by side, the peaks, then the budget verdicts."""
        on, st = self.online.estimate, self.stored.estimate
        phases = [p for p in on.phase_names if p in st.phases]
        inp, kn = self.online.inputs, self.online.inputs.knobs
        label = stored_label(self.k)
        lines = [
            "memory plan, online teacher vs stored teacher logits (one device)"
            + (f": {inp.config_name}" if inp.config_name else ""),
            f"  student {inp.student.name}: {on.student_params:,} params, "
            f"{on.trainable_params:,} trainable",
        ]
        if inp.teacher is not None:
            lines.append(
                f"  online: teacher {inp.teacher.name} ({on.teacher_params:,} params) runs each step"
            )
        io = st.phases[st.peak_phase]["stored_logits"]
        lines.append(
            f"  {label}: teacher_logits.k={self.k}; the micro-batch's [B, S, k] int64 ids + "
            f"float16 log-probs ({io / (1 << 20):.1f} MiB) on the device; no teacher weights or "
            "forward"
        )
        lines.append(
            f"  micro-batch {kn.batch_size} x {kn.seq_len} tokens, accumulation {kn.grad_accum}, "
            f"activation checkpointing {'on' if kn.activation_checkpointing else 'off'}, "
            f"loss chunk {kn.loss_chunk_size}"
        )
        width = 11 * len(phases)
        lines.append(f"  {'':<18}{ONLINE:^{width}} |{label:^{width}}")
        cols = "".join(f"{PHASE_LABELS[p]:>11}" for p in phases)
        lines.append(f"  {'component (GiB)':<18}{cols} |{cols}")
        for c in COMPONENTS:
            a = [on.phases[p][c] for p in phases]
            b = [st.phases[p][c] for p in phases]
            if not any(a) and not any(b):
                continue
            lines.append(
                f"  {c:<18}"
                + "".join(f"{v / GIB:11.2f}" for v in a)
                + " |"
                + "".join(f"{v / GIB:11.2f}" for v in b)
            )
        lines.append(
            f"  {'total':<18}"
            + "".join(f"{on.total(p) / GIB:11.2f}" for p in phases)
            + " |"
            + "".join(f"{st.total(p) / GIB:11.2f}" for p in phases)
        )
        lines.append(
            f"peak: {ONLINE} {on.peak_bytes / GIB:.2f} GiB in {on.peak_phase}; {label} "
            f"{st.peak_bytes / GIB:.2f} GiB in {st.peak_phase} "
            f"({(on.peak_bytes - st.peak_bytes) / GIB:.2f} GiB less)"
        )
        for budget in dict.fromkeys(v.budget_gib for v in self.verdicts):
            lines.append(f"budget {budget:g} GiB:")
            lines += [v.line() for v in self.verdicts if v.budget_gib == budget]
        if any(v.option is not None and v.mode == label for v in self.verdicts):
            lines.append(
                f"(the {label} overrides come on top of teacher_logits.path=<store> "
                f"teacher_logits.k={self.k})"
            )
        for note in dict.fromkeys(list(self.stored.inputs.notes) + on.notes + st.notes):
            lines.append(f"note: {note}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        return {
            "online": self.online.to_json(),
            "stored_logits": {"k": self.k, **self.stored.to_json()},
            "budgets": [v.to_json() for v in self.verdicts],
        }


def compare(
    online: PlanInputs,
    k: int,
    budgets_gib: tuple[float, ...] = DEFAULT_BUDGETS_GIB,
    *,
    device: str = "cuda",
    dataset_size: int | None = None,
) -> Comparison:
    """Plan ``online`` and its stored-logits twin, and say how each meets each budget.

    Args:
        online: the run's inputs with its online teacher (``teacher`` set).
        k: ``teacher_logits.k`` of the stored mode.
        budgets_gib: the budgets per device to judge.
        device: the run's ``device``.
        dataset_size: examples in the dataset, or None when not known at plan time.
    """
    first = budgets_gib[0] if budgets_gib else None
    on = make_plan(online, first)
    st = make_plan(stored_logits_inputs(online, k), first)
    label = stored_label(k)
    verdicts = [
        verdict(plan, mode, budget, device=device, dataset_size=dataset_size)
        for budget in budgets_gib
        for plan, mode in ((on, ONLINE), (st, label))
    ]
    return Comparison(online=on, stored=st, k=int(k), verdicts=verdicts)
