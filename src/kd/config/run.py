"""The resolved run configuration, and every config key that reaches it, declared once.

Each field below declared with :func:`~kd.config.declare.setting` is a config key: its YAML name,
default, range, resume policy and help sit beside the attribute it lands in (see
:mod:`kd.config.declare`). :mod:`kd.config.schema` derives the key tables validation checks from
these fields, and :func:`run_config` fills the dataclasses by reading the same fields: adding a key
is one declaration here. Defaults live here (and, for the ``_component_`` nodes, in
:mod:`kd.config.schema`); :func:`kd.config.load_config` merges them under the user's YAML.

``kd run``, ``kd validate``, ``kd plan`` and both memory tracers read their settings from a
:class:`RunConfig`; nobody else reads the raw ``DictConfig`` or supplies a default of their own.

This module imports no torch: ``kd plan`` and the config checks stay fast.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from kd.config.declare import (
    MAY_CHANGE,
    MISSING,
    MUST_MATCH,
    build,
    derived,
    frozen_node,
    group,
    raw_value,
    setting,
    settings,
)

# The checkpointer key of each model key (torchtune builders only: a Hugging Face model's folder
# is its checkpoint).
CHECKPOINTER_OF: dict[str, str] = {"model": "checkpointer", "teacher_model": "teacher_checkpointer"}

# Nodes built with `_component_` (kept as read-only config nodes: the builders take their keys).
COMPONENT_KEYS: tuple[str, ...] = (
    "model",
    "teacher_model",
    "tokenizer",
    "checkpointer",
    "teacher_checkpointer",
    "dataset",
    "optimizer",
    "lr_scheduler",
    "metric_logger",
)
# The component key inside a section: the held-out data, built like ``dataset``.
VALIDATION_DATASET = "validation.dataset"
# Keys that hold a dataset node or a list of them (torchtune's concatenated datasets).
DATASET_KEYS: tuple[str, ...] = ("dataset", VALIDATION_DATASET)

# The divergences of kd.losses (the one list; kd.losses reads it from here).
DIVERGENCES: tuple[str, ...] = (
    "forward_kl",
    "reverse_kl",
    "symmetric_kl",
    "jsd",
    "tvd",
    "skew_forward_kl",
    "skew_reverse_kl",
)

# What may sample the student's on-policy completions (on_policy.sampler; kd.rollouts).
SAMPLERS: tuple[str, ...] = ("local", "served")

# Label value of positions without a target (torchtune's CROSS_ENTROPY_IGNORE_IDX).
IGNORE_INDEX = -100

# The validation metrics (kd.training.evaluate.ValStats.metrics) and the direction that is better.
VAL_METRICS: dict[str, str] = {
    "val_loss": "min",
    "val_ce_loss": "min",
    "val_kd_loss": "min",
    "val_top1_agreement": "max",
}


def _check_mode(cfg: DictConfig, raw: Any) -> str:
    # YAML 1.1 (OmegaConf) reads a bare `off` as False.
    return "off" if raw is False else str(raw)


def _has(section: str) -> Any:
    """Whether the config has the (nullable) section ``section``."""
    return lambda cfg: cfg.get(section) is not None


@settings
class TeacherLogitsSettings:
    """Stored teacher top-k log-probs (``teacher_logits:``; :mod:`kd.teachers.stored_logits`):
    ``kd run teacher_logits`` writes them, ``kd run kd`` then trains from them without the
    teacher."""

    path: Path = setting(
        "teacher_logits.path",
        MISSING,
        "folder of the store (manifest.json + Parquet shards) kd run teacher_logits writes",
        resume=MUST_MATCH,
    )
    k: int = setting(
        "teacher_logits.k",
        64,
        "top-k teacher log-probs stored (precompute) or used (training, <= the stored k)",
        min=1,
        max=4096,
        resume=MUST_MATCH,
    )
    tail: str = setting(
        "teacher_logits.tail",
        "bucket",
        "the teacher mass outside the top-k: one tail bucket, or renormalise the top-k",
        choices=("bucket", "renorm"),
        resume=MUST_MATCH,
    )
    format: str = setting(
        "teacher_logits.format",
        "kd",
        "what path holds: kd's store (kd run teacher_logits), axolotl's top-k KD dataset "
        "(target_token_ids / target_logprobs) or DistillKit's rows (token_ids / top_values, or "
        "compressed with compression_config.yaml beside them); "
        "the foreign files train with dataset kd.data.pretokenized_dataset of the same file",
        choices=("kd", "axolotl", "distillkit"),
        resume=MUST_MATCH,
    )
    source_temperature: float | None = setting(
        "teacher_logits.source_temperature",
        None,
        "axolotl / distillkit: the temperature the file's log-probs were taken at, re-tempered "
        "to temperature over the top-k (needs tail renorm); null = the run's temperature",
        min_exclusive=0,
        resume=MUST_MATCH,
    )
    alignment: str = setting(
        "teacher_logits.alignment",
        "auto",
        "axolotl / distillkit: which token the file's entry j predicts: next (token j + 1: kd, "
        "axolotl main), current (token j: axolotl 0.19, raw vLLM prompt log-probs) or auto "
        "(detected from the rows, refused when unclear)",
        choices=("auto", "next", "current"),
        resume=MUST_MATCH,
    )
    rows_per_shard: int = setting(
        "teacher_logits.rows_per_shard",
        1024,
        "dataset rows per Parquet shard the precompute writes (training reads any)",
        min=1,
        resume=MAY_CHANGE,
    )


def _server_url(cfg: DictConfig, raw: Any) -> str:
    return str(raw).rstrip("/")


def _optional_url(cfg: DictConfig, raw: Any) -> str | None:
    return None if raw is None else _server_url(cfg, raw)


@settings
class TeacherServerSettings:
    """A served teacher (``teacher_server:``; :mod:`kd.teachers.served`): top-k log-probs over
    HTTP from vLLM or SGLang, in place of ``teacher_model`` and ``teacher_checkpointer``."""

    url: str = setting(
        "teacher_server.url",
        MISSING,
        "the server's base URL (http://host:port), without /v1",
        read=_server_url,
        resume=MAY_CHANGE,
    )
    api: str = setting(
        "teacher_server.api",
        "vllm",
        "the server's protocol: vllm (POST /v1/completions, prompt_logprobs) or sglang (POST "
        "/generate, input_top_logprobs)",
        choices=("vllm", "sglang"),
        resume=MAY_CHANGE,
    )
    model: str = setting(
        "teacher_server.model",
        MISSING,
        "the served model's name (vLLM --served-model-name or the model path); checked against "
        "the server before training",
        resume=MUST_MATCH,
    )
    top_k: int = setting(
        "teacher_server.top_k",
        20,
        "teacher log-probs asked per position (vLLM caps it at --max-logprobs, default 20)",
        min=1,
        max=4096,
        resume=MUST_MATCH,
    )
    tail: str = setting(
        "teacher_server.tail",
        "bucket",
        "the teacher mass outside the top-k: one tail bucket, or renormalise the top-k (needed "
        "with temperature != 1: the server answers at temperature 1)",
        choices=("bucket", "renorm"),
        resume=MUST_MATCH,
    )
    timeout: float = setting(
        "teacher_server.timeout",
        60.0,
        "seconds one attempt of a request may take in all (connecting, sending, the whole "
        "answer: not per read); a request with its retries and waits ends within (retries + 1) x "
        "timeout + the backoff waits, then the run saves a checkpoint and stops",
        min_exclusive=0,
        max=3600,
        resume=MAY_CHANGE,
    )
    retries: int = setting(
        "teacher_server.retries",
        5,
        "retries of a request that timed out, could not connect or got a 429 / 5xx (with "
        "backoff, or the server's Retry-After when it fits the request's deadline); then the "
        "run saves a checkpoint and stops",
        min=0,
        max=100,
        resume=MAY_CHANGE,
    )
    backoff: float = setting(
        "teacher_server.backoff",
        1.0,
        "backoff factor of the retries in seconds (waits grow as backoff x 2^n, at most 60 s)",
        min=0,
        max=60,
        resume=MAY_CHANGE,
    )
    concurrency: int = setting(
        "teacher_server.concurrency",
        8,
        "requests in flight at once (one per row)",
        min=1,
        max=256,
        resume=MAY_CHANGE,
    )
    prefetch: int = setting(
        "teacher_server.prefetch",
        4,
        "micro-batches asked ahead of training (0 = ask when training needs them); each holds "
        "[b, s, k] ids and log-probs in host memory",
        min=0,
        max=256,
        resume=MAY_CHANGE,
    )
    store: Path | None = setting(
        "teacher_server.store",
        None,
        "write-through: a folder of kd's store (the format of kd run teacher_logits) that keeps "
        "every answer, so a rerun, a resume or a later epoch reads it instead of asking; once "
        "complete the server is not needed. One process, temperature 1. null = keep nothing",
        resume=MAY_CHANGE,
    )
    store_rows_per_shard: int = setting(
        "teacher_server.store_rows_per_shard",
        64,
        "write-through: dataset rows per shard of teacher_server.store; a shard is written once "
        "all its rows were answered (kd run teacher_logits finishes the store with the same "
        "teacher_logits.rows_per_shard)",
        min=1,
        resume=MAY_CHANGE,
    )
    token_env: str | None = setting(
        "teacher_server.token_env",
        None,
        "the environment variable holding the server's API token (sent as a Bearer token); "
        "null = no token. The token itself never goes in the config",
        resume=MAY_CHANGE,
    )


COMBINES: tuple[str, ...] = ("weights", "mix", "route")


def _members(cfg: DictConfig, raw: Any) -> tuple[Any, ...]:
    return tuple(frozen_node(m) for m in raw) if isinstance(raw, (list, ListConfig)) else ()


@settings
class TeachersSettings:
    """Several named teachers (``teachers:``; :mod:`kd.teachers.multi`), each an ordinary teacher
    (its own ``teacher_model`` + ``teacher_checkpointer``, ``teacher_logits`` or
    ``teacher_server``), combined per example."""

    combine: str = setting(
        "teachers.combine",
        "weights",
        "weights: the weighted sum of per-teacher divergences; mix: one divergence to the "
        "weighted mixture of the teachers' distributions; route: each row learns from the "
        "teacher its route_field names (rows naming none: CE only)",
        choices=COMBINES,
        resume=MUST_MATCH,
    )
    route_field: str | None = setting(
        "teachers.route_field",
        None,
        "the data row's field naming its teacher (combine: route)",
        resume=MUST_MATCH,
    )
    members: tuple[Any, ...] = setting(
        "teachers.members",
        MISSING,
        "the teachers: a list of {name, weight, teacher_model + teacher_checkpointer | "
        "teacher_logits | teacher_server, cross_tokenizer (a teacher with another tokenizer)}",
        read=_members,
        resume=MUST_MATCH,
    )


@settings
class CrossTokenizerSettings:
    """A teacher with another tokenizer (``cross_tokenizer:``; :mod:`kd.teachers.cross`): GOLD's
    character-span alignment and hybrid ULD loss (:mod:`kd.cross_tokenizer`)."""

    matched_weight: float | None = setting(
        "cross_tokenizer.matched_weight",
        None,
        "weight of the exact part over the token strings both vocabularies share (the rest, "
        "1 - it, is ULD's sorted distance); null = the matched share of the teacher's vocabulary",
        min=0.0,
        max=1.0,
        resume=MUST_MATCH,
    )


@settings
class SelfTeacherSettings:
    """Self-distillation (``self_teacher:``; :mod:`kd.teachers.self_teacher`): the student is
    its own teacher, seeing each row with a privileged context the student never sees, in place
    of ``teacher_model`` and ``teacher_checkpointer``."""

    context: str = setting(
        "self_teacher.context",
        "",
        "the teacher's privileged context: a template over the row's fields ({reference} is the "
        "row's reference field; {{ and }} are braces), e.g. a reference solution, a system prompt "
        "or few-shot examples; empty = none (the teacher sees what the student sees)",
        resume=MUST_MATCH,
    )
    place: str = setting(
        "self_teacher.place",
        "system",
        "where the context goes: system (a system message before the conversation, joined to "
        "the row's own) or user (before the text of the last user message)",
        choices=("system", "user"),
        resume=MUST_MATCH,
    )
    weights: str = setting(
        "self_teacher.weights",
        "initial",
        "initial: the student's initial weights (a LoRA student with its adapters off, no copy; "
        "a full fine-tune: a frozen copy loaded beside it); live: the student's current weights "
        "(no copy, the teacher moves as the student learns)",
        choices=("initial", "live"),
        resume=MUST_MATCH,
    )


@settings
class HiddenStateSettings:
    """Hidden-state distillation (``hidden_states:``; :mod:`kd.teachers.hidden_states`): the student's
    mapped layer outputs are matched to the teacher's, through a learned projection when the
    widths differ; the loss adds ``weight * hidden_loss``."""

    layer_map: tuple[str, ...] = setting(
        "hidden_states.layer_map",
        MISSING,
        "pairs 'student:teacher' of points matched: a decoder layer's output by index (0 = first "
        "layer), embed (the token embeddings) or norm (the final norm's output); kd init proposes "
        "it",
        resume=MUST_MATCH,
    )
    loss: str = setting(
        "hidden_states.loss",
        "cosine",
        "per position: cosine (1 - cosine similarity), mse (mean squared error per dimension) or "
        "nmse (squared error over the teacher's squared norm); averaged over pairs and labelled "
        "positions",
        choices=("mse", "nmse", "cosine"),
        resume=MUST_MATCH,
    )
    weight: float = setting(
        "hidden_states.weight",
        1.0,
        "loss = (1 - kd_ratio) * CE + kd_ratio * KD + weight * hidden_loss",
        min=0.0,
        resume=MUST_MATCH,
    )


@settings
class LossSettings:
    """How the loss is computed (``loss = (1 - kd_ratio) * CE + kd_ratio * KD``)."""

    kd_ratio: float = setting(
        "kd_ratio",
        0.5,
        "loss = (1 - kd_ratio) * CE + kd_ratio * KD",
        min=0.0,
        max=1.0,
        resume=MUST_MATCH,
    )
    temperature: float = setting(
        "temperature",
        1.0,
        "softmax temperature of both models; KD is scaled by T^2",
        min_exclusive=0.0,
        resume=MUST_MATCH,
    )
    divergence: str = setting(
        "kd_loss.divergence", "forward_kl", "the divergence", choices=DIVERGENCES, resume=MUST_MATCH
    )
    beta: float = setting(
        "kd_loss.beta", 0.5, "JSD mixture weight", min=0.0, max=1.0, resume=MUST_MATCH
    )
    skew_alpha: float = setting(
        "kd_loss.skew_alpha", 0.1, "skew KL mixture weight", min=0.0, max=1.0, resume=MUST_MATCH
    )
    chunk_size: int = setting(
        "loss_chunk_size",
        1024,
        "tokens per chunk in the loss; memory is chunk x vocab",
        min=1,
        resume=MAY_CHANGE,
    )
    fused: bool = setting(
        "fused_loss",
        True,
        "fused linear+CE+KD loss over labelled tokens only (no full logits); false = logits path",
        resume=MAY_CHANGE,
    )
    # Label value of positions without a target (torchtune's CROSS_ENTROPY_IGNORE_IDX).
    ignore_index: int = derived(lambda cfg: IGNORE_INDEX, default=IGNORE_INDEX)
    # An offline (top-k) teacher's tail treatment (kd.losses.fused_linear_topk_kd_loss):
    # teacher_logits.tail, declared in TeacherLogitsSettings.
    topk_tail: str = derived(
        lambda cfg: str(raw_value(cfg, "teacher_logits.tail", TeacherLogitsSettings.tail)),
        default=TeacherLogitsSettings.tail,
    )


@settings
class LoraSettings:
    """A LoRA student's adapters (the ``lora_*`` builder's arguments), for the PEFT adapter
    config; read when ``model._component_`` is a ``lora_*`` builder."""

    rank: int = setting("model.lora_rank", 8, "LoRA rank", min=1, resume=MUST_MATCH)
    alpha: float = setting(
        "model.lora_alpha", 16, "LoRA scale numerator", min=0.0, resume=MUST_MATCH
    )
    attn_modules: tuple[str, ...] = setting(
        "model.lora_attn_modules", ["q_proj", "v_proj"], "attention projections", resume=MUST_MATCH
    )
    apply_to_mlp: bool = setting(
        "model.apply_lora_to_mlp", False, "LoRA on the MLP", resume=MUST_MATCH
    )
    apply_to_output: bool = setting(
        "model.apply_lora_to_output", False, "LoRA on the output projection", resume=MUST_MATCH
    )


def _is_lora(cfg: DictConfig) -> bool:
    model = cfg.get("model")
    name = str(model.get("_component_", "")) if isinstance(model, DictConfig) else ""
    return name.rsplit(".", 1)[-1].startswith("lora_")


@settings
class OptimizerSettings:
    """The optimizer and what happens around its step."""

    node: DictConfig = setting(
        "optimizer",
        {"_component_": "torch.optim.AdamW", "lr": 2e-5, "weight_decay": 0.01},
        "optimizer builder; torch.optim.* or torchao.optim.AdamW8bit",
        node=True,
        field_default=MISSING,  # a DictConfig, from the config
        resume=MUST_MATCH,
    )
    # Dotted path of the optimizer class (optimizer._component_).
    component: str = derived(lambda cfg: str(raw_value(cfg, "optimizer._component_", "")))
    in_cpu: bool = setting(
        "optimizer_in_cpu",
        False,
        "keep optimizer states on CPU (torchao CPUOffloadOptimizer)",
        resume=MAY_CHANGE,
    )
    clip_grad_norm: float | None = setting(
        "clip_grad_norm",
        None,
        "max gradient norm; null disables clipping",
        min_exclusive=0.0,
        resume=MUST_MATCH,
    )
    grad_accum: int = setting(
        "gradient_accumulation_steps",
        1,
        "micro-batches per optimizer step",
        min=1,
        resume=MUST_MATCH,
    )

    def kwargs(self) -> dict[str, Any]:
        """The optimizer's arguments (the node without ``_component_``)."""
        data = OmegaConf.to_container(self.node, resolve=True)
        assert isinstance(data, dict)
        data.pop("_component_", None)
        return {str(k): v for k, v in data.items()}


