"""Teacher weights that load but hold no teacher: an output projection of zeros (a file saved from
an empty model) made every teacher distribution uniform, and ``kd run`` trained the student
toward it without a word. Refused when loaded, for every kind that loads a teacher model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from kd.testing import write_hf_tokenizer
from tests.conftest import make_config, run_kd


def _zero_copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    weights = safetensors.torch.load_file(dest / "model.safetensors")
    zero = {k: torch.zeros_like(v) for k, v in weights.items()}
    safetensors.torch.save_file(zero, dest / "model.safetensors", metadata={"format": "pt"})
    return write_hf_tokenizer(dest)


def _hf(folder: Path) -> dict:
    return {"_component_": "kd.hf.causal_lm", "path": str(folder)}


@pytest.mark.parametrize("kind", ["checkpointer", "hf", "int8", "hidden_states", "cross", "member"])
def test_a_teacher_of_zero_weights_is_refused_naming_its_folder(assets, tmp_path, capsys, kind):
    bad = _zero_copy(assets["teacher"], tmp_path / "zero")
    out = tmp_path / "run"
    cfg = make_config(assets, out, max_steps_per_epoch=1)
    if kind == "checkpointer":
        cfg["teacher_checkpointer"]["checkpoint_dir"] = str(bad)
    else:
        cfg["teacher_model"] = _hf(bad)
        del cfg["teacher_checkpointer"]
    if kind == "int8":
        pytest.importorskip("torchao")
        cfg["teacher_quantization"] = "int8"
    elif kind == "hidden_states":
        cfg["hidden_states"] = {"layer_map": ["0:0", "1:1"]}
    elif kind == "cross":
        cfg["cross_tokenizer"] = {}
    elif kind == "member":
        good = {"name": "good", "teacher_model": _hf(assets["teacher"])}
        cfg["teachers"] = {
            "members": [good, {"name": "bad", "teacher_model": cfg.pop("teacher_model")}]
        }
    assert run_kd(cfg, tmp_path / "c.yaml") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert line.startswith(f"kd: error: teacher_model: the output projection loaded from {bad} ")
    assert "is all zeros" in line, line
    assert not (out / "metrics.jsonl").exists() or "step" not in (out / "metrics.jsonl").read_text()
