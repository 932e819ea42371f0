"""What a sampler costs in the memory plan (no torch: ``kd plan`` and the config checks import it).

The planner (:func:`kd.memory.plan.generation_knobs`) asks this module, never the sampler's
kind itself, what samples on the training device at the start of a step:

- ``local``: the student samples there, with a KV cache over ``tokenizer.max_seq_len``
  positions for the rows of one generation (a micro-batch's, or with ``on_policy.batch_rollouts``
  the step's or ``on_policy.rollout_batch_size``'s), and with ``on_policy.async_steps: 1`` it
  keeps a frozen copy of the student's weights to sample from while the student trains.
- ``served``: the server samples; nothing on the training device (no KV cache, no copy).

The teacher's samples (``on_policy.seq_kd``) are always local: the teacher model samples them.
"""

from __future__ import annotations

from kd.config.on_policy_settings import OnPolicySettings

__all__ = ["ON_DEVICE", "rollout_rows", "samples_on_device", "student_copy"]

# Whether a sampler of each kind (on_policy.sampler) runs the student on the training device.
ON_DEVICE: dict[str, bool] = {"local": True, "served": False}


def samples_on_device(settings: OnPolicySettings) -> bool:
    """Whether the student's rollouts run on the training device (a KV cache there)."""
    return ON_DEVICE[settings.sampler]


def rollout_rows(settings: OnPolicySettings, *, batch_size: int, grad_accum: int) -> int:
    """Rows the student samples together on the device: a micro-batch's, or with
    ``batch_rollouts`` a step's (``batch_size * grad_accum``, at most ``rollout_batch_size``)."""
    if not settings.batch_rollouts:
        return batch_size
    rows = batch_size * grad_accum
    if settings.rollout_batch_size is not None:
        rows = min(rows, settings.rollout_batch_size)
    return rows


def student_copy(settings: OnPolicySettings) -> bool:
    """Whether the local sampler keeps a frozen copy of the student's weights on the device (it
    samples the next step with it while the student trains: ``async_steps: 1``)."""
    return samples_on_device(settings) and settings.async_steps > 0
