"""``kd init``'s config rendering: the commented YAML of a run, validated before it is written.

:func:`render_config` writes every key the run needs (model dimensions, checkpointers, tokenizer,
dataset, training knobs, memory budget) and, commented out, the optional features a user turns on
by removing the ``#``: held-out validation with keep_best / early_stopping, stored teacher logits,
on-policy distillation and a served teacher (with pointers to the pages of the other teachers). :func:`write_config` validates the text as ``kd run`` loads it, then
writes it atomically.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kd.errors import KDUserError, one_line
from kd.scaffold.data import DataFormat
from kd.scaffold.inspection import HF_CONFIG_FILE, ModelChoice
from kd.scaffold.layer_map import hidden_states_lines

# LoRA knobs of the generated config (torchtune's names; kd.hf.lora_causal_lm takes the same).
LORA_ATTN_MODULES: tuple[str, ...] = ("q_proj", "v_proj")
LORA_RANK = 16
LORA_ALPHA = 32
FULL_LR = 2e-5
LORA_LR = 3e-4


def _yaml(value: Any) -> str:
    """One YAML value on one line (flow style for lists and mappings)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True)
    text = text.strip()
    return text.removesuffix("...").strip()


def _node(key: str, node: Mapping[str, Any], comments: Mapping[str, str]) -> list[str]:
    lines = [f"{key}:"]
    for name, value in node.items():
        line = f"  {name}: {_yaml(value)}"
        if name in comments:
            line += f"  # {comments[name]}"
        lines.append(line)
    return lines


def _line(key: str, value: Any, comment: str = "") -> str:
    return f"{key}: {_yaml(value)}" + (f"  # {comment}" if comment else "")


def about(choice: ModelChoice, *, lora: bool = False) -> str:
    layers = f", {choice.num_layers} layers" if choice.num_layers else ""
    how = (
        f"torchtune's {choice.torchtune.lora_builder if lora else choice.torchtune.builder}"
        if choice.torchtune is not None
        else f"transformers, kd.hf.{'lora_' if lora else ''}causal_lm ({choice.why_not_torchtune})"
    )
    return (
        f"{one_line(str(choice.folder))} ({choice.hf_model_type}{layers}, vocab "
        f"{choice.vocab_size}): {how}"
    )


_LORA_COMMENTS = {
    "lora_attn_modules": "adapted attention projections: q_proj, k_proj, v_proj, output_proj",
    "apply_lora_to_mlp": "adapters on the MLP projections too",
    "lora_rank": "adapter rank: more capacity, more memory",
    "lora_alpha": "adapter scale alpha / rank; usually 2 x lora_rank",
}


