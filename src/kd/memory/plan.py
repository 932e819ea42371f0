"""The memory plan of a config: the config adapter, the plan object, its table, and the recipe check.

Only this module (and ``kd.cli.plan``) reads config objects; the estimator and the fit search take
:class:`~kd.memory.shapes.ModelShape` and :class:`~kd.memory.estimate.TrainKnobs`.
Importing it imports neither torch nor torchtune.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kd import folders
from kd.config import teacher_kinds as kinds
from kd.config.run import RunConfig, run_config
from kd.config.teacher_kinds import TeacherPlan
from kd.config.teacher_kinds.model import offload_accepted, own_device
from kd.errors import KDUserError, brief
from kd.memory import eval_phase
from kd.memory.estimate import COMPONENTS, GIB, Estimate, estimate
from kd.memory.generation import generation_knobs
from kd.memory.hf_config import shape_of_folder
from kd.memory.knobs import OptimizerSpec, TrainKnobs
from kd.memory.offload import PCIE_GB_PER_S
from kd.memory.shapes import (
    LoraSpec,
    ModelShape,
    ShapeError,
    int8_teacher_bytes_per_param,
    shape_from_component,
)
from kd.rollouts import plan as rollout_plan

PHASE_LABELS = {
    "generation": "generation",
    "forward": "forward",
    "backward": "backward",
    "optimizer_step": "optim step",
    "evaluation": "evaluation",
    "final_eval": "eval:",
}


@dataclass
class PlanInputs:
    """What the planner needs from a config, already typed.

    Attributes:
        student: student shape.
        teacher: teacher shape (None for plain fine-tuning).
        knobs: memory-relevant knobs.
        seq_len_source: which key set the planned sequence length (for the table).
        config_name: the config as given (for the table).
        overrides: the command-line overrides (the fit search appends to them).
        teacher_line: what the table says of a teacher that is neither a model nor a store (a
            served teacher), or None.
    """

    student: ModelShape
    teacher: ModelShape | None
    knobs: TrainKnobs
    seq_len_source: str = "tokenizer.max_seq_len"
    config_name: str = ""
    optimizer_component: str = "torch.optim.AdamW"
    student_component: str = ""
    optimizer_keys: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    teacher_line: str | None = None
    teacher_device: str | None = None
    server_sleep: bool = False


@dataclass
class MemoryPlan:
    """The planned peak memory of one device and whether it fits the budget.

    Attributes:
        peak_bytes: planned peak (allocated + runtime reserve).
        phase: the phase of the peak (forward, backward, optimizer_step, generation with
            ``on_policy``, or evaluation when validation is configured).
        budget_gib: the budget per device (None when unknown).
        fits: ``peak_bytes <= budget`` (and the teacher's own device's peak, with
            ``teacher_device``).
        components: component -> bytes at the peak phase (sums to ``peak_bytes``).
        estimate: the per-phase estimate.
        inputs: shapes and knobs the plan was made from.
        traced: phase -> traced allocated bytes (``kd plan --trace``), when run.
        fit: options that fit (``--fit`` or over budget).
    """

    peak_bytes: int
    phase: str
    budget_gib: float | None
    fits: bool
    components: dict[str, int]
    estimate: Estimate
    inputs: PlanInputs
    traced: dict[str, int] | None = None
    traced_wall_s: float | None = None
    trace_estimate: Estimate | None = None
    fit: list[Any] = field(default_factory=list)

    def _trace_est(self) -> Estimate:
        # The estimate of the fake-tensor path the trace runs (no labelled-row gather).
        return self.trace_estimate or self.estimate

    def _trace_ratio(self) -> float:
        """Estimate over trace at the traced phases' peak (the eval: phase is not traced)."""
        est, traced = self._trace_est(), self.traced or {}
        peak = max((est.allocated(p) for p in est.phase_names if p in traced), default=0)
        return peak / max(1, max(traced.values(), default=1))

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def reserve_bytes(self) -> int:
        return self.components.get("allocator_slack", 0) + self.components.get("cuda_runtime", 0)

    @property
    def reserved_peak_gib(self) -> float:
        """Allocated peak + the allocator's slack: what ``max_memory_reserved`` will show."""
        return self.estimate.reserved_peak_bytes / GIB

    @property
    def between_steps_gib(self) -> float:
        """What the device holds of kd's while a sleeping server is awake to sample
        (``on_policy.server_sleep``): the optimizer step's tensors and the CUDA runtime, the
        allocator's cache freed before the server wakes."""
        step = self.estimate.phases["optimizer_step"]
        return sum(b for c, b in step.items() if c != "allocator_slack") / GIB

    @property
    def traced_peak_gib(self) -> float | None:
        """Traced allocated peak plus the same runtime reserve (comparable with ``peak_gib``)."""
        if not self.traced:
            return None
        return (max(self.traced.values()) + self.reserve_bytes) / GIB

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``peak_gib``, ``budget_gib``, ``fits``, ``phase``, ``components`` (GiB)..."""
        e, k = self.estimate, self.inputs.knobs
        out: dict[str, Any] = {
            "peak_gib": round(self.peak_gib, 4),
            "budget_gib": self.budget_gib,
            "fits": bool(self.fits),
            "phase": self.phase,
            "components": {c: round(b / GIB, 4) for c, b in self.components.items()},
            "phases": {p: round(e.total(p) / GIB, 4) for p in e.phase_names},
            "phase_components": {
                p: {c: round(b / GIB, 4) for c, b in e.phases[p].items()} for p in e.phase_names
            },
            "allocated_peak_gib": round(e.allocated_peak_bytes / GIB, 4),
            "reserved_peak_gib": round(self.reserved_peak_gib, 4),
            "runtime_reserve_gib": round(self.reserve_bytes / GIB, 4),
            "between_steps_gib": (
                round(self.between_steps_gib, 4) if self.inputs.server_sleep else None
            ),
            "runtime_terms": e.runtime.to_json(),
            "host": e.host.to_json(),
            "teacher_device": (
                {
                    "device": self.inputs.teacher_device,
                    "peak_gib": round(e.teacher_device_peak / GIB, 4),
                    "components": {c: round(b / GIB, 4) for c, b in e.teacher_device.items()},
                }
                if e.teacher_device
                else None
            ),
            "student": {
                "builder": self.inputs.student.name,
                "params": e.student_params,
                "trainable_params": e.trainable_params,
            },
            "teacher": (
                {"builder": self.inputs.teacher.name, "params": e.teacher_params}
                if self.inputs.teacher is not None
                else None
            ),
            "batch_size": k.batch_size,
            "seq_len": k.seq_len,
            "gradient_accumulation_steps": k.grad_accum,
            "eval_batch_size": k.eval_batch,
            "stored_topk": k.stored_topk,
            "generation": (
                {
                    "models": list(k.generation.models),
                    "max_new_tokens": k.generation.new_tokens,
                    "prompt_len": max(1, k.seq_len - k.generation.new_tokens),
                }
                if k.generation is not None
                else None
            ),
            "world_size": k.world_size,
            "final_eval": eval_phase.final_eval_json(k),
            "notes": list(self.inputs.notes) + list(e.notes),
        }
        if self.traced:
            out["traced_peak_gib"] = round(self.traced_peak_gib or 0.0, 4)
            out["traced_allocated_gib"] = {p: round(b / GIB, 4) for p, b in self.traced.items()}
            out["traced_wall_s"] = round(self.traced_wall_s or 0.0, 2)
            out["trace_vs_estimate"] = round(self._trace_ratio(), 4)
        if self.fit:
            out["fit"] = [opt.to_json() for opt in self.fit]
        return out

    def _host_lines(self) -> list[str]:
        """The table's host-memory lines: what waits in host memory, what moves, how long."""
        h = self.estimate.host
        lines = [
            f"  host memory {c}: {b / GIB:.2f} GiB (pinned), "
            f"{h.moved.get(c, 0) / GIB:.2f} GiB moved per optimizer step"
            for c, b in h.host.items()
        ]
        if h.moved:
            lines.append(
                f"  host transfers: ~{h.seconds_per_step:.2f} s per optimizer step at an "
                f"assumed {PCIE_GB_PER_S:g} GB/s (PCIe; measure your link)"
            )
        return lines

    def _teacher_device_lines(self) -> list[str]:
        """The table's line of the teacher's own device (``teacher_device``), or none."""
        e, budget = self.estimate, self.budget_gib
        if not e.teacher_device:
            return []
        own = e.teacher_device_peak
        share = f", {100 * own / (budget * GIB):.1f}% of the budget" if budget else ""
        parts = ", ".join(f"{c} {b / GIB:.2f}" for c, b in e.teacher_device.items() if b)
        return [
            f"  teacher device ({self.inputs.teacher_device}): peak {own / GIB:.2f} GiB{share} "
            f"({parts}); the table above is the student's device"
        ]

    def _teacher_device_verdict(self) -> str:
        """The verdict's words on the teacher's own device, or nothing."""
        e, budget = self.estimate, self.budget_gib
        if not e.teacher_device or budget is None:
            return ""
        over = e.teacher_device_peak / GIB - budget
        return f"; teacher device {e.teacher_device_peak / GIB:.2f} GiB: " + (
            "fits" if over <= 0 else f"DOES NOT FIT (over by {over:.2f} GiB)"
        )

    def _what_lines(self) -> list[str]:
        """The table's first lines: the devices, the models, the micro-batch, what else is traced."""
        e, inp, k = self.estimate, self.inputs, self.inputs.knobs
        lines = []
        where = f"world size {k.world_size}, per device" if k.world_size > 1 else "one device"
        if e.teacher_device:
            where = "two devices: the student's, then the teacher's (teacher_device)"
        lines.append(f"memory plan ({where}){': ' + inp.config_name if inp.config_name else ''}")
        lines.append(
            f"  student {inp.student.name}: {e.student_params:,} params, {e.trainable_params:,} trainable"
        )
        if inp.teacher is not None:
            lines.append(f"  teacher {inp.teacher.name}: {e.teacher_params:,} params (frozen)")
        if inp.teacher_line is not None:
            lines.append(f"  teacher: {inp.teacher_line}")
        elif k.stored_topk is not None:
            lines.append(
                f"  teacher: stored top-{k.stored_topk} log-probs (teacher_logits), no teacher "
                "weights or forward"
            )
        lines.append(
            f"  micro-batch {k.batch_size} x {k.seq_len} tokens ({inp.seq_len_source}), "
            f"accumulation {k.grad_accum}, {'bf16' if k.dtype_bytes == 2 else 'fp32'}, "
            f"activation checkpointing {'on' if k.activation_checkpointing else 'off'}, "
            f"{'fused' if k.fused_loss else 'unfused'} loss"
            + (f" (chunk {k.loss_chunk_size})" if k.fused_loss else "")
        )
        if k.generation is not None:
            g = k.generation
            lines.append(
                f"  generation: {' and '.join(g.models)} sample{'s' if len(g.models) == 1 else ''}"
                f" up to {g.new_tokens} tokens after {k.batch_size} prompts of "
                f"{max(1, k.seq_len - g.new_tokens)} tokens (on_policy"
                + (", the larger planned)" if len(g.models) > 1 else ")")
            )
        if k.eval_batch is not None:
            lines.append(
                f"  evaluation batch {k.eval_batch} x {k.seq_len} tokens (validation.batch_size)"
            )
        return lines + eval_phase.final_eval_lines(k)

    def _component_lines(self) -> list[str]:
        """The table's rows: each component by phase, its share of the budget, the totals (and the
        traced peaks beside the estimate's)."""
        e, budget, lines = self.estimate, self.budget_gib, []
        phases = e.phase_names
        head = f"  {'component':<18}" + "".join(f"{PHASE_LABELS[p]:>12}" for p in phases)
        head += f"{'% budget':>10}"
        lines.append(head)
        for c in COMPONENTS:
            vals = [e.phases[p][c] for p in phases]
            if not any(vals):
                continue
            share = f"{100 * self.components[c] / (budget * GIB):9.1f}%" if budget else f"{'':>10}"
            row = f"  {c:<18}" + "".join(f"{v / GIB:12.2f}" for v in vals) + share
            lines.append(row)
        tot = f"  {'total GiB':<18}" + "".join(f"{e.total(p) / GIB:12.2f}" for p in phases)
        if budget:
            tot += f"{100 * self.peak_bytes / (budget * GIB):9.1f}%"
        lines.append(tot)
        if self.traced:
            lines.append(
                f"  {'traced (alloc.)':<18}"
                + "".join(
                    f"{self.traced[p] / GIB:12.2f}" if p in self.traced else f"{'-':>12}"
                    for p in phases
                )
            )
            lines.append(
                f"  {'estimate (alloc.)':<18}"
                + "".join(f"{self._trace_est().allocated(p) / GIB:12.2f}" for p in phases)
            )
        return lines

    def _verdict_lines(self) -> list[str]:
        """The table's last lines: the peak against the budget, the trace's peak, the notes."""
        e, inp, budget, lines = self.estimate, self.inputs, self.budget_gib, []
        verdict = f"peak {self.peak_gib:.2f} GiB in {self.phase}"
        if budget is None:
            verdict += "; no budget known (set memory.budget_gib or --budget-gib)"
        elif self.peak_gib <= budget:
            verdict += f"; budget {budget:.2f} GiB: fits ({budget - self.peak_gib:.2f} GiB free)"
        else:
            verdict += f"; budget {budget:.2f} GiB: DOES NOT FIT (over by {self.peak_gib - budget:.2f} GiB)"
        lines.append(verdict + self._teacher_device_verdict())
        if self.traced:
            lines.append(
                f"traced peak {self.traced_peak_gib:.2f} GiB (allocated "
                f"{max(self.traced.values()) / GIB:.2f} + reserve {self.reserve_bytes / GIB:.2f}); "
                "estimate/trace (same path) "
                f"{self._trace_ratio():.4f}"
            )
        for note in list(inp.notes) + list(e.notes):
            lines.append(f"note: {note}")
        if inp.server_sleep:
            held = self.between_steps_gib
            lines.append(
                f"note: on_policy.server_sleep: while the server samples, kd holds "
                f"{held:.2f} GiB of this device (the optimizer step's tensors and the CUDA "
                "runtime; its cache is freed before the server wakes), so a vLLM server sharing "
                f"it may take the rest: --gpu-memory-utilization at most (device GiB - "
                f"{held:.2f}) / device GiB"
            )
        return lines

    def table(self) -> str:
        """A readable table: components by phase, share of the budget, the peak and the verdict."""
        e = self.estimate
        lines = self._what_lines() + self._component_lines()
        lines.append(
            f"  peaks: allocated {e.allocated_peak_bytes / GIB:.2f} GiB (tensors), reserved "
            f"{self.reserved_peak_gib:.2f} GiB (+ allocator_slack), device {self.peak_gib:.2f} GiB "
            "(+ cuda_runtime); the budget is checked against the device peak"
        )
        lines += self._host_lines() + self._teacher_device_lines()
        return "\n".join(lines + self._verdict_lines())


