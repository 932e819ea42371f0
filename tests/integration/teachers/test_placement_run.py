"""``teacher_device``: the teacher on a device of its own, its signal moved to the student's.

On the CPU the numbers are checked (the placement forced on ``cpu`` beside ``cpu``: the head's
copy, the tied swap and the move of the hidden states run, as real CPU copies); on the fake
accelerator the devices are (``cuda:1`` beside ``cuda:0`` become ``fakecuda:1`` and
``fakecuda:0``, and a tensor left on the teacher's device where the student's is needed raises).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kd import cli, models
from kd.memory import fake_device
from kd.teachers import build, placement
from kd.teachers.model import ModelTeacher
from tests.conftest import (
    FAKE_ACCELERATOR,
    REAL_CUDA,
    STUDENT,
    builder,
    checkpointer_node,
    make_config,
    write_config,
)
from tests.integration.runtime.test_offload_run import _assert_same, _kd_run

if not REAL_CUDA:  # never beside a real CUDA device (tests/conftest.py)
    fake_device.register()
pytestmark = FAKE_ACCELERATOR


@pytest.fixture
def placed(monkeypatch) -> list[placement.HeadOnStudentDevice]:
    """Every head the runs place on the student's device."""
    made: list[placement.HeadOnStudentDevice] = []
    init = placement.HeadOnStudentDevice.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(placement.HeadOnStudentDevice, "__init__", spy)
    return made


def _tied_teacher(assets: dict, out: Path) -> dict:
    """The student's own (tied) model as a plain teacher_model."""
    return {
        "teacher_model": builder(STUDENT),
        "teacher_checkpointer": checkpointer_node(assets["student"], out / "tt"),
    }


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_teacher_device_is_exact(assets, tmp_path, monkeypatch, placed, tied):
    """The teacher placed on "another" device (the CPU, forced apart from the student's CPU):
    the resident run's losses, gradient norms, validation and weights."""
    val = {
        "dataset": make_config(assets, tmp_path)["dataset"],
        "every_n_steps": 1,
        "max_batches": 1,
        "batch_size": 2,
    }
    top = _tied_teacher(assets, tmp_path) if tied else {}
    base = _kd_run(assets, tmp_path / "resident", validation=val, **top)
    assert not placed
    monkeypatch.setattr(build, "same_device", lambda a, b: False)
    moved = _kd_run(assets, tmp_path / "placed", validation=val, teacher_device="cpu", **top)
    assert len(placed) == 1
    head = placed[0]
    assert (head.on_teacher is not None) == tied and head.places
    # Between forwards the projection in the module is the student-device copy.
    assert all(m._parameters[n] is head.on_student for m, n in head.places)
    _assert_same(base, moved)


def test_transformers_teacher_device_is_exact(assets, tmp_path, monkeypatch, placed):
    """The same with a transformers (kd.hf) teacher: its lm_head's copy on the student's side."""
    from tests.integration.test_testing_device_steps import hf_node

    top = {"teacher_model": hf_node(assets["teacher"]), "teacher_checkpointer": None}
    base = _kd_run(assets, tmp_path / "resident", **top)
    monkeypatch.setattr(build, "same_device", lambda a, b: False)
    moved = _kd_run(assets, tmp_path / "placed", teacher_device="cpu", **top)
    (head,) = placed
    assert head.on_teacher is None and head.places
    _assert_same(base, moved)


def test_teacher_device_same_as_student_places_nothing(assets, tmp_path, placed):
    """teacher_device naming the student's device is the resident run (nothing copied)."""
    base = _kd_run(assets, tmp_path / "resident")
    same = _kd_run(assets, tmp_path / "same", teacher_device="cpu")
    assert not placed
    _assert_same(base, same)


def _step(assets, tmp_path, **top):
    from kd.testing_device import fake_device_step
    from tests.integration.test_testing_device_steps import gpu_config

    cfg = gpu_config(assets, tmp_path / "out", device="cuda:0", teacher_device="cuda:1", **top)
    return fake_device_step(write_config(tmp_path / "c.yaml", cfg))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_teacher_device_fake_step(assets, tmp_path, placed, tied):
    """cuda:1 beside cuda:0 on the fake accelerator: the teacher's layers live on device 1, the
    student, its gradients and states and the teacher's projection copy on device 0, and the
    step (micro-batches, optimizer step, validation) runs without a device mismatch."""
    top = _tied_teacher(assets, tmp_path) if tied else {}
    result = _step(assets, tmp_path, **top)
    assert result.stats.stepped
    one, zero = torch.device(fake_device.FAKE_DEVICE, 1), torch.device(fake_device.FAKE_DEVICE, 0)
    teacher = result.recipe.teacher
    assert isinstance(teacher, ModelTeacher) and teacher.device == one
    assert {p.device for p in models.decoder_layers(teacher.model).parameters()} == {one}
    assert {p.device for p in result.recipe.student.parameters()} == {zero}
    assert models.output_weight(teacher.model).device == zero
    (head,) = placed
    if tied:  # the embedding the forward reads stays on the teacher's device
        assert head.on_teacher is not None and head.on_teacher.device == one