def render_config(
    *,
    teacher: ModelChoice | None,
    student: ModelChoice,
    data: DataFormat,
    output_dir: Path,
    max_seq_len: int,
    device: str,
    lora: bool,
    budget_gib: float | None = None,
    config_name: str = "my_kd.yaml",
    self_context: str | None = None,
    cross_tokenizer: str | None = None,
) -> str:
    """The commented YAML of a run: every model dimension set, the knobs users change commented.

    Keys the run needs are written; the others keep their defaults (:mod:`kd.config.schema`); the
    optional features are written commented out (:func:`optional_sections`).

    Args:
        teacher: the teacher (:func:`kd.scaffold.inspection.choose_model`).
        student: the student.
        data: the data format (:func:`kd.scaffold.data.detect_data_format`).
        output_dir: the run's output folder.
        max_seq_len: ``tokenizer.max_seq_len``.
        device: ``cuda`` (bf16) or ``cpu`` (fp32).
        lora: a LoRA student (rank :data:`LORA_RANK` on q/v projections and the MLP).
        budget_gib: ``memory.budget_gib`` (None: the device's memory).
        config_name: the config file, for the commands in the header.
        self_context: with ``teacher`` None, ``self_teacher.context`` (self-distillation).
        cross_tokenizer: why the tokenizers differ, when they do: a ``cross_tokenizer:``
            section is written (the teacher scores its own tokens; GOLD's aligned loss).
    """
    from kd.scaffold.self_teacher import self_section

    if teacher is None:  # kd init --self: the student teaches itself
        teacher_lines = self_section(self_context or "")
    else:
        teacher_lines = _model_section("teacher_model", "teacher_checkpointer", teacher, lora=False)
    dtype = "bf16" if device.startswith("cuda") else "fp32"
    return "\n".join(
        [
            *_header(teacher or student, student, data, lora=lora, config_name=config_name),
            _line(
                "output_dir",
                str(output_dir),
                "checkpoints, metrics.jsonl and final/ (a new or empty folder)",
            ),
            "",
            *_model_section("model", "checkpointer", student, lora=lora),
            *teacher_lines,
            *_cross_tokenizer_section(cross_tokenizer),
            *_data_section(student, data, max_seq_len=max_seq_len),
            *_training_section(lora=lora, device=device, dtype=dtype, vocab=student.vocab_size),
            *optional_sections(
                data,
                max_seq_len=max_seq_len,
                config_name=config_name,
                other_teachers=teacher is not None,
            ),
            # Hidden states match one tokenization between two models (not a self teacher, not
            # a teacher with another tokenizer).
            *(
                hidden_states_lines(teacher, student)
                if teacher is not None and cross_tokenizer is None
                else []
            ),
            "",
            "# Memory plan (checked before any weight loads; kd plan --fit lists settings that fit)",
            "memory:",
            f"  budget_gib: {_yaml(budget_gib)}  # GiB per device; null = the device's total memory",
            "",
        ]
    )


def _cross_tokenizer_section(why: str | None) -> list[str]:
    """``cross_tokenizer:`` with what it costs, when the tokenizers differ."""
    if why is None:
        return []
    return [
        f"# The tokenizers differ ({one_line(why)[:160]}).",
        "# The teacher scores the text in its own tokens; GOLD's hybrid loss aligns both sides by",
        "# character spans (docs/multi_teacher.md). It costs: the student's full logits over each",
        "# row's labelled tokens (no fused loss), the teacher's forward on its own tokens, and",
        "# validation, stored or served teachers and on_policy are not available with it.",
        "cross_tokenizer:",
        "  matched_weight: null  # exact part's weight; null = matched share of the teacher's vocab",
        "",
    ]


def _header(
    teacher: ModelChoice, student: ModelChoice, data: DataFormat, *, lora: bool, config_name: str
) -> list[str]:
    cfg = one_line(config_name)
    return [
        "# Written by `kd init`: distil the teacher into the student on the data below.",
        f"#   teacher: {about(teacher)}",
        f"#   student: {about(student, lora=lora)}",
        f"#   data:    {one_line(data.node['data_files'])}: {data.description}",
        "# Teacher and student tokenize alike (checked by kd init); the data is tokenized with the",
        "# student's tokenizer and chat template.",
        "#",
        f"#   kd validate --config {cfg}        # every check and the memory plan, no weight loaded",
        f"#   kd plan --config {cfg} --fit      # settings that fit a smaller GPU",
        f"#   kd run kd --config {cfg}          # train (kd run --nproc_per_node N kd ... for N GPUs)",
        f"#   kd run kd --config {cfg} max_steps_per_epoch=10   # any key=value overrides",
        "# Keys not written here keep kd's defaults (e.g. seed: null, save_every_n_steps: null,",
        "# compile: false, lr_scheduler: cosine without warmup); add them to change them. The",
        "# commented sections near the end turn on validation, stored teacher logits and on-policy",
        "# distillation.",
        "",
    ]