def _seq_len(cfg: DictConfig, raw: Any) -> int | None:
    """``memory.seq_len``, else ``tokenizer.max_seq_len``, else None (the model's own maximum)."""
    value = raw if raw is not None else raw_value(cfg, "tokenizer.max_seq_len", None)
    return None if value is None else int(value)


def _seq_len_source(cfg: DictConfig) -> str:
    if raw_value(cfg, "memory.seq_len", None) is not None:
        return "memory.seq_len"
    if raw_value(cfg, "tokenizer.max_seq_len", None) is not None:
        return "tokenizer.max_seq_len"
    return "model max_seq_len"


@settings
class MemorySettings:
    """The memory plan's inputs that are not model shapes (``memory:`` section; the budget is
    resolved by :func:`kd.runtime.device.resolve_budget`)."""

    budget_gib: float | None = setting(
        "memory.budget_gib",
        None,
        "GiB per device; null = the device's total memory",
        min_exclusive=0.0,
        resume=MAY_CHANGE,
    )
    check: str = setting(
        "memory.check",
        "error",
        "what an over-budget plan does",
        choices=("error", "warn", "off"),
        read=_check_mode,
        resume=MAY_CHANGE,
    )
    seq_len: int | None = setting(
        "memory.seq_len",
        None,
        "tokens per sequence to plan for; null = tokenizer.max_seq_len",
        min=1,
        read=_seq_len,
        resume=MAY_CHANGE,
    )
    # Which key seq_len came from.
    seq_len_source: str = derived(_seq_len_source)
    reserve_gib: float | None = setting(
        "memory.reserve_gib",
        None,
        "runtime terms in one number (CUDA context, allocator slack); null = the measured terms",
        min=0.0,
        resume=MAY_CHANGE,
    )


