"""The offline (top-k) teacher loss and the fused CE: references, padding, chunking, fake tensors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kd import models
from kd.losses import (
    DIVERGENCES,
    ce_loss,
    fused_linear_ce_loss,
    fused_linear_kd_loss,
    fused_linear_topk_kd_loss,
    kd_loss,
)
from kd.losses import fused as fused_module
from kd.training import train
from tests.conftest import tiny_hidden_decoder

IGN = -100
FORWARD_TYPES = ("forward_kl", "jsd", "tvd", "skew_forward_kl", "skew_reverse_kl")
TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(n_shape=(3, 11), d=12, v=40, k=6, T=1.0, seed=1):
    """Student hidden/weight, teacher logits and its stored top-k (descending), labels."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(*n_shape, d, generator=g).requires_grad_()
    ws = (torch.randn(v, d, generator=g) * 0.5).requires_grad_()
    zt = torch.randn(*n_shape, v, generator=g) * 2.0
    lp, ids = torch.log_softmax(zt / T, dim=-1).topk(k, dim=-1)
    labels = torch.randint(0, v, n_shape, generator=g)
    labels.view(-1)[1::3] = IGN
    return hs, ws, zt, ids, lp, labels


def _grads(loss, hs, ws):
    return torch.autograd.grad(loss, (hs, ws))


def _assert_same(got, want):
    (loss, ce, kd, gh, gw), (rloss, rce, rkd, rgh, rgw) = got, want
    for a, b in ((loss, rloss), (ce, rce), (kd, rkd), (gh, rgh), (gw, rgw)):
        torch.testing.assert_close(a.float(), b.float(), **TOL)


def _topk(hs, ws, ids, lp, labels, **kw):
    loss, ce, kd = fused_linear_topk_kd_loss(hs, ws, ids, lp, labels, **kw)
    assert not ce.requires_grad and not kd.requires_grad
    return (loss, ce, kd, *_grads(loss, hs, ws))


def _dense(hs, ws, labels, kd_of_logits, r):
    """Autograd reference from full student logits: (1 - r) CE + r kd_of_logits(zs)."""
    zs = hs @ ws.t()
    ce = ce_loss(zs, labels)
    kd = kd_of_logits(zs)
    loss = (1 - r) * ce + r * kd
    return (loss, ce.detach(), kd.detach(), *_grads(loss, hs, ws))


# ---- references ------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", ["bucket", "renorm"])
@pytest.mark.parametrize("T", [1.0, 2.0])
@pytest.mark.parametrize("div", DIVERGENCES)
def test_full_support_equals_dense_teacher(div, T, tail):
    """k = V: both tails reduce to the dense teacher (fused_linear_kd_loss and kd_loss)."""
    v = 30
    hs, ws, zt, ids, lp, labels = _inputs(v=v, k=v, T=T)
    kw = dict(divergence=div, temperature=T, kd_ratio=0.3, beta=0.4, skew_alpha=0.2)
    got = _topk(hs, ws, ids, lp, labels, tail=tail, chunk_size=5, **kw)
    # The teacher as hidden states through an identity projection gives logits zt.
    eye = torch.eye(v)
    loss, ce, kd = fused_linear_kd_loss(hs, ws, zt, eye, labels, chunk_size=7, **kw)
    _assert_same(got, (loss, ce, kd, *_grads(loss, hs, ws)))
    ref = _dense(
        hs,
        ws,
        labels,
        lambda zs: kd_loss(zs, zt, labels, divergence=div, temperature=T, beta=0.4, skew_alpha=0.2),
        0.3,
    )
    _assert_same(got, ref)


@pytest.mark.parametrize("T", [1.0, 2.0])
@pytest.mark.parametrize("div", FORWARD_TYPES)
def test_renorm_equals_full_vocab_divergence_against_truncated_teacher(div, T):
    """Lumping the zero-teacher entries into one tail category is exact for forward types."""
    hs, ws, zt, ids, lp, labels = _inputs(k=5, T=T)
    kw = dict(divergence=div, temperature=T, beta=0.3, skew_alpha=0.2)
    got = _topk(hs, ws, ids, lp, labels, tail="renorm", chunk_size=4, kd_ratio=0.6, **kw)
    # Teacher exactly zero outside its top-k, renormalised over it (softmax of the masked logits).
    zt_top = torch.full_like(zt, float("-inf")).scatter(-1, ids, zt.gather(-1, ids))
    ref = _dense(hs, ws, labels, lambda zs: kd_loss(zs, zt_top, labels, **kw), 0.6)
    _assert_same(got, ref)