def _model_section(model_key: str, ckpt_key: str, choice: ModelChoice, *, lora: bool) -> list[str]:
    """``model:`` / ``teacher_model:`` and its checkpointer (torchtune builders only)."""
    what = "Student (trained" + (", LoRA adapters" if lora else "") + ")"
    if model_key == "teacher_model":
        what = "Teacher (frozen)"
    source = (
        f"dimensions from {one_line(str(choice.folder / HF_CONFIG_FILE))}"
        if choice.torchtune is not None
        else "the transformers model of this folder (config.json + *.safetensors)"
    )
    out = [f"# {what}: {source}"]
    node = choice.model_node(lora=lora)
    comments: dict[str, str] = {}
    if lora:
        node.update(
            lora_attn_modules=list(LORA_ATTN_MODULES),
            apply_lora_to_mlp=True,
            lora_rank=LORA_RANK,
            lora_alpha=LORA_ALPHA,
        )
        comments = _LORA_COMMENTS
    out += _node(model_key, node, comments)
    checkpointer = choice.checkpointer_node()
    if checkpointer is not None:
        ckpt_comments = {}
        if not choice.weight_files:
            ckpt_comments["checkpoint_files"] = (
                "weights not downloaded yet: list the folder's *.safetensors here"
            )
        out += _node(ckpt_key, checkpointer, ckpt_comments)
    out.append("")
    return out


def _data_section(student: ModelChoice, data: DataFormat, *, max_seq_len: int) -> list[str]:
    """``tokenizer:`` (the student's folder) and ``dataset:``."""
    tokenizer = {
        "_component_": "kd.hf.tokenizer",
        "path": str(student.folder),
        "max_seq_len": max_seq_len,
    }
    out = ["# The student's tokenizer and chat template (tokenizer.json / tokenizer_config.json)"]
    out += _node(
        "tokenizer",
        tokenizer,
        {
            "max_seq_len": "tokens per example (longer ones are truncated); the plan assumes all "
            "are this long"
        },
    )
    out.append("")
    masked = " (prompts masked from the loss)" if data.kind != "text" else ""
    out.append(f"# Data: {data.description}{masked}")
    out += _node("dataset", data.node, {"train_on_input": "true also trains on the prompts"})
    out.append("")
    return out


# glibc's largest mmap threshold (64-bit): a larger fresh allocation is mmapped, and each of its
# 4 KiB pages faults on first write, every time it is allocated again.
GLIBC_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024


def cpu_loss_chunk_size(vocab: int) -> int:
    """``loss_chunk_size`` on a CPU: the largest power of two (at most the default 1024, at least
    16) whose ``[chunk, vocab]`` fp32 loss buffers stay under glibc's mmap threshold. The fused
    loss's memory is O(chunk x vocab); on a CPU its speed does not depend on the chunk
    (``scripts/bench_loss_chunk.py``: 0.96-1.03x at 128 against 1024, docs/step_efficiency.md),
    so a CPU run takes the smaller buffers. GPUs keep 1024 (fewer, larger GEMMs)."""
    chunk = 1024
    while chunk > 16 and chunk * vocab * 4 > GLIBC_MMAP_THRESHOLD_MAX:
        chunk //= 2
    return chunk


def _chunk_lines(device: str, vocab: int) -> list[str]:
    """A CPU run's ``loss_chunk_size`` (:func:`cpu_loss_chunk_size`); GPUs keep the default."""
    if device.startswith("cuda"):
        return []
    chunk = cpu_loss_chunk_size(vocab)
    mib = chunk * vocab * 4 / 2**20
    return [
        _line(
            "loss_chunk_size",
            chunk,
            f"CPU: each [chunk, {vocab}] fp32 loss buffer is {mib:.0f} MiB (memory is chunk x "
            "vocab; CPU speed does not depend on it); GPUs: 1024",
        )
    ]


