"""Every config key `kd` knows, with its default, type and allowed range, as tables.

The keys that reach a run are declared once, as fields of the settings dataclasses in
:mod:`kd.config.run` (:func:`kd.config.declare.setting`); the tables here are derived from those
declarations, plus the ``_component_`` nodes and the sections, which are declared here. A teacher
kind declares its own section in its module (:mod:`kd.config.teacher_kinds`), which adds it to
these tables when the kind is registered (:func:`add_section`; importing :mod:`kd.config`
registers the built-in kinds). Recipes
read scalar knobs from the resolved config after :func:`kd.config.load_config` has merged these
defaults under the user's YAML, so no recipe calls ``cfg.get(key, default)``.

Top-level keys follow torchtune's KD configs (a torchtune user changes only paths); `kd`'s own keys
(``temperature``, ``save_every_n_steps``, ``loss_chunk_size``, ``memory``...) sit beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kd.config.declare import MAY_CHANGE, MISSING, MUST_MATCH, Key, declared_keys
from kd.config.run import COMPONENT_KEYS, DIVERGENCES, VAL_METRICS, RunConfig

__all__ = [
    "COMPONENT_ARGS",
    "DIVERGENCES",
    "MAY_CHANGE",
    "MISSING",
    "MUST_MATCH",
    "SECTIONS",
    "TOP_LEVEL",
    "VAL_METRICS",
    "Key",
    "Problem",
    "defaults",
]

# Metrics that compare the student with the teacher (none without one: teacher_model null).
TEACHER_METRICS: tuple[str, ...] = ("val_kd_loss", "val_top1_agreement")

# The `_component_` nodes that are not a RunConfig setting (RunConfig.components holds them).
# Nodes are validated by binding their `_component_` signature; a default here is only used when
# the YAML leaves the node out.
_NODES: dict[str, Key] = {
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
    "metric_logger": Key(
        {"_component_": "kd.metrics.StdoutLogger"},
        node=True,
        help="extra metric sink beside output_dir/metrics.jsonl; kd.metrics.WandBLogger logs to wandb "
        "(offline without an API key); torchtune's DiskLogger/WandBLogger also work",
        resume=MAY_CHANGE,
    ),
}


@dataclass(frozen=True)
class Section:
    """A top-level mapping of keys (``memory:``, ``validation:``...), whose keys are declared in
    :mod:`kd.config.run` (or, for a teacher kind's section, in its kind module).

    Attributes:
        help: one line for the docs.
        resume: as :attr:`Key.resume`; ``may_change`` covers the whole section.
        optional: the section is null unless the YAML sets it (``validation``); otherwise it is
            present with its keys' defaults (``memory``).
        words: what users call the section in front of one of its keys (``eval_every_n_steps``
            is ``validation.every_n_steps``): an unknown key is matched against them.
        after: a section added by :func:`add_section` goes after this one in the tables (so in
            the checks' order and a run's config snapshot); None: last.
    """

    help: str
    resume: str
    optional: bool = False
    words: tuple[str, ...] = ()
    after: str | None = None


_SECTIONS: dict[str, Section] = {
    "kd_loss": Section(
        "divergence to the teacher: a name, {divergence, beta, skew_alpha} or a torchtune loss",
        MUST_MATCH,
        words=("kd", "loss", "kd_loss"),
    ),
    "memory": Section(
        "memory plan: budget_gib (null = device total), check error|warn|off, seq_len override",
        MAY_CHANGE,
        words=("memory", "mem", "plan"),
    ),
    "fsdp": Section("FSDP2 options of the distributed recipe", MAY_CHANGE, words=("fsdp",)),
    "validation": Section(
        "held-out evaluation: {dataset, every_n_steps, max_batches, batch_size}; null = none",
        MAY_CHANGE,
        optional=True,
        words=("validation", "eval", "evaluation", "val", "run_val", "valid"),
    ),
    "on_policy": Section(
        "on-policy distillation (GKD): {lmbda, max_new_tokens, temperature, top_p, seq_kd}; "
        "with probability lmbda a micro-batch trains on the student's own completions of its "
        "prompts, scored by the teacher; null = the dataset's completions only",
        MUST_MATCH,
        optional=True,
        words=("on_policy", "gkd", "generation", "gen"),
    ),
    "eval": Section(
        "lm-evaluation-harness tasks scored on final/ at the end of training: {tasks, limit, "
        "batch_size, num_fewshot, chat}; null = none (kd eval scores any folder later)",
        MAY_CHANGE,
        optional=True,
        words=("lm_eval", "harness", "benchmark", "tasks"),
    ),
    "keep_best": Section(
        "keep output_dir/best/, the student of the best validation: {metric, mode}; "
        "needs validation",
        MAY_CHANGE,
        optional=True,
        words=("keep_best", "best"),
    ),
    "early_stopping": Section(
        "stop after {patience} evaluations without improvement (keep_best's metric, else "
        "val_loss); needs validation",
        MAY_CHANGE,
        optional=True,
        words=("early_stopping", "early_stop", "stopping", "early"),
    ),
}

_DECLARED: dict[str, Key] = declared_keys(RunConfig)

# Keys of each section, from the declarations.
SECTIONS: dict[str, dict[str, Key]] = {
    name: {
        dotted.split(".", 1)[1]: key
        for dotted, key in _DECLARED.items()
        if dotted.split(".", 1)[0] == name
    }
    for name in _SECTIONS
}
MEMORY = SECTIONS["memory"]
FSDP = SECTIONS["fsdp"]
KD_LOSS = SECTIONS["kd_loss"]
VALIDATION = SECTIONS["validation"]
KEEP_BEST = SECTIONS["keep_best"]
EARLY_STOPPING = SECTIONS["early_stopping"]
ON_POLICY = SECTIONS["on_policy"]

# Words users put before a section's key, for suggestions (kd.config.checks.keys).
SECTION_WORDS: dict[str, tuple[str, ...]] = {n: s.words for n, s in _SECTIONS.items()}

# Arguments of component nodes that kd reads itself (the plan, the LoRA adapter config), checked
# like the keys above when the node has them; the component checks the rest.
COMPONENT_ARGS: dict[str, Key] = {
    dotted: key
    for dotted, key in _DECLARED.items()
    if "." in dotted and dotted.split(".", 1)[0] in COMPONENT_KEYS
}


def _section_key(name: str, section: Section) -> Key:
    keys = SECTIONS[name]
    default = None
    if not section.optional:
        default = {sub: key.default for sub, key in keys.items() if key.default is not MISSING}
    return Key(
        default, node=True, nullable=section.optional, help=section.help, resume=section.resume
    )


# Keys of the top-level config: the declared settings, the component nodes, the sections.
TOP_LEVEL: dict[str, Key] = {
    **{dotted: key for dotted, key in _DECLARED.items() if "." not in dotted},
    **_NODES,
    **{name: _section_key(name, section) for name, section in _SECTIONS.items()},
}


def _insert(table: dict[str, Any], name: str, value: Any, after: str | None) -> None:
    """Put ``name`` in ``table`` right after ``after`` (last when None), in place: modules hold
    the tables by reference."""
    items = [(k, v) for k, v in table.items() if k != name]
    at = len(items) if after is None else [k for k, _ in items].index(after) + 1
    items.insert(at, (name, value))
    table.clear()
    table.update(items)


def add_section(name: str, section: Section, settings: type) -> None:
    """Add the optional section ``name`` whose keys ``settings`` declares (a teacher kind's,
    :func:`kd.config.teacher_kinds.register`): every table above gains it, after
    ``section.after``."""
    keys = {dotted.split(".", 1)[1]: key for dotted, key in declared_keys(settings).items()}
    after = section.after
    _insert(_SECTIONS, name, section, after)
    _insert(SECTIONS, name, keys, after)
    _insert(SECTION_WORDS, name, section.words, after)
    _insert(TOP_LEVEL, name, _section_key(name, section), after)


def remove_section(name: str) -> None:
    """Undo :func:`add_section`."""
    for table in (_SECTIONS, SECTIONS, SECTION_WORDS, TOP_LEVEL):
        table.pop(name, None)


# Keys torchtune's KD recipes accept that kd does not use; they are dropped with a notice.
IGNORED_TORCHTUNE_KEYS: dict[str, str] = {
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
