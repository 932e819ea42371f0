"""Host-memory terms of the plan: what activation offloading and a parked teacher keep in host
memory instead of on the device, and the bytes they move over PCIe each optimizer step.

* ``enable_activation_offloading`` (:mod:`kd.runtime.offload`): every saved activation of the
  student (each checkpointed layer's input with activation checkpointing) is copied to pinned
  host memory in forward and brought back in backward. On the device stay torchtune's forward
  stash (the last :data:`OFFLOAD_STASH` offloaded tensors, kept until their copy finished: with
  checkpointing that many layer inputs, without it at most one layer's saved set) and, in
  backward, the layer being differentiated. Moved: the saved set twice (out and back) per
  micro-batch.
* ``teacher_offload: park`` (:mod:`kd.teachers.parking`): the teacher's weights but its output
  projection (which the loss reads after the forward) live in pinned host memory and are copied
  to the device for each of its forwards, then dropped (a frozen teacher needs no copy back). On
  the device they count only while the teacher runs (its forward, its sampling); moved: those
  weights once per micro-batch. ``stream``: the same bytes moved, but one decoder layer at a time
  on the device during the forward, and the next one being copied beside it (sampling still
  holds them all in).

Times are the moved bytes at :data:`PCIE_GB_PER_S`, an assumption (a PCIe 4.0 x16 link moves
about 25 GB/s from pinned memory; PCIe 5.0 about twice that): measure your own link. Pure
arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kd.memory.activations import StudentActivations
from kd.memory.knobs import TrainKnobs
from kd.memory.shapes import ModelShape

PCIE_GB_PER_S = 25.0
"""Assumed host <-> device bandwidth (GB/s, 1e9 bytes) for the times the plan states."""

OFFLOAD_STASH = 5
"""torchtune's ``max_fwd_stash_size``: offloaded tensors kept on the device until copied."""

TEACHER_OFFLOAD_MODES = ("none", "park", "stream")


@dataclass(frozen=True)
class HostTerms:
    """Host memory and PCIe traffic of one optimizer step.

    Attributes:
        host: component -> bytes of host memory (pinned): ``offloaded_activations`` (per
            micro-batch, the largest moment), ``parked_teacher``.
        moved: component -> bytes over PCIe per optimizer step (both directions).
    """

    host: dict[str, int] = field(default_factory=dict)
    moved: dict[str, int] = field(default_factory=dict)

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def moved_bytes(self) -> int:
        return sum(self.moved.values())

    @property
    def seconds_per_step(self) -> float:
        """The moved bytes at :data:`PCIE_GB_PER_S` (not overlapped with compute)."""
        return self.moved_bytes / (PCIE_GB_PER_S * 1e9)

    def to_json(self) -> dict[str, object]:
        gib = float(1 << 30)
        return {
            "host_gib": {c: round(b / gib, 4) for c, b in self.host.items()},
            "moved_gib_per_step": {c: round(b / gib, 4) for c, b in self.moved.items()},
            "pcie_gb_per_s": PCIE_GB_PER_S,
            "transfer_s_per_step": round(self.seconds_per_step, 4),
        }


def forward_kept(student: ModelShape, acts: StudentActivations, k: TrainKnobs) -> int:
    """Saved-activation bytes still on the device during and after an offloaded forward
    (torchtune's stash); all of them without offloading."""
    if not k.activation_offloading:
        return acts.total
    if k.activation_checkpointing:
        per_layer = k.dtype_bytes * k.tokens * student.embed_dim
        return min(acts.total, OFFLOAD_STASH * per_layer)
    return min(acts.total, max(acts.layers, default=0))


def teacher_head_params(teacher: ModelShape) -> int:
    """The teacher's output projection (the embedding when tied): the part a parked teacher
    keeps on the device, since the loss reads it after the forward."""
    return teacher.vocab_size * teacher.embed_dim


def parked_teacher_bytes(teacher: ModelShape | None, k: TrainKnobs) -> int:
    """Bytes of the planned teacher's weights that wait in host memory when parked or streamed
    (0 when not): all of them but the output projection. Sampling holds them all in."""
    if teacher is None or k.teacher_offload == "none":
        return 0
    body = teacher.total_params() - teacher_head_params(teacher)
    return int(k.teacher_dtype_bytes * body)


def teacher_forward_in_bytes(teacher: ModelShape | None, k: TrainKnobs) -> int:
    """Bytes of parked weights on the device during the teacher's forward: all of them
    (``park``), or with ``stream`` the unit computing and the next one, prefetched beside it (the
    embedding, untied, and the first layer; then two decoder layers)."""
    parked = parked_teacher_bytes(teacher, k)
    if k.teacher_offload != "stream" or teacher is None:
        return parked
    embedding = 0 if teacher.tie_word_embeddings else teacher.embedding_params()
    layer = teacher.largest_layer_params()
    return min(parked, int(k.teacher_dtype_bytes * (layer + max(layer, embedding))))


def host_terms(
    student: ModelShape, teacher: ModelShape | None, acts: StudentActivations, k: TrainKnobs
) -> HostTerms:
    """Host memory and bytes moved per optimizer step (module doc)."""
    host: dict[str, int] = {}
    moved: dict[str, int] = {}
    if k.activation_offloading:
        host["offloaded_activations"] = acts.total
        moved["offloaded_activations"] = 2 * acts.total * k.grad_accum
    parked = parked_teacher_bytes(teacher, k)
    if parked:
        others = int(k.teacher_dtype_bytes * (k.other_teacher_params - k.other_teacher_head_params))
        host["parked_teacher"] = parked + others
        # each micro-batch's forward brings it in; a teacher that samples (seq_kd) is held in
        # for its rollout too (at most once more per micro-batch)
        samples = k.generation is not None and "teacher" in k.generation.models
        moved["parked_teacher"] = (parked + others) * k.grad_accum * (2 if samples else 1)
    return HostTerms(host=host, moved=moved)