def _training_section(*, lora: bool, device: str, dtype: str, vocab: int) -> list[str]:
    return [
        "# Training",
        _line("batch_size", 4, "micro-batch per device; memory grows linearly with it"),
        _line(
            "gradient_accumulation_steps",
            8,
            "micro-batches per optimizer step (global batch = batch_size x this x devices)",
        ),
        _line("epochs", 1),
        _line("max_steps_per_epoch", None, "an int caps optimizer steps per epoch (quick trials)"),
        "",
        "optimizer:",
        "  _component_: torch.optim.AdamW",
        f"  lr: {_yaml(LORA_LR if lora else FULL_LR)}",
        "  weight_decay: 0.01",
        "  fused: True  # one kernel per step, no per-step temporaries (False: foreach, +1x "
        "trainable params at the step)",
        "",
        "# Loss = (1 - kd_ratio) * CE + kd_ratio * T^2 * divergence(teacher || student)",
        "kd_loss:",
        "  divergence: forward_kl  # forward_kl, reverse_kl, symmetric_kl, jsd, tvd, "
        "skew_forward_kl, skew_reverse_kl",
        _line("kd_ratio", 0.5, "0 = plain fine-tuning on labels, 1 = distillation only"),
        _line("temperature", 1.0, ">1 softens both distributions (the KD term is scaled by T^2)"),
        *_chunk_lines(device, vocab),
        "",
        _line("device", device, "cuda, cuda:N or cpu"),
        _line("dtype", dtype, "bf16 halves memory vs fp32 (bf16 on GPUs)"),
        _line(
            "enable_activation_checkpointing",
            False,
            "true recomputes layers in backward: less memory, ~30% slower",
        ),
        "",
    ]


def _commented(lines: list[str]) -> list[str]:
    """YAML lines commented out: removing the leading ``# `` of a block turns it on."""
    return [f"# {line}" for line in lines]


