"""Memory planner for the transformers backend (``kd.hf.*``): shapes from config.json alone, the
estimate against the traced real step (tiny configs of Qwen3, Llama 3.2 and Gemma 3 here; the
published sizes in the slow test and scripts/hf_memory_accuracy.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kd.errors import KDUserError
from kd.memory.estimate import estimate
from kd.memory.hf_accuracy import PAIRS, PUBLISHED, Setting, compare, write_config_folder
from kd.memory.hf_config import shape_of_folder

# Tiny configs of the three architectures (written by transformers' config classes): Llama with
# Llama 3's rope_scaling, Qwen3's q/k norms and free head size, Gemma 3's norms, (1 + w) scales,
# embedding scale and sliding-window layers (a window the test's 48 tokens reach).
TINY: dict[str, tuple[str, dict]] = {
    "qwen3": (
        "Qwen3Config",
        dict(
            vocab_size=1000,
            hidden_size=96,
            intermediate_size=224,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=40,
            tie_word_embeddings=True,
            max_position_embeddings=512,
        ),
    ),
    "llama": (
        "LlamaConfig",
        dict(
            vocab_size=1000,
            hidden_size=96,
            intermediate_size=224,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            vocab_size=1000,
            hidden_size=96,
            intermediate_size=224,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=40,
            sliding_window=16,
            max_position_embeddings=512,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
}

# config.json files as people write them (keys left to the config class's defaults).
HAND_WRITTEN: dict[str, dict] = {
    "qwen3_default_head_dim": {
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "gemma3_pattern": {
        "model_type": "gemma3_text",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
    },
    "mistral_window": {
        "model_type": "mistral",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 32,
    },
    "qwen2_biases": {
        "model_type": "qwen2",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "llama_biases": {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "attention_bias": True,
        "mlp_bias": True,
    },
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    import transformers

    root = tmp_path_factory.mktemp("hf_configs")
    out = {}
    for name, (cls, kwargs) in TINY.items():
        getattr(transformers, cls)(**kwargs).save_pretrained(root / name)
        out[name] = root / name
    return out


def _meta_counts(folder: Path) -> tuple[int, int]:
    """(parameters, buffer bytes in bf16) of the transformers model built on the meta device."""
    import torch

    from kd import models
    from kd.hf.model import build_causal_lm

    with torch.device("meta"), models.default_dtype(torch.bfloat16):
        model = build_causal_lm(folder)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return sum(p.numel() for p in model.parameters()), buffers


# --------------------------------------------------------------------------- shapes
def test_published_and_tiny_shapes_are_exact(tmp_path, tiny_dirs):
    """Parameters and buffers from config.json alone equal transformers' own model, for the
    published Qwen3 / Llama 3.1-3.2 / Gemma 3 configs, the tiny ones and hand-written configs
    that leave keys to the defaults."""
    folders = [write_config_folder(tmp_path / "published", name) for name in PUBLISHED]
    folders += list(tiny_dirs.values())
    for name, cfg in HAND_WRITTEN.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        folders.append(tmp_path / name)
    for folder in folders:
        shape, notes = shape_of_folder(str(folder))
        params, buffers = _meta_counts(folder)
        assert shape.total_params() == params, folder.name
        assert shape.buffer_bytes(2) == buffers, folder.name
        assert not notes
    gemma, _ = shape_of_folder(str(tmp_path / "gemma3_pattern"))
    assert gemma.layer_types == (
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    )
    qwen3, _ = shape_of_folder(str(tmp_path / "qwen3_default_head_dim"))
    assert qwen3.head_dim == 128  # Qwen3Config's default, not hidden_size / heads


def test_unknown_architecture_is_counted_by_transformers(tmp_path):
    """A model_type without a closed form is counted on the meta device, and the plan says so."""
    import transformers

    folder = tmp_path / "phi3"
    transformers.Phi3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    ).save_pretrained(folder)
    shape, notes = shape_of_folder(str(folder))
    assert shape.total_params() == _meta_counts(folder)[0]
    assert notes and "phi3" in notes[0] and "--trace" in notes[0]


def _hf_cfg(student: Path, teacher: Path, **over):
    from kd.config.parse import fill_defaults

    cfg = OmegaConf.create(
        {
            "model": {"_component_": "kd.hf.causal_lm", "path": str(student)},
            "teacher_model": {"_component_": "kd.hf.causal_lm", "path": str(teacher)},
            "kd_ratio": 0.5,
            "tokenizer": {"max_seq_len": 48},
            "batch_size": 3,
            "gradient_accumulation_steps": 1,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
            "enable_activation_checkpointing": False,
            "loss_chunk_size": 64,
        }
    )
    for key, value in over.items():
        cfg[key] = value
    fill_defaults(cfg)
    return cfg


def test_plan_of_hf_folders_needs_no_torch(tiny_dirs):
    """kd plan sizes known architectures from config.json: no torch, no transformers."""
    cfg = OmegaConf.to_yaml(_hf_cfg(tiny_dirs["gemma3"], tiny_dirs["qwen3"]))
    code = (
        "import sys; from omegaconf import OmegaConf; from kd.memory import plan_from_config; "
        f"p = plan_from_config(OmegaConf.create({cfg!r})); "
        "assert not {'torch', 'transformers'} & set(sys.modules), 'imported torch'; "
        "print(p.estimate.student_params)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert int(out.stdout) == shape_of_folder(str(tiny_dirs["gemma3"]))[0].total_params()


def test_missing_config_json_is_one_user_error(tmp_path, tiny_dirs):
    from kd.config.run import run_config
    from kd.memory.plan import inputs_from_run

    run = run_config(_hf_cfg(tmp_path, tiny_dirs["llama"]))
    with pytest.raises(KDUserError, match=r"model: cannot plan memory.*config.json"):
        inputs_from_run(run)


# --------------------------------------------------------------------------- estimate vs trace
LORA = {
    "_component_": "kd.hf.lora_causal_lm",
    "lora_attn_modules": ["q_proj", "v_proj"],
    "apply_lora_to_mlp": True,
    "lora_rank": 8,
    "lora_alpha": 16,
}


@pytest.mark.parametrize(
    "arch,lora,ac",
    [
        ("qwen3", False, False),
        ("llama", True, True),
        ("gemma3", False, True),
        ("gemma3", True, False),
    ],
)
def test_tiny_hf_trace_matches_estimate(tiny_dirs, arch, lora, ac):
    """The closed form for transformers' layers against the real step traced under
    FakeTensorMode (teacher of the same architecture), every phase within 3%."""
    from kd.config.run import run_config
    from kd.memory.plan import inputs_from_run
    from kd.memory.trace import trace_run

    over: dict = {"enable_activation_checkpointing": ac}
    if lora:
        over["model"] = dict(LORA, path=str(tiny_dirs[arch]))
    run = run_config(_hf_cfg(tiny_dirs[arch], tiny_dirs[arch], **over))
    traced = trace_run(run)
    inputs = inputs_from_run(run)
    est = estimate(inputs.student, inputs.teacher, replace(inputs.knobs, select_labelled=False))
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.allocated(phase) == pytest.approx(traced.phase_peaks[phase], rel=0.03), phase


def test_mixed_backends_trace_matches_estimate(tiny_dirs):
    """A torchtune teacher with a transformers student: each sized by its own backend's terms."""
    from kd.config.run import run_config
    from kd.memory.plan import inputs_from_run
    from kd.memory.trace import trace_run

    teacher = {
        "_component_": "torchtune.models.qwen2.qwen2",
        "vocab_size": 1000,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "embed_dim": 128,
        "intermediate_dim": 256,
        "max_seq_len": 256,
    }
    run = run_config(_hf_cfg(tiny_dirs["qwen3"], tiny_dirs["qwen3"], teacher_model=teacher))
    traced = trace_run(run)
    inputs = inputs_from_run(run)
    est = estimate(inputs.student, inputs.teacher, replace(inputs.knobs, select_labelled=False))
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.allocated(phase) == pytest.approx(traced.phase_peaks[phase], rel=0.03), phase


