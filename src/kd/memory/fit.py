"""Search the memory knobs for settings that fit a budget, fastest first.

Knobs searched (all keep the training the same, only slower or with a different optimizer
implementation): activation checkpointing, a smaller micro-batch with gradient accumulation raised so
the global batch is unchanged, a smaller loss chunk, torchao AdamW8bit, and CPU offload where the
recipe accepts it (``optimizer_in_cpu`` on one CUDA device, ``fsdp.cpu_offload`` over several CUDA
ranks). A LoRA student and a quantized teacher change what is trained, so they are only suggested,
each with the fastest knob setting that makes it fit, never switched.

With on-policy distillation (``on_policy``) the generation phase is planned with every setting:
its KV cache and prefill scale with the micro-batch, so a smaller micro-batch is the knob that
shrinks it (``on_policy.max_new_tokens`` does not: prompt and completion always fill
``tokenizer.max_seq_len`` in the plan). When the teacher's sampling (``seq_kd``) is what does not
fit, sampling with the student alone is suggested (it changes the training).

Every option is planned again with its own knobs and shapes and kept only when it fits the budget
and the data: a micro-batch times accumulation never needs more examples per rank than the dataset
has (:mod:`kd.memory.data_size`), or, when its length is not known before it is built, than
:data:`UNKNOWN_DATA_EXAMPLES` (the options then say so).

Relative step times are rough, documented multipliers (``_TIME``), only used to order the options.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from kd import families
from kd.memory.estimate import EVAL_PHASE, GEN_PHASE, GIB, Estimate, estimate
from kd.memory.knobs import OptimizerSpec, TrainKnobs
from kd.memory.offload import PCIE_GB_PER_S
from kd.memory.shapes import (
    BUILDERS,
    INT8_BYTES_PER_PARAM,  # noqa: F401  (re-exported: kd.memory.fit.INT8_BYTES_PER_PARAM)
    NF4_BYTES_PER_PARAM,
    LoraSpec,
    ModelShape,
    int8_teacher_bytes_per_param,
)

# Multipliers on the step time (ordering heuristics, not measurements):
# recomputing every layer's forward costs ~1/3 of a forward+backward; each halving of the
# micro-batch loses some GPU efficiency; smaller loss chunks add kernel launches; 8-bit states
# add (de)quantization; CPU-offloaded states (or FSDP2 shards) move over PCIe every step, and so
# do offloaded activations and a parked or streamed teacher (whose options state the bytes and the
# seconds at kd.memory.offload.PCIE_GB_PER_S, an assumption).
_TIME = {
    "ac": 1.33,
    "halve_batch": 1.06,
    "halve_chunk": 1.01,
    "adamw8bit": 1.03,
    "cpu_offload": 1.6,
    "activation_offloading": 1.15,
    "teacher_park": 1.5,
    "teacher_stream": 1.55,
}

# The words of a host offload (:func:`_settings`) -> its term in HostTerms.moved.
_MOVED = {"activations in host": "offloaded_activations", "teacher in host": "parked_teacher"}

# Examples per rank one optimizer step may need when the dataset's length is unknown at plan time.
UNKNOWN_DATA_EXAMPLES = 4096

# Savings below this are not worth a suggestion (they print as 0.0 GiB).
MIN_SAVING_BYTES = GIB // 10


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

# The LoRA student the fit search suggests (torchtune's knob names; kd.hf.lora_causal_lm too).
SUGGESTED_LORA = LoraSpec(
    rank=16, alpha=32, attn_modules=("q_proj", "k_proj", "v_proj", "output_proj"), mlp=True
)
HF_LORA_COMPONENT = "kd.hf.lora_causal_lm"


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


def examples_bound(knobs: TrainKnobs, dataset_size: int | None) -> tuple[int, str | None]:
    """The most examples per rank one optimizer step may use, and a note when that bound comes from
    a guess rather than the data.

    Args:
        knobs: the current knobs (world size).
        dataset_size: examples in the dataset, or None when not known at plan time.
    """
    if dataset_size is not None:
        return max(1, dataset_size // max(1, knobs.world_size)), None
    note = None
    if knobs.batch_size * knobs.grad_accum > UNKNOWN_DATA_EXAMPLES:
        note = (
            "the dataset's length is not known before it is built: settings use at most "
            f"{UNKNOWN_DATA_EXAMPLES} examples per rank per optimizer step; check the dataset has "
            "that many"
        )
    return UNKNOWN_DATA_EXAMPLES, note


def _batches(knobs: TrainKnobs, bound: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs, largest micro-batch first: the same global batch when
    the data holds it, else the largest one it holds (``bound`` examples per rank)."""
    total = min(knobs.batch_size * knobs.grad_accum, bound)
    out = []
    b = min(knobs.batch_size, total)
    while b >= 1:
        if total % b == 0 or total < knobs.batch_size * knobs.grad_accum:
            out.append((b, total // b))
        b = b // 2 if b > 1 else 0
    if (1, total) not in out:
        out.append((1, total))
    return out


def _chunks(knobs: TrainKnobs) -> list[int]:
    if not knobs.fused_loss and knobs.stored_topk is None:  # stored top-k: always chunked
        return [knobs.loss_chunk_size]
    out = [knobs.loss_chunk_size]
    c = knobs.loss_chunk_size
    while c > 128:
        c //= 2
        out.append(c)
    return out


def _offload(knobs: TrainKnobs, device: str) -> str | None:
    """The CPU offload the recipe accepts here: ``optimizer_in_cpu`` on one CUDA device,
    ``fsdp.cpu_offload`` over several CUDA ranks; none on the CPU (nothing to move)."""
    if not device.startswith("cuda"):
        return None
    if knobs.world_size > 1:
        return None if knobs.fsdp_cpu_offload else "fsdp_offload"
    return None if knobs.optimizer.in_cpu else "cpu_offload"


def _optimizers(knobs: TrainKnobs, device: str) -> list[str]:
    opts = ["same"]
    if knobs.optimizer.kind == "adamw" and not knobs.optimizer.in_cpu:
        opts.append("adamw8bit")
    offload = _offload(knobs, device)
    if offload is not None:
        opts.append(offload)
    return opts


def _host_offloads(knobs: TrainKnobs, device: str, has_teacher: bool) -> list[tuple[bool, str]]:
    """(activation offloading, teacher offload) pairs the recipe accepts here, the current first:
    on one CUDA device, the student's activations to host memory, and a teacher parked or
    streamed where the config's checks let it (:attr:`TrainKnobs.teacher_parkable`)."""
    out = [(knobs.activation_offloading, knobs.teacher_offload)]
    if not device.startswith("cuda") or knobs.world_size > 1:
        return out
    acts = [knobs.activation_offloading] + ([True] if not knobs.activation_offloading else [])
    teachers = [knobs.teacher_offload]
    parkable = knobs.teacher_offload == "none" and knobs.teacher_bytes_per_param is None
    if has_teacher and parkable and knobs.teacher_parkable:  # the config's checks take it
        teachers += ["park", "stream"]
    return [out[0], *(p for p in itertools.product(acts, teachers) if p != out[0])]


def _log2_ratio(a: int, b: int) -> int:
    n = 0
    while a > b:
        a //= 2
        n += 1
    return n


def _settings(
    knobs: TrainKnobs,
    *,
    device: str,
    bound: int,
    optimizer_keys: tuple[str, ...],
    data_known: bool = False,
    teacher: ModelShape | None = None,
) -> Iterator[tuple[TrainKnobs, list[str], list[str], float]]:
    """Every searched knob setting: (knobs, overrides, words, relative time), the current one
    first when the data holds it; ``bound`` examples per rank at most (:func:`examples_bound`)."""
    for k, over, words, t in _knob_settings(
        knobs, device=device, bound=bound, optimizer_keys=optimizer_keys, data_known=data_known
    ):
        for acts, parked in _host_offloads(knobs, device, teacher is not None):
            kk, o, w, tt = (
                replace(k, activation_offloading=acts, teacher_offload=parked),
                over,
                words,
                t,
            )
            if acts != knobs.activation_offloading:
                o, w = [*o, "enable_activation_offloading=true"], [*w, "activations in host memory"]
                tt *= _TIME["activation_offloading"]
            if parked != knobs.teacher_offload:
                how = (
                    "all of it" if parked == "park" else "one layer at a time, the next prefetched"
                )
                o = [*o, f"teacher_offload={parked}"]
                w = [*w, f"teacher in host memory, on the device for its forwards ({how})"]
                tt *= _TIME[f"teacher_{parked}"]
            yield kk, o, w, tt


def _knob_settings(
    knobs: TrainKnobs,
    *,
    device: str,
    bound: int,
    optimizer_keys: tuple[str, ...],
    data_known: bool = False,
) -> Iterator[tuple[TrainKnobs, list[str], list[str], float]]:
    """:func:`_settings` without the host offloads."""
    total = knobs.batch_size * knobs.grad_accum
    why = "the dataset's size" if data_known else "the bound for data of unknown size"
    ac_values = [knobs.activation_checkpointing] + (
        [True] if not knobs.activation_checkpointing else []
    )
    for ac, (b, ga), chunk, opt in itertools.product(
        ac_values, _batches(knobs, bound), _chunks(knobs), _optimizers(knobs, device)
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
        if (b, ga) != (knobs.batch_size, knobs.grad_accum):
            over += [f"batch_size={b}", f"gradient_accumulation_steps={ga}"]
            words.append(f"micro-batch {b} x accumulation {ga}")
            if b * ga < total:
                words.append(f"global batch lowered to {b * ga} examples per rank ({why})")
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
        elif opt == "fsdp_offload":
            k = replace(k, fsdp_cpu_offload=True)
            over.append("fsdp.cpu_offload=true")
            words.append("sharded weights, gradients and optimizer states on the CPU")
            t *= _TIME["cpu_offload"]
        yield k, over, words, t


def _smaller_eval_batch(
    student: ModelShape,
    teacher: ModelShape | None,
    knobs: TrainKnobs,
    est: Estimate,
    over: list[str],
    words: list[str],
    *,
    budget_bytes: int,
) -> tuple[TrainKnobs, Estimate, list[str], list[str]]:
    """The largest validation batch (halving) whose evaluation fits, with its override; the
    setting unchanged when none does (the evaluation does not change the training step)."""
    e = knobs.eval_batch or 1
    while e > 1:
        e //= 2
        k = replace(knobs, eval_batch=e)
        smaller = estimate(student, teacher, k)
        if smaller.fits(budget_bytes):
            return (
                k,
                smaller,
                [*over, f"validation.batch_size={e}"],
                [*words, f"validation batch {e}"],
            )
    return knobs, est, over, words


def _fitting(
    student: ModelShape,
    teacher: ModelShape | None,
    knobs: TrainKnobs,
    *,
    budget_bytes: int,
    device: str,
    bound: int,
    optimizer_keys: tuple[str, ...],
    data_known: bool = False,
) -> list[FitOption]:
    """Every searched setting (the current one included, with no overrides) that fits, fastest
    first (ties: lower peak first)."""
    found: list[FitOption] = []
    for k, over, words, t in _settings(
        knobs,
        device=device,
        bound=bound,
        optimizer_keys=optimizer_keys,
        data_known=data_known,
        teacher=teacher,
    ):
        if k.batch_size * k.grad_accum > bound:
            continue
        est = estimate(student, teacher, k)
        if est.peak_bytes > budget_bytes and est.peak_phase == EVAL_PHASE:
            k, est, over, words = _smaller_eval_batch(
                student, teacher, k, est, over, words, budget_bytes=budget_bytes
            )
        if est.fits(budget_bytes):
            found.append(FitOption(over, est.peak_bytes, t, ", ".join(_moved_words(words, est))))
    found.sort(key=lambda o: (round(o.relative_time, 4), o.peak_bytes))
    return found


def _moved_words(words: list[str], est: Estimate) -> list[str]:
    """``words`` with the host transfers of offloaded activations and of a parked teacher (every
    local member of ``teachers:``, twice when it samples) stated, bytes and seconds per step, from
    the option's own estimate (:attr:`Estimate.host`)."""
    out = []
    for w in words:
        key = next((c for head, c in _MOVED.items() if w.startswith(head)), "")
        moved = est.host.moved.get(key, 0)
        if moved:
            side = " (a side stream: overlapped with compute)" * (key == "offloaded_activations")
            w += (
                f": {moved / GIB:.1f} GiB moved per step, ~{moved / (PCIE_GB_PER_S * 1e9):.1f} s "
                f"at an assumed {PCIE_GB_PER_S:g} GB/s{side}"
            )
        out.append(w)
    return out


def fit_options(
    student: ModelShape,
    teacher: ModelShape | None,
    knobs: TrainKnobs,
    *,
    budget_bytes: int,
    device: str = "cuda",
    dataset_size: int | None = None,
    student_component: str = "",
    optimizer_keys: tuple[str, ...] = (),
    limit: int = 5,
    quantized_teacher: bool = True,
) -> list[FitOption]:
    """Knob settings whose planned peak fits ``budget_bytes`` and the data, fastest first, then
    suggestions that fit.

    Args:
        student: student shape.
        teacher: teacher shape or None.
        knobs: the current knobs (the search starts from them).
        budget_bytes: per-device budget.
        device: the run's ``device`` (``cuda`` or ``cpu``): which offload the recipe accepts.
        dataset_size: examples in the dataset (:func:`kd.memory.data_size.dataset_examples`), or
            None when not known at plan time.
        student_component: the student's builder path (for the LoRA suggestion).
        optimizer_keys: keys of the config's optimizer node (those AdamW8bit does not take are
            deleted with ``~optimizer.key``).
        limit: at most this many knob options (suggestions come on top).
        quantized_teacher: also suggest a quantized teacher (``kd plan --fit`` asks only with
            ``--consider-teacher-quantization``).

    Returns:
        Options that fit, fastest first (ties: lower peak first), followed by suggestions.
    """
    bound, _ = examples_bound(knobs, dataset_size)
    common: dict[str, Any] = {
        "budget_bytes": budget_bytes,
        "device": device,
        "bound": bound,
        "optimizer_keys": optimizer_keys,
        "data_known": dataset_size is not None,
    }
    kept: list[FitOption] = []
    for opt in _fitting(student, teacher, knobs, **common):
        if not opt.overrides:
            continue  # the current setting (over budget by assumption, or no search needed)
        # Drop options that only add changes to a faster option that already fits.
        if any(set(prev.overrides) <= set(opt.overrides) for prev in kept):
            continue
        kept.append(opt)
        if len(kept) >= limit:
            break
    return kept + suggestions(
        student,
        teacher,
        knobs,
        student_component=student_component,
        quantized_teacher=quantized_teacher,
        **common,
    )


def lora_overrides(student: ModelShape, student_component: str) -> tuple[ModelShape, list[str]]:
    """The suggested LoRA student's shape and the overrides that build it, or the student itself
    and no overrides when there is no LoRA builder for it.

    The shape is the one the planner reads from those overrides (torchtune's ``lora_*`` builders
    of some families build one RoPE cache per layer).
    """
    keys = [
        "model.lora_attn_modules=[q_proj,k_proj,v_proj,output_proj]",
        "model.apply_lora_to_mlp=true",
        f"model.lora_rank={SUGGESTED_LORA.rank}",
        f"model.lora_alpha={SUGGESTED_LORA.alpha:g}",
    ]
    if student.hf:
        return replace(student, lora=SUGGESTED_LORA), [
            f"model._component_={HF_LORA_COMPONENT}",
            *keys,
        ]
    family = families.family_of_builder(student.name)
    known = student.name in BUILDERS or (family is not None and family.name == student.name)
    if family is None or not known:
        return student, []
    module = (
        student_component.rsplit(".", 1)[0]
        if "." in student_component
        else f"torchtune.models.{family.name}"
    )
    shape = replace(student, lora=SUGGESTED_LORA, rope_per_layer=family.lora_rope_per_layer)
    return shape, [f"model._component_={module}.lora_{student.name}", *keys]


def suggestions(
    student: ModelShape,
    teacher: ModelShape | None,
    knobs: TrainKnobs,
    *,
    budget_bytes: int,
    device: str = "cuda",
    bound: int = UNKNOWN_DATA_EXAMPLES,
    optimizer_keys: tuple[str, ...] = (),
    data_known: bool = False,
    student_component: str = "",
    quantized_teacher: bool = True,
) -> list[FitOption]:
    """A LoRA student, a quantized teacher (when ``quantized_teacher``) and (on-policy, when the
    teacher's sampling is the peak) a student that samples alone, each with the fastest knob
    setting that makes it fit (they change the training); only those that fit and save memory
    are returned. The int8 teacher is ``teacher_quantization=int8`` (its decoder-layer linears,
    counted as the planner counts that key); NF4 has no config key."""
    common: dict[str, Any] = {
        "budget_bytes": budget_bytes,
        "device": device,
        "bound": bound,
        "optimizer_keys": optimizer_keys,
        "data_known": data_known,
    }
    out: list[FitOption] = []
    if student.lora is None:
        lora, keys = lora_overrides(student, student_component)
        # A self teacher of a LoRA student is its base with adapters off: no copy.
        lora_knobs = replace(knobs, teacher_bytes_per_param=0.0, self_teacher_copy=False)
        found = (
            _fitting(lora, teacher, lora_knobs if knobs.self_teacher_copy else knobs, **common)
            if keys
            else []
        )
        if found:
            best = found[0]
            out.append(
                FitOption(
                    keys + best.overrides,
                    best.peak_bytes,
                    best.relative_time * 0.8,
                    "suggestion: a LoRA student (trains adapters only; changes the result"
                    + ("; no frozen copy for the self teacher" if knobs.self_teacher_copy else "")
                    + ")"
                    + (f", with {best.description}" if best.description else ""),
                    suggestion=True,
                )
            )
    alone = _student_samples_alone(student, teacher, knobs, **common)
    if alone is not None:
        out.append(alone)
    if teacher is not None and quantized_teacher and knobs.teacher_bytes_per_param is None:
        int8 = int8_teacher_bytes_per_param(teacher, knobs.dtype_bytes)
        for name, per_param in (("int8 weight-only", int8), ("NF4", NF4_BYTES_PER_PARAM)):
            key = (
                "teacher_quantization=int8; " if per_param == int8 else "not a kd config key yet; "
            )
            # kd parks no quantized teacher (kd.config.teacher_kinds.model.check_teacher_offload)
            best = _quantized_teacher_setting(student, teacher, knobs, per_param, **common)
            if best is None:
                continue
            option, saving = best
            with_knobs = f" with {option.description}" if option.description else ""
            out.append(
                FitOption(
                    option.overrides,
                    option.peak_bytes,
                    option.relative_time * 1.1,
                    f"suggestion: an {name} teacher ({key}changes the "
                    f"teacher's outputs) would save {saving / GIB:.1f} GiB per device and fit at "
                    f"{option.peak_bytes / GIB:.1f} GiB{with_knobs}",
                    suggestion=True,
                    extra={"teacher_quantization": name},
                )
            )
    stored = _stored_members_setting(student, teacher, knobs, **common)
    if stored is not None:
        out.append(stored)
    return out


def _stored_members_setting(
    student: ModelShape, teacher: ModelShape | None, knobs: TrainKnobs, **common: Any
) -> FitOption | None:
    """``teachers:`` with several local members: the fastest knob setting that fits only once the
    members beside the planned (largest) one train from stored logits instead of their weights
    (``kd run teacher_logits`` per member, then ``teacher_logits:`` in its entry); else None."""
    if knobs.other_teacher_params <= 0:
        return None
    found = []
    for k, over, words, t in _settings(
        knobs,
        device=common["device"],
        bound=common["bound"],
        optimizer_keys=common["optimizer_keys"],
        data_known=common["data_known"],
    ):
        if k.batch_size * k.grad_accum > common["bound"]:
            continue
        plain = estimate(student, teacher, k).peak_bytes
        moved = estimate(student, teacher, replace(k, other_teacher_params=0)).peak_bytes
        if moved <= common["budget_bytes"] < plain:
            found.append(FitOption(over, moved, t, ", ".join(words)))
    if not found:
        return None
    best = min(found, key=lambda f: (round(f.relative_time, 4), f.peak_bytes))
    return FitOption(
        best.overrides,
        best.peak_bytes,
        best.relative_time,
        "suggestion: the smaller local teachers of teachers.members from stored logits (kd run "
        "teacher_logits for each, then teacher_logits: {path} in its entry in place of its "
        f"model) fits at {best.peak_bytes / GIB:.1f} GiB"
        + (f" with {best.description}" if best.description else ""),
        suggestion=True,
        extra={"stored_members": True},
    )


def _student_samples_alone(
    student: ModelShape,
    teacher: ModelShape | None,
    knobs: TrainKnobs,
    **common: Any,
) -> FitOption | None:
    """``on_policy.seq_kd=false`` with the fastest knob setting that fits, when the teacher's
    sampling is the plan's peak (dropping it lowers the peak); else None."""
    g = knobs.generation
    if g is None or "teacher" not in g.models:
        return None
    plain = estimate(student, teacher, knobs)
    if plain.peak_phase != GEN_PHASE:
        return None
    models = tuple(m for m in g.models if m != "teacher")
    alone = replace(knobs, generation=replace(g, models=models) if models else None)
    if estimate(student, teacher, alone).peak_bytes >= plain.peak_bytes:
        return None
    found = _fitting(student, teacher, alone, **common)
    if not found:
        return None
    best = found[0]
    return FitOption(
        ["on_policy.seq_kd=false", *best.overrides],
        best.peak_bytes,
        best.relative_time,
        "suggestion: only the student samples (the other micro-batches train on the dataset's "
        "completions instead of the teacher's; changes the training)"
        + (f", with {best.description}" if best.description else ""),
        suggestion=True,
    )


def _quantized_teacher_setting(
    student: ModelShape,
    teacher: ModelShape,
    knobs: TrainKnobs,
    per_param: float,
    *,
    budget_bytes: int,
    device: str,
    bound: int,
    optimizer_keys: tuple[str, ...],
    data_known: bool = False,
) -> tuple[FitOption, int] | None:
    """The fastest knob setting that fits only because the teacher is quantized to
    ``per_param`` bytes per parameter, and what the quantization saves there; None when there is
    none (or it saves less than :data:`MIN_SAVING_BYTES`). kd parks no quantized teacher: a
    config that parks it is told ``teacher_offload=none``."""
    found: list[tuple[FitOption, int]] = []
    unpark = ["teacher_offload=none"] if knobs.teacher_offload != "none" else []
    for k, over, words, t in _settings(
        replace(knobs, teacher_offload="none", teacher_parkable=False),
        device=device,
        bound=bound,
        optimizer_keys=optimizer_keys,
        data_known=data_known,
        teacher=teacher,
    ):
        if k.batch_size * k.grad_accum > bound:
            continue
        plain = estimate(student, teacher, k).peak_bytes
        quantized = estimate(student, teacher, replace(k, teacher_bytes_per_param=per_param))
        saving = plain - quantized.peak_bytes
        if quantized.peak_bytes <= budget_bytes < plain and saving >= MIN_SAVING_BYTES:
            said = ", ".join(_moved_words(words, quantized))
            found.append((FitOption([*unpark, *over], quantized.peak_bytes, t, said), saving))
    if not found:
        return None
    return min(found, key=lambda f: (round(f[0].relative_time, 4), f[0].peak_bytes))


def format_options(options: list[FitOption], *, note: str | None = None) -> str:
    """Options as lines: ready overrides first (fastest first), then suggestions.

    Args:
        options: :func:`fit_options`' result.
        note: a line on the bound the data put on the options (:func:`examples_bound`).
    """
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
        if not o.suggestion:
            continue
        if o.extra.get("teacher_quantization"):
            lines.append(o.description)
            if o.overrides:
                lines.append(f"  {' '.join(o.overrides)}")
        else:
            lines.append(f"{o.description}:")
            lines.append(f"  {' '.join(o.overrides)}    # {o.peak_bytes / GIB:.2f} GiB")
    if note:
        lines.append(f"note: {note}")
    return "\n".join(lines)
