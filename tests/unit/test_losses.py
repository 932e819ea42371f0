"""Tests of kd.losses: divergences vs float64 references, fused vs unfused, memory and fake tensors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kd.config.schema import DIVERGENCES as SCHEMA_DIVERGENCES
from kd.losses import DIVERGENCES, ce_loss, fused_linear_kd_loss, kd_loss, per_token_divergence

IGN = -100


def _ref_divergence(zs: torch.Tensor, zt: torch.Tensor, div: str, T: float, beta: float, a: float):
    """Float64 per-position reference written from the definitions (probabilities, not log-probs)."""
    v = min(zs.size(-1), zt.size(-1))
    q = torch.softmax(zs[..., :v].double() / T, -1)
    p = torch.softmax(zt[..., :v].double() / T, -1)

    def kl(x, y):
        return (x * (x.log() - y.log())).sum(-1)

    if div == "forward_kl":
        return kl(p, q)
    if div == "reverse_kl":
        return kl(q, p)
    if div == "symmetric_kl":
        return 0.5 * (kl(p, q) + kl(q, p))
    if div == "jsd":
        if beta == 0.0:
            return kl(p, q)
        if beta == 1.0:
            return kl(q, p)
        m = beta * p + (1 - beta) * q
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    if div == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    if div == "skew_forward_kl":
        return kl(p, a * p + (1 - a) * q)
    assert div == "skew_reverse_kl"
    return kl(q, a * q + (1 - a) * p)


def _ref_kd(zs, zt, labels, div, T=1.0, beta=0.5, a=0.1):
    d = _ref_divergence(zs, zt, div, T, beta, a)
    mask = labels != IGN
    return d[mask].sum() / mask.sum().clamp_min(1) * T * T


def _data(shape=(3, 7), vs=40, vt=40, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(*shape, vs, generator=g) * scale
    zt = torch.randn(*shape, vt, generator=g) * scale
    labels = torch.randint(0, min(vs, vt), shape, generator=g)
    labels.view(-1)[::4] = IGN
    return zs, zt, labels


def test_divergences_match_schema():
    assert DIVERGENCES == SCHEMA_DIVERGENCES


@pytest.mark.parametrize("div", DIVERGENCES)
@pytest.mark.parametrize("T", [1.0, 2.5])
def test_each_divergence_matches_float64_reference(div, T):
    zs, zt, labels = _data()
    got = kd_loss(zs, zt, labels, divergence=div, temperature=T, beta=0.3, skew_alpha=0.2)
    want = _ref_kd(zs, zt, labels, div, T, beta=0.3, a=0.2)
    assert got.dtype == torch.float32
    assert got.item() > 1e-3
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("div", DIVERGENCES)
def test_zero_when_teacher_equals_student(div):
    zs, _, labels = _data()
    assert abs(kd_loss(zs, zs.clone(), labels, divergence=div, temperature=2.0).item()) < 1e-6


@pytest.mark.parametrize("div", DIVERGENCES)
def test_padded_vocabulary_uses_shared_entries(div):
    zs, zt, labels = _data(vs=40, vt=40)
    padded_t = torch.cat([zt, torch.randn(*zt.shape[:-1], 9) * 10], -1)
    padded_s = torch.cat([zs, torch.randn(*zs.shape[:-1], 5) * 10], -1)
    want = kd_loss(zs, zt, labels, divergence=div)
    torch.testing.assert_close(kd_loss(zs, padded_t, labels, divergence=div), want)
    torch.testing.assert_close(kd_loss(padded_s, zt, labels, divergence=div), want)


@pytest.mark.parametrize("div", DIVERGENCES)
def test_all_masked_gives_zero_and_finite_grads(div):
    zs, zt, labels = _data()
    zs.requires_grad_()
    labels = torch.full_like(labels, IGN)
    loss = kd_loss(zs, zt, labels, divergence=div) + ce_loss(zs, labels)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(zs.grad).all() and zs.grad.abs().max() == 0


def test_bf16_logits_are_computed_in_fp32():
    zs, zt, labels = _data()
    zs16, zt16 = zs.bfloat16(), zt.bfloat16()
    got = kd_loss(zs16, zt16, labels, temperature=2.0)
    assert got.dtype == torch.float32
    want = _ref_kd(zs16.float(), zt16.float(), labels, "forward_kl", 2.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    ce = ce_loss(zs16, labels)
    assert ce.dtype == torch.float32
    torch.testing.assert_close(ce, ce_loss(zs16.float(), labels))


def test_ce_loss_matches_cross_entropy():
    zs, _, labels = _data()
    want = torch.nn.functional.cross_entropy(zs.reshape(-1, 40), labels.reshape(-1))
    torch.testing.assert_close(ce_loss(zs, labels), want)


def test_unknown_divergence_raises_value_error():
    zs, zt, labels = _data()
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        kd_loss(zs, zt, labels, divergence="kl")
    with pytest.raises(ValueError, match="unknown divergence"):
        per_token_divergence(zs, zt, "bogus", 0.5, 0.1)
    with pytest.raises(ValueError, match="unknown divergence"):
        fused_linear_kd_loss(
            torch.randn(4, 3), torch.randn(5, 3), torch.randn(4, 3), torch.randn(5, 3),
            torch.zeros(4, dtype=torch.long), divergence="fkl",
        )  # fmt: skip


# ---- TRL-style properties -------------------------------------------------------------------


@pytest.mark.parametrize("div", DIVERGENCES)
def test_uniform_logits_give_zero(div):
    labels = torch.zeros(4, dtype=torch.long)
    zs = torch.zeros(4, 11)
    zt = torch.full((4, 11), 3.0)  # uniform too: softmax is shift invariant
    assert abs(kd_loss(zs, zt, labels, divergence=div).item()) < 1e-7


def test_jsd_is_symmetric_at_half_beta_and_not_otherwise():
    zs, zt, labels = _data()
    a = kd_loss(zs, zt, labels, divergence="jsd", beta=0.5)
    b = kd_loss(zt, zs, labels, divergence="jsd", beta=0.5)
    torch.testing.assert_close(a, b)
    a = kd_loss(zs, zt, labels, divergence="jsd", beta=0.2)
    b = kd_loss(zt, zs, labels, divergence="jsd", beta=0.2)
    assert abs(a.item() - b.item()) > 1e-4


def test_jsd_and_skew_edge_cases():
    zs, zt, labels = _data()

    def loss(div, **kw):
        return kd_loss(zs, zt, labels, divergence=div, temperature=1.5, **kw)

    fkl, rkl = loss("forward_kl"), loss("reverse_kl")
    # TRL's generalized_jsd_loss convention at the edges (the mixture formula is 0 there).
    torch.testing.assert_close(loss("jsd", beta=0.0), fkl)
    torch.testing.assert_close(loss("jsd", beta=1.0), rkl)
    # Generalized JSD is bounded by the KLs it interpolates and by beta-entropy bounds.
    for beta in (0.1, 0.5, 0.9):
        j = loss("jsd", beta=beta)
        assert 0 < j.item() < min(fkl.item(), rkl.item())
    torch.testing.assert_close(loss("skew_forward_kl", skew_alpha=0.0), fkl)
    torch.testing.assert_close(loss("skew_reverse_kl", skew_alpha=0.0), rkl)
    assert abs(loss("skew_forward_kl", skew_alpha=1.0).item()) < 1e-6
    assert abs(loss("skew_reverse_kl", skew_alpha=1.0).item()) < 1e-6
    torch.testing.assert_close(loss("symmetric_kl"), 0.5 * (fkl + rkl))


def test_forward_kl_gradient_equals_torchtune_forward_kl_loss():
    """torchtune's ForwardKLLoss is the soft cross-entropy H(p, q) = KL(p||q) + H(p): same gradient
    w.r.t. the student logits as our true KL, value larger by the mean teacher entropy."""
    from kd._torchtune import ForwardKLLoss

    zs, zt, labels = _data(shape=(21,))
    ours_in = zs.clone().requires_grad_()
    tt_in = zs.clone().requires_grad_()
    ours = kd_loss(ours_in, zt, labels, divergence="forward_kl", temperature=1.0)
    theirs = ForwardKLLoss(ignore_index=IGN)(tt_in, zt, labels)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_in.grad, tt_in.grad, rtol=1e-5, atol=1e-7)
    p = torch.softmax(zt.double(), -1)
    entropy = -(p * p.log()).sum(-1)[labels != IGN].mean()
    torch.testing.assert_close(theirs.double() - ours.double(), entropy, rtol=1e-5, atol=1e-6)


# ---- fused path ------------------------------------------------------------------------------


def _fused_inputs(n_shape=(3, 13), ds=12, dt=20, vs=50, vt=57, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    hs = (torch.randn(*n_shape, ds, generator=g)).to(dtype).requires_grad_()
    ws = (torch.randn(vs, ds, generator=g) * 0.5).to(dtype).requires_grad_()
    ht = torch.randn(*n_shape, dt, generator=g).to(dtype).requires_grad_()
    wt = (torch.randn(vt, dt, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vs, n_shape, generator=g)
    labels.view(-1)[1::3] = IGN
    return hs, ws, ht, wt, labels


def _unfused(hs, ws, ht, wt, labels, div, T, r, beta=0.5, a=0.1):
    zs = hs @ ws.t()
    with torch.no_grad():
        zt = ht @ wt.t()
    ce = ce_loss(zs, labels)
    kd = kd_loss(zs, zt, labels, divergence=div, temperature=T, beta=beta, skew_alpha=a)
    return (1 - r) * ce + r * kd, ce, kd


@pytest.mark.parametrize("div", DIVERGENCES)
@pytest.mark.parametrize("T", [1.0, 2.0])
def test_fused_equals_unfused_values_and_gradients(div, T):
    hs, ws, ht, wt, labels = _fused_inputs()
    loss, ce, kd = fused_linear_kd_loss(
        hs, ws, ht, wt, labels, divergence=div, temperature=T, kd_ratio=0.3, chunk_size=7,
        beta=0.4, skew_alpha=0.2,
    )  # fmt: skip
    loss.backward()
    got = (hs.grad.clone(), ws.grad.clone())
    hs.grad = ws.grad = None
    ref, ref_ce, ref_kd = _unfused(hs, ws, ht, wt, labels, div, T, 0.3, beta=0.4, a=0.2)
    ref.backward()
    for a, b in ((loss, ref), (ce, ref_ce), (kd, ref_kd)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], hs.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ws.grad, rtol=1e-5, atol=1e-5)
    assert ht.grad is None and wt.grad is None  # nothing flows to the teacher
    assert not ce.requires_grad and not kd.requires_grad
    torch.testing.assert_close(loss, 0.7 * ce + 0.3 * kd)


def test_fused_all_masked_returns_connected_zeros():
    hs, ws, ht, wt, labels = _fused_inputs()
    loss, ce, kd = fused_linear_kd_loss(hs, ws, ht, wt, torch.full_like(labels, IGN))
    assert loss.requires_grad
    loss.backward()
    assert loss.item() == ce.item() == kd.item() == 0.0
    assert hs.grad.shape == hs.shape and ws.grad.shape == ws.shape
    assert hs.grad.abs().max() == 0 and ws.grad.abs().max() == 0


def test_fused_bf16_inputs_give_bf16_grads_close_to_fp32():
    hs, ws, ht, wt, labels = _fused_inputs(dtype=torch.bfloat16)
    loss, _, _ = fused_linear_kd_loss(hs, ws, ht, wt, labels, temperature=2.0, chunk_size=16)
    loss.backward()
    assert loss.dtype == torch.float32
    assert hs.grad.dtype == ws.grad.dtype == torch.bfloat16
    h32, w32 = hs.detach().float().requires_grad_(), ws.detach().float().requires_grad_()
    ref, _, _ = fused_linear_kd_loss(h32, w32, ht.float(), wt.float(), labels, temperature=2.0)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ws.grad.float(), w32.grad, rtol=5e-2, atol=2e-3)
    torch.testing.assert_close(hs.grad.float(), h32.grad, rtol=5e-2, atol=2e-3)


def _saved_numels(fn) -> list[int]:
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_fused_keeps_no_full_logits_for_backward():
    n, d, v = 96, 8, 300
    hs, ws, ht, wt, labels = _fused_inputs(n_shape=(n,), ds=d, dt=d, vs=v, vt=v)
    fused = _saved_numels(lambda: fused_linear_kd_loss(hs, ws, ht, wt, labels, chunk_size=16))
    unfused = _saved_numels(lambda: _unfused(hs, ws, ht, wt, labels, "forward_kl", 1.0, 0.5))
    assert fused, "the fused loss saves d(hidden) and d(weight)"
    assert max(fused) <= max(n * d, v * d) < n * v  # only hidden- or weight-sized tensors
    assert max(unfused) >= n * v  # sanity: the logits path does save full logits


def test_fused_runs_forward_and_backward_under_fake_tensor_mode():
    with FakeTensorMode():
        hs = torch.randn(2, 64, 16, requires_grad=True)
        ws = torch.randn(100, 16, requires_grad=True)
        ht = torch.randn(2, 64, 24, dtype=torch.bfloat16)
        wt = torch.randn(110, 24, dtype=torch.bfloat16)
        labels = torch.randint(0, 100, (2, 64))
        labels[:, :5] = IGN
        loss, ce, kd = fused_linear_kd_loss(
            hs, ws, ht, wt, labels, divergence="jsd", temperature=2.0, chunk_size=32
        )
        loss.backward()
        assert loss.shape == ce.shape == kd.shape == ()
        assert hs.grad.shape == hs.shape and ws.grad.shape == ws.shape


def test_fused_fake_path_masks_like_the_real_path():
    """The fake-tensor code path (all rows kept, weighted by the mask) gives the real answer."""
    from kd.losses import fused as losses

    hs, ws, ht, wt, labels = _fused_inputs()
    want, _, _ = fused_linear_kd_loss(hs, ws, ht, wt, labels, chunk_size=8)
    want.backward()
    want_grads = (hs.grad.clone(), ws.grad.clone())
    hs.grad = ws.grad = None
    orig = losses.is_fake
    losses.is_fake = lambda t: True
    try:
        got, _, _ = fused_linear_kd_loss(hs, ws, ht, wt, labels, chunk_size=8)
    finally:
        losses.is_fake = orig
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(hs.grad, want_grads[0])
    torch.testing.assert_close(ws.grad, want_grads[1])


def test_fused_second_backward_raises():
    hs, ws, ht, wt, labels = _fused_inputs()
    loss, _, _ = fused_linear_kd_loss(hs, ws, ht, wt, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


def test_fused_frozen_student_weight_gives_hidden_grad_only():
    hs, ws, ht, wt, labels = _fused_inputs()
    ws.requires_grad_(False)
    loss, _, _ = fused_linear_kd_loss(hs, ws, ht, wt, labels, temperature=2.0, chunk_size=5)
    loss.backward()
    got = hs.grad.clone()
    hs.grad = None
    ref, _, _ = _unfused(hs, ws, ht, wt, labels, "forward_kl", 2.0, 0.5)
    ref.backward()
    assert ws.grad is None
    torch.testing.assert_close(got, hs.grad, rtol=1e-5, atol=1e-5)
