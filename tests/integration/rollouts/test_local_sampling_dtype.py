"""``on_policy.sampling_dtype`` through ``kd run``: null is today's run bit for bit; bf16 on an
fp32 student samples with a bf16 copy of its weights (the logits it draws from are bf16 values,
its completions are those of the student cast to bf16 at every step), the copy takes the weights
after each step, one copy serves ``async_steps: 1`` too (the resume cases are
``test_local_run.py::test_interrupted_run_resumes_exactly[bf16-*]``)."""

from __future__ import annotations

import copy

import pytest
import torch

import kd.rollouts.decode
import kd.rollouts.local
import kd.rollouts.sampling
from kd.backends import backend_of, decode_attention
from tests.conftest import read_metrics
from tests.integration.rollouts.test_local_run import (
    assert_same_weights,
    losses,
    on_policy,
    run,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def cast(student: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The test's own cast of the live student: a deep copy with its parameters in ``dtype``
    (buffers as they are, as in a student built in that dtype), whose one-position attention
    on the CPU in bf16 is kd's (``kd.backends.decode_attention``, as the sampler's copy's)."""
    ref = copy.deepcopy(student)
    for p in ref.parameters():
        p.data = p.data.to(dtype)
    if dtype in decode_attention.LOW_PRECISION:
        backend_of(student).install_decode_attention(ref)
    return ref


@pytest.mark.parametrize("value", ["null", "fp32"])
def test_sampling_dtype_of_the_student_is_todays_run(assets, tmp_path, value):
    """null (and fp32 on an fp32 student: nothing to cast) keeps no copy: the same losses and
    weights, bit for bit, as a run without the key."""
    today = run(tmp_path, "today", assets, on_policy=on_policy(lmbda=0.5))
    same = run(
        tmp_path,
        "same",
        assets,
        on_policy=on_policy(lmbda=0.5, sampling_dtype=None if value == "null" else value),
    )
    assert [r["loss"] for r in read_metrics(same)] == [r["loss"] for r in read_metrics(today)]
    assert losses(same) == losses(today)
    assert_same_weights(today, same)


@pytest.mark.parametrize(
    "extra,lora",
    [({}, False), ({"batch_rollouts": True}, False), ({}, True)],
    ids=["rollout", "fast", "lora"],
)
def test_bf16_copy_samples_and_follows_the_weights(assets, tmp_path, monkeypatch, extra, lora):
    """bf16 on the fp32 tiny student: every logit the sampler draws from is a bf16 value (fp32
    sampling gives values bf16 cannot hold), each step's greedy completions equal those of the
    live student cast to bf16 then (a stale copy or the fp32 student would give other logits),
    after each step the copy holds the student's weights cast to bf16 (a LoRA student's base and
    adapters, unmerged), and the run trains."""
    drawn: list[torch.Tensor] = []
    original_next = kd.rollouts.sampling.sample_next

    def spy_next(logits, **kw):
        drawn.append(logits.detach().clone())
        return original_next(logits, **kw)

    checked: list[int] = []
    original_sample = kd.rollouts.local.LocalSampler.sample

    def spy_sample(self, prompts, *, rows, epoch, step, student):
        start = len(drawn)
        done = original_sample(self, prompts, rows=rows, epoch=epoch, step=step, student=student)
        got = drawn[start:]
        assert len(got) == done.steps
        # The same sampler path with no copy of its own, given the test's casts of the student.
        plain = copy.copy(self)
        plain._policy, plain.copy_dtype = None, None
        for dtype in (torch.bfloat16, torch.float32):
            start = len(drawn)
            want = original_sample(
                plain, prompts, rows=rows, epoch=epoch, step=step, student=cast(student, dtype)
            )
            logits = drawn[start:]
            del drawn[start:]
            same = len(logits) == len(got) and all(map(torch.equal, logits, got))
            if dtype == torch.bfloat16:  # the bf16 student's rollout, to the bit, at this step
                assert same, step
                assert torch.equal(want.tokens, done.tokens) and want.steps == done.steps
            else:  # what an fp32 sampler would have drawn from
                assert not same, step
        checked.append(step)
        return done

    follows: list[int] = []
    original_after = kd.rollouts.local.LocalSampler.after_step

    def spy_after(self, student, step):
        original_after(self, student, step)
        mine = list(self._policy.parameters())
        theirs = list(student.parameters())
        assert all(m.dtype == torch.bfloat16 for m in mine)
        assert all(
            torch.equal(m, t.detach().to(torch.bfloat16)) for m, t in zip(mine, theirs, strict=True)
        )
        follows.append(step)

    monkeypatch.setattr(kd.rollouts.sampling, "sample_next", spy_next)
    monkeypatch.setattr(kd.rollouts.decode, "sample_next", spy_next)
    monkeypatch.setattr(kd.rollouts.local.LocalSampler, "sample", spy_sample)
    monkeypatch.setattr(kd.rollouts.local.LocalSampler, "after_step", spy_after)
    out = run(
        tmp_path,
        "bf16",
        assets,
        lora=lora,
        on_policy=on_policy(temperature=0.0, sampling_dtype="bf16", **extra),
    )
    assert drawn and all(torch.equal(x, x.to(torch.bfloat16).float()) for x in drawn)
    assert sorted(set(checked)) == [1, 2, 3]
    assert follows == [0, 1, 2, 3]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    if not lora:  # fp32 training: the saved student stays fp32
        assert {str(t.dtype) for t in _final(out).values()} == {"torch.float32"}


def _final(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


def test_one_copy_serves_async_steps(assets, tmp_path, monkeypatch):
    """async_steps: 1 with bf16: one copy is made (at the start, before the first rollout), in
    bf16, and every rollout samples with it."""
    made: list[torch.dtype | None] = []
    original = kd.rollouts.local.sampling_copy

    def spy_copy(model, dtype):
        made.append(dtype)
        return original(model, dtype)

    models: list[torch.dtype] = []
    original_rollout = kd.rollouts.sampling.rollout

    def spy_rollout(model, prompts, **kw):
        models.append(next(model.parameters()).dtype)
        return original_rollout(model, prompts, **kw)

    monkeypatch.setattr(kd.rollouts.local, "sampling_copy", spy_copy)
    monkeypatch.setattr(kd.rollouts.sampling, "rollout", spy_rollout)
    run(tmp_path, "async", assets, on_policy=on_policy(sampling_dtype="bf16", async_steps=1))
    assert made == [torch.bfloat16]
    assert models and set(models) == {torch.bfloat16}
