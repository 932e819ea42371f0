"""Activation offloading and a parked teacher on a real CUDA device (marker ``gpu``; skipped
without one): the side stream, pinned memory and asynchronous copies, where the CPU path has none.
Each mode gives the resident run's numbers (fp32), and the two stream races torchtune's
``OffloadActivations`` had (axolotl PRs #3833 and #3776) stay fixed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kd import cli
from kd.runtime import offload
from kd.teachers import parking
from tests.conftest import make_config, read_metrics, write_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SGD = {"_component_": "torch.optim.SGD", "lr": 0.5}


def _run(assets: dict[str, Path], out: Path, **top) -> list[dict]:
    cfg = make_config(
        assets, out, device="cuda", dtype="fp32", optimizer=SGD, max_steps_per_epoch=2, **top
    )
    cfg["memory"] = {"budget_gib": None, "check": "error"}
    path = write_config(out.parent / f"{out.name}.yaml", cfg)
    assert cli.main(["run", "kd", "--config", str(path)]) == 0
    return [r for r in read_metrics(out) if "loss" in r]


def _same(a: list[dict], b: list[dict]) -> None:
    for key in ("loss", "ce_loss", "kd_loss", "grad_norm"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], abs=1e-5), key


@pytest.mark.parametrize("ac", [False, True], ids=["plain", "ac"])
def test_activation_offloading_on_cuda_is_exact(assets, tmp_path, ac):
    top = {"enable_activation_checkpointing": ac}
    base = _run(assets, tmp_path / "resident", **top)
    _same(base, _run(assets, tmp_path / "off", enable_activation_offloading=True, **top))


@pytest.mark.parametrize("mode", ["park", "stream"])
def test_parked_teacher_on_cuda_is_exact(assets, tmp_path, mode, monkeypatch):
    made: list[parking.ParkedWeights] = []
    init = parking.ParkedWeights.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(parking.ParkedWeights, "__init__", spy)
    base = _run(assets, tmp_path / "resident")
    _same(base, _run(assets, tmp_path / mode, teacher_offload=mode))
    (p,) = made
    copies = p.host_copies()
    assert copies and all(now is host and host.is_pinned() for now, host in copies)


def _layer() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)
    ).cuda()


def _grads(model: torch.nn.Module, x: torch.Tensor, manager=None) -> list[torch.Tensor]:
    model.zero_grad()
    ctx = (
        manager
        if manager is not None
        else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    )
    with ctx:
        y = model(x[:, 1:])  # a saved slice: storage offset 1, like shifted labels
        for _ in range(8):  # enough saved tensors to cycle the forward stash
            y = model(torch.nn.functional.gelu(y[:, :, :256].contiguous()))
    y.square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_offloading_on_a_side_stream_is_exact():
    """Forward and backward on a stream that is not the default one (what FSDP2 and checkpoint
    recompute do): torchtune cached the default stream and synced against it (#3833); kd reads
    the live one. The saved slice goes over dense (#3776). Repeated, since races are rare."""
    model = _layer()
    x = torch.randn(8, 65, 256, device="cuda", requires_grad=False)
    want = _grads(model, x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # x and the weights were made on the default
    for _ in range(20):
        manager = offload.HostActivations("cuda")
        with torch.cuda.stream(side):
            assert manager.s0 == side
            got = _grads(model, x, manager)
        torch.cuda.synchronize()
        assert manager.offloaded_bytes > 0 and not manager.tracker
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_teacher_on_second_gpu_is_exact(assets, tmp_path):
    """teacher_device: cuda:1 beside device: cuda:0 gives the one-device run's numbers, and the
    teacher's layers did live on cuda:1."""
    from kd.teachers import placement

    made: list[placement.HeadOnStudentDevice] = []
    init = placement.HeadOnStudentDevice.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    base = _run(assets, tmp_path / "resident")  # device: cuda (cuda:0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(placement.HeadOnStudentDevice, "__init__", spy)
        two = _run(assets, tmp_path / "two", teacher_device="cuda:1")
    _same(base, two)
    (head,) = made
    assert head.on_student.device == torch.device("cuda", 0)
    assert all(m._parameters[n] is head.on_student for m, n in head.places)


def test_streamed_teacher_prefetch_is_stream_safe():
    """teacher_offload: stream on CUDA copies layer i + 1 on a side stream while layer i runs:
    the output is the resident model's, bit for bit, over many forwards (a missing wait would
    read a half-copied layer; a missing record_stream would let the next copy overwrite a layer
    still being read), and at most the layer computing and the one prefetched are on the device
    beside the kept projection."""
    from kd import models
    from tests.conftest import tiny_hidden_decoder

    torch.manual_seed(0)
    resident = tiny_hidden_decoder(vocab=512, dim=256).cuda().eval()
    streamed = tiny_hidden_decoder(vocab=512, dim=256).eval()
    streamed.load_state_dict(resident.state_dict())
    models.freeze(resident), models.freeze(streamed)
    p = parking.ParkedWeights(streamed, torch.device("cuda"), mode="stream")
    tokens = torch.randint(0, 512, (4, 64), device="cuda")
    with torch.no_grad():
        want = resident(tokens)
        layer = sum(
            t.numel() * t.element_size() for t in models.decoder_layers(resident)[0].parameters()
        )
        for _ in range(50):
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            got = streamed(tokens)
            torch.cuda.synchronize()
            assert torch.equal(got, want)
            assert torch.cuda.max_memory_allocated() - before < 3 * layer + 64 * got.nbytes
    assert p.prefetched == 50 * len(models.decoder_layers(streamed))
    assert all(now is host and host.is_pinned() for now, host in p.host_copies())


def test_streamed_teacher_reserves_few_layers_beyond_its_tensors():
    """teacher_offload: stream with a device that lags the host (a large batch in 8 layers):
    the caching allocator reserves at most a few layers beyond the tensors' peak, since the host
    waits for the forward three units back before each copy (kd.teachers.parking._Throttle).
    The H100 run of 2026-11-27 reserved 4.0 GiB beyond the tensors streaming a 3B teacher
    before the wait existed; kd.memory.runtime's ``offload_cache`` for ``stream`` can come
    down once this passes on a GPU."""
    from kd import models
    from tests.conftest import tiny_hidden_decoder

    torch.manual_seed(0)
    model = tiny_hidden_decoder(vocab=512, dim=1024).eval()
    model.layers.extend(tiny_hidden_decoder(vocab=512, dim=1024, seed=1).layers)
    model.layers.extend(tiny_hidden_decoder(vocab=512, dim=1024, seed=2).layers)
    model.layers.extend(tiny_hidden_decoder(vocab=512, dim=1024, seed=3).layers)
    models.freeze(model)
    p = parking.ParkedWeights(model, torch.device("cuda"), mode="stream")
    layer = sum(t.numel() * t.element_size() for t in models.decoder_layers(model)[0].parameters())
    tokens = torch.randint(0, 512, (256, 64), device="cuda")
    with torch.no_grad():
        model(tokens)  # warm: kernels loaded, first blocks taken
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(5):
            model(tokens)
        torch.cuda.synchronize()
    extra = torch.cuda.max_memory_reserved() - torch.cuda.max_memory_allocated()
    assert p._throttle.waits > 0
    assert extra <= 4 * layer + (64 << 20), (extra / layer, layer)
