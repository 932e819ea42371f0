"""Every kind of step ``kd run kd`` takes on a GPU, run on the fake accelerator in CI.

Each case writes a real config (``device: cuda``, bf16) and runs the recipe's own preload, load,
one optimizer step (forward, loss, backward, clip, optimizer step, scheduler) and, with
validation, one validation pass on :mod:`kd.memory.fake_device` (:func:`kd.testing_device.
fake_device_step`): a tensor left on the CPU where the device needed it raises
``FakeTensorDeviceMismatchError`` and fails the case.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_config, write_config

from kd.memory.fake_device import FAKE_DEVICE
from kd.testing_device import fake_device_step

COSINE = {
    "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
    "num_warmup_steps": 1,
}


def gpu_config(assets: dict, out: Path, **top: Any) -> dict:
    """The tiny run as on a GPU: cuda, bf16, clipped, a cosine schedule, 2 micro-batches of 2."""
    settings: dict[str, Any] = dict(
        device="cuda",
        dtype="bf16",
        batch_size=2,
        gradient_accumulation_steps=2,
        clip_grad_norm=1.0,
        lr_scheduler=COSINE,
        max_steps_per_epoch=2,
    )
    settings.update(top)
    return make_config(assets, out, **settings)


def step(cfg: dict, tmp: Path, *overrides: str, world_size: int = 1):
    """The recipe's step of ``cfg`` on the fake accelerator; checks where everything trained."""
    result = fake_device_step(write_config(tmp / "c.yaml", cfg), overrides, world_size=world_size)
    for kind, types in result.devices.items():
        assert types == {FAKE_DEVICE}, (kind, types)
    assert result.stats.stepped
    return result


def test_model_teacher_full_student(assets, tmp_path):
    result = step(gpu_config(assets, tmp_path / "out"), tmp_path)
    assert result.dtypes == {torch.bfloat16}