@settings
class FSDPSettings:
    """FSDP2 options when several ranks train (``fsdp:`` section)."""

    cpu_offload: bool = setting(
        "fsdp.cpu_offload",
        False,
        "offload parameters, gradients and optimizer states to CPU",
        resume=MAY_CHANGE,
    )
    reshard_after_forward: bool = setting(
        "fsdp.reshard_after_forward",
        True,
        "free unsharded parameters after forward (less memory)",
        resume=MAY_CHANGE,
    )
    reduce_dtype: str = setting(
        "fsdp.reduce_dtype",
        "fp32",
        "gradient reduce-scatter dtype",
        choices=("fp32", "bf16"),
        resume=MAY_CHANGE,
    )


def _output_dir(cfg: DictConfig, raw: Any) -> Path:
    # A partial config (kd plan, the tracers) may have none yet.
    return Path(str(raw or ".")).expanduser()


@settings
class CheckpointSettings:
    """Where outputs go and when step checkpoints are written."""

    output_dir: Path = setting(
        "output_dir",
        MISSING,
        "folder for checkpoints, metrics.jsonl and logs",
        read=_output_dir,
        resume=MAY_CHANGE,
    )
    save_every_n_steps: int | None = setting(
        "save_every_n_steps",
        None,
        "optimizer steps between checkpoints; null = only at the end",
        min=1,
        resume=MAY_CHANGE,
    )
    keep_last_n: int = setting(
        "keep_last_n", 2, "step checkpoints kept on disk", min=1, resume=MAY_CHANGE
    )
    resume: bool = setting(
        "resume_from_checkpoint",
        False,
        "continue from the newest complete step checkpoint in output_dir",
        resume=MAY_CHANGE,
    )
    overwrite: bool = setting(
        "overwrite_output_dir",
        False,
        "a fresh run into an output_dir holding another run's outputs moves them into "
        "output_dir/previous_<time>/ (nothing is deleted); false refuses such a folder",
        resume=MAY_CHANGE,
    )