# --------------------------------------------------------------------------- run adapter
def _hf_config_path(node: Any) -> str | None:
    ckpt_dir = node.get("checkpoint_dir") if node is not None else None
    if not ckpt_dir:
        return None
    return os.path.join(os.path.expanduser(str(ckpt_dir)), folders.CONFIG_JSON)


HF_COMPONENTS = ("kd.hf.causal_lm", "kd.hf.lora_causal_lm")


def _hf_lora(data: dict[str, Any]) -> LoraSpec | None:
    """The adapters of a ``kd.hf.lora_causal_lm`` node (torchtune's knob names; ``o_proj`` is
    transformers' ``output_proj``)."""
    if "lora_attn_modules" not in data and "lora_rank" not in data:
        return None
    attn = data.get("lora_attn_modules") or []
    return LoraSpec(
        rank=int(data.get("lora_rank", 8)),
        alpha=float(data.get("lora_alpha", 16)),
        attn_modules=tuple("output_proj" if str(a) == "o_proj" else str(a) for a in attn),
        mlp=bool(data.get("apply_lora_to_mlp", False)),
        output=bool(data.get("apply_lora_to_output", False)),
        dropout=float(data.get("lora_dropout", 0.0) or 0.0),
    )


def _shape(run: RunConfig, model_key: str, ckpt_key: str) -> tuple[ModelShape, list[str]]:
    node = run.components[model_key]
    if node is None:
        raise KDUserError(f"{model_key}: missing; set its _component_ (a torchtune model builder)")
    data = OmegaConf.to_container(node, resolve=True)
    assert isinstance(data, dict)
    comp = str(data.pop("_component_", ""))
    try:
        if comp in HF_COMPONENTS:
            # A Hugging Face model is sized from its own folder's config.json.
            if "path" not in data:
                raise ShapeError(f"{comp} needs path (the model's folder)")
            lora = _hf_lora(data) if comp.endswith("lora_causal_lm") else None
            shape, notes = shape_of_folder(str(data["path"]), lora=lora, key=f"{model_key}.path")
            attention = data.get("attn_implementation", "sdpa")
            if attention != "sdpa":
                notes.append(
                    f"{model_key}.attn_implementation={attention}: planned as sdpa (eager "
                    "attention keeps [b, heads, s, s] probabilities); check with kd plan --trace"
                )
            return shape, notes
        config_path = (
            os.path.join(os.path.expanduser(str(data["path"])), folders.CONFIG_JSON)
            if "path" in data
            else _hf_config_path(run.components[ckpt_key])
        )
        return shape_from_component(comp, data, hf_config_path=config_path), []
    except ShapeError as e:
        raise KDUserError(
            f"{model_key}: cannot plan memory: {e}; use a torchtune builder or set "
            "memory.check=off to skip the plan"
        ) from e
    except (ValueError, TypeError, OSError) as e:  # a size that is not a number, a bad config.json
        where = f"{model_key}.path" if "path" in data else f"{ckpt_key}.checkpoint_dir"
        raise KDUserError(
            f"{model_key}: cannot plan memory ({brief(e)}); give the builder's sizes as whole "
            f"numbers, and check {where}/config.json"
        ) from e