@pytest.mark.parametrize("div", ["reverse_kl", "symmetric_kl"])
def test_renorm_reverse_types_renormalise_the_student_over_the_top_k(div):
    T = 2.0
    hs, ws, zt, ids, lp, labels = _inputs(k=5, T=T)
    got = _topk(hs, ws, ids, lp, labels, tail="renorm", divergence=div, temperature=T, kd_ratio=0.5)
    # Both sides restricted to the k ids and renormalised there: kd_loss of the gathered logits.
    ref = _dense(
        hs,
        ws,
        labels,
        lambda zs: kd_loss(
            zs.gather(-1, ids), zt.gather(-1, ids), labels, divergence=div, temperature=T
        ),
        0.5,
    )
    _assert_same(got, ref)
    assert torch.isfinite(got[2]) and got[2] > 0


def _ref_divergence64(p: torch.Tensor, q: torch.Tensor, div: str, beta: float, a: float):
    """Hand-written divergences between probability vectors (last dim), float64."""

    def kl(x, y):
        return (torch.special.xlogy(x, x) - torch.special.xlogy(x, y)).sum(-1)

    if div == "forward_kl":
        return kl(p, q)
    if div == "reverse_kl":
        return kl(q, p)
    if div == "symmetric_kl":
        return 0.5 * (kl(p, q) + kl(q, p))
    if div == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    if div == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    if div == "skew_forward_kl":
        return kl(p, a * p + (1 - a) * q)
    return kl(q, a * q + (1 - a) * p)


@pytest.mark.parametrize("T", [1.0, 2.0])
@pytest.mark.parametrize("div", DIVERGENCES)
def test_bucket_equals_hand_written_k_plus_one_categories(div, T):
    hs, ws, _, ids, lp, labels = _inputs(k=4, T=T)
    beta, a, r = 0.3, 0.2, 0.4
    got = _topk(
        hs, ws, ids, lp, labels, tail="bucket", divergence=div, temperature=T, kd_ratio=r,
        beta=beta, skew_alpha=a, chunk_size=3,
    )  # fmt: skip

    h64, w64 = hs.detach().double().requires_grad_(), ws.detach().double().requires_grad_()
    zs = h64 @ w64.t()
    q = torch.softmax(zs / T, dim=-1)
    q_top = q.gather(-1, ids)
    q_cat = torch.cat([q_top, (1 - q_top.sum(-1, keepdim=True))], dim=-1)
    p_top = lp.double().exp()
    p_tail = (1 - p_top.sum(-1, keepdim=True)).clamp_min(torch.finfo(torch.float32).tiny)
    p_cat = torch.cat([p_top, p_tail], dim=-1)
    mask = labels != IGN
    kd = _ref_divergence64(p_cat, q_cat, div, beta, a)[mask].mean() * T * T
    ce = torch.nn.functional.cross_entropy(zs[mask], labels[mask])
    loss = (1 - r) * ce + r * kd
    _assert_same(got, (loss, ce.detach(), kd.detach(), *_grads(loss, h64, w64)))


def test_bucket_penalises_the_tail_renorm_ignores_it_for_forward_kl():
    """Sanity of the two modes: only bucket sees the student's mass outside the teacher's top-k."""
    hs, ws, _, ids, lp, labels = _inputs(k=3)
    _, _, kd_b = fused_linear_topk_kd_loss(hs, ws, ids, lp, labels, tail="bucket")
    _, _, kd_r = fused_linear_topk_kd_loss(hs, ws, ids, lp, labels, tail="renorm")
    assert kd_b > 0 and kd_r > 0 and not torch.isclose(kd_b, kd_r)


# ---- padding, masking, chunking, dtypes ------------------------------------------------------


