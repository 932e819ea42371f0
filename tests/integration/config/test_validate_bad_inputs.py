"""Issue 23 item 5, the failing cases that are not a config key's: weights holding NaN, a moved
but identical model folder on resume, and the metric logger after kd's error line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from kd import cli
from tests.conftest import checkpointer_node, make_config, write_config

RUN = ["run", "kd"]


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("kd: error:")]


def _nan_copy(folder: Path, dest: Path) -> Path:
    """``folder`` with every weight NaN (a damaged export)."""
    shutil.copytree(folder, dest)
    weights = safetensors.torch.load_file(dest / "model.safetensors")
    nan = {k: torch.full_like(v, float("nan")) for k, v in weights.items()}
    safetensors.torch.save_file(nan, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("key", ["model", "teacher_model"])
def test_all_nan_weights_are_blamed_on_the_weights_file(assets, tmp_path, capsys, key):
    """Not 'lower optimizer.lr': no learning rate helps weights loaded as NaN."""
    asset, ckpt_key = (
        ("student", "checkpointer") if key == "model" else ("teacher", "teacher_checkpointer")
    )
    bad = _nan_copy(assets[asset], tmp_path / "nan")
    cfg = make_config(assets, tmp_path / "run", max_steps_per_epoch=2)
    cfg[ckpt_key] = checkpointer_node(bad, tmp_path / "run" / "tt")
    assert cli.main([*RUN, "--config", str(write_config(tmp_path / "c.yaml", cfg))]) == 2
    (line,) = _errors(capsys)
    assert line.startswith(f"kd: error: {key}: ") and f"as loaded from {bad}" in line, line
    assert "the weights file is damaged" in line and "lower optimizer.lr" not in line


def test_disk_logger_that_cannot_start_prints_nothing_after_the_error(assets, tmp_path):
    """torchtune's DiskLogger under a file: kd's error line is the last line on stderr (no
    "Exception ignored in DiskLogger.__del__" from the half-built logger)."""
    import os
    import subprocess
    import sys

    (tmp_path / "blocker").write_text("x")
    logger = {
        "_component_": "torchtune.training.metric_logging.DiskLogger",
        "log_dir": str(tmp_path / "blocker" / "logs"),
    }
    cfg = make_config(assets, tmp_path / "run", max_steps_per_epoch=1, metric_logger=logger)
    config = write_config(tmp_path / "c.yaml", cfg)
    done = subprocess.run(
        [sys.executable, "-m", "kd.cli", *RUN, "--config", str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert done.returncode == 2
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("kd: error: metric_logger: "), lines[-3:]
    assert "DiskLogger failed (NotADirectoryError" in lines[-1]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr
