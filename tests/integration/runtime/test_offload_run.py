"""Activation offloading and teacher parking change where tensors live, never the numbers: each
mode's `kd run` gives the resident run's losses, gradient norms and trained weights (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kd import cli
from kd.memory import fake_device
from kd.runtime import offload
from kd.teachers import parking
from tests.conftest import FAKE_ACCELERATOR, REAL_CUDA, make_config, read_metrics, write_config
from tests.integration.teachers.test_cross_run import letter_data, other_tok_teacher  # noqa: F401
from tests.integration.teachers.test_multi_cross import _cross_member, _multi
from tests.integration.teachers.test_multi_run import _member

SGD = {"_component_": "torch.optim.SGD", "lr": 0.5}

# The fake accelerator's device must exist before this process's first backward starts autograd's
# device threads (a backward on the CPU first leaves no queue for it: an internal assert later).
if not REAL_CUDA:  # never beside a real CUDA device (tests/conftest.py)
    fake_device.register()
pytestmark = FAKE_ACCELERATOR


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
    for key in ("loss", "ce_loss", "kd_loss", "grad_norm", "val_loss", "val_kd_loss"):
        va, vb = [r[key] for r in ma if key in r], [r[key] for r in mb if key in r]
        assert va == pytest.approx(vb, abs=1e-6) and len(va) == len(vb), key
    assert any("loss" in r for r in ma)
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


@pytest.fixture
def parked(monkeypatch) -> list[parking.ParkedWeights]:
    """Every parked teacher the run builds."""
    made: list[parking.ParkedWeights] = []
    init = parking.ParkedWeights.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(parking.ParkedWeights, "__init__", spy)
    return made


def _parked_step(cfg: dict, tmp: Path, *overrides: str):
    """``test_fake_device_steps.step`` for a parked teacher: the student on the fake device, the
    teacher's weights on the host but its output projection (and buffers) there too."""
    from kd.memory.fake_device import FAKE_DEVICE
    from kd.testing_device import fake_device_step

    result = fake_device_step(write_config(tmp / "c.yaml", cfg), overrides)
    for kind, types in result.devices.items():
        want = {FAKE_DEVICE, "cpu"} if kind.startswith("teacher") else {FAKE_DEVICE}
        assert types == want, (kind, types)
    assert result.stats.stepped
    return result


def _assert_parked(p: parking.ParkedWeights) -> None:
    """Between forwards every parked weight is its host copy, and it was brought in."""
    assert p.forwards > 0 and p.moved_bytes > 0 and p.parked_bytes > 0
    copies = p.host_copies()
    assert copies and all(now is host and host.device.type == "cpu" for now, host in copies)


@pytest.mark.parametrize("mode", ["park", "stream"])
def test_parked_teacher_is_exact(assets, tmp_path, parked, mode):
    """teacher_offload park / stream: the resident run's losses, gradient norms and weights
    (with validation, whose teacher forwards park it too)."""
    val = {
        "dataset": make_config(assets, tmp_path)["dataset"],
        "every_n_steps": 1,
        "max_batches": 1,
        "batch_size": 2,
    }
    base = _kd_run(assets, tmp_path / "resident", validation=val)
    off = _kd_run(assets, tmp_path / mode, validation=val, teacher_offload=mode)
    assert len(parked) == 1
    _assert_parked(parked[0])
    _assert_same(base, off)
    assert any("val_loss" in r for r in off[0])


def test_everything_offloaded_is_exact(assets, tmp_path, parked, managers, capsys):
    """Activation offloading and a streamed teacher together: still the resident run. On
    device: cpu each key says, in one line, that it saves nothing there."""
    top = {"enable_activation_checkpointing": True}
    base = _kd_run(assets, tmp_path / "resident", **top)
    assert "saves no memory" not in capsys.readouterr().err
    off = _kd_run(
        assets, tmp_path / "off", enable_activation_offloading=True, teacher_offload="stream", **top
    )
    assert len(parked) == 1 and len(managers) == 1
    _assert_same(base, off)
    said = [line for line in capsys.readouterr().err.splitlines() if "saves no memory" in line]
    assert said == [
        "kd: teacher_offload: stream on device cpu saves no memory (host memory is this "
        "machine's RAM, the device's own); set teacher_offload=none",
        "kd: enable_activation_offloading on device cpu saves no memory (host memory is this "
        "machine's RAM, the device's own); set enable_activation_offloading=false",
    ]


