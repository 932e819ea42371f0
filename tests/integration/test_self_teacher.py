"""Self-distillation (``self_teacher:``) through ``kd run`` / ``kd validate`` on the tiny assets,
both backends: with an empty context the first step has exactly zero divergence, a LoRA
teacher is the base model (adapters off), the teacher's positions map onto the student's for
contexts of any length, padding and multi-turn chats, a resumed run is bit-identical, and the
mistakes are one line each (exit 2)."""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import pytest
import torch
from conftest import MAX_SEQ_LEN, make_config, read_metrics, sigterm_at_step, write_config
from safetensors.torch import load_file

from kd import cli, models
from kd.testing import CHATML, hf_tokenizer_node, write_jsonl

CONTEXT = "Reference answer: {reference}. Reply with it."


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> Path:
    """48 additions with a reference field whose length varies from row to row."""
    rng = random.Random(5)
    rows = []
    for i in range(48):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append(
            {"input": f"{a}+{b}", "output": str(a + b), "reference": "x" * (i % 7) + str(a + b)}
        )
    return write_jsonl(tmp_path_factory.mktemp("self") / "train.jsonl", rows)


def hf_node(folder: Path, *, lora: bool) -> dict:
    node = {
        "_component_": "kd.hf.lora_causal_lm" if lora else "kd.hf.causal_lm",
        "path": str(folder),
    }
    if lora:
        node.update(
            lora_attn_modules=["q_proj", "v_proj"],
            apply_lora_to_mlp=True,
            lora_rank=4,
            lora_alpha=8,
        )
    return node


def self_config(
    assets: dict, out: Path, data: Path, *, backend: str = "hf", lora: bool = True, **top
) -> dict:
    """A self-distillation config: the student alone, the chat-template tokenizer, rows with a
    ``reference`` field."""
    cfg = make_config(assets, out, lora=lora and backend == "tt", **top)
    cfg["tokenizer"] = hf_tokenizer_node(assets["tokenizer"], MAX_SEQ_LEN)
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    if backend == "hf":
        cfg["model"] = hf_node(assets["student"], lora=lora)
        del cfg["checkpointer"]
    cfg["dataset"]["data_files"] = str(data)
    cfg.setdefault("self_teacher", {"context": CONTEXT})
    return cfg


def run(cfg: dict, path: Path, *overrides: str) -> int:
    return cli.main(["run", "kd", "--config", str(write_config(path, cfg)), *overrides])


BACKENDS = [("hf", True), ("hf", False), ("tt", True), ("tt", False)]
IDS = ["hf-lora", "hf-full", "tt-lora", "tt-full"]


@pytest.mark.parametrize(("backend", "lora"), BACKENDS, ids=IDS)
def test_empty_context_is_zero_divergence_at_step_1(assets, rows_file, tmp_path, backend, lora):
    cfg = self_config(
        assets,
        tmp_path / "o",
        rows_file,
        backend=backend,
        lora=lora,
        self_teacher={"context": ""},
        max_steps_per_epoch=2,
    )
    assert run(cfg, tmp_path / "c.yaml") == 0
    rows = read_metrics(tmp_path / "o")
    assert rows[0]["kd_loss"] == 0.0
    assert rows[1]["kd_loss"] > 0  # the student moved; the teacher did not