def optimizer_spec(run: RunConfig) -> OptimizerSpec:
    """What the configured optimizer keeps per trainable parameter."""
    opt = run.optimizer
    name = opt.component.rsplit(".", 1)[-1].lower()
    kwargs = opt.kwargs()
    if "8bit" in name:
        kind = "adamw8bit"
    elif name == "sgd":
        kind = "sgd"
    else:
        kind = "adamw"
    foreach = kwargs.get("foreach")
    return OptimizerSpec(
        kind=kind,
        fused=bool(kwargs.get("fused", False)),
        foreach=None if foreach is None else bool(foreach),
        momentum=float(kwargs.get("momentum", 0.0) or 0.0),
        in_cpu=opt.in_cpu,
    )


def inputs_from_run(run: RunConfig, *, world_size: int = 1, config_name: str = "") -> PlanInputs:
    """Typed planner inputs of a run.

    Raises:
        KDUserError: a model whose shape cannot be determined.
    """
    student, notes = _shape(run, "model", "checkpointer")
    seq = run.memory.seq_len
    tp = teacher_plan(run, student, notes, seq_len=int(seq or student.max_seq_len))
    if seq is None:
        seq = student.max_seq_len
        notes.append(
            f"tokenizer.max_seq_len is not set: planned for the model's {seq} tokens; "
            "set tokenizer.max_seq_len (or memory.seq_len)"
        )
    reserve = run.memory.reserve_gib
    final_eval, eval_notes = eval_phase.final_eval_knobs(run, student, seq_len=int(seq))
    knobs = TrainKnobs(
        batch_size=run.batch_size,
        seq_len=int(seq),
        grad_accum=run.optimizer.grad_accum,
        dtype_bytes=4 if run.dtype == "fp32" else 2,
        activation_checkpointing=run.activation_checkpointing,
        optimizer=optimizer_spec(run),
        fused_loss=run.loss.fused,
        loss_chunk_size=run.loss.chunk_size,
        divergence=run.loss.divergence,
        temperature=run.loss.temperature,
        world_size=int(world_size),
        fsdp_cpu_offload=run.fsdp.cpu_offload,
        reshard_after_forward=run.fsdp.reshard_after_forward,
        reduce_dtype_bytes=4 if run.fsdp.reduce_dtype == "fp32" else 2,
        reserve_bytes=None if reserve is None else int(reserve * GIB),
        device_type="cpu" if run.device.startswith("cpu") else "cuda",
        eval_batch=run.validation.batch_size if run.validation is not None else None,
        stored_topk=tp.stored_topk,
        generation=generation_knobs(
            run.on_policy,
            teacher=tp.teacher is not None and tp.teacher_samples,
            batch_size=run.batch_size,
            grad_accum=run.optimizer.grad_accum,
            dtype=run.dtype,
        ),
        teacher_bytes_per_param=tp.bytes_per_param,
        self_teacher_copy=tp.self_copy,
        other_teacher_params=tp.other_params,
        hidden_map=tp.hidden_map,
        hidden_loss=tp.hidden_loss,
        cross_tokenizer=tp.cross and run.loss.needs_teacher_logits,
        cross_vocab=tp.cross_vocab or None,
        activation_offloading=run.activation_offloading,
        teacher_offload=tp.offload if tp.teacher is not None else "none",
        teacher_parkable=offload_accepted(run),
        other_teacher_head_params=tp.other_head_params,
        teacher_own_device=tp.teacher is not None and own_device(run),
        final_eval=final_eval,
        teacher_logits=run.loss.needs_teacher_logits,
    )
    notes += eval_notes
    if student.lora is not None and student.lora.use_dora:
        notes.append(
            "use_dora: DoRA's weight-norm temporaries are not in the closed form; check with --trace"
        )
    if run.compile:
        notes.append("compile=true: planned as eager (compiled layers usually save less)")
    notes += rollout_plan.uncounted(run.on_policy)
    model = run.components["model"]
    return PlanInputs(
        student=student,
        teacher=tp.teacher,
        knobs=knobs,
        seq_len_source=run.memory.seq_len_source,
        config_name=config_name,
        optimizer_component=run.optimizer.component,
        student_component=str(model.get("_component_", "")) if model is not None else "",
        optimizer_keys=tuple(str(key) for key in run.optimizer.node),
        notes=notes,
        teacher_line=tp.line,
        teacher_device=run.teacher_device if knobs.teacher_own_device else None,
        server_sleep=run.on_policy is not None
        and run.on_policy.sampler == "served"
        and run.on_policy.server_sleep,
    )