# ------------------------------------------------------------------ on the fake accelerator
@pytest.mark.parametrize(
    ("ac", "world_size"), [(False, 1), (True, 1), (True, 2)], ids=["plain", "ac", "ac-fsdp2"]
)
def test_activation_offloading_device_step(assets, tmp_path, managers, ac, world_size):
    """The device step with offloading: every activation goes to a host copy and comes back to
    the device it was saved from (one left on the host would be a device mismatch), one device
    and FSDP2."""
    from tests.integration.test_testing_device_steps import gpu_config, step

    cfg = gpu_config(
        assets,
        tmp_path / "out",
        enable_activation_checkpointing=ac,
        enable_activation_offloading=True,
    )
    step(cfg, tmp_path, world_size=world_size)
    assert len(managers) == 1 and managers[0].offloaded_bytes > 0
    assert not managers[0].tracker


@pytest.mark.parametrize("case", ["transformers-lora", "on-policy"])
def test_activation_offloading_other_steps(assets, tmp_path, managers, case):
    """A transformers LoRA student, and a student that samples its own completions (no autograd
    in the rollout: nothing is offloaded there) before its offloaded training forward."""
    from tests.integration.test_testing_device_steps import (
        gpu_config,
        heldout,
        on_transformers,
        step,
    )

    if case == "transformers-lora":
        cfg = gpu_config(
            assets, tmp_path / "out", enable_activation_offloading=True, validation=heldout(assets)
        )
        on_transformers(cfg, assets, student=True, teacher=False, lora=True)
    else:
        node = {"lmbda": 1.0, "max_new_tokens": 4, "temperature": 1.0}
        cfg = gpu_config(
            assets, tmp_path / "out", enable_activation_offloading=True, on_policy=node
        )
    step(cfg, tmp_path)
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


def test_a_transposed_activation_comes_back_with_its_strides():
    """A dense saved tensor that is not contiguous (a transposed view) comes back with its own
    strides, as torchtune's host copy keeps them: a compiled layer's backward asserts them
    (``compile`` with ``enable_activation_offloading`` and no checkpointing failed its first
    backward: "expected ... stride 28==1")."""
    seen: list[tuple[int, ...]] = []

    class Saves(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            seen.append(t.stride())
            return grad * 2

    x = torch.randn(16, 64, requires_grad=True)
    manager = offload.HostActivations("cpu")
    with manager:
        y = (x * 1.0).t()  # [64, 16], strides (1, 64)
        out = Saves.apply(y).sum()
    assert manager.offloaded_bytes == 16 * 64 * 4 and not y.is_contiguous()
    out.backward()
    assert seen == [y.stride()]
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0), atol=0, rtol=0)


@pytest.mark.slow
def test_compiled_layers_with_offloaded_activations_are_exact(assets, tmp_path, managers):
    """compile: the compiled layers' saved tensors go to host copies and come back with the
    strides their backward asserts; the same numbers as without offloading."""
    top = {"compile": True}
    base = _kd_run(assets, tmp_path / "resident", **top)
    off = _kd_run(assets, tmp_path / "offload", enable_activation_offloading=True, **top)
    assert len(managers) == 1 and managers[0].offloaded_bytes > 0
    _assert_same(base, off)


def test_compute_stream_is_read_live():
    """Off CUDA there is one stream (None); torchtune's cached default stream is never used."""
    manager = offload.HostActivations("cpu")
    assert manager.s0 is None
    manager.s0 = "stale"
    assert manager.s0 is None


@pytest.mark.parametrize(
    ("mode", "backend"),
    [("park", "torchtune"), ("stream", "torchtune"), ("park", "transformers")],
)
def test_parked_teacher_device_step(assets, tmp_path, parked, mode, backend):
    """The device step with the teacher parked: its forward, the validation's and its sampling
    (seq_kd) run on device copies; a weight left in host memory would be a device mismatch."""
    from tests.integration.test_testing_device_steps import gpu_config, heldout, on_transformers

    cfg = gpu_config(
        assets,
        tmp_path / "out",
        teacher_offload=mode,
        validation=heldout(assets),
        on_policy={"lmbda": 0.0, "seq_kd": True, "max_new_tokens": 4, "temperature": 1.0},
    )
    if backend == "transformers":
        on_transformers(cfg, assets, student=False, teacher=True, lora=False)
    result = _parked_step(cfg, tmp_path)
    assert result.validated and result.stats.sampled["teacher"][0] == 2
    assert len(parked) == 1
    _assert_parked(parked[0])


