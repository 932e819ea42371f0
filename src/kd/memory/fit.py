"""Search the memory knobs for settings that fit a budget, fastest first.

Knobs searched (all keep the training the same, only slower or with a different optimizer
implementation): activation checkpointing, a smaller micro-batch with gradient accumulation raised so
the global batch is unchanged, a smaller loss chunk, torchao AdamW8bit, CPU offload of the optimizer
states. A LoRA student and a quantized teacher change what is trained, so they are only suggested
(with their planned peak), never switched.

Relative step times are rough, documented multipliers (``_TIME``), only used to order the options.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from kd.memory.estimate import GIB, OptimizerSpec, TrainKnobs, estimate
from kd.memory.shapes import NF4_BYTES_PER_PARAM, LoraSpec, ModelShape

# Multipliers on the step time (ordering heuristics, not measurements):
# recomputing every layer's forward costs ~1/3 of a forward+backward; each halving of the
# micro-batch loses some GPU efficiency; smaller loss chunks add kernel launches; 8-bit states
# add (de)quantization; CPU-offloaded states move gradients over PCIe every step.
_TIME = {
    "ac": 1.33,
    "halve_batch": 1.06,
    "halve_chunk": 1.01,
    "adamw8bit": 1.03,
    "cpu_offload": 1.6,
}


# Keyword arguments torchao.optim.AdamW8bit accepts (others are removed from the optimizer node).
_ADAMW8BIT_KEYS = frozenset(
    {
        "_component_",
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "amsgrad",
        "block_size",
        "bf16_stochastic_round",
    }
)


@dataclass
class FitOption:
    """One setting of the knobs and its planned peak.

    Attributes:
        overrides: ready ``key=value`` (and ``~key``) overrides for ``kd run`` / ``kd plan``.
        peak_bytes: planned peak with these overrides.
        relative_time: estimated step time relative to the current config (1.0 = same).
        description: what changes, in words.
        suggestion: changes what is trained (LoRA, teacher quantization): listed, never applied.
    """

    overrides: list[str]
    peak_bytes: int
    relative_time: float
    description: str
    suggestion: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "overrides": list(self.overrides),
            "peak_gib": round(self.peak_bytes / GIB, 3),
            "relative_time": round(self.relative_time, 3),
            "description": self.description,
            "suggestion": self.suggestion,
        }


def _batches(knobs: TrainKnobs) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs with the same global batch, largest micro-batch first."""
    total = knobs.batch_size * knobs.grad_accum
    out = []
    b = knobs.batch_size
    while b >= 1:
        if total % b == 0:
            out.append((b, total // b))
        b = b // 2 if b > 1 else 0
    if (1, total) not in out:
        out.append((1, total))
    return out


def _chunks(knobs: TrainKnobs) -> list[int]:
    if not knobs.fused_loss:
        return [knobs.loss_chunk_size]
    out = [knobs.loss_chunk_size]
    c = knobs.loss_chunk_size
    while c > 128:
        c //= 2
        out.append(c)
    return out


def _optimizers(knobs: TrainKnobs) -> list[str]:
    opts = ["same"]
    if knobs.optimizer.kind == "adamw" and not knobs.optimizer.in_cpu:
        opts.append("adamw8bit")
    if not knobs.optimizer.in_cpu:
        opts.append("cpu_offload")
    return opts


def _log2_ratio(a: int, b: int) -> int:
    n = 0
    while a > b:
        a //= 2
        n += 1
    return n


def fit_options(
    student: ModelShape,
    teacher: ModelShape | None,
    knobs: TrainKnobs,
    *,
    budget_bytes: int,
    student_component: str = "",
    optimizer_keys: tuple[str, ...] = (),
    limit: int = 5,
) -> list[FitOption]:
    """Knob settings whose planned peak fits ``budget_bytes``, fastest first, then suggestions.

    Args:
        student: student shape.
        teacher: teacher shape or None.
        knobs: the current knobs (the search starts from them).
        budget_bytes: per-device budget.
        student_component: the student's builder path (for the LoRA suggestion).
        optimizer_keys: keys of the config's optimizer node (those AdamW8bit does not take are
            deleted with ``~optimizer.key``).
        limit: at most this many knob options (suggestions come on top).

    Returns:
        Options that fit, fastest first (ties: lower peak first), followed by suggestions.
    """
    found: list[FitOption] = []
    ac_values = [knobs.activation_checkpointing] + (
        [True] if not knobs.activation_checkpointing else []
    )
    for ac, (b, ga), chunk, opt in itertools.product(
        ac_values, _batches(knobs), _chunks(knobs), _optimizers(knobs)
    ):
        k = replace(
            knobs, activation_checkpointing=ac, batch_size=b, grad_accum=ga, loss_chunk_size=chunk
        )
        over: list[str] = []
        words: list[str] = []
        t = 1.0
        if ac != knobs.activation_checkpointing:
            over.append("enable_activation_checkpointing=true")
            words.append("activation checkpointing")
            t *= _TIME["ac"]
        if b != knobs.batch_size:
            over += [f"batch_size={b}", f"gradient_accumulation_steps={ga}"]
            words.append(f"micro-batch {b} x accumulation {ga}")
            t *= _TIME["halve_batch"] ** _log2_ratio(knobs.batch_size, b)
        if chunk != knobs.loss_chunk_size:
            over.append(f"loss_chunk_size={chunk}")
            words.append(f"loss chunk {chunk}")
            t *= _TIME["halve_chunk"] ** _log2_ratio(knobs.loss_chunk_size, chunk)
        if opt == "adamw8bit":
            k = replace(k, optimizer=OptimizerSpec(kind="adamw8bit"))
            over.append("optimizer._component_=torchao.optim.AdamW8bit")
            over += [f"~optimizer.{key}" for key in optimizer_keys if key not in _ADAMW8BIT_KEYS]
            words.append("8-bit AdamW states")
            t *= _TIME["adamw8bit"]
        elif opt == "cpu_offload":
            k = replace(k, optimizer=replace(k.optimizer, in_cpu=True))
            over.append("optimizer_in_cpu=true")
            words.append("optimizer states on the CPU")
            t *= _TIME["cpu_offload"]
        if not over:
            continue
        est = estimate(student, teacher, k)
        if est.peak_bytes <= budget_bytes:
            found.append(FitOption(over, est.peak_bytes, t, ", ".join(words)))
    found.sort(key=lambda o: (round(o.relative_time, 4), o.peak_bytes))
    # Drop options that only add changes to a faster option that already fits.
    kept: list[FitOption] = []
    for opt in found:
        if any(set(prev.overrides) <= set(opt.overrides) for prev in kept):
            continue
        kept.append(opt)
        if len(kept) >= limit:
            break
    return kept + suggestions(student, teacher, knobs, student_component=student_component)


def suggestions(
    student: ModelShape,
    teacher: ModelShape | None,
    knobs: TrainKnobs,
    *,
    student_component: str = "",
) -> list[FitOption]:
    """LoRA student and quantized teacher: what they would save (they change the training)."""
    out: list[FitOption] = []
    if student.lora is None:
        lora = replace(
            student,
            lora=LoraSpec(
                rank=16,
                alpha=32,
                attn_modules=("q_proj", "k_proj", "v_proj", "output_proj"),
                mlp=True,
            ),
        )
        est = estimate(lora, teacher, knobs)
        module = (
            student_component.rsplit(".", 1)[0] if "." in student_component else "torchtune.models"
        )
        out.append(
            FitOption(
                [
                    f"model._component_={module}.lora_{student.name}",
                    "model.lora_attn_modules=[q_proj,k_proj,v_proj,output_proj]",
                    "model.apply_lora_to_mlp=true",
                    "model.lora_rank=16",
                    "model.lora_alpha=32",
                ],
                est.peak_bytes,
                0.8,
                "suggestion: a LoRA student (trains adapters only; changes the result)",
                suggestion=True,
            )
        )
    if teacher is not None:
        t_bytes = knobs.dtype_bytes * teacher.total_params()
        nf4 = int(teacher.total_params() * NF4_BYTES_PER_PARAM)
        int8 = int(teacher.total_params() * 1.006)
        base = estimate(student, teacher, knobs).peak_bytes
        for name, q in (("int8 weight-only", int8), ("NF4", nf4)):
            peak = base - (t_bytes - q)
            out.append(
                FitOption(
                    [],
                    peak,
                    1.1,
                    f"suggestion: an {name} teacher would save {(t_bytes - q) / GIB:.1f} GiB "
                    f"(peak about {peak / GIB:.1f} GiB; not a kd config key yet, changes the teacher's outputs)",
                    suggestion=True,
                )
            )
    return out


def format_options(options: list[FitOption]) -> str:
    """Options as lines: ready overrides first (fastest first), then suggestions."""
    knobs = [o for o in options if not o.suggestion]
    lines = []
    if knobs:
        lines.append("settings that fit (fastest first; append to the command line):")
        for o in knobs:
            lines.append(
                f"  {' '.join(o.overrides)}    # {o.peak_bytes / GIB:.2f} GiB, ~{o.relative_time:.2f}x step "
                f"time: {o.description}"
            )
    else:
        lines.append(
            "no setting of the searched knobs fits; consider the suggestions below or more devices"
        )
    for o in options:
        if o.suggestion:
            fits = ""
            if o.overrides:
                fits = f"  {' '.join(o.overrides)}    # {o.peak_bytes / GIB:.2f} GiB"
                lines.append(f"{o.description}:")
                lines.append(fits)
            else:
                lines.append(o.description)
    return "\n".join(lines)