def _garbage_padding(ids, lp, labels, seed=3):
    g = torch.Generator().manual_seed(seed)
    pad = (labels == IGN)[..., None].expand_as(ids)
    bad_ids = torch.randint(-(10**6), 10**6, ids.shape, generator=g)
    return torch.where(pad, bad_ids, ids), torch.where(pad, float("nan"), lp)


@pytest.mark.parametrize("tail", ["bucket", "renorm"])
@pytest.mark.parametrize("fake_path", [False, True])
def test_padding_rows_are_ignored_whatever_they_hold(tail, fake_path, monkeypatch):
    hs, ws, _, ids, lp, labels = _inputs(k=5, T=2.0)
    kw = dict(tail=tail, divergence="jsd", temperature=2.0, chunk_size=4)
    want = _topk(hs, ws, ids, lp, labels, **kw)
    bad_ids, bad_lp = _garbage_padding(ids, lp, labels)
    if fake_path:
        # The fake-tensor code path (every row kept, weighted by the mask) on real tensors.
        monkeypatch.setattr(fused_module, "is_fake", lambda t: True)
    got = _topk(hs, ws, bad_ids, bad_lp, labels, **kw)
    _assert_same(got, want)
    assert all(torch.isfinite(t).all() for t in got)


def test_all_masked_gives_connected_zeros():
    hs, ws, _, ids, lp, labels = _inputs()
    bad_ids, bad_lp = _garbage_padding(ids, lp, torch.full_like(labels, IGN))
    loss, ce, kd = fused_linear_topk_kd_loss(hs, ws, bad_ids, bad_lp, torch.full_like(labels, IGN))
    assert loss.requires_grad
    loss.backward()
    assert loss.item() == ce.item() == kd.item() == 0.0
    assert hs.grad.shape == hs.shape and ws.grad.shape == ws.shape
    assert hs.grad.abs().max() == 0 and ws.grad.abs().max() == 0


@pytest.mark.parametrize("tail", ["bucket", "renorm"])
def test_chunk_size_does_not_change_the_numbers(tail):
    hs, ws, _, ids, lp, labels = _inputs(k=7, T=2.0)
    kw = dict(tail=tail, divergence="skew_reverse_kl", temperature=2.0, kd_ratio=0.8)
    want = _topk(hs, ws, ids, lp, labels, chunk_size=10_000, **kw)
    for chunk in (1, 3):
        _assert_same(_topk(hs, ws, ids, lp, labels, chunk_size=chunk, **kw), want)


def test_float16_logprobs_and_int32_ids_are_accepted():
    hs, ws, _, ids, lp, labels = _inputs(k=8)
    lp16 = lp.half()
    got = _topk(hs, ws, ids.int(), lp16, labels, divergence="reverse_kl")
    want = _topk(hs, ws, ids, lp16.float(), labels, divergence="reverse_kl")
    _assert_same(got, want)
    assert all(torch.isfinite(t).all() for t in got)


def test_flat_positions_equal_batched_positions():
    hs, ws, _, ids, lp, labels = _inputs()
    want = _topk(hs, ws, ids, lp, labels)
    got = _topk(hs, ws, ids.reshape(-1, ids.size(-1)), lp.reshape(-1, lp.size(-1)),
                labels.reshape(-1))  # fmt: skip
    _assert_same(got, want)


def test_vocab_restricts_the_student_softmax_to_the_shared_entries():
    """vocab < Vs: the student's KD softmax runs over the first vocab entries, like a teacher with
    a smaller vocabulary on the online path."""
    v, vt = 40, 33
    hs, ws, _, _, _, labels = _inputs(v=v)
    g = torch.Generator().manual_seed(5)
    zt = torch.randn(*labels.shape, vt, generator=g)
    lp, ids = torch.log_softmax(zt, dim=-1).topk(vt, dim=-1)
    got = _topk(hs, ws, ids, lp, labels, vocab=vt, divergence="tvd")
    loss, ce, kd = fused_linear_kd_loss(hs, ws, zt, torch.eye(vt), labels, divergence="tvd")
    _assert_same(got, (loss, ce, kd, *_grads(loss, hs, ws)))