def optional_sections(
    data: DataFormat,
    *,
    max_seq_len: int,
    config_name: str = "my_kd.yaml",
    other_teachers: bool = True,
) -> list[str]:
    """The optional features, commented out: remove the ``# `` of a block to turn it on.

    Each block is valid YAML once uncommented (a test uncomments each one and validates the
    config): ``validation`` (held-out data read like ``dataset``, here pointed at a ``val``
    file beside the training data) with ``keep_best`` and ``early_stopping``; ``teacher_logits``
    (stored teacher top-k log-probs, written by ``kd run teacher_logits``); ``on_policy`` (GKD,
    its completions at most half of ``max_seq_len`` so that a prompt fits beside them); ``eval``
    (lm-evaluation-harness tasks scored on ``final/``, a task folder beside the training data);
    with ``other_teachers`` (a config with a teacher model), ``teacher_server`` and pointers to
    the pages of the other kinds of teacher.
    """
    from kd.cli.features import doc_of

    train = Path(str(data.node["data_files"]))
    val_node = {**data.node, "data_files": str(train.with_name(f"val{train.suffix}"))}
    store = train.with_name("teacher_logits")
    validation = [
        "validation:",
        *("  " + line for line in _node("dataset", val_node, {})),
        _line("  every_n_steps", 50, "optimizer steps between evaluations; null = at the end only"),
        _line("  max_batches", None, "null = the whole held-out set"),
    ]
    return [
        "# Optional features: remove the leading '# ' of a block to turn it on.",
        "# Held-out validation (val_loss, val_kd_loss, val_top1_agreement in metrics.jsonl;",
        f"# {doc_of('validation')}):",
        *_commented(validation),
        "# Keep output_dir/best/, the student of the best validation (needs validation):",
        *_commented(
            [
                "keep_best:",
                _line(
                    "  metric",
                    "val_loss",
                    "val_loss, val_ce_loss, val_kd_loss or val_top1_agreement",
                ),
                _line("  mode", None, "null = min for the losses, max for val_top1_agreement"),
            ]
        ),
        "# Stop after `patience` evaluations without improvement (needs validation):",
        *_commented(["early_stopping:", _line("  patience", 3)]),
        "# Score final/ on lm-evaluation-harness tasks after training (eval.json, metrics.jsonl;",
        "# a folder of task files, docs/eval.md; `kd eval` scores any folders later):",
        *_commented(
            [
                "eval:",
                _line(
                    "  tasks", [str(train.with_name("eval_tasks"))], "task folders or lm-eval names"
                ),
                _line("  limit", None, "null = every example"),
            ]
        ),
        f"# Stored teacher logits ({doc_of('teacher_logits')}): `kd run teacher_logits --config "
        f"{one_line(config_name)}` writes them once, then",
        "# `kd run kd` trains from them without loading the teacher:",
        *_commented(
            [
                "teacher_logits:",
                _line("  path", str(store), "the store folder (manifest.json + Parquet shards)"),
                _line("  k", 64, "top-k teacher log-probs stored per token"),
            ]
        ),
        f"# On-policy distillation (GKD; {doc_of('on_policy')}): some micro-batches train on the",
        "# student's own samples:",
        *_commented(
            [
                "on_policy:",
                _line("  lmbda", 0.5, "probability a micro-batch uses the student's completions"),
                _line(
                    "  max_new_tokens",
                    min(128, max(1, max_seq_len // 2)),
                    "tokens sampled per prompt at most (prompt + these fit max_seq_len)",
                ),
                _line("  temperature", 0.9, "sampling temperature (0 = greedy)"),
            ]
        ),
        *(_teacher_alternatives() if other_teachers else []),
        "",
    ]


def _teacher_alternatives() -> list[str]:
    """Where the other kinds of teacher are described: each replaces ``teacher_model`` and
    ``teacher_checkpointer`` (the served teacher's block is valid YAML once they are removed)."""
    from kd.cli.features import doc_of

    return [
        f"# A served teacher (vLLM or SGLang over HTTP; {doc_of('teacher_server')}): in place of",
        "# teacher_model and teacher_checkpointer (delete those two, then turn this block on):",
        *_commented(
            [
                "teacher_server:",
                _line("  url", "http://127.0.0.1:8000", "the server (vllm serve / sglang)"),
                _line("  api", "vllm", "vllm or sglang"),
                _line("  model", "teacher", "the model name the server serves"),
            ]
        ),
        f"# Several teachers: a teachers: section ({doc_of('teachers')}); a teacher with another",
        f"# tokenizer: kd init --cross-tokenizer writes cross_tokenizer: ({doc_of('cross_tokenizer')});",
        f"# self-distillation: kd init --self writes self_teacher: ({doc_of('self_teacher')}).",
    ]


def _weights_missing_problem(problem: Any, missing_keys: Sequence[str]) -> bool:
    return any(str(problem.key).startswith(f"{k}.checkpoint_files") for k in missing_keys)


def write_config(text: str, dest: Path, *, weights_pending: Sequence[str] = ()) -> None:
    """Validate a generated config as ``kd run`` loads it, then write it to ``dest`` atomically.

    Args:
        text: the YAML.
        dest: the file to write (its folder is created).
        weights_pending: checkpointer keys whose weight files are not downloaded yet; their
            missing ``checkpoint_files`` are the only problems allowed.

    Raises:
        KDUserError: ``dest`` cannot be written.
        RuntimeError: the config does not validate (a bug in kd init).
    """
    from omegaconf import OmegaConf

    from kd.config import load_config
    from kd.config.validate import schema_problems

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.kd-init.tmp")
        tmp.write_text(text, encoding="utf-8")
    except OSError as e:
        raise KDUserError(
            f"--config-out: cannot write {one_line(str(dest))} ({e.strerror or e}); choose a "
            "file in a folder you can write to"
        ) from e
    try:
        cfg = load_config(str(tmp), [])
        data = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(data, dict)
        problems = [
            p
            for p in schema_problems(data, check_paths=True)
            if not _weights_missing_problem(p, weights_pending)
        ]
        if problems:
            raise RuntimeError(
                "kd init generated a config that does not validate (a bug in kd init): "
                + "; ".join(str(p) for p in problems)
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
