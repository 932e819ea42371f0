"""Hidden-state distillation in the memory estimate (``hidden_states:``, :mod:`kd.teachers.hidden_states`).

One component, ``hidden_states``, per phase:

* every phase: the width projections (fp32 weights and their optimizer states), when the widths
  differ;
* forward: the teacher's captured outputs that the teacher forward would otherwise have freed (at
  its last layer: the mapped points before that layer's input; in the loss: every mapped point but
  the final norm, whose output is the teacher's hidden states the loss reads anyway);
* backward (its start): what the hidden loss saved for its backward (the projections' outputs and
  fp32 inputs, the teacher's states, fp32 copies of bf16 states) and the projections' gradients;
* optimizer step: the projections' gradients and the step's temporaries.

Pure arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kd.memory.knobs import TrainKnobs
from kd.memory.shapes import ModelShape

__all__ = ["HiddenTerms", "hidden_terms"]


@dataclass(frozen=True)
class HiddenTerms:
    """Bytes of hidden-state distillation, per phase (all 0 without ``hidden_states``):
    ``resident`` in every phase, the forward's sub-phases on top of it, the backward's and the
    optimizer step's including it."""

    resident: int = 0
    teacher_forward: int = 0
    loss_forward: int = 0
    backward: int = 0
    optimizer_step: int = 0


def _points(entries: tuple[str, ...]) -> list[tuple[str, str]]:
    return [tuple(p.strip() for p in e.split(":", 1)) for e in entries if ":" in e]  # type: ignore[misc]


def hidden_terms(student: ModelShape, teacher: ModelShape | None, k: TrainKnobs) -> HiddenTerms:
    """The ``hidden_states`` component of each phase (:class:`HiddenTerms`)."""
    if teacher is None or not k.hidden_map:
        return HiddenTerms()
    pairs = _points(k.hidden_map)
    a, n = k.dtype_bytes, k.tokens
    d_s, d_t = student.embed_dim, teacher.embed_dim
    projected = d_s != d_t
    proj_params = len(pairs) * d_s * d_t if projected else 0
    states = 0 if k.optimizer.in_cpu or k.optimizer.kind == "sgd" else 2
    # The step's temporaries (as kd.memory.resident.optimizer_state_bytes): foreach holds one per
    # projection at once; the for-loop step (foreach: false, and the FSDP2 trace) one parameter at
    # a time, which the student's largest parameter already covers.
    opt = k.optimizer
    temp = 0 if opt.fused or opt.kind == "sgd" or opt.foreach is False else 1
    resident = 4 * proj_params * (1 + states)
    teacher_points = list(dict.fromkeys(t for _, t in pairs))
    last_input = str(teacher.num_layers - 2)
    early = [
        t for t in teacher_points if t == "embed" or (t.isdigit() and int(t) < int(last_input))
    ]
    state_t = n * d_t * a
    saved = 0
    for _ in pairs:
        if projected and a != 4:
            saved += n * d_s * 4  # the projection's fp32 copy of its bf16 input
        if k.hidden_loss != "cosine":
            saved += n * d_t * 4  # (s - t) for the square's backward
            continue
        saved += n * d_t * 4 if a != 4 else state_t  # the teacher's state (an fp32 copy of bf16)
        if projected:
            saved += n * d_t * 4  # the projection's output
        elif a != 4:
            saved += n * d_s * 4  # the student's state upcast to fp32
    return HiddenTerms(
        resident=resident,
        teacher_forward=len(early) * state_t,
        loss_forward=sum(t != "norm" for t in teacher_points) * state_t,
        backward=resident + saved + 4 * proj_params,
        optimizer_step=resident + 4 * proj_params * (1 + temp),
    )