def _val_batch_size(cfg: DictConfig, raw: Any) -> int:
    return int(raw if raw is not None else raw_value(cfg, "batch_size", RunConfig.batch_size))


def _val_mode(cfg: DictConfig, raw: Any) -> str:
    metric = str(raw_value(cfg, "keep_best.metric", ValidationSettings.metric))
    return str(raw) if raw is not None else VAL_METRICS[metric]


@settings
class ValidationSettings:
    """Held-out evaluation during training (``validation:``, ``keep_best:``, ``early_stopping:``);
    keep_best and early_stopping need validation (:func:`kd.config.validate_config` says so)."""

    dataset: DictConfig | ListConfig = setting(
        "validation.dataset",
        MISSING,
        "the held-out data: a dataset node as for dataset, or a list of them",
        node=True,
        node_list=True,
        resume=MAY_CHANGE,
    )
    every_n_steps: int | None = setting(
        "validation.every_n_steps",
        None,
        "optimizer steps between evaluations; null = only at the end of training",
        min=1,
        resume=MAY_CHANGE,
    )
    max_batches: int | None = setting(
        "validation.max_batches",
        None,
        "evaluate the first max_batches x batch_size examples; null = all",
        min=1,
        resume=MAY_CHANGE,
    )
    batch_size: int = setting(
        "validation.batch_size",
        None,
        "examples per evaluation batch per device; null = batch_size",
        nullable=True,
        min=1,
        read=_val_batch_size,
        field_default=MISSING,
        resume=MAY_CHANGE,
    )
    metric: str = setting(
        "keep_best.metric",
        "val_loss",
        "validation metric that picks the best step",
        choices=tuple(VAL_METRICS),
        resume=MAY_CHANGE,
    )
    mode: str = setting(
        "keep_best.mode",
        None,
        "min or max; null = min for the losses, max for val_top1_agreement",
        nullable=True,
        choices=("min", "max"),
        read=_val_mode,
        field_default=MISSING,
        resume=MAY_CHANGE,
    )
    # Write output_dir/best/ at each improvement (keep_best is set).
    keep_best: bool = derived(lambda cfg: cfg.get("keep_best") is not None)
    patience: int | None = setting(
        "early_stopping.patience",
        MISSING,
        "evaluations without improvement before training stops",
        nullable=False,
        min=1,
        field_default=None,
        resume=MAY_CHANGE,
    )