def test_bad_inputs_raise_value_error():
    hs, ws, _, ids, lp, labels = _inputs(v=40, k=4)
    with pytest.raises(ValueError, match="unknown tail"):
        fused_linear_topk_kd_loss(hs, ws, ids, lp, labels, tail="spread")
    with pytest.raises(ValueError, match="unknown divergence"):
        fused_linear_topk_kd_loss(hs, ws, ids, lp, labels, divergence="kl")
    out = ids.clone()
    out[0, 0, 0] = 40  # labelled position (row 0 is labelled)
    with pytest.raises(ValueError, match=r"outside \[0, 40\)"):
        fused_linear_topk_kd_loss(hs, ws, out, lp, labels)
    with pytest.raises(ValueError, match="positions differ"):
        fused_linear_topk_kd_loss(hs, ws, ids[:, :-1], lp[:, :-1], labels)
    with pytest.raises(ValueError, match="must be integer"):
        fused_linear_topk_kd_loss(hs, ws, lp, lp, labels)
    with pytest.raises(ValueError, match="top-k size"):
        wide = torch.zeros(*labels.shape, 41, dtype=torch.long)
        fused_linear_topk_kd_loss(hs, ws, wide, wide.float(), labels)


def _saved_numels(fn) -> list[int]:
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_keeps_no_full_logits_for_backward():
    n, d, v = 96, 8, 300
    hs, ws, _, ids, lp, labels = _inputs(n_shape=(n,), d=d, v=v, k=16)
    saved = _saved_numels(lambda: fused_linear_topk_kd_loss(hs, ws, ids, lp, labels, chunk_size=8))
    assert saved and max(saved) <= max(n * d, v * d) < n * v
    saved = _saved_numels(lambda: fused_linear_ce_loss(hs, ws, labels, chunk_size=8))
    assert saved and max(saved) <= max(n * d, v * d) < n * v


@pytest.mark.parametrize("tail", ["bucket", "renorm"])
def test_runs_forward_and_backward_under_fake_tensor_mode(tail):
    with FakeTensorMode():
        hs = torch.randn(2, 64, 16, requires_grad=True)
        ws = torch.randn(100, 16, requires_grad=True)
        ids = torch.randint(0, 100, (2, 64, 8))
        lp = torch.randn(2, 64, 8, dtype=torch.float16)
        labels = torch.randint(0, 100, (2, 64))
        labels[:, :5] = IGN
        loss, ce, kd = fused_linear_topk_kd_loss(
            hs, ws, ids, lp, labels, divergence="symmetric_kl", temperature=2.0, chunk_size=32,
            tail=tail,
        )  # fmt: skip
        loss.backward()
        assert loss.shape == ce.shape == kd.shape == ()
        assert hs.grad.shape == hs.shape and ws.grad.shape == ws.shape
        ce_only = fused_linear_ce_loss(hs, ws, labels, chunk_size=32)
        ce_only.backward()
        assert ce_only.shape == ()


# ---- fused CE ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_fused_ce_equals_ce_on_full_logits(chunk):
    hs, ws, _, _, _, labels = _inputs()
    got = fused_linear_ce_loss(hs, ws, labels, chunk_size=chunk)
    g_got = _grads(got, hs, ws)
    want = ce_loss(hs @ ws.t(), labels)
    g_want = _grads(want, hs, ws)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_fused_ce_all_masked_and_bf16():
    hs, ws, _, _, _, labels = _inputs()
    loss = fused_linear_ce_loss(hs, ws, torch.full_like(labels, IGN))
    loss.backward()
    assert loss.item() == 0.0 and hs.grad.abs().max() == 0 and ws.grad.abs().max() == 0
    hb, wb = hs.detach().bfloat16().requires_grad_(), ws.detach().bfloat16().requires_grad_()
    loss = fused_linear_ce_loss(hb, wb, labels)
    loss.backward()
    assert loss.dtype == torch.float32 and hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ce_loss(hs @ ws.t(), labels), rtol=2e-2, atol=2e-2)


# ---- train.compute_loss / micro_step ----------------------------------------------------------


