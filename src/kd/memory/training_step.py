"""The training step's phases in the memory estimate: forward, backward and the optimizer step.

* **forward**: the student forward (saved activations), then the teacher forward under ``no_grad``
  (its per-layer temporaries), then the loss forward (:mod:`kd.memory.loss_head`); the peak is
  the largest of the three sub-phases.
* **backward**: starts with every saved activation and walks the layers backwards, freeing a
  layer's saved tensors while allocating its parameter gradients (with activation checkpointing,
  a layer's activations are first recomputed).
* **optimizer step**: weights + gradients + states (+ the step's temporaries).

Pure arithmetic, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kd.memory import hf_terms
from kd.memory.activations import (
    StudentActivations,
    layer_saved_bytes,
    nograd_forward_bytes,
    student_forward_bytes,
)
from kd.memory.hidden import HiddenTerms
from kd.memory.knobs import TrainKnobs
from kd.memory.loss_head import STORED_TOPK_BYTES, LossHead
from kd.memory.offload import forward_kept, teacher_forward_in_bytes
from kd.memory.resident import Resident
from kd.memory.shapes import ModelShape

# Gradient temporaries at the end of one decoder layer's backward, per token (measured: 2.5 h).
LAYER_BWD_H = 2.5

Components = dict[str, int]


def resident_components(
    res: Resident, k: TrainKnobs, hidden: HiddenTerms | None = None
) -> Components:
    """The components every phase of a step starts from: weights, buffers (plus the micro-batch's
    int64 tokens and labels), stored top-k logits, optimizer states, and the gradients when
    accumulation keeps them between micro-batches."""
    n_tok = k.tokens
    stored = 0  # a cross-tokenizer store reads its rows in the signal (the loss head counts them)
    if k.stored_topk is not None and not k.cross_tokenizer:
        stored = STORED_TOPK_BYTES * k.stored_topk * n_tok
    return {
        "teacher_weights": res.teacher_weights,
        "student_weights": res.student_weights,
        "lora_adapters": res.lora_adapters,
        "buffers": res.model_buffers + 8 * n_tok * 2,
        "stored_logits": stored,
        "optimizer_states": res.optimizer_states,
        "gradients": res.gradients if k.grad_accum > 1 else 0,
        "hidden_states": hidden.resident if hidden is not None else 0,
    }


def forward_phase(
    student: ModelShape,
    teacher: ModelShape | None,
    k: TrainKnobs,
    resident: Components,
    acts: StudentActivations,
    head: LossHead,
    in_flight: int,
    hidden: HiddenTerms | None = None,
) -> tuple[Components, dict[str, int]]:
    """The forward's components at its peak, and the allocated bytes of each sub-phase's peak
    (``student_forward``, ``teacher_forward``, ``loss_forward``).

    The teacher's forward runs on top of the student's saved activations and final hidden
    states; the loss on top of both models' hidden states.
    """
    a, n_tok = k.dtype_bytes, k.tokens
    hid_s = a * n_tok * student.embed_dim
    hid_t = a * n_tok * teacher.embed_dim if teacher else 0
    base = sum(resident.values()) + in_flight
    kept = forward_kept(student, acts, k)
    if k.activation_offloading:  # the saved set waits in host memory but torchtune's stash
        none_saved = StudentActivations(tuple(0 for _ in acts.layers), 0)
        s_fwd = student_forward_bytes(student, k, none_saved) + kept
    else:
        s_fwd = student_forward_bytes(student, k, acts)
    t_fwd = nograd_forward_bytes(teacher, k.batch_size, k.seq_len, a) if teacher else 0
    if k.teacher_own_device:  # its forward runs on its own device; its hidden states arrive
        t_fwd = hid_t
    h = hidden or HiddenTerms()
    parts = {
        "student_forward": {"activations": s_fwd},
        "teacher_forward": {
            "activations": kept + hid_s,
            "teacher_forward": t_fwd,
            # a parked teacher's weights are on the device for its forward only
            "teacher_weights": teacher_forward_in_bytes(teacher, k),
            "hidden_states": h.teacher_forward,
        },
        "loss_forward": {
            "activations": kept + hid_s,
            "teacher_forward": hid_t,
            "logits_loss": head.peak,
            "hidden_states": h.loss_forward,
        },
    }
    subphases = {name: base + sum(part.values()) for name, part in parts.items()}
    peak = max(subphases, key=lambda x: subphases[x])
    comps = dict(resident, fsdp_in_flight=in_flight, **parts[peak])
    comps["hidden_states"] = resident["hidden_states"] + parts[peak].get("hidden_states", 0)
    comps["teacher_weights"] = resident["teacher_weights"] + parts[peak].get("teacher_weights", 0)
    return comps, subphases


@dataclass(frozen=True)
class _LayerBackward:
    """What each torchtune decoder layer's backward adds (the same for every layer).

    Attributes:
        grads: the layer's trainable gradients.
        w2_grad: the MLP's w2 gradient (0 for LoRA).
        recompute: the recomputed saved set with activation checkpointing, else 0.
        temp: gradient temporaries at the end of the layer's backward.
        mlp_temp: at the SwiGLU product's backward: two ``[N, f]`` gradients and d(output).
    """

    grads: int
    w2_grad: int
    recompute: int
    temp: int
    mlp_temp: int


def _layer_backward(student: ModelShape, k: TrainKnobs, res: Resident) -> _LayerBackward:
    a, b, s, n_tok = k.dtype_bytes, k.batch_size, k.seq_len, k.tokens
    h, f = student.embed_dim, student.intermediate_dim
    recompute = 0
    if k.activation_checkpointing:
        recompute = layer_saved_bytes(student, b, s, a, input_grad=True)
    return _LayerBackward(
        grads=res.layer_grads,
        w2_grad=k.per_rank(a * h * f if student.lora is None else 0),
        recompute=recompute,
        temp=int(LAYER_BWD_H * n_tok * h * a / 2),
        mlp_temp=n_tok * (2 * a * f + a * h),
    )


def _trained_share(shape: ModelShape, linears: tuple[str, ...]) -> float:
    """The share of a layer's trainable parameters that belongs to ``linears``."""
    dims = shape.linear_dims()
    if shape.lora is None:
        total = shape.layer_base_params()
        part = sum(i * o for name, (i, o) in dims.items() if name in linears)
    else:
        total = shape.layer_lora_params()
        part = sum(
            shape.lora.rank * (i + o)
            for name, (i, o) in dims.items()
            if name in linears and shape.lora.adapted(name)
        )
    return part / total if total else 0.0