def test_hf_fsdp_trace_is_per_rank(tiny_dirs):
    """kd plan --world-size 2 --trace runs rank 0 of an FSDP2 step of transformers models."""
    from kd.config.run import run_config
    from kd.memory.trace import trace_run

    run = run_config(_hf_cfg(tiny_dirs["qwen3"], tiny_dirs["llama"]))
    one = trace_run(run, world_size=1).phase_peaks
    two = trace_run(run, world_size=2).phase_peaks
    for phase in ("forward", "backward", "optimizer_step"):
        assert two[phase] < one[phase], phase


# --------------------------------------------------------------------------- real size
@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS, ids=[s for _, s in PAIRS])
def test_published_pairs_estimate_within_3_percent(tmp_path, pair):
    """Qwen3-8B -> 1.7B, Llama-3.1-8B -> 3.2-1B and Gemma-3 4B -> 1B at their published sizes:
    the estimate within 3% of the traced step (full fine-tuning, checkpointing, 4096 tokens)."""
    teacher, student = pair
    row = compare(
        teacher, student, Setting(lora=False, ac=True, batch_size=1, seq_len=4096), root=tmp_path
    )
    assert abs(row.peak_ratio - 1) <= 0.03, row
    for phase in ("forward", "backward", "optimizer_step"):
        assert abs(row.phase_ratio(phase) - 1) <= 0.03, (phase, row)