def _batch(b=2, s=10, vocab=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    labels = tokens.clone()
    labels[:, :3] = IGN
    return tokens, train.shift_labels(labels)


def _student_grads(student):
    return [p.grad.clone() for p in student.parameters() if p.grad is not None]


@pytest.mark.parametrize("tail", ["bucket", "renorm"])
def test_micro_step_with_teacher_topk_equals_the_online_teacher_at_full_support(tail):
    student = tiny_hidden_decoder()
    teacher = models.freeze(tiny_hidden_decoder(seed=5))
    tokens, labels = _batch()
    settings = train.LossSettings(chunk_size=7, temperature=2.0, divergence="jsd", topk_tail=tail)
    n = int((labels != IGN).sum())
    with torch.no_grad():
        t_logits = models.logits_from_hidden(teacher, teacher(tokens))
    lp, ids = torch.log_softmax(t_logits / 2.0, dim=-1).topk(64, dim=-1)
    ids, lp = _garbage_padding(ids, lp, labels)
    got = train.micro_step(
        student, None, tokens, labels, settings=settings, num_tokens_total=2 * n,
        teacher_topk=(ids, lp.half().float()),
    )  # fmt: skip
    g_got = _student_grads(student)
    student.zero_grad()
    want = train.micro_step(
        student, teacher, tokens, labels, settings=settings, num_tokens_total=2 * n
    )
    g_want = _student_grads(student)
    assert len(g_got) == len(g_want) > 0
    # The stored log-probs went through float16: agreement to its precision.
    for a, b in ((got.loss, want.loss), (got.ce, want.ce), (got.kd, want.kd)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert int(got.num_tokens) == n


def test_micro_step_with_teacher_topk_equals_the_reference_gradient():
    """k < V: micro_step's gradient is the autograd gradient of the bucket loss of the logits."""
    student = tiny_hidden_decoder()
    tokens, labels = _batch()
    g = torch.Generator().manual_seed(2)
    lp, ids = torch.log_softmax(torch.randn(2, 10, 64, generator=g), -1).topk(6, dim=-1)
    settings = train.LossSettings(chunk_size=5, kd_ratio=0.7)
    n = int((labels != IGN).sum())
    train.micro_step(
        student, None, tokens, labels, settings=settings, num_tokens_total=n,
        teacher_topk=(ids, lp),
    )  # fmt: skip
    g_got = _student_grads(student)
    student.zero_grad()
    zs = models.logits_from_hidden(student, student(tokens))
    q = torch.softmax(zs, dim=-1)
    q_top = q.gather(-1, ids)
    q_cat = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], dim=-1)
    p_top = lp.exp()
    p_cat = torch.cat([p_top, 1 - p_top.sum(-1, keepdim=True)], dim=-1)
    mask = labels != IGN
    kd = _ref_divergence64(p_cat, q_cat, "forward_kl", 0.5, 0.1)[mask].mean()
    (0.3 * ce_loss(zs, labels) + 0.7 * kd).backward()
    for a, b in zip(g_got, _student_grads(student), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_compute_loss_refuses_teacher_and_topk_or_a_non_plain_output(monkeypatch):
    student = tiny_hidden_decoder()
    tokens, labels = _batch()
    topk = (torch.zeros(2, 10, 3, dtype=torch.long), torch.zeros(2, 10, 3))
    settings = train.LossSettings()
    with pytest.raises(ValueError, match="not both"):
        train.compute_loss(student, student, tokens, labels, settings=settings, teacher_topk=topk)
    monkeypatch.setattr(models, "has_plain_output", lambda m: False)
    with pytest.raises(ValueError, match="plain output projection"):
        train.compute_loss(student, None, tokens, labels, settings=settings, teacher_topk=topk)


def test_no_teacher_fused_ce_path_equals_the_logits_path():
    student = tiny_hidden_decoder()
    tokens, labels = _batch()
    out = {}
    for fused in (True, False):
        student.zero_grad()
        settings = train.LossSettings(kd_ratio=0.0, fused=fused, chunk_size=3)
        loss, ce, kd = train.compute_loss(student, None, tokens, labels, settings=settings)
        loss.backward()
        assert float(kd) == 0.0 and not ce.requires_grad
        out[fused] = (loss.detach(), _student_grads(student))
    torch.testing.assert_close(out[True][0], out[False][0], **TOL)
    for a, b in zip(out[True][1], out[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