@settings
class OnPolicySettings:
    """On-policy distillation (``on_policy:``; :mod:`kd.training.on_policy`), GKD's knobs as TRL names
    them: with probability lmbda a micro-batch trains on the student's own completions of its
    prompts (drawn once per micro-batch, the same on every rank), scored by the teacher."""

    lmbda: float = setting(
        "on_policy.lmbda",
        0.5,
        "probability that a micro-batch trains on the student's own completions (0 = never, "
        "1 = always)",
        min=0.0,
        max=1.0,
        resume=MUST_MATCH,
    )
    max_new_tokens: int = setting(
        "on_policy.max_new_tokens",
        128,
        "tokens sampled per prompt at most (sampling stops earlier at the tokenizer's stop "
        "tokens); prompt + max_new_tokens fit tokenizer.max_seq_len (longer prompts keep their "
        "last tokens)",
        min=1,
        resume=MUST_MATCH,
    )
    temperature: float = setting(
        "on_policy.temperature",
        0.9,
        "sampling temperature of the completions (0 = greedy); the loss uses temperature",
        min=0.0,
        resume=MUST_MATCH,
    )
    top_p: float = setting(
        "on_policy.top_p",
        1.0,
        "nucleus sampling: the smallest set of tokens whose probability reaches top_p",
        min_exclusive=0.0,
        max=1.0,
        resume=MUST_MATCH,
    )
    seq_kd: bool = setting(
        "on_policy.seq_kd",
        False,
        "the other micro-batches (probability 1 - lmbda) train on the teacher's completions "
        "instead of the dataset's (sequence-level KD)",
        resume=MUST_MATCH,
    )
    # What samples the student (kd.rollouts: the Sampler interface). The served sampler's own
    # settings are the server_* keys and sync_every_n_steps (kd.rollouts.served).
    sampler: str = setting(
        "on_policy.sampler",
        "local",
        "what samples the student's completions: local (the student in this process) or served "
        "(a vLLM / SGLang server given the student's weights, on_policy.server_url)",
        choices=SAMPLERS,
        resume=MAY_CHANGE,
    )
    batch_rollouts: bool = setting(
        "on_policy.batch_rollouts",
        False,
        "local sampler: one generation per optimizer step over the prompts of all its on-policy "
        "micro-batches, grouped by length, finished rows leaving the batch (each row keeps its "
        "own seeded generator; float rounding of the wider batch may differ from false)",
        resume=MAY_CHANGE,
    )
    rollout_batch_size: int | None = setting(
        "on_policy.rollout_batch_size",
        None,
        "batch_rollouts: prompts per generation (length-sorted groups); null = all of a step's",
        min=1,
        resume=MAY_CHANGE,
    )
    async_steps: int = setting(
        "on_policy.async_steps",
        0,
        "1: the next step's completions are sampled while this step trains (at most one "
        "optimizer step stale); 0: sampled at the start of their own step",
        min=0,
        max=1,
        resume=MAY_CHANGE,
    )
    # The served sampler (sampler: served; kd.rollouts.served, docs/served_sampler.md).
    sync_every_n_steps: int = setting(
        "on_policy.sync_every_n_steps",
        1,
        "sampler served: the student's weights are pushed to the server every n optimizer steps "
        "(a LoRA adapter hot-loaded, full weights reloaded); the rollouts between are up to n - 1 "
        "steps stale (metrics: rollout_version_lag)",
        min=1,
        resume=MUST_MATCH,
    )
    server_url: str | None = setting(
        "on_policy.server_url",
        None,
        "sampler served: the vLLM / SGLang server's base URL (http://host:port), without /v1",
        read=_optional_url,
        resume=MAY_CHANGE,
    )
    server_api: str = setting(
        "on_policy.server_api",
        "vllm",
        "sampler served: the server's protocol: vllm (POST /v1/completions with token ids) or "
        "sglang (POST /generate with input_ids)",
        choices=("vllm", "sglang"),
        resume=MAY_CHANGE,
    )
    server_model: str | None = setting(
        "on_policy.server_model",
        None,
        "sampler served: the name the server serves the student's base model under "
        "(--served-model-name), checked before training",
        resume=MAY_CHANGE,
    )
    server_sync_dir: Path | None = setting(
        "on_policy.server_sync_dir",
        None,
        "sampler served: where the pushed weights are written, a folder the server reads at the "
        "same path (a shared disk when it runs elsewhere); null = output_dir/served_weights",
        resume=MAY_CHANGE,
    )
    server_timeout: float = setting(
        "on_policy.server_timeout",
        300.0,
        "sampler served: seconds one attempt of a request (a rollout, a weight push) may take in "
        "all; a request with its retries ends within (retries + 1) x timeout + the backoff "
        "waits, then the run saves a checkpoint and stops",
        min_exclusive=0,
        max=3600,
        resume=MAY_CHANGE,
    )
    server_retries: int = setting(
        "on_policy.server_retries",
        3,
        "sampler served: retries of a request that timed out, could not connect or got a 429 / "
        "5xx (exponential backoff); then the run saves a checkpoint and stops",
        min=0,
        max=100,
        resume=MAY_CHANGE,
    )
    server_backoff: float = setting(
        "on_policy.server_backoff",
        1.0,
        "sampler served: seconds before the first retry, doubling (at most 60 s a wait)",
        min=0,
        max=60,
        resume=MAY_CHANGE,
    )
    server_concurrency: int = setting(
        "on_policy.server_concurrency",
        16,
        "sampler served: rollout requests in flight per rank (one prompt each; the server "
        "batches them)",
        min=1,
        max=1024,
        resume=MAY_CHANGE,
    )
    server_token_env: str | None = setting(
        "on_policy.server_token_env",
        None,
        "sampler served: the environment variable holding the server's API token (vllm serve "
        "--api-key; sent as a Bearer token, never printed); null = none",
        resume=MAY_CHANGE,
    )


