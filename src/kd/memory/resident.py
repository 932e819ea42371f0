"""Resident terms of the memory estimate: what stays on the device through a step's phases.

The weights of both models (NF4 base linears for QLoRA; a quantized teacher's bytes per
parameter), LoRA adapters, buffers, gradients, optimizer states and the optimizer step's
temporaries, and under FSDP2 each rank's share of them plus the unsharded units in flight.
Pure arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kd.memory.knobs import TrainKnobs
from kd.memory.shapes import NF4_BYTES_PER_PARAM, ModelShape

# torchao AdamW8bit: uint8 codes + one fp32 scale per 256-value block, for params >= 4096 values.
ADAMW8BIT_BYTES_PER_STATE = 1.0 + 4.0 / 256


def optimizer_state_bytes(trainable: int, largest: int, k: TrainKnobs) -> tuple[int, int]:
    """(states, step temporaries) on one device for ``trainable`` parameters, before sharding.

    Args:
        trainable: parameters the optimizer steps.
        largest: the largest of them (the for-loop step's one temporary).
        k: the knobs (``k.optimizer``, the dtype).
    """
    opt, a = k.optimizer, k.dtype_bytes
    if opt.in_cpu:
        return 0, 0
    if opt.kind == "adamw8bit":
        return int(2 * ADAMW8BIT_BYTES_PER_STATE * trainable), 0
    if opt.kind == "sgd":
        return (a * trainable if opt.momentum else 0), 0
    states = 2 * a * trainable
    if opt.fused:
        temp = 0
    elif opt.foreach is False:
        temp = a * largest  # the for-loop step holds one parameter-sized denominator
    else:
        temp = a * trainable  # foreach: sqrt(exp_avg_sq) for every parameter at once
    return states, temp


def fsdp_in_flight_bytes(
    student: ModelShape, teacher: ModelShape | None, k: TrainKnobs
) -> tuple[int, int]:
    """(forward, backward) bytes FSDP2 holds unsharded on each rank; (0, 0) on one device.

    In flight: the current + prefetched unsharded layer of whichever model runs, the root unit
    (embedding, final norm, output) unsharded from forward to backward, and in backward the
    current layer's unsharded gradient in the reduce dtype plus its shard.
    """
    ws = k.num_ranks
    if ws == 1:
        return 0, 0
    a, t_bytes, h = k.dtype_bytes, k.teacher_dtype_bytes, student.embed_dim
    s_layer = a * student.largest_layer_params()
    t_layer = int(t_bytes * teacher.largest_layer_params()) if teacher else 0
    s_root = a * (student.embedding_params() + student.output_params() + h)
    t_root = int(t_bytes * (teacher.embedding_params() + teacher.output_params())) if teacher else 0
    train_layer = (
        student.largest_layer_params() if student.lora is None else student.layer_lora_params()
    )
    reduce_scatter = int(k.reduce_dtype_bytes * train_layer * (1 + 1 / ws))
    return 2 * max(s_layer, t_layer) + s_root + t_root, 2 * s_layer + s_root + reduce_scatter


@dataclass(frozen=True)
class Resident:
    """Per-device bytes that outlive a phase (FSDP2: this rank's share).

    Attributes:
        student_weights: the student's base weights (NF4 for QLoRA's quantized linears).
        lora_adapters: the student's LoRA adapters.
        teacher_weights: the teacher's weights.
        model_buffers: both models' buffers (RoPE caches and the like).
        gradients: every trainable parameter's gradient.
        optimizer_states: the optimizer's states (0 in CPU memory).
        optimizer_temp: the optimizer step's temporaries.
        layer_grads: one decoder layer's trainable gradients.
        output_grad: the output (tied: embedding) weight's gradient; 0 for LoRA.
        head_grads: gradients present from the start of backward (the final norm's; the untied
            embedding's gradient only appears at the very end).
        in_flight_forward: FSDP2's unsharded units during forward (0 on one device).
        in_flight_backward: FSDP2's unsharded units and reduce-scatter during backward.
        trainable_params: student parameters that train.
        teacher_params: teacher parameters (0 without a teacher).
    """

    student_weights: int
    lora_adapters: int
    teacher_weights: int
    model_buffers: int
    gradients: int
    optimizer_states: int
    optimizer_temp: int
    layer_grads: int
    output_grad: int
    head_grads: int
    in_flight_forward: int
    in_flight_backward: int
    trainable_params: int
    teacher_params: int


def _device_teacher_buffers(teacher: ModelShape | None, k: TrainKnobs) -> int:
    """The teacher's buffers on the training device: none on a device of its own, and none when
    it has no weights of its own (a self teacher without a frozen copy runs the student's own
    modules, RoPE tables included: ``teacher_bytes_per_param`` 0)."""
    if teacher is None or k.teacher_own_device or k.teacher_bytes_per_param == 0.0:
        return 0
    return teacher.buffer_bytes(k.dtype_bytes)


def _device_teacher_params(teacher: ModelShape | None, k: TrainKnobs) -> int:
    """Teacher parameters on the device between its forwards: all of them, or a parked
    teacher's output projections (:mod:`kd.memory.offload`)."""
    if teacher is None:
        return k.other_teacher_params
    if k.teacher_offload != "none" or k.teacher_own_device:
        return teacher.vocab_size * teacher.embed_dim + k.other_teacher_head_params
    return teacher.total_params() + k.other_teacher_params


def resident_bytes(student: ModelShape, teacher: ModelShape | None, k: TrainKnobs) -> Resident:
    """The resident terms of ``student`` trained against ``teacher`` with knobs ``k``.

    Under FSDP2, parameters, gradients and states are sharded over the ranks (all on the CPU with
    ``fsdp.cpu_offload``): :meth:`TrainKnobs.per_rank`.
    """
    a, h = k.dtype_bytes, student.embed_dim
    full = student.lora is None
    qbase = student.quantizable_params()
    student_w = int((student.base_params() - qbase) * a + qbase * NF4_BYTES_PER_PARAM)
    if k.generation is not None and k.generation.student_copy:
        # The local sampler's copy (on_policy.async_steps: 1, or on_policy.sampling_dtype): base
        # and adapters in its dtype (its buffers are the student's).
        student_w += int(student.total_params() * (k.generation.copy_dtype_bytes or a))
    teacher_params = (teacher.total_params() if teacher is not None else 0) + (
        k.other_teacher_params
    )
    trainable = student.total_params() if full else student.lora_params()
    if full:
        largest = max(student.vocab_size * h, h * student.intermediate_dim)
    else:
        output_vocab = student.vocab_size if student.lora.output else 0
        largest = student.lora.rank * max(output_vocab, student.intermediate_dim)
    states, opt_temp = optimizer_state_bytes(trainable, largest, k)
    layer_params = student.layer_base_params() if full else student.layer_lora_params()
    untied_embedding = full and not student.tie_word_embeddings
    grads = k.per_rank(a * trainable)
    layer_g = k.per_rank(a * layer_params)
    out_g = k.per_rank(a * student.vocab_size * h if full else 0)
    emb_g_late = k.per_rank(a * student.embedding_params() if untied_embedding else 0)
    fwd, bwd = fsdp_in_flight_bytes(student, teacher, k)
    return Resident(
        student_weights=k.per_rank(student_w),
        lora_adapters=k.per_rank(a * student.lora_params()),
        teacher_weights=k.per_rank(int(k.teacher_dtype_bytes * _device_teacher_params(teacher, k))),
        model_buffers=student.buffer_bytes(a) + _device_teacher_buffers(teacher, k),
        gradients=grads,
        optimizer_states=k.per_rank(states),
        optimizer_temp=k.per_rank(opt_temp),
        layer_grads=layer_g,
        output_grad=out_g,
        head_grads=max(grads - layer_g * student.num_layers - out_g - emb_g_late, 0),
        in_flight_forward=fwd,
        in_flight_backward=bwd,
        trainable_params=trainable,
        teacher_params=teacher_params,
    )