def _layer_steps(
    student: ModelShape, k: TrainKnobs, i: int, g_done: int, remaining: int, lb: _LayerBackward
) -> list[tuple[int, int, int]]:
    """(gradients, saved activations, temporaries) at layer ``i``'s backward peaks.

    Inside a torchtune layer's backward the peaks are at its end and at the SwiGLU product's
    backward: the recomputed (AC) or remaining saved set, the gradients so far (plus w2's) and the
    temporaries. A transformers layer's own saved tensors (recomputed first with checkpointing)
    shrink step by step as its nodes finish (:func:`kd.memory.hf_terms.layer_backward_steps`).
    """
    if not student.hf:
        saved = remaining + lb.recompute
        return [(g_done + lb.grads, saved, lb.temp), (g_done + lb.w2_grad, saved, lb.mlp_temp)]
    a, b, s = k.dtype_bytes, k.batch_size, k.seq_len
    input_grad = i > 0 or student.lora is None
    own = 0
    if not k.activation_checkpointing:
        own = hf_terms.layer_saved_bytes(student, i, b, s, a, input_grad=input_grad)
    return [
        (g_done + int(lb.grads * _trained_share(student, done)), remaining - own + held, temp)
        for held, temp, done in hf_terms.layer_backward_steps(
            student, i, b, s, a, input_grad=input_grad
        )
    ]