def test_several_parked_teachers_device_step(assets, tmp_path, parked):
    """teachers: each member parked and brought in in turn."""
    from tests.integration.test_testing_device_steps import (
        gpu_config,
        no_teacher_nodes,
        two_model_members,
    )

    out = tmp_path / "out"
    members = two_model_members(assets, tmp_path, out)
    cfg = no_teacher_nodes(
        gpu_config(assets, out, teachers={"combine": "weights", "members": members})
    )
    _parked_step(cfg, tmp_path, "teacher_offload=park")
    assert len(parked) == 2
    for p in parked:
        _assert_parked(p)


# ------------------------------------------------------------------ refused settings
@pytest.mark.parametrize(
    ("top", "says"),
    [
        ({"teacher_quantization": "int8"}, "does not park an int8 teacher"),
        ({"compile": True}, "does not park compiled layers (compile)"),
        (
            {"teacher_model": None, "teacher_checkpointer": None, "kd_ratio": 0.0},
            "needs a local teacher model",
        ),
    ],
    ids=["int8", "compile", "no-teacher"],
)
def test_teacher_offload_refusals(assets, tmp_path, capsys, top, says):
    """One line naming teacher_offload and the fix, exit 2, before anything loads."""
    cfg = make_config(assets, tmp_path / "out", teacher_offload="park", **top)
    path = write_config(tmp_path / "c.yaml", cfg)
    assert cli.main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kd: error: teacher_offload: park ")
    assert says in err[0] and err[0].endswith("set teacher_offload=none")
    assert not (tmp_path / "out").exists()


def test_teacher_offload_refuses_a_member_with_another_tokenizer(
    assets,
    other_tok_teacher,  # noqa: F811
    letter_data,  # noqa: F811
    tmp_path,
    capsys,
):
    """A member of teachers: with cross_tokenizer is loaded resident (kd.teachers.cross), so
    parking is refused for it as for a top-level cross_tokenizer (it ran resident while the plan
    counted it parked)."""
    out = tmp_path / "out"
    members = [
        _member("p", assets["teacher"], out),
        _cross_member("x", other_tok_teacher),
    ]
    teachers = {"combine": "weights", "members": members}
    cfg = _multi(assets, out, letter_data, teachers, teacher_offload="park")
    path = write_config(tmp_path / "c.yaml", cfg)
    assert cli.main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "kd: error: teacher_offload: park does not park a teacher with another tokenizer "
        "(cross_tokenizer); set teacher_offload=none"
    ]
    assert not out.exists()


HIDDEN = {"layer_map": ["embed:embed", "0:0", "1:1", "norm:norm"], "loss": "cosine"}


def test_hidden_state_teacher_streamed_is_exact(assets, tmp_path, parked):
    """Hidden-state distillation reads the teacher's layers' outputs during its forward: the same
    with each layer brought in for its own forward."""
    base = _kd_run(assets, tmp_path / "resident", hidden_states=HIDDEN)
    off = _kd_run(assets, tmp_path / "stream", hidden_states=HIDDEN, teacher_offload="stream")
    assert len(parked) == 1
    _assert_parked(parked[0])
    _assert_same(base, off)
    for key in ("hidden_loss",):
        va, vb = [r[key] for r in base[0] if key in r], [r[key] for r in off[0] if key in r]
        assert va and va == pytest.approx(vb, abs=1e-6)


@pytest.mark.parametrize("mode", ["park", "stream"])
def test_hidden_state_teacher_parked_device_step(assets, tmp_path, parked, mode):
    from tests.integration.test_testing_device_steps import gpu_config, heldout

    cfg = gpu_config(
        assets,
        tmp_path / "out",
        hidden_states=HIDDEN,
        validation=heldout(assets),
        teacher_offload=mode,
    )
    assert _parked_step(cfg, tmp_path).validated
    _assert_parked(parked[0])


def test_parked_teacher_refused_under_fsdp2(assets, tmp_path):
    """Over several ranks the teacher is sharded: parking is refused before any weight loads,
    naming fsdp.cpu_offload."""
    from kd.errors import KDUserError
    from kd.testing_device import fake_device_step
    from tests.integration.test_testing_device_steps import gpu_config

    cfg = gpu_config(assets, tmp_path / "out", teacher_offload="park")
    with pytest.raises(KDUserError, match=r"teacher_offload: park runs on one device.*fsdp\.cpu"):
        fake_device_step(write_config(tmp_path / "c.yaml", cfg), world_size=2)


