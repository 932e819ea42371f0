"""The resolved run configuration: one typed, frozen object built once from a validated config.

``kd run``, ``kd validate``, ``kd plan`` and both memory tracers read their settings from a
:class:`RunConfig`; nobody else reads the raw ``DictConfig`` or supplies a default of their own (the
defaults live in :mod:`kd.config.schema`, merged by :func:`kd.config.load_config`).

This module imports no torch: ``kd plan`` and the config checks stay fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from kd.config import schema

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


@dataclass(frozen=True)
class LossSettings:
    """How the loss is computed.

    Attributes:
        kd_ratio: weight of the divergence; ``loss = (1 - kd_ratio) * CE + kd_ratio * KD``.
        temperature: softmax temperature of both models (KD is scaled by T^2).
        divergence: one of :data:`kd.losses.DIVERGENCES`.
        beta: JSD mixture weight.
        skew_alpha: skew-KL mixture weight.
        chunk_size: tokens per loss chunk (memory is chunk x vocab).
        fused: fused linear+loss over labelled tokens (no full logits) instead of the logits path.
        ignore_index: label value of positions without a target.
        topk_tail: an offline (top-k) teacher's tail treatment, ``"bucket"`` or ``"renorm"``
            (:func:`kd.losses.fused_linear_topk_kd_loss`).
        topk_vocab: an offline teacher's shared vocabulary ``min(Vs, Vt)``: the student's KD
            softmax runs over its first ``topk_vocab`` entries, as with the online teacher (None:
            all Vs). The recipe sets it from the store's manifest.
    """

    kd_ratio: float = 0.5
    temperature: float = 1.0
    divergence: str = "forward_kl"
    beta: float = 0.5
    skew_alpha: float = 0.1
    chunk_size: int = 1024
    fused: bool = True
    ignore_index: int = -100
    topk_tail: str = "bucket"
    topk_vocab: int | None = None


@dataclass(frozen=True)
class LoraSettings:
    """A LoRA student's adapters (the ``lora_*`` builder's arguments), for the PEFT adapter config.

    Attributes:
        rank: ``lora_rank``.
        alpha: ``lora_alpha``.
        attn_modules: ``lora_attn_modules`` (``q_proj``, ``v_proj``...).
        apply_to_mlp: ``apply_lora_to_mlp``.
        apply_to_output: ``apply_lora_to_output``.
    """

    rank: int
    alpha: float
    attn_modules: tuple[str, ...]
    apply_to_mlp: bool
    apply_to_output: bool


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer and what happens around its step.

    Attributes:
        component: dotted path of the optimizer class (``optimizer._component_``).
        node: the ``optimizer`` node (read-only; its keys are the optimizer's arguments).
        in_cpu: states and step on the CPU (``optimizer_in_cpu``, torchao CPUOffloadOptimizer).
        clip_grad_norm: max gradient norm, None = no clipping.
        grad_accum: micro-batches per optimizer step.
    """

    component: str
    node: DictConfig
    in_cpu: bool
    clip_grad_norm: float | None
    grad_accum: int

    def kwargs(self) -> dict[str, Any]:
        """The optimizer's arguments (the node without ``_component_``)."""
        data = OmegaConf.to_container(self.node, resolve=True)
        assert isinstance(data, dict)
        data.pop("_component_", None)
        return {str(k): v for k, v in data.items()}


@dataclass(frozen=True)
class MemorySettings:
    """The memory plan's inputs that are not model shapes (``memory:`` section).

    Attributes:
        budget_gib: GiB per device; None = the device's total memory (see
            :func:`kd.device.resolve_budget`).
        check: ``error`` | ``warn`` | ``off``: what an over-budget plan does.
        seq_len: tokens per sequence to plan for (``memory.seq_len``, else
            ``tokenizer.max_seq_len``); None = the model's own maximum.
        seq_len_source: which key ``seq_len`` came from.
        reserve_gib: runtime reserve override; None = the calibrated default.
    """

    budget_gib: float | None
    check: str
    seq_len: int | None
    seq_len_source: str
    reserve_gib: float | None


@dataclass(frozen=True)
class FSDPSettings:
    """FSDP2 options when several ranks train (``fsdp:`` section)."""

    cpu_offload: bool
    reshard_after_forward: bool
    reduce_dtype: str


@dataclass(frozen=True)
class CheckpointSettings:
    """Where outputs go and when step checkpoints are written.

    Attributes:
        output_dir: folder of checkpoints, ``metrics.jsonl`` and ``final/``.
        save_every_n_steps: optimizer steps between step checkpoints; None = only ``final/``.
        keep_last_n: step checkpoints kept.
        resume: continue from the newest complete step checkpoint.
        overwrite: a fresh run moves another run's outputs in output_dir aside
            (``overwrite_output_dir``).
    """

    output_dir: Path
    save_every_n_steps: int | None
    keep_last_n: int
    resume: bool
    overwrite: bool


