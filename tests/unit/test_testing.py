"""kd.testing: the tiny assets load through the real loaders and are deterministic for a seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kd import _torchtune as tt
from kd.config import instantiate
from kd.testing import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    TOKENIZER_VOCAB_SIZE,
    TinyModel,
    checkpointer_node,
    load_tiny_model,
    tokenizer_node,
    write_jsonl,
    write_tiny_model,
    write_tokenizer,
)

QWEN2 = TinyModel(288, 2, 4, 2, 32, 64, max_seq_len=32)
QWEN2_UNTIED = TinyModel(320, 2, 4, 2, 48, 96, max_seq_len=32, tie_word_embeddings=False)
LLAMA = TinyModel(
    288, 2, 4, 2, 32, 64, max_seq_len=32, tie_word_embeddings=False, family="llama", rope_base=1e4
)
SHAPES = {"qwen2": QWEN2, "qwen2_untied": QWEN2_UNTIED, "llama": LLAMA}
WRITERS = ("torchtune", "transformers")


def _needs(writer: str) -> None:
    if writer == "transformers":
        pytest.importorskip("transformers")


def test_import_is_cheap() -> None:
    code = "import sys, kd.testing; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stderr


def test_tokenizer_loads_through_torchtune(tmp_path: Path) -> None:
    tok_dir = write_tokenizer(tmp_path / "tok")
    assert sorted(p.name for p in tok_dir.iterdir()) == [
        "merges.txt",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
    ]
    tok = instantiate(tokenizer_node(tok_dir, 16), key="tokenizer")
    assert tok.encode("abc", add_bos=False, add_eos=False) == [97, 98, 99]
    assert tok.encode("é", add_bos=False, add_eos=False) == list("é".encode())  # bytes, no merges
    assert tok.special_tokens["<|endoftext|>"] == ENDOFTEXT_ID == tok.pad_id
    assert tok.special_tokens["<|im_start|>"] == IM_START_ID
    assert tok.special_tokens["<|im_end|>"] == IM_END_ID == tok.eos_id
    assert max(tok.special_tokens.values()) + 1 == TOKENIZER_VOCAB_SIZE
    messages = [tt.Message("user", "hi", masked=True), tt.Message("assistant", "yo")]
    tokens, mask = tok.tokenize_messages(messages)
    assert tokens[0] == IM_START_ID and tokens[-1] == IM_END_ID and len(tokens) == len(mask)
    assert len(tok.tokenize_messages(messages * 5)[0]) == 16  # max_seq_len truncates


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_model_loads_in_transformers_and_torchtune_alike(
    name: str, writer: str, tmp_path: Path
) -> None:
    """transformers' AutoModelForCausalLM and torchtune's checkpointer give the same logits."""
    _needs("transformers")
    import transformers

    shape = SHAPES[name]
    tok = write_tokenizer(tmp_path / "tok")
    folder = write_tiny_model(
        tmp_path / "m", shape, seed=3, writer=writer, perturb=0.05, tokenizer_dir=tok
    )
    assert (folder / "vocab.json").read_text() == (tok / "vocab.json").read_text()
    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.model_type == shape.family
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (
        shape.vocab_size,
        shape.embed_dim,
        shape.num_layers,
    )
    assert config.num_key_value_heads == shape.num_kv_heads
    assert bool(config.tie_word_embeddings) == shape.tie_word_embeddings
    assert ("lm_head.weight" in load_file(folder / "model.safetensors")) != (
        shape.tie_word_embeddings
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_tiny_model(folder, shape, tmp_path / "scratch")
    tokens = torch.randint(
        0, TOKENIZER_VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = hf(tokens).logits  # [2, 12, vocab_size]
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-4, atol=1e-4)
    assert expected.shape[-1] == shape.vocab_size
    assert expected.std() > 0.05  # logits far from 0, so a wrong weight mapping shows


@pytest.mark.parametrize("writer", WRITERS)
def test_models_are_deterministic_for_a_seed(writer: str, tmp_path: Path) -> None:
    _needs(writer)

    def write(name: str, seed: int) -> Path:
        return write_tiny_model(tmp_path / name, QWEN2, seed=seed, writer=writer)

    a, b, c = write("a", 7), write("b", 7), write("c", 8)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert wa.keys() == wc.keys()
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])


@pytest.mark.parametrize("writer", WRITERS)
def test_init_is_hugging_face_init(writer: str, tmp_path: Path) -> None:
    """Normal weights (std 0.02), zero biases, unit norms: the loss starts near ln(vocab)."""
    _needs(writer)
    weights = load_file(
        write_tiny_model(tmp_path / "m", QWEN2, seed=0, writer=writer) / "model.safetensors"
    )
    embed = weights["model.embed_tokens.weight"]
    assert embed.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(weights["model.norm.weight"], torch.ones(QWEN2.embed_dim))
    assert not weights["model.layers.0.self_attn.q_proj.bias"].any()


def test_builder_and_checkpointer_nodes_build_and_load(tmp_path: Path) -> None:
    """The config nodes a run would use: the builder's model takes the checkpointer's weights."""
    for shape in SHAPES.values():
        folder = write_tiny_model(tmp_path / shape.family, shape, seed=0)
        model = instantiate(shape.builder(), key="model")
        ckpt = instantiate(
            checkpointer_node(folder, tmp_path / "out", shape.model_type), key="checkpointer"
        )
        model.load_state_dict(ckpt.load_checkpoint()[tt.MODEL_KEY], strict=True)
        lora = instantiate(
            {
                **shape.builder(lora=True),
                "lora_attn_modules": ["q_proj"],
                "lora_rank": 2,
                "lora_alpha": 4,
            },
            key="model",
        )
        assert any(isinstance(m, tt.LoRALinear) for m in lora.modules())


def test_unsupported_shapes_and_writers_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        TinyModel(288, 2, 4, 2, 32, 64, family="llama")
    with pytest.raises(ValueError, match="family"):
        TinyModel(288, 2, 4, 2, 32, 64, family="gpt2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="writer"):
        write_tiny_model(tmp_path / "m", QWEN2, seed=0, writer="keras")  # type: ignore[arg-type]


def test_jsonl_loads_through_instruct_dataset(tmp_path: Path) -> None:
    rows = [{"input": f"{i}+{i}", "output": str(2 * i)} for i in range(5)]
    path = write_jsonl(tmp_path / "sub" / "train.jsonl", rows)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
    tok = instantiate(tokenizer_node(write_tokenizer(tmp_path / "tok"), 32), key="tokenizer")
    dataset = instantiate(
        {
            "_component_": "torchtune.datasets.instruct_dataset",
            "source": "json",
            "data_files": str(path),
            "split": "train",
            "cache_dir": str(tmp_path / "cache"),
        },
        tok,
        key="dataset",
    )
    assert len(dataset) == len(rows)
    sample = dataset[3]
    labelled = [t for t, lab in zip(sample["tokens"], sample["labels"], strict=True) if lab != -100]
    assert "assistant\n6" in tok.decode(labelled)  # row 3's answer is labelled, its question not
    assert "3+3" not in tok.decode(labelled)
