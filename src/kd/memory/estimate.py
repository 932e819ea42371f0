"""Closed-form peak memory of one KD training step: pure arithmetic on shapes and knobs.

What one optimizer step of ``kd.training.train`` allocates on one device, phase by phase
(:func:`estimate` composes them; each term lives in the module of its job):

* the **resident** terms (:mod:`kd.memory.resident`): weights, adapters, buffers, gradients,
  optimizer states, FSDP2 shares and the units in flight;
* **forward**, **backward** and **optimizer step** (:mod:`kd.memory.training_step`), from the
  student's saved activations and no-grad transients (:mod:`kd.memory.activations`) and the loss
  head (:mod:`kd.memory.loss_head`: the fused head's chunks, the full-logits path, the stored
  top-k batch);
* **evaluation** (only with ``validation``; :mod:`kd.memory.evaluation`): one validation batch
  between steps;
* **generation** (only with ``on_policy``; :mod:`kd.memory.generation`): the rollout at the start
  of a step.

Every byte term is derived from the tensors torchtune's modules and ``kd.losses`` save or
allocate (transformers' layers, for ``kd.hf`` models: :mod:`kd.memory.hf_terms`) (see
``docs/memory_accuracy.md`` for the derivation and the check against MemTracker traces). Bytes
are per device; FSDP2 terms divide the sharded pieces by the world size. The runtime reserve is
added to every phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kd.memory.activations import student_activations
from kd.memory.evaluation import evaluation_phase
from kd.memory.generation import generation_phase
from kd.memory.hidden import hidden_terms
from kd.memory.knobs import TrainKnobs
from kd.memory.loss_head import loss_head
from kd.memory.resident import resident_bytes
from kd.memory.shapes import ModelShape
from kd.memory.training_step import (
    Components,
    backward_phase,
    forward_phase,
    optimizer_phase,
    resident_components,
)

GIB = 1 << 30

# Runtime reserve the tracer cannot see, per device: CUDA context + cuBLAS/cuDNN workspaces
# (~0.5-0.7 GiB on H100 with CUDA 12 lazy loading) and caching-allocator rounding/fragmentation
# (2 MiB rounding of large blocks, partly used segments). Documented in docs/memory_accuracy.md;
# override with ``memory.reserve_gib``.
RESERVE_FIXED_BYTES = 1 * GIB
RESERVE_FRACTION = 0.03  # of the allocated peak: allocator rounding and fragmentation
RESERVE_NCCL_BYTES = GIB // 2  # extra per rank when distributed (NCCL channel buffers)


# The phases of every training step; on-policy sampling precedes them (``on_policy``), the
# evaluation phase follows them when validation is on.
PHASES = ("forward", "backward", "optimizer_step")
GEN_PHASE = "generation"
EVAL_PHASE = "evaluation"

# Component names, in table order.
COMPONENTS = (
    "teacher_weights",
    "student_weights",
    "lora_adapters",
    "buffers",
    "gradients",
    "optimizer_states",
    "optimizer_temp",
    "activations",
    "teacher_forward",
    "stored_logits",
    "logits_loss",
    "backward_temp",
    "kv_cache",
    "sampling",
    "hidden_states",
    "fsdp_in_flight",
    "runtime_reserve",
)


@dataclass
class Estimate:
    """Per-phase component bytes and the peak.

    Attributes:
        phases: phase -> component -> bytes (each phase sums to its total).
        peak_phase: the phase with the largest total.
        student_params: exact student parameter count (base + adapters).
        trainable_params: student parameters that train.
        teacher_params: exact teacher parameter count (0 without a teacher).
        notes: one-line remarks (assumptions the user should know).
        subphases: allocated bytes (no reserve) at the peaks of the forward's sub-phases
            (``student_forward``, ``teacher_forward``, ``loss_forward``) and of the other
            phases, as a trace reports them.
    """

    phases: dict[str, dict[str, int]]
    peak_phase: str
    student_params: int
    trainable_params: int
    teacher_params: int
    notes: list[str] = field(default_factory=list)
    subphases: dict[str, int] = field(default_factory=dict)

    @property
    def phase_names(self) -> tuple[str, ...]:
        """The phases estimated, in order: ``generation`` with ``on_policy``, :data:`PHASES`, then
        ``evaluation`` with validation."""
        return tuple(p for p in (GEN_PHASE, *PHASES, EVAL_PHASE) if p in self.phases)

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_bytes(self) -> int:
        return self.total(self.peak_phase)

    @property
    def allocated_peak_bytes(self) -> int:
        """Peak without the runtime reserve (what a MemTracker trace measures)."""
        return self.peak_bytes - self.phases[self.peak_phase].get("runtime_reserve", 0)

    def allocated(self, phase: str) -> int:
        return self.total(phase) - self.phases[phase].get("runtime_reserve", 0)


def runtime_reserve(allocated: int, k: TrainKnobs) -> int:
    """The runtime reserve added to every phase: ``memory.reserve_gib`` when set, else the fixed
    part, a fraction of the allocated peak and, distributed, NCCL's buffers."""
    if k.reserve_bytes is not None:
        return int(k.reserve_bytes)
    reserve = RESERVE_FIXED_BYTES + int(RESERVE_FRACTION * allocated)
    if k.num_ranks > 1:
        reserve += RESERVE_NCCL_BYTES
    return reserve


