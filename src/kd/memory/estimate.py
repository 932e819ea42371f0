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
  of a step;
* **final_eval** (only with ``eval:``; :mod:`kd.memory.eval_phase`): ``final/`` scored by lm-eval
  after training, the training state freed.

Every byte term is derived from the tensors torchtune's modules and ``kd.losses`` save or
allocate (transformers' layers, for ``kd.hf`` models: :mod:`kd.memory.hf_terms`) (see
``docs/memory_accuracy.md`` for the derivation and the check against MemTracker traces). Bytes
are per device; FSDP2 terms divide the sharded pieces by the world size. The runtime terms
(:mod:`kd.memory.runtime`: the allocator's slack, the CUDA context, NCCL) are added to every
phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kd.memory.activations import student_activations
from kd.memory.eval_phase import final_eval_phase
from kd.memory.evaluation import evaluation_phase
from kd.memory.generation import generation_phase
from kd.memory.hidden import hidden_terms
from kd.memory.knobs import TrainKnobs
from kd.memory.loss_head import loss_head
from kd.memory.offload import (
    OFFLOAD_STASH,
    PCIE_GB_PER_S,
    HostTerms,
    host_terms,
    parked_teacher_bytes,
    teacher_forward_in_bytes,
)
from kd.memory.resident import resident_bytes
from kd.memory.runtime import RuntimeTerms, runtime_terms
from kd.memory.shapes import ModelShape
from kd.memory.teacher_device import teacher_device_components
from kd.memory.training_step import (
    Components,
    backward_phase,
    forward_phase,
    optimizer_phase,
    resident_components,
)

GIB = 1 << 30

# The phases of every training step; on-policy sampling precedes them (``on_policy``), the
# evaluation phase follows them when validation is on.
PHASES = ("forward", "backward", "optimizer_step")
GEN_PHASE = "generation"
EVAL_PHASE = "evaluation"
# ``eval:``: final/ scored by lm-eval after training (kd.memory.eval_phase).
FINAL_EVAL_PHASE = "final_eval"

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
    "allocator_slack",
    "cuda_runtime",
)
# What a trace does not see (kd.memory.runtime): inside the allocator, then outside it.
RUNTIME_COMPONENTS = ("allocator_slack", "cuda_runtime")


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
        host: host memory and PCIe traffic (activation offloading, a parked teacher).
        subphases: allocated bytes (no reserve) at the peaks of the forward's sub-phases
            (``student_forward``, ``teacher_forward``, ``loss_forward``) and of the other
            phases, as a trace reports them.
        teacher_device: component -> bytes on the teacher's own device at its peak
            (``teacher_device``, :mod:`kd.memory.teacher_device`); empty: one device.
    """

    phases: dict[str, dict[str, int]]
    peak_phase: str
    student_params: int
    trainable_params: int
    teacher_params: int
    notes: list[str] = field(default_factory=list)
    subphases: dict[str, int] = field(default_factory=dict)
    runtime: RuntimeTerms = field(default_factory=RuntimeTerms)
    host: HostTerms = field(default_factory=HostTerms)
    teacher_device: dict[str, int] = field(default_factory=dict)

    @property
    def teacher_device_peak(self) -> int:
        """The teacher's own device's peak (0 on one device); the budget is per device."""
        return sum(self.teacher_device.values())

    @property
    def phase_names(self) -> tuple[str, ...]:
        """The phases estimated, in order: ``generation`` with ``on_policy``, :data:`PHASES`, then
        ``evaluation`` with validation, ``final_eval`` with ``eval:``."""
        return tuple(
            p for p in (GEN_PHASE, *PHASES, EVAL_PHASE, FINAL_EVAL_PHASE) if p in self.phases
        )

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_bytes(self) -> int:
        return self.total(self.peak_phase)

    @property
    def allocated_peak_bytes(self) -> int:
        """Peak without the runtime terms (what a MemTracker trace measures, and
        ``torch.cuda.max_memory_allocated``)."""
        return self.allocated(self.peak_phase)

    @property
    def reserved_peak_bytes(self) -> int:
        """The allocated peak plus the allocator's slack (``torch.cuda.max_memory_reserved``)."""
        return self.allocated_peak_bytes + self.phases[self.peak_phase].get("allocator_slack", 0)

    def allocated(self, phase: str) -> int:
        return self.total(phase) - sum(self.phases[phase].get(c, 0) for c in RUNTIME_COMPONENTS)

    def fits(self, budget_bytes: float) -> bool:
        """Whether every device's peak (the student's; the teacher's own, with
        ``teacher_device``) is within the per-device ``budget_bytes``."""
        return max(self.peak_bytes, self.teacher_device_peak) <= budget_bytes


def runtime_reserve(allocated: int, k: TrainKnobs) -> int:
    """Every runtime term added to each phase (bytes): :func:`kd.memory.runtime.runtime_terms`."""
    terms = runtime_of(allocated, k)
    return terms.allocator_slack + terms.cuda_runtime


def runtime_of(allocated: int, k: TrainKnobs, parked_teacher: int = 0) -> RuntimeTerms:
    """The named runtime terms of a run whose tensors peak at ``allocated`` bytes
    (``parked_teacher``: the teacher's bytes moved in per forward when parked or streamed)."""
    return runtime_terms(
        allocated,
        device_type=k.device_type,
        activation_checkpointing=k.activation_checkpointing,
        num_ranks=k.num_ranks,
        override=k.reserve_bytes,
        activation_offloading=k.activation_offloading,
        teacher_offload=k.teacher_offload,
        parked_teacher=parked_teacher,
    )


