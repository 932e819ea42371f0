"""Activation offloading and teacher parking change where tensors live, never the numbers: each
mode's `kd run` gives the resident run's losses, gradient norms and trained weights (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_config, read_metrics, write_config
from safetensors.torch import load_file

from kd import cli
from kd.training import offload

SGD = {"_component_": "torch.optim.SGD", "lr": 0.5}


def _kd_run(assets, out: Path, *, lora: bool = False, **top) -> tuple[list[dict], dict]:
    cfg = make_config(
        assets, out, lora=lora, optimizer=SGD, max_steps_per_epoch=2, save_every_n_steps=None, **top
    )
    path = write_config(out.parent / f"{out.name}.yaml", cfg)
    assert cli.main(["run", "kd_single_device", "--config", str(path)]) == 0
    weights: dict = {}
    for f in sorted((out / "final").glob("*.safetensors")):
        weights.update(load_file(f))
    return read_metrics(out), weights


def _assert_same(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> None:
    (ma, wa), (mb, wb) = a, b
    for key in ("loss", "ce_loss", "kd_loss", "grad_norm"):
        assert [r[key] for r in ma] == pytest.approx([r[key] for r in mb], abs=1e-6), key
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0)


@pytest.fixture
def managers(monkeypatch) -> list[offload.HostActivations]:
    """Every activation-offloading manager the run builds (to check that it offloaded)."""
    made: list[offload.HostActivations] = []
    init = offload.HostActivations.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(offload.HostActivations, "__init__", spy)
    return made


@pytest.mark.parametrize(
    ("ac", "lora"), [(False, False), (True, False), (True, True)], ids=["plain", "ac", "ac-lora"]
)
def test_activation_offloading_is_exact(assets, tmp_path, managers, ac, lora):
    """enable_activation_offloading: the same losses, gradient norms and weights as without, with
    and without activation checkpointing; the saved activations did go to host copies."""
    top = {"enable_activation_checkpointing": ac}
    base = _kd_run(assets, tmp_path / "resident", lora=lora, **top)
    assert not managers
    off = _kd_run(assets, tmp_path / "offload", lora=lora, enable_activation_offloading=True, **top)
    assert len(managers) == 1 and managers[0].offloaded_bytes > 0
    assert not managers[0].tracker, "every offloaded activation came back in backward"
    _assert_same(base, off)


# ------------------------------------------------------------------ on the fake accelerator
@pytest.mark.parametrize(
    ("ac", "world_size"), [(False, 1), (True, 1), (True, 2)], ids=["plain", "ac", "ac-fsdp2"]
)
def test_activation_offloading_device_step(assets, tmp_path, managers, ac, world_size):
    """The device step with offloading: every activation goes to a host copy and comes back to
    the device it was saved from (one left on the host would be a device mismatch), one device
    and FSDP2."""
    from test_fake_device_steps import gpu_config, step

    cfg = gpu_config(
        assets,
        tmp_path / "out",
        enable_activation_checkpointing=ac,
        enable_activation_offloading=True,
    )
    step(cfg, tmp_path, world_size=world_size)
    assert len(managers) == 1 and managers[0].offloaded_bytes > 0
    assert not managers[0].tracker


# ------------------------------------------------------------------ the two stream fixes
def test_parameter_views_stay_and_slices_are_dense(monkeypatch):
    """A linear layer's saved ``weight.t()`` is not offloaded (only the input is); a saved slice
    with a storage offset is handed over dense, and its gradient is exact."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(8, 65, requires_grad=True)
    manager = offload.HostActivations("cpu")
    handed: list[torch.Tensor] = []  # what torchtune's pack copies to the host from
    empty_like = torch.empty_like

    def spy(t, *args, **kwargs):
        handed.append(t)
        return empty_like(t, *args, **kwargs)

    monkeypatch.setattr(torch, "empty_like", spy)
    with manager:
        sliced = x[:, 1:]  # storage offset 1, not contiguous
        out = lin(sliced).square().sum()
    monkeypatch.undo()
    assert len(handed) == 2 and all(t.storage_offset() == 0 and t.is_contiguous() for t in handed)
    kept = [t for t, moved in manager.tracker.values() if not moved]
    host = [t for t, moved in manager.tracker.values() if moved]
    out.backward()
    want = torch.autograd.grad((lin(x[:, 1:]).square().sum()), x)[0]
    torch.testing.assert_close(x.grad, want, atol=0, rtol=0)
    assert manager.offloaded_bytes == 2 * 8 * 64 * 4  # the input of lin and of square; no weight
    assert len(host) == 2 and all(t.storage_offset() == 0 and t.is_contiguous() for t in host)
    assert any(t._base is lin.weight for t in kept)  # weight.t() stayed where it was


def test_compute_stream_is_read_live():
    """Off CUDA there is one stream (None); torchtune's cached default stream is never used."""
    manager = offload.HostActivations("cpu")
    assert manager.s0 is None
    manager.s0 = "stale"
    assert manager.s0 is None