@dataclass(frozen=True)
class ValidationSettings:
    """Held-out evaluation during training (``validation:``, ``keep_best:``, ``early_stopping:``).

    Attributes:
        dataset: the ``validation.dataset`` node (read-only; one builder or a list of them,
            built like ``dataset``, :func:`kd.data.build_dataset`).
        every_n_steps: optimizer steps between evaluations; None = only at the end of training.
        max_batches: evaluate the first ``max_batches * batch_size`` examples; None = all.
        batch_size: examples per evaluation batch per rank (``validation.batch_size``, else
            ``batch_size``).
        metric: the metric the best step is chosen by (``keep_best.metric``, else ``val_loss``).
        mode: ``min`` or ``max``: which direction of ``metric`` is better.
        keep_best: write ``output_dir/best/`` at each improvement.
        patience: evaluations without improvement before training stops (``early_stopping``);
            None = never stop early.
    """

    dataset: DictConfig | ListConfig
    every_n_steps: int | None
    max_batches: int | None
    batch_size: int
    metric: str
    mode: str
    keep_best: bool
    patience: int | None


@dataclass(frozen=True)
class TeacherLogitsSettings:
    """Stored teacher top-k log-probs (``teacher_logits:``; :mod:`kd.stored_logits`).

    Attributes:
        path: the store's folder (``kd run teacher_logits`` writes it, ``kd run kd`` reads it).
        k: top-k entries per labelled position (stored by the precompute; used by training, at
            most the stored k).
        tail: ``bucket`` (the teacher mass outside the top-k as one extra entry) or ``renorm``
            (the top-k renormalised).
        rows_per_shard: dataset rows per shard file the precompute writes.
        format: ``kd`` (a store of ``kd run teacher_logits``), ``axolotl`` or ``distillkit``
            (another tool's top-k file, :mod:`kd.foreign_logits`).
        source_temperature: the temperature a foreign file's log-probs were taken at (None: the
            run's temperature).
    """

    path: Path
    k: int
    tail: str
    rows_per_shard: int
    format: str = "kd"
    source_temperature: float | None = None


@dataclass(frozen=True)
class TeacherServerSettings:
    """A served teacher (``teacher_server:``; :mod:`kd.teachers.served`).

    Attributes:
        url: the server's base URL (``http://host:port``).
        api: ``vllm`` or ``sglang``: the protocol spoken.
        model: the served model's name, checked against the server.
        top_k: log-probs asked per position.
        tail: ``bucket`` or ``renorm`` (as ``teacher_logits.tail``).
        timeout: seconds per request before a retry.
        retries: retries of a request (timeouts, connection errors, 5xx).
        backoff: backoff factor of the retries, seconds.
        concurrency: requests in flight at once.
        prefetch: micro-batches asked ahead of training.
        token_env: the environment variable holding the API token (None: no token).
    """

    url: str
    api: str
    model: str
    top_k: int
    tail: str = "bucket"
    timeout: float = 60.0
    retries: int = 5
    backoff: float = 1.0
    concurrency: int = 8
    prefetch: int = 4
    token_env: str | None = None