def _store_manifest(folder: Path) -> dict[str, Any] | None:
    from kd.teachers.store_manifest import read_manifest

    return read_manifest(folder)


def teacher_plan(
    run: RunConfig, student: ModelShape, notes: list[str], *, seq_len: int
) -> TeacherPlan:
    """What the run's teacher kind (:func:`kd.config.teacher_kinds.selected`) adds to the plan: its
    forward's shape, a top-k signal, its weights' bytes, further teachers, hidden-state pairs, a
    cross-tokenizer loss, the table's line. No teacher, or one the run asks nothing of
    (:func:`kd.config.teacher_kinds.in_use`: ``kd_ratio: 0`` without ``seq_kd``): all empty."""
    tp = TeacherPlan(
        run=run,
        student=student,
        shape_of=_shape,
        notes=notes,
        seq_len=seq_len,
        dtype_bytes=4 if run.dtype == "fp32" else 2,
        int8_bytes=int8_teacher_bytes_per_param,
        store_manifest=_store_manifest,
    )
    kind = kinds.in_use(run)
    if kind is not None and kind.plan is not None:
        kind.plan(tp)
    return tp


def make_plan(inputs: PlanInputs, budget_gib: float | None) -> MemoryPlan:
    """Estimate ``inputs`` and compare the peak with ``budget_gib``."""
    est = estimate(inputs.student, inputs.teacher, inputs.knobs)
    comps = dict(est.phases[est.peak_phase])
    fits = True if budget_gib is None else est.fits(budget_gib * GIB)
    return MemoryPlan(
        peak_bytes=est.peak_bytes,
        phase=est.peak_phase,
        budget_gib=None if budget_gib is None else float(budget_gib),
        fits=fits,
        components=comps,
        estimate=est,
        inputs=inputs,
    )


