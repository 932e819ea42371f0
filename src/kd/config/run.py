"""The resolved run configuration, and every config key that reaches it, declared once.

Each field below declared with :func:`~kd.config.declare.setting` is a config key: its YAML name,
default, range, resume policy and help sit beside the attribute it lands in (see
:mod:`kd.config.declare`). :mod:`kd.config.schema` derives the key tables validation checks from
these fields, and :func:`run_config` fills the dataclasses by reading the same fields: adding a key
is one declaration here, or in the module of its section's concept: ``on_policy:`` in
:mod:`kd.config.on_policy_settings`, a teacher kind's section in its kind module
(:mod:`kd.config.teacher_kinds`; :class:`RunConfig` reads the sections of the registered kinds,
:data:`KIND_SECTIONS`, and knows no kind itself). Defaults
live with the declarations (and, for the ``_component_`` nodes, in :mod:`kd.config.schema`);
:func:`kd.config.load_config` merges them under the user's YAML.

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
from kd.config.on_policy_settings import OnPolicySettings

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

# Label value of positions without a target (torchtune's CROSS_ENTROPY_IGNORE_IDX).
IGNORE_INDEX = -100

# What a top-k teacher's mass outside its k ids becomes (kd.losses.fused_linear_topk_kd_loss): one
# tail bucket, or the top-k renormalised; TOPK_TAIL is the default (teacher_logits.tail's too).
TOPK_TAILS: tuple[str, ...] = ("bucket", "renorm")
TOPK_TAIL = "bucket"

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
    # teacher_logits.tail, declared by the store kind (kd.config.teacher_kinds.store).
    topk_tail: str = derived(
        lambda cfg: str(raw_value(cfg, "teacher_logits.tail", TOPK_TAIL)), default=TOPK_TAIL
    )

    @property
    def needs_teacher_logits(self) -> bool:
        """Whether the loss has a KD term (``kd_ratio`` above 0): the one fact that decides
        whether a step or an evaluation asks the teacher for logits, logs ``kd_loss`` /
        ``val_kd_loss`` and plans the teacher's forward (``kd_ratio: 0`` trains on CE alone)."""
        return self.kd_ratio > 0


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


# The settings dataclass of each teacher kind's section, by section (kd.config.teacher_kinds.register
# fills it: the built-in kinds when kd.config is imported, others at runtime). RunConfig reads each
# present section into kind_settings and answers it as an attribute (run.teacher_logits).
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
    full fine-tune), ``validation`` (None without ``validation:``), ``on_policy`` (None: the
    dataset's completions only). Each registered teacher kind's section reads as an attribute of
    its name, its settings or None without the section (``teacher_logits``: None, the teacher
    runs online; ``teacher_server``, ``self_teacher``, ``teachers``, ``cross_tokenizer``,
    ``hidden_states``; :data:`KIND_SECTIONS`), held in ``kind_settings``.
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
    on_policy: OnPolicySettings | None = group(_has("on_policy"))
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
    # The sections of the registered teacher kinds that the config sets, by section.
    kind_settings: dict[str, Any] = derived(_kind_settings, default={})
    yaml: str = derived(lambda cfg: OmegaConf.to_yaml(cfg, resolve=True))

    def __getattr__(self, name: str) -> Any:
        """A registered teacher kind's section: its settings, or None when the config has none
        (called only for names that are not fields)."""
        if name in KIND_SECTIONS:
            return self.__dict__.get("kind_settings", {}).get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def has_teacher(self) -> bool:
        """Whether a teacher model runs during training (not with stored teacher logits: a
        ``teacher_model`` node then only identifies the teacher they came from)."""
        return self.components["teacher_model"] is not None and self.teacher_logits is None

    @property
    def teacher_samples(self) -> bool:
        """Whether the teacher may sample completions to train on (``on_policy.seq_kd`` with
        ``lmbda`` below 1: the coin then sometimes comes out false)."""
        return self.on_policy is not None and self.on_policy.teacher_samples

    def with_section(self, name: str, settings: Any) -> RunConfig:
        """The same run with the teacher kind's section ``name`` set to ``settings`` (None:
        without it), as ``dataclasses.replace`` sets a field."""
        assert name in KIND_SECTIONS, name
        sections = {k: v for k, v in self.kind_settings.items() if k != name}
        if settings is not None:
            sections[name] = settings
        return dataclasses.replace(self, kind_settings=sections)

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
