"""One checkpoint, two backends: a Hugging Face folder loaded through torchtune's builder and
``FullModelHFCheckpointer`` and through ``transformers.AutoModelForCausalLM`` gives the same fp32
logits (max abs difference <= 1e-4) on random tokens.

Families: qwen2 (tied and untied), Llama 3 (untied, ``llama3`` builder) and Llama 3.2 (tied,
``llama3_2`` builder, whose scaled RoPE config.json describes with ``rope_scaling``). Each folder is
written once by transformers' ``save_pretrained`` and once by torchtune's model with kd's weight
conversion, with weights large enough (``PERTURB``) that attention is far from uniform and norms
and biases far from 1 and 0, so a wrong weight or RoPE mapping shows. The tokens sit at positions
``STRIDE`` apart, so relative distances span the context and every RoPE frequency, including the
low ones Llama 3.2's scaling changes, turns far enough to matter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from kd import _torchtune as tt
from kd.checkpoint import tune_to_hf_state_dict
from kd.testing import TinyModel, load_tiny_model, write_tiny_model

ATOL = 1e-4
SEQ_LEN = 24
MAX_SEQ_LEN = 16384
STRIDE = 640  # positions 0, 640, ..., 14720
VOCAB = 288  # above the ids of write_tokenizer's special tokens (config.json bos/eos)
PERTURB = 0.3


def tiny(family: str, tied: bool) -> TinyModel:
    return TinyModel(
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=32,
        intermediate_dim=64,
        max_seq_len=MAX_SEQ_LEN,
        tie_word_embeddings=tied,
        family=family,  # type: ignore[arg-type]
        rope_base=500_000.0 if family == "llama" else 1_000_000.0,
    )


def tokens_and_positions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=gen)
    positions = STRIDE * torch.arange(SEQ_LEN).expand(2, SEQ_LEN)
    return tokens, positions


def hf_logits(folder: Path, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32
    ).eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        return model(input_ids=tokens, position_ids=positions).logits


def tune_logits(module: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor):
    with torch.no_grad():
        return module(tokens, input_pos=positions)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape == (2, SEQ_LEN, VOCAB)
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("writer", ["transformers", "torchtune"])
@pytest.mark.parametrize(("family", "tied"), [("qwen2", True), ("qwen2", False), ("llama", False)])
def test_tiny_model_logits_match(family, tied, writer, tmp_path):
    shape = tiny(family, tied)
    folder = write_tiny_model(tmp_path / "model", shape, seed=11, writer=writer, perturb=PERTURB)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is tied
    tokens, positions = tokens_and_positions(seed=5)
    tune = tune_logits(load_tiny_model(folder, shape, tmp_path / "scratch"), tokens, positions)
    hf = hf_logits(folder, tokens, positions)
    assert tune.abs().max() > 0.1  # perturbed weights: logits well away from zero
    print(f"max abs diff {max_diff(tune, hf):.2e}, max abs logit {tune.abs().max():.2f}")
    assert max_diff(tune, hf) <= ATOL


# ------------------------------------------------------------------ Llama 3.2: tied, scaled RoPE
# torchtune's llama3_2 builder: Llama3ScaledRoPE with scale_factor 32 and its fixed low/high
# frequency factors 1 and 4 over an original context of 8192; config.json says the same with
# rope_scaling (rope_type "llama3"), as Llama-3.2-1B's does.
LLAMA3_2: dict[str, Any] = {
    "vocab_size": VOCAB,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 32,
    "intermediate_dim": 64,
    "max_seq_len": MAX_SEQ_LEN,
    "rope_base": 500_000,
    "norm_eps": 1e-5,
    "scale_factor": 32,
    "tie_word_embeddings": True,
}
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_2_hf_config(*, rope_scaling: dict[str, Any] | None = ROPE_SCALING) -> dict[str, Any]:
    b = LLAMA3_2
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": b["vocab_size"],
        "hidden_size": b["embed_dim"],
        "intermediate_size": b["intermediate_dim"],
        "num_hidden_layers": b["num_layers"],
        "num_attention_heads": b["num_heads"],
        "num_key_value_heads": b["num_kv_heads"],
        "head_dim": b["embed_dim"] // b["num_heads"],
        "max_position_embeddings": b["max_seq_len"],
        "rms_norm_eps": b["norm_eps"],
        "rope_theta": float(b["rope_base"]),
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": b["tie_word_embeddings"],
        "torch_dtype": "float32",
    }


def llama3_2_builder() -> torch.nn.Module:
    from torchtune.models.llama3_2 import llama3_2

    return llama3_2(**LLAMA3_2)


def perturb(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.02) if param.dim() >= 2 else param.fill_(1.0)
            param.add_(torch.randn_like(param) * PERTURB)


def write_llama3_2(dest: Path, writer: str) -> Path:
    """A tied Llama 3.2 folder, written by transformers or by torchtune + kd's conversion."""
    dest.mkdir(parents=True)
    config = llama3_2_hf_config()
    torch.manual_seed(13)
    if writer == "transformers":
        import transformers

        fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
        fields.pop("torch_dtype")
        module = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
        perturb(module)
        module.save_pretrained(dest)
    else:
        module = llama3_2_builder()
        perturb(module)
        state = tune_to_hf_state_dict(module.state_dict(), model_type="LLAMA3_2", hf_config=config)
        save_file({k: v.contiguous() for k, v in state.items()}, str(dest / "model.safetensors"))
        (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def load_llama3_2_torchtune(folder: Path, scratch: Path) -> torch.nn.Module:
    ckpt = tt.FullModelHFCheckpointer(
        checkpoint_dir=str(folder),
        checkpoint_files=["model.safetensors"],
        model_type="LLAMA3_2",
        output_dir=str(scratch),
    )
    module = llama3_2_builder()
    module.load_state_dict(ckpt.load_checkpoint()[tt.MODEL_KEY])
    return module.eval()


@pytest.mark.parametrize("writer", ["transformers", "torchtune"])
def test_tied_llama3_2_logits_match(writer, tmp_path):
    folder = write_llama3_2(tmp_path / "model", writer)
    tokens, positions = tokens_and_positions(seed=6)
    tune = tune_logits(load_llama3_2_torchtune(folder, tmp_path / "scratch"), tokens, positions)
    hf = hf_logits(folder, tokens, positions)
    assert tune.abs().max() > 0.1
    print(f"max abs diff {max_diff(tune, hf):.2e}, max abs logit {tune.abs().max():.2f}")
    assert max_diff(tune, hf) <= ATOL

    # The positions exercise the scaling: the same weights without rope_scaling differ.
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_scaling", None)
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": 500_000.0}))
    unscaled = max_diff(tune, hf_logits(folder, tokens, positions))
    print(f"without rope_scaling: max abs diff {unscaled:.2e}")
    assert unscaled > 100 * ATOL
