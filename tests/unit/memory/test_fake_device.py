"""The fake accelerator (kd.memory.fake_device): a device of its own under fake tensors, whose host
work is real and whose device mismatches fail, in forward and in backward alike."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from kd.memory.fake_device import (
    FAKE_DEVICE,
    FakeAccelerator,
    FakeDeviceMismatch,
    FakeTensorDeviceMismatchError,
    is_fake_device,
    register,
)
from tests.conftest import FAKE_ACCELERATOR

pytestmark = FAKE_ACCELERATOR


def test_register_is_idempotent_and_names_the_device():
    assert register() == register() == torch.device(FAKE_DEVICE)
    assert is_fake_device(FAKE_DEVICE) and not is_fake_device("cpu")


def test_host_work_is_real_and_device_work_fake():
    with FakeAccelerator():
        host = torch.tensor([3, 1, 2]).sort().values
        assert type(host) is torch.Tensor and host.tolist() == [1, 2, 3]
        device = host.to(FAKE_DEVICE)
        assert isinstance(device, FakeTensor) and device.device.type == FAKE_DEVICE
        # Reads of device values are zeros; a selection keeps every position.
        assert float(device.sum()) == 0.0 and bool((device > 0).all()) is False
        assert (device > 1).nonzero().shape == (3, 1)


def test_a_cpu_tensor_meeting_the_device_in_forward_raises():
    with FakeAccelerator():
        weight = torch.randn(4, 4, device=FAKE_DEVICE, dtype=torch.bfloat16)
        with pytest.raises(FakeTensorDeviceMismatchError):
            torch.ones(2, 4, dtype=torch.bfloat16) @ weight


class _CpuInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad + torch.ones(grad.shape, dtype=grad.dtype)  # made on the CPU: the bug


def test_a_mismatch_in_backward_fails_with_its_frame_instead_of_aborting():
    with pytest.raises(FakeDeviceMismatch, match="made on the CPU: the bug"):
        with FakeAccelerator():
            x = torch.randn(4, device=FAKE_DEVICE, requires_grad=True)
            _CpuInBackward.apply(x).sum().backward()


def test_backward_optimizer_and_checkpointing_run_on_the_device():
    from torch.utils.checkpoint import checkpoint

    with FakeAccelerator(), torch.device(FAKE_DEVICE):
        lin = torch.nn.Linear(8, 8, dtype=torch.bfloat16)
        x = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
        checkpoint(lin, x, use_reentrant=False).float().sum().backward()
        opt = torch.optim.AdamW(lin.parameters(), fused=False)
        opt.step()
        states = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
        assert {v.device.type for v in states} == {FAKE_DEVICE}  # "step" stays a host scalar


def test_attention_takes_a_fused_kernel_on_the_device():
    """No [b, h, s, s] weights are kept: the math path's are what a GPU never holds."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with FakeAccelerator():
        q = torch.randn(1, 4, 16, 8, device=FAKE_DEVICE, dtype=torch.bfloat16)
        kv = torch.randn(1, 2, 16, 8, device=FAKE_DEVICE, dtype=torch.bfloat16)
        with Ops():
            torch.nn.functional.scaled_dot_product_attention(
                q, kv, kv, is_causal=True, enable_gqa=True
            )
    assert any("flash_attention" in op for op in seen) and not any("bmm" in op for op in seen)


def test_a_generator_on_the_device_samples():
    with FakeAccelerator():
        gen = torch.Generator(device=FAKE_DEVICE).manual_seed(1)
        probs = torch.rand(5, device=FAKE_DEVICE).softmax(-1)
        assert torch.multinomial(probs, 1, generator=gen).device.type == FAKE_DEVICE
    assert torch.Generator is torch._C.Generator
