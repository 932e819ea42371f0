"""kd.runtime.prepare: the flags, wrappers and sharding the recipe and the memory traces apply."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from kd import _torchtune as tt
from kd import models
from kd.config import instantiate
from kd.runtime.prepare import ShardSpec, prepare_student, prepare_teacher, shard_spec
from tests.conftest import STUDENT, TEACHER, builder


def _build(spec: dict, *, lora: bool = False, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return instantiate(builder(spec, lora=lora), key="model")


def _hidden_shape(model: torch.nn.Module) -> tuple[int, ...]:
    tokens = torch.randint(0, 256, (2, 5))
    return tuple(model(tokens).shape)


def _wrapped_layers(model: torch.nn.Module) -> list[bool]:
    return [isinstance(layer, CheckpointWrapper) for layer in model.layers]


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_full_student_trains_every_parameter(ac):
    student = _build(STUDENT).eval()  # prepare_student must put it back in train mode

    out = prepare_student(student, lora=False, activation_checkpointing=ac)

    assert out is student
    assert all(p.requires_grad for p in student.parameters())
    assert all(m.training for m in student.modules())
    assert _wrapped_layers(student) == [ac] * STUDENT["layers"]
    assert not any(isinstance(m, FSDPModule) for m in student.modules())
    # Hidden-output mode: final-norm hidden states [b, s, d], not logits [b, s, v].
    assert _hidden_shape(student) == (2, 5, STUDENT["hidden"])


def test_lora_student_trains_only_adapters_and_checkpoints_layers():
    student = _build(STUDENT, lora=True)
    adapter = set(tt.get_adapter_params(student))

    prepare_student(student, lora=True, activation_checkpointing=True)

    trainable = {
        n.replace("._checkpoint_wrapped_module", "")
        for n, p in student.named_parameters()
        if p.requires_grad
    }
    assert trainable == adapter and all("lora_" in n for n in trainable)
    assert _wrapped_layers(student) == [True] * STUDENT["layers"]
    hidden = student(torch.randint(0, 256, (2, 5)))
    assert hidden.shape == (2, 5, STUDENT["hidden"])
    hidden.float().pow(2).mean().backward()  # through the recomputed layers
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
    assert all(p.grad is None for p in student.parameters() if not p.requires_grad)


def test_teacher_is_frozen_in_eval_mode_and_returns_hidden_states():
    teacher = _build(TEACHER)

    out = prepare_teacher(teacher)

    assert out is teacher
    assert not any(p.requires_grad for p in teacher.parameters())
    assert not any(m.training for m in teacher.modules())
    assert _wrapped_layers(teacher) == [False] * TEACHER["layers"]
    assert _hidden_shape(teacher) == (2, 5, TEACHER["hidden"])


@pytest.fixture
def fake_mesh():
    """A fake process group of 2 ranks (this process is rank 0) and its 1-D CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_shard_comes_last_and_keeps_the_flags(fake_mesh):
    spec = ShardSpec(
        device_type="cpu",
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        reshard_after_forward=True,
        cpu_offload=False,
        mesh=fake_mesh,
    )
    student = _build(STUDENT, lora=True, device="meta")
    teacher = _build(TEACHER, device="meta")
    full_rows = models.vocab_size(teacher)

    prepare_student(student, lora=True, activation_checkpointing=True, shard=spec)
    prepare_teacher(teacher, shard=spec)

    for model in (student, teacher):
        assert isinstance(model, FSDPModule)
        # Decoder layers are their own FSDP groups, around the activation-checkpoint wrapper.
        assert all(isinstance(layer, FSDPModule) for layer in model.layers)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert "unembed" in model.__dict__  # hidden-output mode (models.set_hidden_output)
    assert _wrapped_layers(student) == [True] * STUDENT["layers"]
    assert all("lora_" in n for n, p in student.named_parameters() if p.requires_grad)
    assert any(p.requires_grad for p in student.parameters())
    assert not any(p.requires_grad for p in teacher.parameters())
    assert not any(m.training for m in teacher.modules())
    # Rank 0 holds half of each parameter (the teacher's untied output projection: half the rows).
    assert teacher.output.weight.to_local().shape[0] == full_rows // 2


def test_shard_spec_of_the_fsdp_settings():
    from kd.config.run import FSDPSettings

    fsdp = FSDPSettings(cpu_offload=True, reshard_after_forward=False, reduce_dtype="fp32")
    assert shard_spec(fsdp, device_type="cuda", param_dtype=torch.bfloat16) == ShardSpec(
        device_type="cuda",
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        reshard_after_forward=False,
        cpu_offload=True,
    )
    bf16 = FSDPSettings(cpu_offload=False, reshard_after_forward=True, reduce_dtype="bf16")
    spec = shard_spec(bf16, device_type="cpu", param_dtype=torch.float32)
    assert (spec.reduce_dtype, spec.reshard_after_forward, spec.cpu_offload, spec.mesh) == (
        torch.bfloat16,
        True,
        False,
        None,
    )
