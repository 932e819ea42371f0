"""The planner's estimate against ``kd plan --trace`` for real transformers models, from their
published ``config.json`` numbers alone (no weights, no hub).

:data:`PUBLISHED` holds each model's config as its Hugging Face repository publishes it (written
here with transformers' own config classes, so every other key takes the class default, as
``from_pretrained`` would); :func:`write_config_folder` writes one into a folder that
``kd.hf.causal_lm`` accepts for planning and tracing. :func:`compare` plans and traces one
teacher/student pair. ``scripts/hf_memory_accuracy.py`` runs the grid into
``docs/memory_accuracy.md``; a slow test checks one setting per pair.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from kd.folders import CONFIG_JSON

# config class -> kwargs, from each model's config.json on the Hugging Face hub (Llama 3.1/3.2 keep
# their rope_scaling; Gemma 3 4B's text model is the text_config of its multimodal config).
PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    "Qwen3-8B": (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            attention_bias=False,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
    "Qwen3-1.7B": (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            attention_bias=False,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
    "Qwen2.5-3B": (
        "Qwen2Config",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151643,
        ),
    ),
    "Qwen2.5-0.5B": (
        "Qwen2Config",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151643,
        ),
    ),
    "Llama-3.2-3B": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=True,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
    ),
    "Llama-3.1-8B": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
    ),
    "Llama-3.2-1B": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=True,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
    ),
    "gemma-3-4b-pt (text)": (
        "Gemma3TextConfig",
        dict(
            vocab_size=262208,
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=34,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            max_position_embeddings=131072,
            query_pre_attn_scalar=256,
            sliding_window=1024,
            sliding_window_pattern=6,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            rms_norm_eps=1e-6,
        ),
    ),
    "gemma-3-1b-pt": (
        "Gemma3TextConfig",
        dict(
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            max_position_embeddings=32768,
            query_pre_attn_scalar=256,
            sliding_window=512,
            sliding_window_pattern=6,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rms_norm_eps=1e-6,
        ),
    ),
}

# (teacher, student) pairs the accuracy grid and the slow test cover.
PAIRS: tuple[tuple[str, str], ...] = (
    ("Qwen3-8B", "Qwen3-1.7B"),
    ("Llama-3.1-8B", "Llama-3.2-1B"),
    ("gemma-3-4b-pt (text)", "gemma-3-1b-pt"),
)


def folder_name(model: str) -> str:
    """A folder name for a :data:`PUBLISHED` model (``gemma-3-4b-pt``)."""
    return model.split(" ")[0]


def write_config_folder(root: Path, model: str) -> Path:
    """Write ``model``'s config.json (no weights) into ``root/<name>`` with transformers' class.

    Args:
        root: parent folder.
        model: a key of :data:`PUBLISHED`.

    Returns:
        The folder.
    """
    import transformers

    cls_name, kwargs = PUBLISHED[model]
    config = getattr(transformers, cls_name)(**kwargs)
    dest = Path(root) / folder_name(model)
    dest.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(dest)
    return dest


@dataclass(frozen=True)
class Setting:
    """One row's knobs.

    Attributes:
        lora: a LoRA student (q, k, v, o and the MLP, rank 16) instead of full fine-tuning.
        ac: activation checkpointing.
        batch_size: micro-batch.
        seq_len: tokens per sequence.
    """

    lora: bool
    ac: bool
    batch_size: int
    seq_len: int

    def label(self) -> str:
        return (
            f"{'LoRA' if self.lora else 'full'} b{self.batch_size} s{self.seq_len} "
            f"AC {'on' if self.ac else 'off'}"
        )


@dataclass
class Row:
    """Estimate against trace for one pair and setting (allocated bytes, no runtime reserve).

    Attributes:
        teacher: teacher model name.
        student: student model name.
        setting: the knobs.
        estimate: phase -> estimated bytes (the fake-tensor path: no labelled-row gather).
        trace: phase -> traced bytes.
        estimate_peak_phase: the estimate's peak phase.
        trace_peak_phase: the trace's peak phase.
        trace_s: seconds the trace took.
        student_params: exact student parameters (estimate).
        teacher_params: exact teacher parameters (estimate).
    """

    teacher: str
    student: str
    setting: Setting
    estimate: dict[str, int]
    trace: dict[str, int]
    estimate_peak_phase: str
    trace_peak_phase: str
    trace_s: float
    student_params: int
    teacher_params: int

    @property
    def peak_ratio(self) -> float:
        return max(self.estimate.values()) / max(self.trace.values())

    def phase_ratio(self, phase: str) -> float:
        return self.estimate[phase] / self.trace[phase]


def run_config_for(
    teacher_dir: Path,
    student_dir: Path,
    setting: Setting,
    *,
    world_size: int = 1,
    cross: bool = False,
) -> Any:
    """The RunConfig of a KD run of two transformers folders with ``setting``'s knobs (with
    ``cross``, the teacher taken as having another tokenizer: ``cross_tokenizer: {}``)."""
    from kd.config.parse import fill_defaults
    from kd.config.run import run_config

    student: dict[str, Any] = {"_component_": "kd.hf.causal_lm", "path": str(student_dir)}
    if setting.lora:
        student = {
            "_component_": "kd.hf.lora_causal_lm",
            "path": str(student_dir),
            "lora_attn_modules": ["q_proj", "k_proj", "v_proj", "output_proj"],
            "apply_lora_to_mlp": True,
            "lora_rank": 16,
            "lora_alpha": 32,
        }
    cfg = OmegaConf.create(
        {
            "model": student,
            "teacher_model": {"_component_": "kd.hf.causal_lm", "path": str(teacher_dir)},
            "kd_ratio": 0.5,
            "tokenizer": {"max_seq_len": setting.seq_len},
            "batch_size": setting.batch_size,
            "gradient_accumulation_steps": 1,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-5},
            "enable_activation_checkpointing": setting.ac,
            "fused_loss": True,
            "kd_loss": {"divergence": "forward_kl"},
        }
    )
    if cross:
        cfg.cross_tokenizer = {"matched_weight": None}
    fill_defaults(cfg)
    return run_config(cfg)


def compare(
    teacher: str,
    student: str,
    setting: Setting,
    *,
    root: Path,
    world_size: int = 1,
    cross: bool = False,
) -> Row:
    """Plan and trace one pair (config folders are written under ``root`` when missing; with
    ``cross``, the teacher has another tokenizer)."""
    from kd.memory.estimate import PHASES, estimate
    from kd.memory.plan import inputs_from_run
    from kd.memory.trace import trace_run

    dirs = {}
    for model in (teacher, student):
        folder = Path(root) / folder_name(model)
        dirs[model] = (
            folder if (folder / CONFIG_JSON).is_file() else write_config_folder(root, model)
        )
    run = run_config_for(dirs[teacher], dirs[student], setting, cross=cross)
    inputs = inputs_from_run(run, world_size=world_size)
    est = estimate(inputs.student, inputs.teacher, replace(inputs.knobs, select_labelled=False))
    t0 = time.perf_counter()
    traced = trace_run(run, world_size=world_size)
    wall = time.perf_counter() - t0
    est_phases = {p: est.allocated(p) for p in PHASES}
    return Row(
        teacher=teacher,
        student=student,
        setting=setting,
        estimate=est_phases,
        trace=dict(traced.phase_peaks),
        estimate_peak_phase=max(est_phases, key=lambda p: est_phases[p]),
        trace_peak_phase=max(traced.phase_peaks, key=lambda p: traced.phase_peaks[p]),
        trace_s=wall,
        student_params=est.student_params,
        teacher_params=est.teacher_params,
    )