@settings
class EvalSettings:
    """lm-evaluation-harness tasks scored on ``final/`` at the end of training (``eval:``;
    :mod:`kd.harness`, what ``kd eval`` runs): the table, ``output_dir/eval.json`` and one
    metrics row; null = none."""

    tasks: tuple[str, ...] = setting(
        "eval.tasks",
        MISSING,
        "task folders of kd task files (docs/eval.md) or lm-eval task names with local data",
        resume=MAY_CHANGE,
    )
    limit: int | None = setting(
        "eval.limit", None, "at most limit examples per task; null = all", min=1, resume=MAY_CHANGE
    )
    batch_size: int = setting(
        "eval.batch_size", 8, "examples per lm-eval batch", min=1, resume=MAY_CHANGE
    )
    num_fewshot: int | None = setting(
        "eval.num_fewshot",
        None,
        "few-shot examples per prompt; null = each task's own",
        min=0,
        resume=MAY_CHANGE,
    )
    chat: bool = setting(
        "eval.chat", False, "prompts through the tokenizer's chat template", resume=MAY_CHANGE
    )


# The settings dataclass of each section a teacher kind registered outside this module declares
# (kd.config.teacher_kinds.register fills it; the kinds declared here are RunConfig's own fields).
KIND_SECTIONS: dict[str, type] = {}