@dataclass(frozen=True)
class OnPolicySettings:
    """On-policy distillation (``on_policy:``; :mod:`kd.on_policy`), GKD's knobs as TRL names them.

    Attributes:
        lmbda: probability that a micro-batch trains on the student's own completions of its
            prompts (drawn once per micro-batch, the same on every rank).
        max_new_tokens: tokens sampled per prompt at most (fewer at a stop token).
        temperature: sampling temperature (0 = greedy); the loss uses ``LossSettings.temperature``.
        top_p: nucleus sampling mass (1 = the whole distribution).
        seq_kd: the other micro-batches train on the teacher's completions instead of the
            dataset's.
    """

    lmbda: float = 0.5
    max_new_tokens: int = 128
    temperature: float = 0.9
    top_p: float = 1.0
    seq_kd: bool = False


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a run, typed and read once (see :func:`run_config`).

    Attributes:
        loss: loss settings (also what the tracers use).
        optimizer: optimizer, clipping and accumulation.
        memory: memory-plan settings.
        fsdp: FSDP2 settings.
        checkpoint: outputs and step checkpoints.
        components: the ``_component_`` nodes by key (read-only; ``None`` for an absent optional
            component such as ``teacher_model: null``; ``dataset`` may be a list of nodes,
            torchtune's concatenated datasets, see :func:`kd.data.build_dataset`).
        lora: the student's LoRA settings (None for a full fine-tune).
        validation: held-out evaluation, best checkpoint and early stopping (None: no
            ``validation:``).
        teacher_logits: the stored teacher logits (None: ``teacher_logits: null``).
        on_policy: on-policy distillation (None: ``on_policy: null``, the dataset's completions).
        seed: random seed; None = drawn at start (and adopted from the checkpoint on resume).
        shuffle: reshuffle the dataset every epoch.
        batch_size: micro-batch per rank.
        max_seq_len: ``tokenizer.max_seq_len`` (None = untruncated).
        epochs: passes over the dataset.
        max_steps_per_epoch: cap on optimizer steps per epoch.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: ``bf16`` or ``fp32`` (parameters of both models).
        activation_checkpointing: recompute decoder layers in backward.
        compile: ``torch.compile`` the decoder layers.
        log_every_n_steps: optimizer steps between metric rows.
        log_peak_memory_stats: add peak memory to the metric rows.
        max_bad_steps: non-finite steps skipped before the run stops.
        trust_remote_components: allow any importable ``_component_`` target, not only what
            each key may build (:mod:`kd.config.allowlist`).
        yaml: the resolved config as YAML (the snapshot checkpoints store).
        teacher_server: the served teacher (None: ``teacher_server: null``).
    """

    loss: LossSettings
    optimizer: OptimizerSettings
    memory: MemorySettings
    fsdp: FSDPSettings
    checkpoint: CheckpointSettings
    components: dict[str, DictConfig | ListConfig | None]
    lora: LoraSettings | None
    validation: ValidationSettings | None
    teacher_logits: TeacherLogitsSettings | None
    on_policy: OnPolicySettings | None
    seed: int | None
    shuffle: bool
    batch_size: int
    max_seq_len: int | None
    epochs: int
    max_steps_per_epoch: int | None
    device: str
    dtype: str
    activation_checkpointing: bool
    compile: bool
    log_every_n_steps: int
    log_peak_memory_stats: bool
    max_bad_steps: int
    trust_remote_components: bool
    yaml: str
    teacher_server: TeacherServerSettings | None = None

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


def _check_mode(raw: Any) -> str:
    # YAML 1.1 (OmegaConf) reads a bare `off` as False.
    return "off" if raw is False else str(raw)


def _frozen_node(node: Any) -> DictConfig | ListConfig | None:
    """A read-only copy of a component node (a list of nodes stays a list: ``dataset``)."""
    if node is None:
        return None
    copy = OmegaConf.create(OmegaConf.to_container(node, resolve=True))
    OmegaConf.set_readonly(copy, True)
    return copy


def _lora(model: Any) -> LoraSettings | None:
    name = str(model.get("_component_", "")).rsplit(".", 1)[-1]
    if not name.startswith("lora_"):
        return None
    return LoraSettings(
        rank=int(model.lora_rank),
        alpha=float(model.lora_alpha),
        attn_modules=tuple(str(m) for m in model.lora_attn_modules),
        apply_to_mlp=bool(model.get("apply_lora_to_mlp", False)),
        apply_to_output=bool(model.get("apply_lora_to_output", False)),
    )


def _validation(cfg: DictConfig) -> ValidationSettings | None:
    """The validation settings, or None without ``validation:`` (keep_best and early_stopping
    need it: :func:`kd.config.validate_config` says so)."""
    val = cfg.get("validation")
    if val is None:
        return None
    best = cfg.get("keep_best")
    metric = str(best.metric) if best is not None else schema.KEEP_BEST["metric"].default
    mode = best.mode if best is not None else None
    stopping = cfg.get("early_stopping")
    dataset = _frozen_node(val.dataset)
    assert dataset is not None
    return ValidationSettings(
        dataset=dataset,
        every_n_steps=None if val.every_n_steps is None else int(val.every_n_steps),
        max_batches=None if val.max_batches is None else int(val.max_batches),
        batch_size=int(val.batch_size if val.batch_size is not None else cfg.batch_size),
        metric=metric,
        mode=str(mode) if mode is not None else schema.VAL_METRICS[metric],
        keep_best=best is not None,
        patience=int(stopping.patience) if stopping is not None else None,
    )


def _teacher_logits(cfg: DictConfig) -> TeacherLogitsSettings | None:
    node = cfg.get("teacher_logits")
    if node is None:
        return None
    return TeacherLogitsSettings(
        path=Path(str(node.path)).expanduser(),
        k=int(node.k),
        tail=str(node.tail),
        rows_per_shard=int(node.rows_per_shard),
        format=str(node.format),
        source_temperature=None
        if node.source_temperature is None
        else float(node.source_temperature),
    )


def _teacher_server(cfg: DictConfig) -> TeacherServerSettings | None:
    node = cfg.get("teacher_server")
    if node is None:
        return None
    return TeacherServerSettings(
        url=str(node.url).rstrip("/"),
        api=str(node.api),
        model=str(node.model),
        top_k=int(node.top_k),
        tail=str(node.tail),
        timeout=float(node.timeout),
        retries=int(node.retries),
        backoff=float(node.backoff),
        concurrency=int(node.concurrency),
        prefetch=int(node.prefetch),
        token_env=None if node.token_env is None else str(node.token_env),
    )


def _on_policy(cfg: DictConfig) -> OnPolicySettings | None:
    node = cfg.get("on_policy")
    if node is None:
        return None
    return OnPolicySettings(
        lmbda=float(node.lmbda),
        max_new_tokens=int(node.max_new_tokens),
        temperature=float(node.temperature),
        top_p=float(node.top_p),
        seq_kd=bool(node.seq_kd),
    )


def run_config(cfg: DictConfig) -> RunConfig:
    """Build the :class:`RunConfig` of a loaded, validated config (defaults already merged).

    Args:
        cfg: the output of :func:`kd.config.load_config` that passed
            :func:`kd.config.validate_config` (a partial config with the schema defaults merged,
            :func:`kd.config.parse.fill_defaults`, serves the planner and the tracers).

    Returns:
        The typed, frozen run configuration.
    """
    memory = cfg.memory
    tokenizer = cfg.get("tokenizer")
    max_seq_len = tokenizer.get("max_seq_len") if tokenizer is not None else None
    if memory.get("seq_len") is not None:
        seq_len, source = int(memory.seq_len), "memory.seq_len"
    elif max_seq_len is not None:
        seq_len, source = int(max_seq_len), "tokenizer.max_seq_len"
    else:
        seq_len, source = None, "model max_seq_len"
    optimizer = _frozen_node(cfg.optimizer)
    assert isinstance(optimizer, DictConfig)
    return RunConfig(
        loss=LossSettings(
            kd_ratio=float(cfg.kd_ratio),
            temperature=float(cfg.temperature),
            divergence=str(cfg.kd_loss.divergence),
            beta=float(cfg.kd_loss.beta),
            skew_alpha=float(cfg.kd_loss.skew_alpha),
            chunk_size=int(cfg.loss_chunk_size),
            fused=bool(cfg.fused_loss),
            topk_tail=str(cfg.teacher_logits.tail) if cfg.get("teacher_logits") else "bucket",
        ),
        optimizer=OptimizerSettings(
            component=str(optimizer.get("_component_", "")),
            node=optimizer,
            in_cpu=bool(cfg.optimizer_in_cpu),
            clip_grad_norm=None if cfg.clip_grad_norm is None else float(cfg.clip_grad_norm),
            grad_accum=int(cfg.gradient_accumulation_steps),
        ),
        memory=MemorySettings(
            budget_gib=None if memory.budget_gib is None else float(memory.budget_gib),
            check=_check_mode(memory.check),
            seq_len=seq_len,
            seq_len_source=source,
            reserve_gib=None if memory.reserve_gib is None else float(memory.reserve_gib),
        ),
        fsdp=FSDPSettings(
            cpu_offload=bool(cfg.fsdp.cpu_offload),
            reshard_after_forward=bool(cfg.fsdp.reshard_after_forward),
            reduce_dtype=str(cfg.fsdp.reduce_dtype),
        ),
        checkpoint=CheckpointSettings(
            output_dir=Path(str(cfg.get("output_dir") or ".")).expanduser(),
            save_every_n_steps=None
            if cfg.save_every_n_steps is None
            else int(cfg.save_every_n_steps),
            keep_last_n=int(cfg.keep_last_n),
            resume=bool(cfg.resume_from_checkpoint),
            overwrite=bool(cfg.overwrite_output_dir),
        ),
        components={key: _frozen_node(cfg.get(key)) for key in COMPONENT_KEYS},
        lora=_lora(cfg.get("model") or {}),
        validation=_validation(cfg),
        teacher_logits=_teacher_logits(cfg),
        on_policy=_on_policy(cfg),
        seed=None if cfg.seed is None else int(cfg.seed),
        shuffle=bool(cfg.shuffle),
        batch_size=int(cfg.batch_size),
        max_seq_len=None if max_seq_len is None else int(max_seq_len),
        epochs=int(cfg.epochs),
        max_steps_per_epoch=None
        if cfg.max_steps_per_epoch is None
        else int(cfg.max_steps_per_epoch),
        device=str(cfg.device),
        dtype=str(cfg.dtype),
        activation_checkpointing=bool(cfg.enable_activation_checkpointing),
        compile=bool(cfg.compile),
        log_every_n_steps=int(cfg.log_every_n_steps),
        log_peak_memory_stats=bool(cfg.log_peak_memory_stats),
        max_bad_steps=int(cfg.max_bad_steps),
        trust_remote_components=bool(cfg.trust_remote_components),
        yaml=OmegaConf.to_yaml(cfg, resolve=True),
        teacher_server=_teacher_server(cfg),
    )
