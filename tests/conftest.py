"""Shared fixtures: a tiny Qwen2-style tokenizer, tiny HF-format models and data, written to disk in
the real formats (vocab.json/merges.txt, safetensors + config.json, json data) so the real loading
code runs. Models are built with transformers' classes; the teacher has a larger padded vocab."""

from __future__ import annotations

import json
import os
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

warnings.filterwarnings("ignore")

# Tiny models: one intra-op thread is much faster than two fighting over a 2-core machine, for this
# process and the `kd` subprocesses the tests start (they inherit the environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(1)

STUDENT = dict(vocab=288, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, tied=True)
TEACHER = dict(vocab=320, hidden=48, inter=96, layers=2, heads=4, kv_heads=2, tied=False)
MAX_SEQ_LEN = 64


def write_tokenizer(dest: Path) -> Path:
    from kd._torchtune import QWEN2_5_SPECIAL_TOKENS, bytes_to_unicode

    dest.mkdir(parents=True, exist_ok=True)
    b2u = bytes_to_unicode()
    (dest / "vocab.json").write_text(json.dumps({b2u[b]: b for b in range(256)}))
    (dest / "merges.txt").write_text("#version: 0.2\n")
    added = [
        {"id": 256 + i, "content": name, "special": True}
        for i, name in enumerate(QWEN2_5_SPECIAL_TOKENS)
    ]
    (dest / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    return dest


def write_hf_qwen2(dest: Path, spec: dict[str, Any], seed: int) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["inter"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=256,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec["tied"],
    )
    Qwen2ForCausalLM(config).save_pretrained(dest)
    return dest


def builder(spec: dict[str, Any], lora: bool = False) -> dict[str, Any]:
    node: dict[str, Any] = {
        "_component_": "torchtune.models.qwen2.lora_qwen2"
        if lora
        else "torchtune.models.qwen2.qwen2",
        "vocab_size": spec["vocab"],
        "num_layers": spec["layers"],
        "num_heads": spec["heads"],
        "num_kv_heads": spec["kv_heads"],
        "embed_dim": spec["hidden"],
        "intermediate_dim": spec["inter"],
        "max_seq_len": 256,
        "norm_eps": 1e-6,
        "tie_word_embeddings": spec["tied"],
    }
    if lora:
        node.update(
            lora_attn_modules=["q_proj", "v_proj"],
            apply_lora_to_mlp=True,
            lora_rank=4,
            lora_alpha=8,
        )
    return node


def write_data(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"input": f"{a}+{b}", "output": str(a + b)})
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("assets")
    return {
        "tokenizer": write_tokenizer(root / "tokenizer"),
        "student": write_hf_qwen2(root / "student", STUDENT, seed=1),
        "teacher": write_hf_qwen2(root / "teacher", TEACHER, seed=2),
        "data": write_data(root / "train.json", 64, seed=3),
    }


def make_config(
    assets: dict[str, Path], output_dir: Path, *, lora: bool = False, **top: Any
) -> dict:
    """A complete kd config (plain dict) for the tiny assets."""
    tok = assets["tokenizer"]
    cfg: dict[str, Any] = {
        "output_dir": str(output_dir),
        "model": builder(STUDENT, lora=lora),
        "teacher_model": builder(TEACHER),
        "tokenizer": {
            "_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer",
            "path": str(tok / "vocab.json"),
            "merges_file": str(tok / "merges.txt"),
            "special_tokens_path": str(tok / "tokenizer.json"),
            "max_seq_len": MAX_SEQ_LEN,
        },
        "checkpointer": {
            "_component_": "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": str(assets["student"]),
            "checkpoint_files": ["model.safetensors"],
            "output_dir": str(output_dir / "tt"),
            "model_type": "QWEN2",
        },
        "teacher_checkpointer": {
            "_component_": "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": str(assets["teacher"]),
            "checkpoint_files": ["model.safetensors"],
            "output_dir": str(output_dir / "tt"),
            "model_type": "QWEN2",
        },
        "dataset": {
            "_component_": "torchtune.datasets.instruct_dataset",
            "source": "json",
            "data_files": str(assets["data"]),
            "split": "train",
        },
        "seed": 0,
        "shuffle": False,
        "batch_size": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "lr_scheduler": None,
        "kd_ratio": 0.5,
        "epochs": 1,
        "max_steps_per_epoch": 3,
        "device": "cpu",
        "dtype": "fp32",
        "loss_chunk_size": 16,
        "memory": {"budget_gib": 16, "check": "error"},
    }
    cfg.update(top)
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_metrics(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