def plan_from_config(
    cfg: DictConfig, *, world_size: int = 1, budget_gib: float | None = None
) -> MemoryPlan:
    """The memory plan of a loaded config (no weights, no torch import); see :func:`plan_run`.

    Args:
        cfg: config from ``kd.config.load_config``.
        world_size: FSDP2 ranks (per-rank numbers).
        budget_gib: per-device budget; None uses ``memory.budget_gib`` (which may be None too).
    """
    run = run_config(cfg)
    budget = run.memory.budget_gib if budget_gib is None else budget_gib
    return make_plan(inputs_from_run(run, world_size=world_size), budget)


def _takes_int8(run: RunConfig, world_size: int) -> bool:
    """Whether ``kd run`` takes ``teacher_quantization=int8`` for ``run``: one device, and a
    kind that quantizes (a local teacher model; :func:`kd.config.teacher_kinds.refuse`)."""
    if world_size > 1:
        return False
    try:
        kinds.refuse(dataclasses.replace(run, teacher_quantization="int8"))
    except KDUserError:
        return False
    return True


def attach_fit(plan: MemoryPlan, run: RunConfig, *, quantized_teacher: bool = True) -> str | None:
    """Search the knobs for ``plan`` (:func:`kd.memory.fit.fit_options`) with the recipe's limits
    for the run's device and the dataset's size; sets ``plan.fit``. ``quantized_teacher``: also
    suggest a quantized teacher.

    Returns:
        A note for the options when the data's size had to be guessed, else None.
    """
    from kd.memory.data_size import run_dataset_size
    from kd.memory.fit import examples_bound, fit_options

    size = run_dataset_size(run)
    if quantized_teacher:
        quantized_teacher = _takes_int8(run, plan.inputs.knobs.world_size)
    plan.fit = fit_options(
        plan.inputs.student,
        plan.inputs.teacher,
        plan.inputs.knobs,
        budget_bytes=int(plan.budget_gib * GIB) if plan.budget_gib else 0,
        device=run.device,
        dataset_size=size,
        student_component=plan.inputs.student_component,
        optimizer_keys=plan.inputs.optimizer_keys,
        quantized_teacher=quantized_teacher,
    )
    return examples_bound(plan.inputs.knobs, size)[1]


