"""What only a CUDA device shows (marker ``gpu``; skipped without one; ``scripts/gpu_check.py``
runs them on every lent GPU): the bf16 step on the device against the same step on the CPU, fused
AdamW's CUDA kernel, ``optimizer_in_cpu`` (torchao's CPUOffloadOptimizer), ``compile: true``,
on-policy rollouts with the KV cache on the device, a LoRA student, validation, and the peak-memory
fields of ``metrics.jsonl``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kd import cli
from tests.conftest import make_config, read_metrics, write_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(assets: dict[str, Path], out: Path, **top) -> list[dict]:
    cfg = make_config(assets, out, device="cuda", dtype="bf16", **top)
    cfg["memory"] = {"budget_gib": None, "check": "error"}
    path = write_config(out.parent / f"{out.name}.yaml", cfg)
    assert cli.main(["run", "kd", "--config", str(path)]) == 0
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert rows and all(math.isfinite(r["loss"]) for r in rows)
    return rows


def test_bf16_step_on_cuda_matches_the_cpu_step(assets, tmp_path):
    """Step 1's loss (same weights, rows, bf16) on CUDA is the CPU's within bf16 rounding, and
    step 2 (after the CUDA optimizer step) stays close: a tensor on the wrong device, a missing
    dtype cast or a CUDA-only kernel difference would break one of them."""
    cuda = _run(assets, tmp_path / "cuda", max_steps_per_epoch=2)
    cfg = make_config(assets, tmp_path / "cpu", device="cpu", dtype="bf16", max_steps_per_epoch=2)
    assert cli.main(["run", "kd", "--config", str(write_config(tmp_path / "cpu.yaml", cfg))]) == 0
    cpu = [r for r in read_metrics(tmp_path / "cpu") if "loss" in r]
    for key in ("loss", "ce_loss", "kd_loss"):
        assert cuda[0][key] == pytest.approx(cpu[0][key], rel=2e-2), key
    assert cuda[1]["loss"] == pytest.approx(cpu[1]["loss"], rel=5e-2)


def test_peak_memory_fields_are_logged_on_cuda(assets, tmp_path):
    rows = _run(assets, tmp_path / "run", max_steps_per_epoch=2)
    for r in rows:
        assert 0 < r["peak_memory_gib"] <= r["peak_memory_reserved_gib"]
        # the device's used memory counts the CUDA context on top of the allocator's segments
        assert r["device_used_gib"] > r["peak_memory_reserved_gib"]
        assert r["planned_peak_gib"] > r["peak_memory_gib"]


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_fused_and_foreach_on_cuda_agree(assets, tmp_path, fused):
    opt = {"_component_": "torch.optim.AdamW", "lr": 1e-3, "fused": fused}
    rows = _run(assets, tmp_path / f"f{fused}", optimizer=opt, max_steps_per_epoch=3)
    ref = _run(
        assets,
        tmp_path / "ref",
        optimizer={"_component_": "torch.optim.AdamW", "lr": 1e-3, "foreach": True},
        max_steps_per_epoch=3,
    )
    assert rows[-1]["loss"] == pytest.approx(ref[-1]["loss"], rel=2e-2)


def test_optimizer_in_cpu_trains_on_one_cuda_device(assets, tmp_path):
    rows = _run(assets, tmp_path / "off", optimizer_in_cpu=True, max_steps_per_epoch=3)
    ref = _run(assets, tmp_path / "on", max_steps_per_epoch=3)
    assert rows[-1]["loss"] == pytest.approx(ref[-1]["loss"], rel=5e-2)


def test_compile_true_on_cuda(assets, tmp_path):
    rows = _run(assets, tmp_path / "compiled", compile=True, max_steps_per_epoch=2)
    ref = _run(assets, tmp_path / "eager", max_steps_per_epoch=2)
    assert rows[0]["loss"] == pytest.approx(ref[0]["loss"], rel=2e-2)


def test_lora_on_policy_and_validation_on_cuda(assets, tmp_path):
    """A LoRA student sampling with the KV cache on the device (seq_kd: the teacher samples too),
    then a validation pass: every tensor the rollout makes must be on the device."""
    val = {
        "dataset": {
            "_component_": "torchtune.datasets.instruct_dataset",
            "source": "json",
            "data_files": str(assets["data"]),
            "split": "train",
        },
        "every_n_steps": 1,
        "max_batches": 2,
    }
    rows = _run(
        assets,
        tmp_path / "lora_op",
        lora=True,
        on_policy={"lmbda": 1.0, "max_new_tokens": 8, "temperature": 1.0, "seq_kd": True},
        validation=val,
        max_steps_per_epoch=2,
    )
    out = tmp_path / "lora_op"
    vals = [r for r in read_metrics(out) if "val_loss" in r]
    assert vals and all(math.isfinite(r["val_loss"]) for r in vals)
    assert rows[-1]["time_generate_s"] > 0
