"""``python -m kd.testing_server``: a served teacher to try without a GPU (issue 42). It serves a
local Hugging Face folder on 127.0.0.1 with vLLM's protocol, read by kd's own parser, and its
log-probs are the folder's model's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import torch

from kd.teachers.protocols import VLLMProtocol
from kd.testing import TOKENIZER_VOCAB_SIZE, TinyModel, write_hf_tokenizer, write_tiny_model

SHAPE = TinyModel(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=32,
    intermediate_dim=64,
    max_seq_len=128,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    folder = write_tiny_model(root / "model", SHAPE, seed=3, writer="transformers")
    for item in write_hf_tokenizer(root / "tokenizer").iterdir():
        shutil.copyfile(item, folder / item.name)
    return folder


def test_it_serves_a_folder_as_vllm_does_and_stops_on_ctrl_c(model_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kd.testing_server", "--model", str(model_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"},
    )
    try:
        first = proc.stdout.readline()
        assert first.startswith(f"serving {model_dir} as "), proc.stderr.read()
        url = first.split(" on ")[-1].strip()
        assert url.startswith("http://127.0.0.1:")
        assert proc.stdout.readline().startswith(f"teacher_server: {{url: {url}, api: vllm, ")
        served = requests.get(f"{url}/v1/models", timeout=30).json()
        assert [m["id"] for m in served["data"]] == [str(model_dir)]
        ids = [5, 17, 42, 7]
        protocol = VLLMProtocol()
        answer = requests.post(
            url + protocol.path, json=protocol.body(str(model_dir), [ids], 3), timeout=60
        ).json()
        (row,) = protocol.parse(answer, [ids], 3, TOKENIZER_VOCAB_SIZE)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            want = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        top = want[:-1].topk(3, dim=-1)  # position j scores token j + 1
        assert row.ids.tolist() == top.indices.tolist()
        torch.testing.assert_close(torch.from_numpy(row.logprobs), top.values, atol=1e-4, rtol=0)
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    assert code == 0
    assert "Skipping import" not in proc.stderr.read()


def test_a_folder_that_is_not_a_model_is_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kd.testing_server", "--model", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("kd.testing_server: error: ") and "--model" in line