def check_memory(
    run: RunConfig, *, world_size: int, budget_gib: float | None, config_name: str = ""
) -> MemoryPlan | None:
    """The check every recipe (and ``kd validate``) makes before any weight loads, honouring
    ``memory.check``.

    * ``error``: over budget raises :class:`~kd.errors.KDUserError` whose message is the table and the
      overrides that fit (``kd plan --fit``).
    * ``warn``: over budget prints the table on stderr and returns the plan.
    * ``off``: returns None without planning.

    Args:
        run: the run configuration.
        world_size: ranks (per-rank plan).
        budget_gib: the resolved budget per device (:func:`kd.runtime.device.resolve_budget`); None when
            unknown (the plan is then made but cannot be over budget).
        config_name: the config as given (for the table).

    Returns:
        The plan (None with ``check: off``).
    """
    mode = run.memory.check
    if mode == "off":
        return None
    try:
        inputs = inputs_from_run(run, world_size=world_size, config_name=config_name)
    except KDUserError as e:
        if mode == "warn":
            print(f"kd: warning: {e}", file=sys.stderr)
            return None
        raise
    plan = make_plan(inputs, budget_gib)
    if plan.fits:
        return plan
    from kd.memory.fit import format_options

    note = attach_fit(plan, run, quantized_teacher=False)  # users ask kd not to quantize unasked
    message = (
        f"memory: the plan needs {plan.peak_gib:.2f} GiB per device in {plan.phase} but the budget "
        f"is {plan.budget_gib:.2f} GiB (memory.budget_gib); nothing was loaded or written\n"
        + plan.table()
        + "\n"
        + format_options(plan.fit, note=note)
        + "\nset memory.check=warn to run anyway"
    )
    if mode == "warn":
        print(message, file=sys.stderr)
        return plan
    raise KDUserError(message)
