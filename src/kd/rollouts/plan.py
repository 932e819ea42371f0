"""What a sampler costs in the memory plan (no torch: ``kd plan`` and the config checks import it).

The planner (:func:`kd.memory.plan.generation_knobs`) asks this module, never the sampler's
kind itself, what samples on the training device at the start of a step:

- ``local``: the student samples there, with a KV cache over ``tokenizer.max_seq_len``
  positions for the rows of one generation (a micro-batch's, or with ``on_policy.batch_rollouts``
  the step's or ``on_policy.rollout_batch_size``'s), and with ``on_policy.async_steps: 1`` it
  keeps a frozen copy of the student's weights to sample from while the student trains; with
  ``on_policy.sampling_dtype`` other than the student's ``dtype`` that copy (one copy, async or
  not) is in the sampling dtype, and so are its KV cache and logits.
- ``served``: the server samples; nothing on the training device (no KV cache, no copy).

The teacher's samples (``on_policy.seq_kd``) are always local: the teacher model samples them.
"""

from __future__ import annotations

from kd.config.on_policy_settings import OnPolicySettings

__all__ = [
    "DTYPE_BYTES",
    "ON_DEVICE",
    "copy_dtype",
    "copy_dtype_bytes",
    "rollout_rows",
    "samples_on_device",
    "student_copy",
    "torchrun_problem",
    "uncounted",
]

# Whether a sampler of each kind (on_policy.sampler) runs the student on the training device.
ON_DEVICE: dict[str, bool] = {"local": True, "served": False}
# Bytes per value of each sampling dtype (on_policy.sampling_dtype).
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp32": 4}


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


def copy_dtype(settings: OnPolicySettings, *, dtype: str) -> str | None:
    """The dtype the local sampler's own copy of the student is in when it is not the student's
    ``dtype`` (``on_policy.sampling_dtype``), else None (it samples in the student's dtype)."""
    wanted = settings.sampling_dtype
    if not samples_on_device(settings) or wanted is None or wanted == dtype:
        return None
    return wanted


def copy_dtype_bytes(settings: OnPolicySettings, *, dtype: str) -> int | None:
    """Bytes per value of the sampler's copy when its dtype is not the student's
    (:func:`copy_dtype`), else None."""
    other = copy_dtype(settings, dtype=dtype)
    return None if other is None else DTYPE_BYTES[other]


def student_copy(settings: OnPolicySettings, *, dtype: str) -> bool:
    """Whether the local sampler keeps a frozen copy of the student's weights on the device: it
    samples the next step with it while the student trains (``async_steps: 1``), or it samples
    in another dtype than the student's (:func:`copy_dtype`); one copy serves both."""
    return samples_on_device(settings) and (
        settings.async_steps > 0 or copy_dtype(settings, dtype=dtype) is not None
    )


def torchrun_problem(settings: OnPolicySettings, *, copies: bool) -> str | None:
    """The line the run's sampler refuses ``settings`` with under torchrun (several ranks),
    before any weight is read (its ``check``); ``kd plan --world-size N`` refuses them with it
    too. ``copies``: the sampler keeps a copy in another dtype (:func:`copy_dtype` is not None).
    None when they may run on several ranks."""
    if settings.sampler == "served":
        if settings.async_steps > 0:
            return (
                "on_policy.async_steps: 1 asks the server from a background thread, whose "
                "failures the ranks cannot agree on; under torchrun set on_policy.async_steps=0"
            )
        return None
    if settings.async_steps > 0:
        return (
            "on_policy.async_steps: 1 samples from a background thread on one device; under "
            "torchrun set on_policy.async_steps=0"
        )
    if settings.cuda_graphs:
        return (
            "on_policy.cuda_graphs replays the one-device fast decode (batch_rollouts), "
            "which torchrun's sharded student does not run; set on_policy.cuda_graphs=false"
        )
    if copies:
        return (
            "on_policy.sampling_dtype keeps a whole copy of the student on one device, which "
            "kd does not shard; under torchrun set on_policy.sampling_dtype=null"
        )
    return None


def uncounted(settings: OnPolicySettings | None) -> list[str]:
    """The plan's notes on what a sampler holds that the plan does not count: with
    ``async_steps: 1`` the local sampler's next rollout (its KV cache and decode temporaries) is
    live during the step's forward, backward and optimizer step, which count only its copy."""
    if settings is None or not settings.async_steps or not settings.lmbda:
        return []
    if not samples_on_device(settings):
        return []
    return [
        "on_policy.async_steps: 1: the next step's rollout (its KV cache and decode temporaries) "
        "runs beside this step's forward, backward and optimizer step, and is not added to them "
        "(only the sampler's frozen copy is): leave room for the generation phase's kv_cache and "
        "activations beside the peak"
    ]
