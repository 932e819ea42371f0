"""The evaluation phase of the memory estimate (only with ``validation:``): what stays resident
between steps plus one validation batch through ``kd.training.evaluate.token_sums``.

Pure arithmetic, no torch.
"""

from __future__ import annotations

from kd.memory.activations import nograd_forward_bytes
from kd.memory.knobs import TrainKnobs
from kd.memory.shapes import ModelShape
from kd.memory.training_step import Components, between_steps

# kd.training.evaluate.token_sums, per chunk of n labelled rows: fp32 [n, V] buffers. The student's logits
# and cross-entropy's log-softmax; with a teacher, both models' logits plus, at the teacher's
# log-softmax, the student's log-probs, the output and its clamped copy (and the tempered input when
# T != 1); then, the logits freed, both log-probs and the divergence's temporaries: exp, difference
# and product (jsd and the skews also keep the mixture's log).
_EVAL_DIVERGENCE_BUFFERS: dict[str, int] = {"jsd": 4, "skew_forward_kl": 4, "skew_reverse_kl": 4}


def eval_chunk_bytes(student: ModelShape, teacher: ModelShape | None, k: TrainKnobs) -> int:
    """Peak of one chunk of ``kd.training.evaluate.token_sums`` beyond the labelled hidden states."""
    assert k.eval_batch is not None
    n = min(k.loss_chunk_size, k.eval_batch * k.seq_len)
    vs = student.vocab_size
    ce = 8 * n * vs
    if teacher is None:
        return ce
    vt = teacher.vocab_size
    vocab = min(vs, vt)
    upcast = k.dtype_bytes if k.dtype_bytes != 4 else 0  # the dtype's logits before the fp32 copy
    tempered = 1 if k.temperature != 1.0 else 0
    steps = (
        ce,
        4 * n * vs + (upcast + 4) * n * vt,  # the teacher's logits
        4 * n * (vs + vt) + 4 * n * vocab * (3 + tempered),  # the teacher's log-softmax
        4 * n * vocab * (2 + _EVAL_DIVERGENCE_BUFFERS.get(k.divergence, 3)),
    )
    return max(steps)


def evaluation_bytes(
    student: ModelShape, teacher: ModelShape | None, k: TrainKnobs
) -> dict[str, int]:
    """The evaluation's transient components (``activations``, ``teacher_forward``,
    ``logits_loss``, ``buffers``) at its peak: one validation batch through ``token_sums``.

    The student's no-grad forward; the teacher's with the student's labelled hidden states kept;
    then both labelled hidden states and one chunk of logits. On real tensors the labelled rows are
    gathered (copies; their int64 index and targets); the fake-tensor trace keeps every row and a
    boolean mask instead. The batch's int64 tokens and shifted labels are held throughout.
    """
    assert k.eval_batch is not None
    b, s, a = k.eval_batch, k.seq_len, k.dtype_bytes
    n_tok = b * s
    hid_s = a * n_tok * student.embed_dim
    hid_t = a * n_tok * teacher.embed_dim if teacher is not None else 0
    copy = 2 if k.select_labelled else 1
    rows = 16 * n_tok + (16 * n_tok if k.select_labelled else n_tok)
    steps = [
        {"activations": max(nograd_forward_bytes(student, b, s, a), copy * hid_s)},
        {
            "activations": hid_s,
            "teacher_forward": hid_t,
            "logits_loss": eval_chunk_bytes(student, teacher, k),
        },
    ]
    if teacher is not None:
        # On its own device (teacher_device) only its hidden states arrive here.
        t_fwd = 0 if k.teacher_own_device else nograd_forward_bytes(teacher, b, s, a)
        steps.append(
            {
                "activations": hid_s,
                "teacher_forward": max(t_fwd, copy * hid_t),
            }
        )
    best = max(steps, key=lambda d: sum(d.values()))
    return dict(best, buffers=rows)


def evaluation_phase(
    student: ModelShape,
    teacher: ModelShape | None,
    k: TrainKnobs,
    resident: Components,
    *,
    model_buffers: int,
    in_flight: int,
) -> Components:
    """The evaluation phase (``k.eval_batch`` set): one validation batch (:func:`evaluation_bytes`)
    on top of what stays between steps (:func:`kd.memory.training_step.between_steps`), its own
    tensors beside both models' buffers (``model_buffers``); sharded roots stay gathered as in
    forward (``in_flight``)."""
    phase = between_steps(resident, in_flight=in_flight, buffers=model_buffers)
    for comp, val in evaluation_bytes(student, teacher, k).items():
        phase[comp] = phase.get(comp, 0) + val
    return phase
