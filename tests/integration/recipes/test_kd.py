"""End-to-end runs of kd_single_device on tiny HF-format Qwen2 models (teacher with a larger padded
vocab than the student), through the same paths a user takes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kd import cli, models
from kd.config import load_config, validate_config
from kd.config.run import run_config
from kd.recipes.kd import KDRecipe
from kd.runtime.distributed import WorldInfo
from tests.conftest import make_config, read_metrics, write_config

REQUIRED_METRICS = {
    "step",
    "loss",
    "ce_loss",
    "kd_loss",
    "lr",
    "tokens_per_second",
    "grad_norm",
    "peak_memory_gib",
}


def _run_in_process(cfg_dict: dict, tmp_path: Path) -> KDRecipe:
    path = write_config(tmp_path / "cfg.yaml", cfg_dict)
    cfg = load_config(str(path), [])
    validate_config(cfg)
    recipe = KDRecipe(run_config(cfg), world=WorldInfo(world_size=1, rank=0, local_rank=0))
    recipe.preload()
    recipe.load()
    recipe.train()
    recipe.cleanup()
    return recipe


def _hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        return hf(tokens).logits


def _recipe_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return models.logits_from_hidden(model, model(tokens))


def test_full_student_cli_run(assets, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    out = tmp_path / "run"
    wandb_logger = {"_component_": "kd.metrics.WandBLogger", "log_dir": str(out / "wandb_logs")}
    path = write_config(tmp_path / "cfg.yaml", make_config(assets, out, metric_logger=wandb_logger))
    assert cli.main(["run", "kd_single_device", "--config", str(path)]) == 0
    assert list((out / "wandb_logs" / "wandb").glob("offline-run-*"))
    rows = read_metrics(out)
    assert len(rows) == 3
    assert REQUIRED_METRICS <= set(rows[0])
    assert all(r["kd_loss"] > 0 and r["ce_loss"] > 0 for r in rows)
    assert (out / "final" / "model.safetensors").exists()
    assert (out / "final" / "config.json").exists()
    # The student changed: its saved weights differ from the initial checkpoint.
    from safetensors.torch import load_file

    before = load_file(assets["student"] / "model.safetensors")
    after = load_file(out / "final" / "model.safetensors")
    key = "model.layers.0.mlp.down_proj.weight"
    assert not torch.allclose(before[key], after[key])


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_saved_student_matches_transformers(assets, tmp_path, lora):
    recipe = _run_in_process(make_config(assets, tmp_path / "run", lora=lora), tmp_path)
    tokens = torch.randint(0, 278, (2, 12))
    ours = _recipe_logits(recipe.student, tokens)
    theirs = _hf_logits(tmp_path / "run" / "final", tokens)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    if lora:
        assert (tmp_path / "run" / "final" / "adapter" / "adapter_model.safetensors").exists()
        assert (tmp_path / "run" / "final" / "adapter" / "adapter_config.json").exists()


def test_accumulation_equivalence_sgd(assets, tmp_path):
    """batch 4 x accumulation 2 gives the update of batch 8 x accumulation 1 (SGD, fp32)."""
    common = dict(
        optimizer={"_component_": "torch.optim.SGD", "lr": 0.5},
        max_steps_per_epoch=2,
        save_every_n_steps=None,
    )
    a = _run_in_process(
        make_config(assets, tmp_path / "a", batch_size=4, gradient_accumulation_steps=2, **common),
        tmp_path,
    )
    b = _run_in_process(
        make_config(assets, tmp_path / "b", batch_size=8, gradient_accumulation_steps=1, **common),
        tmp_path,
    )
    sa, sb = a.student.state_dict(), b.student.state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=1e-6, rtol=0)
    la, lb = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], abs=1e-6)


def test_torchtune_kd_config_runs(assets, tmp_path):
    """torchtune's own KD config runs with only path and model-size overrides."""
    import torchtune

    tt_cfg = (
        Path(torchtune.__file__).parent.parent
        / "recipes/configs/qwen2/1.5_to_0.5B_KD_lora_single_device.yaml"
    )
    assert tt_cfg.exists()
    tok, out = assets["tokenizer"], tmp_path / "tt_run"

    def sizes(prefix: str, spec: dict) -> list[str]:
        return [
            f"{prefix}.vocab_size={spec['vocab']}",
            f"{prefix}.num_layers={spec['layers']}",
            f"{prefix}.num_heads={spec['heads']}",
            f"{prefix}.num_kv_heads={spec['kv_heads']}",
            f"{prefix}.embed_dim={spec['hidden']}",
            f"{prefix}.intermediate_dim={spec['inter']}",
            f"{prefix}.max_seq_len=256",
            f"{prefix}.norm_eps=1e-6",
            f"{prefix}.tie_word_embeddings={spec['tied']}",
        ]

    from tests.conftest import STUDENT, TEACHER

    overrides = [
        f"output_dir={out}",
        "model._component_=torchtune.models.qwen2.lora_qwen2",
        *sizes("model", STUDENT),
        "teacher_model._component_=torchtune.models.qwen2.qwen2",
        *sizes("teacher_model", TEACHER),
        f"tokenizer.path={tok / 'vocab.json'}",
        f"tokenizer.merges_file={tok / 'merges.txt'}",
        f"tokenizer.special_tokens_path={tok / 'tokenizer.json'}",
        "tokenizer.max_seq_len=64",
        f"checkpointer.checkpoint_dir={assets['student']}",
        f"teacher_checkpointer.checkpoint_dir={assets['teacher']}",
        "dataset._component_=torchtune.datasets.instruct_dataset",
        "dataset.source=json",
        f"dataset.data_files={assets['data']}",
        "~dataset.packed",
        "device=cpu",
        "dtype=fp32",
        "batch_size=4",
        "gradient_accumulation_steps=1",
        "max_steps_per_epoch=2",
        "memory.budget_gib=16",
    ]
    code = cli.main(["run", "kd_single_device", "--config", str(tt_cfg), *overrides])
    assert code == 0
    assert len(read_metrics(out)) == 2
    assert (out / "final" / "adapter" / "adapter_model.safetensors").exists()


def test_misspelled_key_exits_2_one_line(assets, tmp_path):
    cfg = make_config(assets, tmp_path / "run")
    cfg["kd_ration"] = cfg.pop("kd_ratio")
    path = write_config(tmp_path / "bad.yaml", cfg)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "kd.cli", "run", "kd_single_device", "--config", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kd: error")]
    assert len(errors) == 1 and "kd_ration" in errors[0] and "kd_ratio" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_vocab_beyond_student_rejected_before_loading(assets, tmp_path):
    cfg = make_config(assets, tmp_path / "run")
    cfg["model"]["vocab_size"] = 200  # tokenizer emits ids up to 277
    path = write_config(tmp_path / "cfg.yaml", cfg)
    code = cli.main(["run", "kd_single_device", "--config", str(path)])
    assert code == 2
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_resolved_defaults_present(assets, tmp_path):
    path = write_config(tmp_path / "cfg.yaml", make_config(assets, tmp_path / "run"))
    cfg = load_config(str(path), ["kd_loss=reverse_kl"])
    assert cfg.kd_loss.divergence == "reverse_kl"
    assert OmegaConf.select(cfg, "temperature") == 1.0
