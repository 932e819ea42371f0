"""Every config key `kd` knows, with its default, type and allowed range: the one place defaults live.

Recipes read scalar knobs from the resolved config after :func:`kd.config.load_config` has merged
these defaults under the user's YAML, so no recipe calls ``cfg.get(key, default)``.

Top-level keys follow torchtune's KD configs (a torchtune user changes only paths); `kd`'s own keys
(``temperature``, ``save_every_n_steps``, ``loss_chunk_size``, ``memory``...) sit beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Key.resume values.
MUST_MATCH = "must_match"
MAY_CHANGE = "may_change"


@dataclass(frozen=True)
class Key:
    """One config key.

    Attributes:
        default: value used when the YAML does not set the key (``MISSING`` = required).
        types: accepted Python types of the resolved value (``None`` is accepted iff ``nullable``).
        help: one line for ``kd validate`` and the docs.
        nullable: whether ``null`` is allowed.
        choices: allowed values, if the key is an enumeration.
        min: inclusive lower bound for numbers.
        max: inclusive upper bound for numbers.
        min_exclusive: exclusive lower bound for numbers (``temperature > 0``).
        node: the key holds a mapping (a ``_component_`` node or a section).
        node_list: the key may also hold a non-empty list of such mappings (torchtune's
            concatenated datasets).
        resume: ``must_match``: a run resumed from a checkpoint must have the checkpoint's value,
            because the key changes the training trajectory; ``may_change``: it may differ (paths,
            logging, saving, memory knobs). For a node, ``may_change`` covers all its leaves.
    """

    default: Any
    types: tuple[type, ...] = ()
    help: str = ""
    nullable: bool = False
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    max: float | None = None
    min_exclusive: float | None = None
    node: bool = False
    node_list: bool = False
    resume: str = MUST_MATCH

    def __post_init__(self) -> None:
        assert self.resume in (MUST_MATCH, MAY_CHANGE), self.resume


MISSING = "???"

DIVERGENCES = (
    "forward_kl",
    "reverse_kl",
    "symmetric_kl",
    "jsd",
    "tvd",
    "skew_forward_kl",
    "skew_reverse_kl",
)

_INT = (int,)
_NUM = (int, float)
_BOOL = (bool,)
_STR = (str,)

# Keys of the top-level config. Nodes (model, checkpointer, ...) are validated by binding their
# `_component_` signature; their defaults here are only used when the YAML leaves them out.
TOP_LEVEL: dict[str, Key] = {
    "output_dir": Key(
        MISSING, _STR, "folder for checkpoints, metrics.jsonl and logs", resume=MAY_CHANGE
    ),
    "model": Key(
        MISSING,
        node=True,
        help="student model builder (`_component_`), full or lora_*",
        resume=MUST_MATCH,
    ),
    "teacher_model": Key(
        MISSING,
        node=True,
        nullable=True,
        help="teacher model builder (`_component_`); null only with kd_ratio 0 (plain fine-tuning)",
        resume=MUST_MATCH,
    ),
    "tokenizer": Key(
        MISSING,
        node=True,
        help="tokenizer builder; `max_seq_len` bounds the plan",
        resume=MUST_MATCH,
    ),
    "checkpointer": Key(
        MISSING, node=True, help="student checkpointer (HF safetensors)", resume=MUST_MATCH
    ),
    "teacher_checkpointer": Key(
        MISSING,
        node=True,
        nullable=True,
        help="teacher checkpointer (HF safetensors); null with teacher_model",
        resume=MUST_MATCH,
    ),
    "dataset": Key(
        MISSING,
        node=True,
        node_list=True,
        help="dataset builder (`_component_`), or a list of them (concatenated)",
        resume=MUST_MATCH,
    ),
    "seed": Key(
        None, _INT, "random seed; null picks one and logs it", nullable=True, resume=MUST_MATCH
    ),
    "shuffle": Key(True, _BOOL, "shuffle the dataset each epoch", resume=MUST_MATCH),
    "batch_size": Key(4, _INT, "micro-batch size per device", min=1, resume=MUST_MATCH),
    "optimizer": Key(
        {"_component_": "torch.optim.AdamW", "lr": 2e-5, "weight_decay": 0.01},
        node=True,
        help="optimizer builder; torch.optim.* or torchao.optim.AdamW8bit",
        resume=MUST_MATCH,
    ),
    "optimizer_in_cpu": Key(
        False,
        _BOOL,
        "keep optimizer states on CPU (torchao CPUOffloadOptimizer)",
        resume=MAY_CHANGE,
    ),
    "lr_scheduler": Key(
        {
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 0,
        },
        node=True,
        nullable=True,
        help="LR schedule with warmup; null keeps the LR constant",
        resume=MUST_MATCH,
    ),
    "loss": Key(
        None,
        node=True,
        nullable=True,
        help="torchtune CE loss component; kd's loss includes CE, so this is mapped with a notice",
        resume=MUST_MATCH,
    ),
    "kd_loss": Key(
        {"divergence": "forward_kl", "beta": 0.5, "skew_alpha": 0.1},
        node=True,
        help="divergence to the teacher: a name, {divergence, beta, skew_alpha} or a torchtune loss",
        resume=MUST_MATCH,
    ),
    "kd_ratio": Key(
        0.5, _NUM, "loss = (1 - kd_ratio) * CE + kd_ratio * KD", min=0.0, max=1.0, resume=MUST_MATCH
    ),
    "temperature": Key(
        1.0,
        _NUM,
        "softmax temperature of both models; KD is scaled by T^2",
        min_exclusive=0.0,
        resume=MUST_MATCH,
    ),
    "fused_loss": Key(
        True,
        _BOOL,
        "fused linear+CE+KD loss over labelled tokens only (no full logits); false = logits path",
        resume=MAY_CHANGE,
    ),
    "loss_chunk_size": Key(
        1024,
        _INT,
        "tokens per chunk in the loss; memory is chunk x vocab",
        min=1,
        resume=MAY_CHANGE,
    ),
    "epochs": Key(1, _INT, "passes over the dataset", min=1, resume=MAY_CHANGE),
    "max_steps_per_epoch": Key(
        None, _INT, "cap on optimizer steps per epoch", nullable=True, min=1, resume=MAY_CHANGE
    ),
    "gradient_accumulation_steps": Key(
        1, _INT, "micro-batches per optimizer step", min=1, resume=MUST_MATCH
    ),
    "clip_grad_norm": Key(
        None,
        _NUM,
        "max gradient norm; null disables clipping",
        nullable=True,
        min_exclusive=0.0,
        resume=MUST_MATCH,
    ),
    "compile": Key(
        False, _BOOL, "torch.compile the decoder layers (first steps are slower)", resume=MAY_CHANGE
    ),
    "metric_logger": Key(
        {"_component_": "kd.metrics.StdoutLogger"},
        node=True,
        help="extra metric sink beside output_dir/metrics.jsonl; kd.metrics.WandBLogger logs to wandb "
        "(offline without an API key); torchtune's DiskLogger/WandBLogger also work",
        resume=MAY_CHANGE,
    ),
    "log_every_n_steps": Key(
        1, _INT, "optimizer steps between metric rows", min=1, resume=MAY_CHANGE
    ),
    "log_peak_memory_stats": Key(
        True, _BOOL, "log peak memory (CUDA allocated/reserved, or RSS on CPU)", resume=MAY_CHANGE
    ),
    "device": Key("cuda", _STR, "cuda, cpu, or cuda:N", resume=MAY_CHANGE),
    "dtype": Key(
        "bf16", _STR, "parameter dtype of both models", choices=("bf16", "fp32"), resume=MUST_MATCH
    ),
    "enable_activation_checkpointing": Key(
        False,
        _BOOL,
        "recompute decoder layers in backward (less memory, ~30% slower)",
        resume=MAY_CHANGE,
    ),
    "resume_from_checkpoint": Key(
        False,
        _BOOL,
        "continue from the newest complete step checkpoint in output_dir",
        resume=MAY_CHANGE,
    ),
    "overwrite_output_dir": Key(
        False,
        _BOOL,
        "a fresh run into an output_dir holding another run's outputs moves them into "
        "output_dir/previous_<time>/ (nothing is deleted); false refuses such a folder",
        resume=MAY_CHANGE,
    ),
    "save_every_n_steps": Key(
        None,
        _INT,
        "optimizer steps between checkpoints; null = only at the end",
        nullable=True,
        min=1,
        resume=MAY_CHANGE,
    ),
    "keep_last_n": Key(2, _INT, "step checkpoints kept on disk", min=1, resume=MAY_CHANGE),
    "max_bad_steps": Key(
        0, _INT, "non-finite steps skipped before the run stops", min=0, resume=MAY_CHANGE
    ),
    "trust_remote_components": Key(
        False,
        _BOOL,
        "allow any importable `_component_` target, not only what each key may build "
        "(docs/security.md)",
        resume=MAY_CHANGE,
    ),
    "memory": Key(
        {"budget_gib": None, "check": "error", "seq_len": None, "reserve_gib": None},
        node=True,
        help="memory plan: budget_gib (null = device total), check error|warn|off, seq_len override",
        resume=MAY_CHANGE,
    ),
    "fsdp": Key(
        {"cpu_offload": False, "reshard_after_forward": True, "reduce_dtype": "fp32"},
        node=True,
        help="FSDP2 options of the distributed recipe",
        resume=MAY_CHANGE,
    ),
    "validation": Key(
        None,
        node=True,
        nullable=True,
        help="held-out evaluation: {dataset, every_n_steps, max_batches, batch_size}; null = none",
        resume=MAY_CHANGE,
    ),
    "teacher_logits": Key(
        None,
        node=True,
        nullable=True,
        help="stored teacher top-k log-probs: {path, k, tail, format, source_temperature, "
        "rows_per_shard}; `kd run "
        "teacher_logits` writes them, `kd run kd` then trains from them without the teacher; "
        "null = the teacher runs online",
        resume=MUST_MATCH,
    ),
    "teacher_server": Key(
        None,
        node=True,
        nullable=True,
        help="a served teacher (vLLM or SGLang) answering top-k log-probs over HTTP: {url, api, "
        "model, top_k, tail, timeout, retries, backoff, concurrency, prefetch, token_env}; in "
        "place of teacher_model and teacher_checkpointer; null = no served teacher",
        resume=MUST_MATCH,
    ),
    "on_policy": Key(
        None,
        node=True,
        nullable=True,
        help="on-policy distillation (GKD): {lmbda, max_new_tokens, temperature, top_p, seq_kd}; "
        "with probability lmbda a micro-batch trains on the student's own completions of its "
        "prompts, scored by the teacher; null = the dataset's completions only",
        resume=MUST_MATCH,
    ),
    "keep_best": Key(
        None,
        node=True,
        nullable=True,
        help="keep output_dir/best/, the student of the best validation: {metric, mode}; "
        "needs validation",
        resume=MAY_CHANGE,
    ),
    "early_stopping": Key(
        None,
        node=True,
        nullable=True,
        help="stop after {patience} evaluations without improvement (keep_best's metric, else "
        "val_loss); needs validation",
        resume=MAY_CHANGE,
    ),
}

# The validation metrics (kd.evaluate.ValStats.metrics) and the direction that is better.
VAL_METRICS: dict[str, str] = {
    "val_loss": "min",
    "val_ce_loss": "min",
    "val_kd_loss": "min",
    "val_top1_agreement": "max",
}
# Metrics that compare the student with the teacher (none without one: teacher_model null).
TEACHER_METRICS: tuple[str, ...] = ("val_kd_loss", "val_top1_agreement")

# Keys of the `memory:` section.
MEMORY: dict[str, Key] = {
    "budget_gib": Key(
        None,
        _NUM,
        "GiB per device; null = the device's total memory",
        nullable=True,
        min_exclusive=0.0,
        resume=MAY_CHANGE,
    ),
    "check": Key(
        "error",
        _STR,
        "what an over-budget plan does",
        choices=("error", "warn", "off"),
        resume=MAY_CHANGE,
    ),
    "seq_len": Key(
        None,
        _INT,
        "tokens per sequence to plan for; null = tokenizer.max_seq_len",
        nullable=True,
        min=1,
        resume=MAY_CHANGE,
    ),
    "reserve_gib": Key(
        None,
        _NUM,
        "runtime reserve (CUDA context, allocator); null = calibrated default",
        nullable=True,
        min=0.0,
        resume=MAY_CHANGE,
    ),
}

# Keys of the `fsdp:` section.
FSDP: dict[str, Key] = {
    "cpu_offload": Key(
        False, _BOOL, "offload parameters, gradients and optimizer states to CPU", resume=MAY_CHANGE
    ),
    "reshard_after_forward": Key(
        True, _BOOL, "free unsharded parameters after forward (less memory)", resume=MAY_CHANGE
    ),
    "reduce_dtype": Key(
        "fp32", _STR, "gradient reduce-scatter dtype", choices=("fp32", "bf16"), resume=MAY_CHANGE
    ),
}

# Keys of the `kd_loss:` section (our form).
KD_LOSS: dict[str, Key] = {
    "divergence": Key("forward_kl", _STR, "the divergence", choices=DIVERGENCES, resume=MUST_MATCH),
    "beta": Key(0.5, _NUM, "JSD mixture weight", min=0.0, max=1.0, resume=MUST_MATCH),
    "skew_alpha": Key(0.1, _NUM, "skew KL mixture weight", min=0.0, max=1.0, resume=MUST_MATCH),
}

# Keys of the `validation:` section.
VALIDATION: dict[str, Key] = {
    "dataset": Key(
        MISSING,
        node=True,
        node_list=True,
        help="the held-out data: a dataset node as for dataset, or a list of them",
        resume=MAY_CHANGE,
    ),
    "every_n_steps": Key(
        None,
        _INT,
        "optimizer steps between evaluations; null = only at the end of training",
        nullable=True,
        min=1,
        resume=MAY_CHANGE,
    ),
    "max_batches": Key(
        None,
        _INT,
        "evaluate the first max_batches x batch_size examples; null = all",
        nullable=True,
        min=1,
        resume=MAY_CHANGE,
    ),
    "batch_size": Key(
        None,
        _INT,
        "examples per evaluation batch per device; null = batch_size",
        nullable=True,
        min=1,
        resume=MAY_CHANGE,
    ),
}

# Keys of the `keep_best:` section.
KEEP_BEST: dict[str, Key] = {
    "metric": Key(
        "val_loss",
        _STR,
        "validation metric that picks the best step",
        choices=tuple(VAL_METRICS),
        resume=MAY_CHANGE,
    ),
    "mode": Key(
        None,
        _STR,
        "min or max; null = min for the losses, max for val_top1_agreement",
        nullable=True,
        choices=("min", "max"),
        resume=MAY_CHANGE,
    ),
}

# Keys of the `early_stopping:` section.
EARLY_STOPPING: dict[str, Key] = {
    "patience": Key(
        MISSING,
        _INT,
        "evaluations without improvement before training stops",
        min=1,
        resume=MAY_CHANGE,
    ),
}

# Keys of the `teacher_logits:` section (kd.stored_logits).
TEACHER_LOGITS: dict[str, Key] = {
    "path": Key(
        MISSING,
        _STR,
        "folder of the store (manifest.json + Parquet shards) kd run teacher_logits writes",
        resume=MUST_MATCH,
    ),
    "k": Key(
        64,
        _INT,
        "top-k teacher log-probs stored (precompute) or used (training, <= the stored k)",
        min=1,
        max=4096,
        resume=MUST_MATCH,
    ),
    "tail": Key(
        "bucket",
        _STR,
        "the teacher mass outside the top-k: one tail bucket, or renormalise the top-k",
        choices=("bucket", "renorm"),
        resume=MUST_MATCH,
    ),
    "format": Key(
        "kd",
        _STR,
        "what path holds: kd's store (kd run teacher_logits), axolotl's top-k KD dataset "
        "(target_token_ids / target_logprobs) or DistillKit's raw rows (token_ids / top_values); "
        "the foreign files train with dataset kd.data.pretokenized_dataset of the same file",
        choices=("kd", "axolotl", "distillkit"),
        resume=MUST_MATCH,
    ),
    "source_temperature": Key(
        None,
        _NUM,
        "axolotl / distillkit: the temperature the file's log-probs were taken at, re-tempered "
        "to temperature over the top-k (needs tail renorm); null = the run's temperature",
        nullable=True,
        min_exclusive=0,
        resume=MUST_MATCH,
    ),
    "rows_per_shard": Key(
        1024,
        _INT,
        "dataset rows per Parquet shard the precompute writes (training reads any)",
        min=1,
        resume=MAY_CHANGE,
    ),
}

# Keys of the `teacher_server:` section (kd.teachers.served).
TEACHER_SERVER: dict[str, Key] = {
    "url": Key(
        MISSING,
        _STR,
        "the server's base URL (http://host:port), without /v1",
        resume=MAY_CHANGE,
    ),
    "api": Key(
        "vllm",
        _STR,
        "the server's protocol: vllm (POST /v1/completions, prompt_logprobs) or sglang (POST "
        "/generate, input_top_logprobs)",
        choices=("vllm", "sglang"),
        resume=MAY_CHANGE,
    ),
    "model": Key(
        MISSING,
        _STR,
        "the served model's name (vLLM --served-model-name or the model path); checked against "
        "the server before training",
        resume=MUST_MATCH,
    ),
    "top_k": Key(
        20,
        _INT,
        "teacher log-probs asked per position (vLLM caps it at --max-logprobs, default 20)",
        min=1,
        max=4096,
        resume=MUST_MATCH,
    ),
    "tail": Key(
        "bucket",
        _STR,
        "the teacher mass outside the top-k: one tail bucket, or renormalise the top-k (needed "
        "with temperature != 1: the server answers at temperature 1)",
        choices=("bucket", "renorm"),
        resume=MUST_MATCH,
    ),
    "timeout": Key(
        60.0,
        _NUM,
        "seconds one request may take before it is retried",
        min_exclusive=0,
        resume=MAY_CHANGE,
    ),
    "retries": Key(
        5,
        _INT,
        "retries of a request that timed out, could not connect or got a 5xx (with backoff); "
        "then the run saves a checkpoint and stops",
        min=0,
        resume=MAY_CHANGE,
    ),
    "backoff": Key(
        1.0,
        _NUM,
        "backoff factor of the retries in seconds (waits grow as backoff x 2^n, at most 60 s)",
        min=0,
        resume=MAY_CHANGE,
    ),
    "concurrency": Key(
        8,
        _INT,
        "requests in flight at once (one per row)",
        min=1,
        max=256,
        resume=MAY_CHANGE,
    ),
    "prefetch": Key(
        4,
        _INT,
        "micro-batches asked ahead of training (0 = ask when training needs them); each holds "
        "[b, s, k] ids and log-probs in host memory",
        min=0,
        max=256,
        resume=MAY_CHANGE,
    ),
    "token_env": Key(
        None,
        _STR,
        "the environment variable holding the server's API token (sent as a Bearer token); "
        "null = no token. The token itself never goes in the config",
        nullable=True,
        resume=MAY_CHANGE,
    ),
}

# Keys of the `on_policy:` section (kd.on_policy; TRL GKDConfig's names and defaults).
ON_POLICY: dict[str, Key] = {
    "lmbda": Key(
        0.5,
        _NUM,
        "probability that a micro-batch trains on the student's own completions (0 = never, "
        "1 = always)",
        min=0.0,
        max=1.0,
        resume=MUST_MATCH,
    ),
    "max_new_tokens": Key(
        128,
        _INT,
        "tokens sampled per prompt at most (sampling stops earlier at the tokenizer's stop "
        "tokens); prompt + max_new_tokens fit tokenizer.max_seq_len (longer prompts keep their "
        "last tokens)",
        min=1,
        resume=MUST_MATCH,
    ),
    "temperature": Key(
        0.9,
        _NUM,
        "sampling temperature of the completions (0 = greedy); the loss uses temperature",
        min=0.0,
        resume=MUST_MATCH,
    ),
    "top_p": Key(
        1.0,
        _NUM,
        "nucleus sampling: the smallest set of tokens whose probability reaches top_p",
        min_exclusive=0.0,
        max=1.0,
        resume=MUST_MATCH,
    ),
    "seq_kd": Key(
        False,
        _BOOL,
        "the other micro-batches (probability 1 - lmbda) train on the teacher's completions "
        "instead of the dataset's (sequence-level KD)",
        resume=MUST_MATCH,
    ),
}

SECTIONS: dict[str, dict[str, Key]] = {
    "memory": MEMORY,
    "fsdp": FSDP,
    "kd_loss": KD_LOSS,
    "validation": VALIDATION,
    "keep_best": KEEP_BEST,
    "early_stopping": EARLY_STOPPING,
    "teacher_logits": TEACHER_LOGITS,
    "teacher_server": TEACHER_SERVER,
    "on_policy": ON_POLICY,
}

# Arguments of component nodes that kd reads itself (the plan, the LoRA adapter config), checked
# like the keys above when the node has them; the component checks the rest.
COMPONENT_ARGS: dict[str, Key] = {
    "tokenizer.max_seq_len": Key(
        None, _INT, "tokens per example (truncation) and of the plan", nullable=True, min=1
    ),
    "model.lora_rank": Key(8, _INT, "LoRA rank", min=1),
    "model.lora_alpha": Key(16, _NUM, "LoRA scale numerator", min=0.0),
    "model.lora_attn_modules": Key(["q_proj", "v_proj"], (list,), "attention projections"),
    "model.apply_lora_to_mlp": Key(False, _BOOL, "LoRA on the MLP"),
    "model.apply_lora_to_output": Key(False, _BOOL, "LoRA on the output projection"),
}

# Keys torchtune's KD recipes accept that kd does not use; they are dropped with a notice.
IGNORED_TORCHTUNE_KEYS: dict[str, str] = {
    "enable_activation_offloading": "torchtune's KD recipe ignores it too; use enable_activation_checkpointing",
    "profiler": "profiling is not wired into kd recipes; use scripts/ benchmarks",
    "low_cpu_ram": "kd loads weights shard by shard already",
    "log_level": "kd logs at INFO",
    "cudnn_deterministic_mode": "not used",
    "save_adapter_weights_only": "kd always saves the merged student and the adapter",
    "fsdp_cpu_offload": "use fsdp.cpu_offload",
    "fsdp_reshard_after_forward": "use fsdp.reshard_after_forward",
    "custom_sharded_layers": "kd shards every decoder layer",
    "enable_async_checkpointing": "kd checkpoints synchronously with atomic renames",
    "tokenizer_vocab_size": "kd reads the tokenizer's ids",
}


def defaults() -> dict[str, Any]:
    """The default value of every key that has one, as a plain nested dict."""
    out: dict[str, Any] = {}
    for name, key in TOP_LEVEL.items():
        if key.default is MISSING:
            continue
        out[name] = _copy(key.default)
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


@dataclass
class Problem:
    """One thing wrong with a config: the key (dotted) and a message ending in the fix."""

    key: str
    message: str
    extra: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"