def test_signal_left_on_teacher_device_raises(assets, tmp_path, monkeypatch):
    """The fake accelerator tells the devices apart: a teacher whose hidden states are not moved
    to the student's device fails the step, as CUDA would."""
    from kd.memory.fake_device import FakeTensorDeviceMismatchError

    init = ModelTeacher.__init__

    def unmoved(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.signal_device = None

    monkeypatch.setattr(ModelTeacher, "__init__", unmoved)
    with pytest.raises(FakeTensorDeviceMismatchError):
        _step(assets, tmp_path)


@pytest.mark.parametrize(
    ("top", "says"),
    [
        ({"teacher_device": "cuda:7"}, "teacher_device: cuda:7 is not on this machine"),
        ({"teacher_device": "gpu1"}, "teacher_device: 'gpu1' is not a device kd runs on"),
        (
            {"teacher_device": "cpu", "teacher_offload": "park"},
            "teacher_device: cpu and teacher_offload both say",
        ),
        (
            {"teacher_device": "cpu", "on_policy": {"seq_kd": True}},
            "does not sample from the teacher",
        ),
    ],
    ids=["missing-device", "not-a-device", "offload", "seq-kd"],
)
def test_teacher_device_refusals(assets, tmp_path, capsys, top, says):
    """One line, exit 2, before any weight is read."""
    cfg = make_config(assets, tmp_path / "out", **top)
    path = write_config(tmp_path / "c.yaml", cfg)
    assert cli.main(["run", "kd_single_device", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert not (tmp_path / "out" / "final").exists()


def test_teacher_device_refused_under_torchrun():
    """Several ranks shard the teacher instead: refused in one line naming the key."""
    from kd.errors import KDUserError

    with pytest.raises(KDUserError, match="teacher_device: cuda:1 .* torchrun"):
        placement.check_teacher_device("cuda:1", distributed=True)


def test_self_teacher_refused(assets, tmp_path, capsys):
    cfg = make_config(assets, tmp_path / "out", teacher_device="cpu", self_teacher={"mode": "lora"})
    path = write_config(tmp_path / "c.yaml", cfg)
    assert cli.main(["validate", "--config", str(path)]) == 2
    assert "teacher_device: cpu needs one local teacher model" in capsys.readouterr().err


def _plan_json(capsys, budget: float, *overrides: str) -> tuple[int, dict]:
    import json

    code = cli.main(
        [
            "plan",
            "--config",
            "qwen2_5/14B_to_3B_full_single_device",
            "--budget-gib",
            str(budget),
            "--json",
            *overrides,
        ]
    )
    return code, json.loads(capsys.readouterr().out)


def test_plan_per_device(capsys):
    """kd plan with teacher_device: the student's device keeps the teacher's output projection
    (a copy) and the hidden states it receives, not its weights or forward; the teacher's own
    device is planned beside, against the same per-device budget."""
    gib = 1 << 30
    vocab, dim, params = 152064, 5120, 14_770_033_664  # Qwen2.5-14B-Instruct, untied
    _, one = _plan_json(capsys, 40)
    code, two = _plan_json(capsys, 40, "device=cuda:0", "teacher_device=cuda:1")
    assert one["teacher_device"] is None
    assert one["components"]["teacher_weights"] == pytest.approx(2 * params / gib, abs=1e-3)
    assert two["components"]["teacher_weights"] == pytest.approx(2 * vocab * dim / gib, abs=1e-3)
    own = two["teacher_device"]
    assert own["device"] == "cuda:1"
    assert own["components"]["teacher_weights"] == pytest.approx(
        2 * (params - vocab * dim) / gib, abs=1e-3
    )
    assert own["components"]["teacher_forward"] > 0
    assert two["peak_gib"] < one["peak_gib"] - 20 and code == 0 and two["fits"]
    # The teacher's device over the budget is a plan that does not fit, whatever the student's.
    from kd.memory.estimate import Estimate

    est = Estimate({"forward": {"activations": 10}}, "forward", 0, 0, 0, teacher_device={"t": 20})
    assert est.fits(20) and not est.fits(15)
    # The student's device named as the teacher's: one device, planned as before.
    _, same = _plan_json(capsys, 40, "device=cuda", "teacher_device=cuda:0")
    assert same["teacher_device"] is None and same["peak_gib"] == one["peak_gib"]