def _with_reserve(
    phases: dict[str, Components],
    subphases: dict[str, int],
    k: TrainKnobs,
    teacher: ModelShape | None = None,
) -> tuple[dict[str, Components], str, RuntimeTerms]:
    """Every component in every phase (0 when absent), the runtime reserve added (with what the
    allocator keeps of ``teacher`` parked or streamed), the allocated peaks of the phases after
    forward recorded in ``subphases``; and the peak phase."""
    for ph in phases.values():
        for c in COMPONENTS:
            ph.setdefault(c, 0)
    peak_phase = max(phases, key=lambda p: sum(phases[p].values()))
    terms = runtime_of(sum(phases[peak_phase].values()), k, parked_teacher_bytes(teacher, k))
    for name in ("backward", "optimizer_step", EVAL_PHASE, GEN_PHASE, FINAL_EVAL_PHASE):
        if name in phases:
            subphases[name] = sum(phases[name].values())
    for ph in phases.values():
        ph["allocator_slack"] = terms.allocator_slack
        ph["cuda_runtime"] = terms.cuda_runtime
    out = {p: {c: int(phases[p][c]) for c in COMPONENTS} for p in phases}
    return out, peak_phase, terms


def _host_notes(host: HostTerms, k: TrainKnobs) -> list[str]:
    """The plan's lines on host memory: its size and transfers; on ``device: cpu`` that it is
    the device's own RAM, so offloading saves none there."""
    notes = []
    if host.moved:
        notes.append(
            f"host memory {host.host_bytes / GIB:.2f} GiB (pinned); "
            f"{host.moved_bytes / GIB:.2f} GiB moved per optimizer step, "
            f"~{host.seconds_per_step:.2f} s at an assumed {PCIE_GB_PER_S:g} GB/s PCIe "
            "(measure your link)"
        )
    if host.host and k.device_type == "cpu":
        notes.append(
            "device: cpu: the host memory above is this machine's RAM, the device's own: "
            "offloading saves none there (set teacher_offload=none, "
            "enable_activation_offloading=false)"
        )
    return notes


def estimate(student: ModelShape, teacher: ModelShape | None, knobs: TrainKnobs) -> Estimate:
    """Per-phase bytes of one training step on one device.

    Args:
        student: the trainable decoder (LoRA when ``student.lora`` is set).
        teacher: the frozen decoder, or None.
        knobs: batch, sequence, precision, checkpointing, optimizer, loss and sharding knobs.
            Without a KD term (``knobs.teacher_logits`` false: ``kd_ratio: 0``) the teacher (the
            ``scorer`` below) runs no forward on a training or validation batch, but for
            hidden-state pairs; its weights stay, and its sampling when it samples.

    Returns:
        The estimate; ``peak_bytes`` includes the runtime reserve.

    Raises:
        ValueError: stored teacher logits with a teacher, or generation by a missing model.
    """
    k, scorer = knobs, teacher if knobs.teacher_logits or knobs.hidden_map else None
    res = resident_bytes(student, teacher, k)
    head = loss_head(student, teacher, k, output_grad=res.output_grad)
    acts = student_activations(student, k)
    hidden = hidden_terms(student, teacher, k)
    resident = resident_components(res, k, hidden)
    forward, subphases = forward_phase(
        student, scorer, k, resident, acts, head, res.in_flight_forward, hidden
    )
    phases = {
        "forward": forward,
        "backward": backward_phase(student, k, resident, res, acts, head, hidden),
        "optimizer_step": optimizer_phase(resident, res, hidden),
    }
    # The evaluation runs the teacher's forward, its sampling holds every parked weight in.
    in_eval, sampling = dict(resident), dict(resident)
    in_eval["teacher_weights"] += teacher_forward_in_bytes(scorer, k)
    sampling["teacher_weights"] += parked_teacher_bytes(teacher, k)
    if k.eval_batch is not None:
        phases[EVAL_PHASE] = evaluation_phase(
            student,
            scorer,
            k,
            in_eval,
            model_buffers=res.model_buffers,
            in_flight=res.in_flight_forward,
        )
    if k.generation is not None:
        sampler = sampling if "teacher" in k.generation.models else resident
        phases[GEN_PHASE] = generation_phase(
            student, teacher, k, sampler, model_buffers=res.model_buffers
        )
    phases |= {FINAL_EVAL_PHASE: final_eval_phase(student, k)} if k.final_eval else {}
    notes = []
    if k.num_ranks > 1:
        ws = k.num_ranks
        notes.append(f"FSDP2 over {ws} ranks: per-rank numbers; weights, grads and states / {ws}")
    if k.teacher_offload != "none" and teacher is not None:
        which = (
            "all of them"
            if k.teacher_offload == "park"
            else "one decoder layer, the next prefetched"
        )
        notes.append(
            f"teacher_offload={k.teacher_offload}: the teacher's weights but its output projection "
            f"wait in host memory; on the device during its forwards: {which} (its sampling: all)"
        )
    if k.activation_offloading:
        notes.append(
            "enable_activation_offloading: the student's saved activations wait in host memory "
            f"(torchtune's stash of {OFFLOAD_STASH} tensors and the layer in backward stay)"
        )
    host = host_terms(student, teacher, acts, k)
    notes += _host_notes(host, k)
    phases, peak_phase, terms = _with_reserve(phases, subphases, k, teacher)
    own = teacher_device_components(teacher, k) if k.teacher_own_device and teacher else {}
    if own:
        notes.append(
            "teacher_device: the teacher's weights and forward on its own device, planned beside; "
            "here its output projection's copy and the hidden states it sends each micro-batch"
        )
    return Estimate(
        phases=phases,
        peak_phase=peak_phase,
        student_params=student.total_params(),
        trainable_params=res.trainable_params,
        teacher_params=res.teacher_params,
        notes=[*notes, *head.notes],
        subphases=subphases,
        runtime=terms,
        host=host,
        teacher_device=own,
    )
