"""The teacher's own device (``teacher_device``): what it holds, planned against the same
per-device budget as the student's.

With ``teacher_device`` the teacher's weights (all but an untied output projection, which is
copied to the student's device for the loss; a tied one is the embedding its forward reads, so
it is on both), its buffers, the micro-batch's tokens and its no-grad forward (the hidden states
between layers, one layer's transients, the output hidden states until they are copied to the
student's device) live on that device; the student's device holds the projection's copy and the
hidden states it receives (:attr:`kd.memory.knobs.TrainKnobs.teacher_own_device`). Validation
runs the teacher on its batch too: the larger forward is planned. Its runtime terms are its
own (:mod:`kd.memory.runtime`). Pure arithmetic, no torch.
"""

from __future__ import annotations

from kd.memory.activations import nograd_forward_bytes
from kd.memory.knobs import TrainKnobs
from kd.memory.runtime import runtime_terms
from kd.memory.shapes import ModelShape


def teacher_device_components(teacher: ModelShape, k: TrainKnobs) -> dict[str, int]:
    """Component -> bytes on the teacher's own device at its peak (its forward), the runtime
    terms included.

    Args:
        teacher: the teacher model.
        k: the knobs (batch, sequence, dtype, validation batch, device type).
    """
    a = k.dtype_bytes
    weights = int(k.teacher_dtype_bytes * (teacher.total_params() - teacher.output_params()))
    batch = max(k.batch_size, k.eval_batch or 0)
    comps = {
        "teacher_weights": weights,
        "buffers": teacher.buffer_bytes(a) + 8 * batch * k.seq_len,
        "teacher_forward": nograd_forward_bytes(teacher, batch, k.seq_len, a),
    }
    terms = runtime_terms(
        sum(comps.values()),
        device_type=k.device_type,
        activation_checkpointing=False,
        num_ranks=1,
        override=k.reserve_bytes,
    )
    comps["allocator_slack"] = terms.allocator_slack
    comps["cuda_runtime"] = terms.cuda_runtime
    return comps
