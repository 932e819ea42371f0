"""The shared training step: label alignment, exact accumulation scaling, invariances."""

from __future__ import annotations

import copy

import pytest
import torch

from kd import models
from kd.training import train
from tests.conftest import tiny_hidden_decoder


def _batch(b: int = 2, s: int = 10, vocab: int = 60, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    labels = tokens.clone()
    labels[:, :3] = -100  # prompt
    return tokens, train.shift_labels(labels)


def test_shift_labels():
    labels = torch.tensor([[5, 6, 7]])
    assert train.shift_labels(labels).tolist() == [[6, 7, -100]]


def test_count_tokens_over_micro_batches():
    a = torch.tensor([[1, -100, 2]])
    b = torch.tensor([[-100, -100, 3]])
    assert int(train.count_tokens([a, b])) == 3


def test_micro_step_scales_by_global_token_count():
    student, teacher = tiny_hidden_decoder(), tiny_hidden_decoder(vocab=80, dim=48, seed=5)
    models.freeze(teacher)
    tokens, labels = _batch()
    settings = train.LossSettings(chunk_size=7)
    n = int((labels != -100).sum())
    full = train.micro_step(student, teacher, tokens, labels, settings=settings, num_tokens_total=n)
    g_full = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    half = train.micro_step(
        student, teacher, tokens, labels, settings=settings, num_tokens_total=2 * n
    )
    torch.testing.assert_close(half.loss * 2, full.loss)
    for p, g in zip(student.parameters(), g_full, strict=True):
        torch.testing.assert_close(p.grad * 2, g, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in teacher.parameters())


def test_teacher_equal_student_gives_zero_kd():
    student = tiny_hidden_decoder()
    teacher = models.freeze(copy.deepcopy(student))
    tokens, labels = _batch()
    for fused in (True, False):
        settings = train.LossSettings(fused=fused, chunk_size=5)
        _, ce, kd = train.compute_loss(student, teacher, tokens, labels, settings=settings)
        assert float(kd.detach()) == pytest.approx(0.0, abs=1e-6)
        assert float(ce) > 0


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
def test_kd_ratio_zero_equals_plain_ce(fused):
    """kd_ratio 0: the teacher's forward does not run, and the loss and the student's gradients
    are those of plain fine-tuning (no teacher), bit for bit."""
    student, teacher = tiny_hidden_decoder(), models.freeze(tiny_hidden_decoder(seed=3))
    calls = []
    teacher.register_forward_hook(lambda *_: calls.append(1))
    tokens, labels = _batch()
    settings = train.LossSettings(kd_ratio=0.0, fused=fused, chunk_size=5)
    out = []
    for t in (teacher, None):
        student.zero_grad()
        loss, ce, kd = train.compute_loss(student, t, tokens, labels, settings=settings)
        loss.backward()
        out.append((loss.detach(), ce, kd, [p.grad.clone() for p in student.parameters()]))
    assert calls == []
    (loss, ce, kd, grads), (plain, plain_ce, _, plain_grads) = out
    assert torch.equal(loss, plain) and torch.equal(ce, plain_ce) and float(kd) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    # kd_ratio above 0 asks the teacher
    train.compute_loss(student, teacher, tokens, labels, settings=train.LossSettings(fused=fused))
    assert calls == [1]


def test_fused_and_unfused_paths_agree():
    student, teacher = (
        tiny_hidden_decoder(),
        models.freeze(tiny_hidden_decoder(vocab=80, dim=48, seed=7)),
    )
    tokens, labels = _batch()
    out = {}
    for fused in (True, False):
        student.zero_grad()
        settings = train.LossSettings(fused=fused, divergence="jsd", temperature=2.0, chunk_size=4)
        loss, _, _ = train.compute_loss(student, teacher, tokens, labels, settings=settings)
        loss.backward()
        out[fused] = (loss.detach(), [p.grad.clone() for p in student.parameters()])
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(out[True][1], out[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_check_vocab_padded_teacher_ok_and_overflow_named():
    assert models.check_vocab(tokenizer_max=277, student_vocab=288, teacher_vocab=320) == []
    problems = models.check_vocab(tokenizer_max=300, student_vocab=288, teacher_vocab=320)
    assert len(problems) == 1 and problems[0].startswith("tokenizer:") and "student" in problems[0]
    problems = models.check_vocab(tokenizer_max=300, student_vocab=400, teacher_vocab=290)
    assert len(problems) == 1 and "teacher" in problems[0]


def test_optimizer_step_refuses_nonfinite_gradients():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.weight.detach().clone()
    model(torch.full((1, 3), float("nan"))).sum().backward()
    norm, stepped = train.optimizer_step(model, opt, clip_grad_norm=1.0)
    assert not stepped and not torch.isfinite(norm)
    assert torch.equal(model.weight.detach(), before)
    assert all(p.grad is None for p in model.parameters())


def test_cpu_offload_optimizer_refuses_what_optimizer_may_not_build():
    from kd.errors import KDUserError

    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(KDUserError, match=r"^optimizer._component_: os.system is not something"):
        train.cpu_offload_optimizer(params, component="os.system", kwargs={}, trust=False)