def _layer_candidates(
    student: ModelShape,
    k: TrainKnobs,
    res: Resident,
    acts: StudentActivations,
    grads_resident: int,
    output_grad_held: int,
) -> Iterator[Components]:
    """The backward's candidate peaks while it walks the decoder layers from the last."""
    lb = _layer_backward(student, k, res)
    # with accumulation, new gradients are temporaries and the loss's d(weight) is held apart
    # from the resident gradients until the embedding's backward
    held_apart = output_grad_held if student.tie_word_embeddings else 0
    g_done = res.head_grads + output_grad_held
    remaining = sum(acts.layers)
    for i in reversed(range(student.num_layers)):
        # offloaded: only the layer being differentiated is back on the device
        here = acts.layers[i] if k.activation_offloading else remaining
        for grads_here, saved, temp in _layer_steps(student, k, i, g_done, here, lb):
            new_grads = (grads_here - g_done + held_apart) if grads_resident else 0
            yield {
                "activations": saved,
                "logits_loss": 0,
                "gradients": grads_resident or grads_here,
                "backward_temp": temp + new_grads,
            }
        remaining -= acts.layers[i]
        g_done += lb.grads


def backward_phase(
    student: ModelShape,
    k: TrainKnobs,
    resident: Components,
    res: Resident,
    acts: StudentActivations,
    head: LossHead,
    hidden: HiddenTerms | None = None,
) -> Components:
    """The backward's components at its peak: its start (loss gradients + final norm), each
    layer's backward from the last, or its end (tied embeddings: the embedding's dense gradient
    and its sum with the output's gradient, held since the loss, before the accumulation)."""
    grads_resident = res.gradients if k.grad_accum > 1 else 0
    held = head.output_grad_held
    start = head.backward_start
    if grads_resident and held and not student.tie_word_embeddings:
        # untied output, accumulating: d(weight) is added in place into .grad and freed before
        # the final norm's backward allocates its temporaries
        start = max(0, start - held)
    first = {
        # offloaded: the forward's stash is still there when the final norm's set comes back
        "activations": (
            min(acts.total, forward_kept(student, acts, k) + acts.head)
            if k.activation_offloading
            else acts.total
        ),
        "logits_loss": head.saved - (0 if grads_resident else held) + start,
        "gradients": grads_resident or (res.head_grads + held),
        "backward_temp": 0,
    }
    tied_full = student.lora is None and student.tie_word_embeddings
    emb_temp = k.per_rank(2 * k.dtype_bytes * student.embedding_params() if tied_full else 0)
    end = {
        "activations": 0,
        "logits_loss": 0,
        "gradients": res.gradients,
        "backward_temp": emb_temp,
    }
    candidates = [first, *_layer_candidates(student, k, res, acts, grads_resident, held), end]
    best = max(candidates, key=lambda d: sum(d.values()))
    h = hidden.backward if hidden is not None else 0
    return dict(resident, fsdp_in_flight=res.in_flight_backward, **best, hidden_states=h)


def between_steps(resident: Components, *, in_flight: int, buffers: int) -> Components:
    """What stays on the device between optimizer steps: the resident components without
    gradients (``kd.training.train.optimizer_step`` sets them to None) or stored logits, the FSDP2 units
    ``in_flight`` and ``buffers`` in place of the training micro-batch's."""
    return dict(resident, gradients=0, stored_logits=0, fsdp_in_flight=in_flight, buffers=buffers)


def optimizer_phase(
    resident: Components, res: Resident, hidden: HiddenTerms | None = None
) -> Components:
    """The optimizer step: every gradient and the step's temporaries on top of the resident."""
    h = hidden.optimizer_step if hidden is not None else resident.get("hidden_states", 0)
    return dict(
        resident, gradients=res.gradients, optimizer_temp=res.optimizer_temp, hidden_states=h
    )