def _with_reserve(
    phases: dict[str, Components], subphases: dict[str, int], k: TrainKnobs
) -> tuple[dict[str, Components], str]:
    """Every component in every phase (0 when absent), the runtime reserve added, the allocated
    peaks of the phases after forward recorded in ``subphases``; and the peak phase."""
    for ph in phases.values():
        for c in COMPONENTS:
            ph.setdefault(c, 0)
    peak_phase = max(phases, key=lambda p: sum(phases[p].values()))
    reserve = runtime_reserve(sum(phases[peak_phase].values()), k)
    for name in ("backward", "optimizer_step", EVAL_PHASE, GEN_PHASE):
        if name in phases:
            subphases[name] = sum(phases[name].values())
    for ph in phases.values():
        ph["runtime_reserve"] = reserve
    return {p: {c: int(phases[p][c]) for c in COMPONENTS} for p in phases}, peak_phase


def estimate(student: ModelShape, teacher: ModelShape | None, knobs: TrainKnobs) -> Estimate:
    """Per-phase bytes of one training step on one device.

    Args:
        student: the trainable decoder (LoRA when ``student.lora`` is set).
        teacher: the frozen decoder, or None.
        knobs: batch, sequence, precision, checkpointing, optimizer, loss and sharding knobs.

    Returns:
        The estimate; ``peak_bytes`` includes the runtime reserve.

    Raises:
        ValueError: stored teacher logits with a teacher, or generation by a missing model.
    """
    k = knobs
    res = resident_bytes(student, teacher, k)
    head = loss_head(student, teacher, k, output_grad=res.output_grad)
    acts = student_activations(student, k)
    hidden = hidden_terms(student, teacher, k)
    resident = resident_components(res, k, hidden)
    forward, subphases = forward_phase(
        student, teacher, k, resident, acts, head, res.in_flight_forward, hidden
    )
    phases = {
        "forward": forward,
        "backward": backward_phase(student, k, resident, res, acts, head, hidden),
        "optimizer_step": optimizer_phase(resident, res, hidden),
    }
    if k.eval_batch is not None:
        phases[EVAL_PHASE] = evaluation_phase(
            student,
            teacher,
            k,
            resident,
            model_buffers=res.model_buffers,
            in_flight=res.in_flight_forward,
        )
    if k.generation is not None:
        phases[GEN_PHASE] = generation_phase(
            student, teacher, k, resident, model_buffers=res.model_buffers
        )
    notes = []
    if k.num_ranks > 1:
        ws = k.num_ranks
        notes.append(f"FSDP2 over {ws} ranks: per-rank numbers; weights, grads and states / {ws}")
    phases, peak_phase = _with_reserve(phases, subphases, k)
    return Estimate(
        phases=phases,
        peak_phase=peak_phase,
        student_params=student.total_params(),
        trainable_params=res.trainable_params,
        teacher_params=res.teacher_params,
        notes=[*notes, *head.notes],
        subphases=subphases,
    )