def _kind_settings(cfg: DictConfig) -> dict[str, Any]:
    return {
        name: build(cls, cfg) for name, cls in KIND_SECTIONS.items() if cfg.get(name) is not None
    }


def _components(cfg: DictConfig) -> dict[str, DictConfig | ListConfig | None]:
    return {key: frozen_node(cfg.get(key)) for key in COMPONENT_KEYS}


@settings
class RunConfig:
    """Every setting of a run, typed and read once (see :func:`run_config`).

    Groups: ``loss``, ``optimizer``, ``memory``, ``fsdp``, ``checkpoint``; ``lora`` (None for a
    full fine-tune), ``validation`` (None without ``validation:``), ``teacher_logits`` (None:
    the teacher runs online), ``teacher_server`` (None: no served teacher), ``self_teacher`` (None: no
    self-distillation), ``on_policy`` (None: the dataset's completions only).
    ``components``: the ``_component_`` nodes by key (read-only; ``None`` for an absent optional
    component such as ``teacher_model: null``; ``dataset`` may be a list of nodes, torchtune's
    concatenated datasets, see :func:`kd.data.build_dataset`). ``yaml``: the resolved config as
    YAML (the snapshot checkpoints store).
    """

    loss: LossSettings = group()
    optimizer: OptimizerSettings = group()
    memory: MemorySettings = group()
    fsdp: FSDPSettings = group()
    checkpoint: CheckpointSettings = group()
    components: dict[str, DictConfig | ListConfig | None] = derived(_components)
    lora: LoraSettings | None = group(_is_lora)
    validation: ValidationSettings | None = group(_has("validation"))
    teacher_logits: TeacherLogitsSettings | None = group(_has("teacher_logits"))
    teacher_server: TeacherServerSettings | None = group(_has("teacher_server"))
    self_teacher: SelfTeacherSettings | None = group(_has("self_teacher"))
    on_policy: OnPolicySettings | None = group(_has("on_policy"))
    teachers: TeachersSettings | None = group(_has("teachers"))
    cross_tokenizer: CrossTokenizerSettings | None = group(_has("cross_tokenizer"))
    hidden_states: HiddenStateSettings | None = group(_has("hidden_states"))
    eval: EvalSettings | None = group(_has("eval"))
    seed: int | None = setting(
        "seed", None, "random seed; null picks one and logs it", resume=MUST_MATCH
    )
    shuffle: bool = setting("shuffle", True, "shuffle the dataset each epoch", resume=MUST_MATCH)
    batch_size: int = setting(
        "batch_size", 4, "micro-batch size per device", min=1, resume=MUST_MATCH
    )
    max_seq_len: int | None = setting(
        "tokenizer.max_seq_len",
        None,
        "tokens per example (truncation) and of the plan",
        min=1,
        resume=MUST_MATCH,
    )
    epochs: int = setting("epochs", 1, "passes over the dataset", min=1, resume=MAY_CHANGE)
    max_steps_per_epoch: int | None = setting(
        "max_steps_per_epoch",
        None,
        "cap on optimizer steps per epoch",
        min=1,
        resume=MAY_CHANGE,
    )
    device: str = setting("device", "cuda", "cuda, cpu, or cuda:N", resume=MAY_CHANGE)
    dtype: str = setting(
        "dtype",
        "bf16",
        "parameter dtype of both models",
        choices=("bf16", "fp32"),
        resume=MUST_MATCH,
    )
    activation_checkpointing: bool = setting(
        "enable_activation_checkpointing",
        False,
        "recompute decoder layers in backward (less memory, ~30% slower)",
        resume=MAY_CHANGE,
    )
    activation_offloading: bool = setting(
        "enable_activation_offloading",
        False,
        "keep the student's saved activations in host memory between its forward and backward "
        "(torchtune's OffloadActivations: pinned memory, a side stream on CUDA; with activation "
        "checkpointing only each layer's input moves); kd plan reports the host memory",
        resume=MAY_CHANGE,
    )
    compile: bool = setting(
        "compile",
        False,
        "torch.compile the decoder layers (first steps are slower)",
        resume=MAY_CHANGE,
    )
    log_every_n_steps: int = setting(
        "log_every_n_steps", 1, "optimizer steps between metric rows", min=1, resume=MAY_CHANGE
    )
    log_peak_memory_stats: bool = setting(
        "log_peak_memory_stats",
        True,
        "log peak memory (CUDA allocated/reserved, or RSS on CPU)",
        resume=MAY_CHANGE,
    )
    max_bad_steps: int = setting(
        "max_bad_steps",
        0,
        "non-finite steps skipped before the run stops",
        min=0,
        resume=MAY_CHANGE,
    )
    teacher_quantization: str = setting(
        "teacher_quantization",
        "none",
        "weight-only quantization of a local teacher_model's decoder-layer linears through "
        "torchao: none, or int8 (opt-in: changes the teacher's outputs; measure the cost with "
        "scripts/int8_teacher_report.py)",
        choices=("none", "int8"),
        resume=MUST_MATCH,
    )
    teacher_offload: str = setting(
        "teacher_offload",
        "none",
        "where a local teacher model's weights wait between its forwards: none (on the device), "
        "park (in pinned host memory, all copied to the device for each forward), or stream "
        "(copied one decoder layer at a time, the next prefetched); its output projection stays "
        "on the device; one device only; kd plan states the host memory and the bytes moved per "
        "step",
        choices=("none", "park", "stream"),
        resume=MAY_CHANGE,
    )
    teacher_device: str | None = setting(
        "teacher_device",
        None,
        "the device a local teacher model runs on when it is not the student's (cuda:1 beside "
        "device: cuda:0; one process, not under torchrun): its hidden states and a copy of its "
        "output projection are on the student's device for the loss; kd plan plans each device "
        "against the budget; null: the student's device",
        resume=MAY_CHANGE,
    )
    trust_remote_components: bool = setting(
        "trust_remote_components",
        False,
        "allow any importable `_component_` target, not only what each key may build "
        "(docs/security.md)",
        resume=MAY_CHANGE,
    )
    # The sections of teacher kinds registered outside this module (kd.config.teacher_kinds.register).
    kind_settings: dict[str, Any] = derived(_kind_settings, default={})
    yaml: str = derived(lambda cfg: OmegaConf.to_yaml(cfg, resolve=True))

    @property
    def has_teacher(self) -> bool:
        """Whether a teacher model runs during training (not with stored teacher logits: a
        ``teacher_model`` node then only identifies the teacher they came from)."""
        return self.components["teacher_model"] is not None and self.teacher_logits is None

    def with_seed(self, seed: int) -> RunConfig:
        """The same run with ``seed`` set (the snapshot records the seed actually used)."""
        cfg = OmegaConf.create(self.yaml)
        cfg.seed = int(seed)
        return dataclasses.replace(self, seed=int(seed), yaml=OmegaConf.to_yaml(cfg))


def run_config(cfg: DictConfig) -> RunConfig:
    """Build the :class:`RunConfig` of a loaded, validated config (defaults already merged).

    Each field reads the config key it declares (:func:`kd.config.declare.build`).

    Args:
        cfg: the output of :func:`kd.config.load_config` that passed
            :func:`kd.config.validate_config` (a partial config with the schema defaults merged,
            :func:`kd.config.parse.fill_defaults`, serves the planner and the tracers).

    Returns:
        The typed, frozen run configuration.
    """
    return build(RunConfig, cfg)