def test_streamed_teacher_prefetches_the_next_layer(monkeypatch):
    """stream: when a unit's forward starts, the next unit's copy is started (off CUDA at once,
    on one stream): at most the unit computing and the next are on the device; after the
    forward none is, and none is left pending."""
    from kd import models
    from tests.conftest import tiny_hidden_decoder

    model = tiny_hidden_decoder()
    models.freeze(model)
    p = parking.ParkedWeights(model, torch.device("cpu"), mode="stream")
    layers = list(models.decoder_layers(model))
    seen: list[int] = []
    # From the start (not only after a first forward) the modules hold the host copies.
    assert all(now is host for now, host in p.host_copies())

    def count(*_args):
        on = [
            u
            for u in p._units
            if u.slots and all(m._parameters[n] is not s.host for s in u.slots for m, n in s.places)
        ]
        seen.append(len(on) + len(p._pending))

    for layer in layers:
        layer.register_forward_pre_hook(count)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8)))
    assert p.prefetched == len(layers)  # layer 0 with the embedding, each layer the next
    assert seen == [2] * (len(layers) - 1) + [1]
    assert not p._pending
    assert all(now is host for now, host in p.host_copies())


@pytest.mark.parametrize("mode", ["park", "stream"])
def test_a_teacher_parked_on_the_cpu_is_not_copied_again(mode):
    """device: cpu: the host copies are on the device already; a unit brought in is their
    storage, not a second copy of the teacher in the same memory (park held two during each
    forward). Between forwards the modules hold the host copies, as on CUDA."""
    from kd import models
    from tests.conftest import tiny_hidden_decoder

    model = tiny_hidden_decoder()
    models.freeze(model)
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        want = model(tokens)
    p = parking.ParkedWeights(model, torch.device("cpu"), mode=mode)
    layer = models.decoder_layers(model)[0]
    seen: list[bool] = []  # per parameter brought in: it shares its host copy's storage

    def same_storage(*_args):
        for u in p._units:
            for slot in u.slots:
                for m, n in slot.places:
                    if m._parameters[n] is not slot.host:  # brought in
                        seen.append(m._parameters[n].data_ptr() == slot.host.data_ptr())

    layer.register_forward_pre_hook(same_storage)
    with torch.no_grad():
        got = model(tokens)
    assert seen and all(seen)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert all(now is host for now, host in p.host_copies())


def test_streamed_teacher_copies_wait_for_the_forward_three_units_back():
    """stream on CUDA: before the host copies unit ``i`` it waits until unit ``i - 3``'s forward
    is done on the device (an event recorded after that forward), so the allocator can give the
    freed blocks to the copy instead of taking new ones (an H100 reserved 4 GiB more without
    it). Events stand in for CUDA's here; each forward's events are its own."""
    from kd import models
    from tests.conftest import tiny_hidden_decoder

    log: list[tuple[str, int]] = []

    class Event:
        made = 0

        def __init__(self) -> None:
            self.n = Event.made
            Event.made += 1

        def record(self) -> None:
            log.append(("record", self.n))

        def synchronize(self) -> None:
            log.append(("wait", self.n))

    model = tiny_hidden_decoder()
    models.freeze(model)
    model.layers.extend(tiny_hidden_decoder(seed=1).layers)  # 4 decoder layers: 5 units
    models.freeze(model)
    p = parking.ParkedWeights(model, torch.device("cpu"), mode="stream")
    p._throttle = parking._Throttle(3, Event)
    for forward in range(2):
        log.clear()
        Event.made = 0
        with torch.no_grad():
            model(torch.randint(0, 64, (2, 8)))
        # units: the embedding (0) and layers 1-4, each prefetched by the unit before it; the
        # copy of unit 3 waits for unit 0's forward, that of unit 4 for unit 1's (event n is
        # unit n's)
        assert log == [
            ("record", 0),
            ("record", 1),
            ("wait", 0),
            ("record", 2),
            ("wait", 1),
            ("record", 3),
            ("record", 4),
        ], (forward, log)
        assert not p._throttle._done  # the last unit's forward clears what was left


def test_optimizer_in_cpu_on_the_cpu_is_refused_before_anything_is_written(
    assets, tmp_path, capsys
):
    cfg = make_config(assets, tmp_path / "out", optimizer_in_cpu=True)
    path = str(write_config(tmp_path / "c.yaml", cfg))
    for command in (["validate", "--config", path], ["run", "kd", "--config", path]):
        assert cli.main(command) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert err == [
            "kd: error: optimizer_in_cpu: offloads optimizer states from one GPU (device=cuda, "
            "one rank); with several ranks use fsdp.cpu_offload=true, on CPU set "
            "optimizer_in_cpu=false"
        ], err
    assert not (tmp_path / "out").exists()
