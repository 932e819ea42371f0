"""What each config key may build: the one table of allowed ``_component_`` targets.

A ``_component_: dotted.path`` node imports that path and calls it with the node's keys, so a
config file is code, and configs are shared between people. Each key may therefore build only
what that key is for, named exactly (module and name, never a package prefix): ``optimizer``
builds optimizers, ``metric_logger`` builds loggers, and neither builds ``torch.load``,
``torch.hub.load`` or ``kd.cli.main``. Nothing here loads code or unpickles: model weights come
from safetensors (torchtune reads other files with ``torch.load(weights_only=True)``), tokenizers
and data from text formats. ``trust_remote_components: true`` in the config allows any importable
target (docs/security.md).

Nested ``_component_`` nodes are built with their nested key (``dataset.message_transform``); a
list index in a key (``dataset[1]``) does not change what it may build. A tokenizer's string
``prompt_template`` is imported and called by torchtune, so it is checked here too.

The schema pass of :func:`kd.config.validate_config` reads this table, so it imports nothing
heavy (no torch, no torchtune). Adding a component: add its exact dotted path to the key's
table below, and check that it neither imports code named by its arguments nor unpickles.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

TRUST_FIX = "set trust_remote_components: true only if you trust whoever wrote this config"

# torchtune 0.6.1 `torchtune.models.<package>.__all__`: the text decoders' builders (the component
# builder named after the package and the sized ones); each also exists as `lora_<name>`. Left
# out: qlora_* (kd's LoRA handling does not know NF4 weights), *_classifier and *_reward_7b (score
# heads, not language models), llama3_2_vision (images) and the t5, clip and flux encoders.
_MODEL_BUILDERS: dict[str, tuple[str, ...]] = {
    "qwen2": ("qwen2", "qwen2_0_5b", "qwen2_1_5b", "qwen2_7b"),
    "qwen2_5": (
        "qwen2_5_0_5b",
        "qwen2_5_1_5b_base",
        "qwen2_5_1_5b_instruct",
        "qwen2_5_3b",
        "qwen2_5_7b_base",
        "qwen2_5_7b_instruct",
        "qwen2_5_14b_base",
        "qwen2_5_14b_instruct",
        "qwen2_5_32b_base",
        "qwen2_5_32b_instruct",
        "qwen2_5_72b_base",
        "qwen2_5_72b_instruct",
    ),
    "llama2": ("llama2", "llama2_7b", "llama2_13b", "llama2_70b"),
    "code_llama2": ("code_llama2_7b", "code_llama2_13b", "code_llama2_70b"),
    "llama3": ("llama3", "llama3_8b", "llama3_70b"),
    "llama3_1": ("llama3_1", "llama3_1_8b", "llama3_1_70b", "llama3_1_405b"),
    "llama3_2": ("llama3_2", "llama3_2_1b", "llama3_2_3b"),
    "llama3_3": ("llama3_3_70b",),
    "gemma": ("gemma", "gemma_2b", "gemma_7b"),
    "gemma2": ("gemma2", "gemma2_2b", "gemma2_9b", "gemma2_27b"),
    "mistral": ("mistral", "mistral_7b"),
    "phi3": ("phi3", "phi3_mini"),
    "phi4": ("phi4_14b",),
}

# The tokenizer builders of the same packages (llama3_x and code_llama2 use llama3's / llama2's).
_TOKENIZER_BUILDERS: dict[str, tuple[str, ...]] = {
    "qwen2": ("qwen2_tokenizer",),
    "qwen2_5": ("qwen2_5_tokenizer",),
    "llama2": ("llama2_tokenizer",),
    "llama3": ("llama3_tokenizer",),
    "gemma": ("gemma_tokenizer",),
    "gemma2": ("gemma_tokenizer",),
    "mistral": ("mistral_tokenizer",),
    "phi3": ("phi3_mini_tokenizer",),
    "phi4": ("phi4_tokenizer",),
}


def _in(module: str, names: Iterable[str]) -> frozenset[str]:
    return frozenset(f"{module}.{name}" for name in names)


@dataclass(frozen=True)
class Allowed:
    """What one config key may build.

    Attributes:
        summary: a short description for messages ("torch.optim optimizers such as ...").
        example: one allowed target, for "set it to ..." hints.
        targets: every allowed dotted path, exactly.
    """

    summary: str
    example: str
    targets: frozenset[str]


# The transformers backend: any causal LM of a local Hugging Face folder (kd/hf/model.py).
HF_MODEL_BUILDERS = _in("kd.hf", ("causal_lm", "lora_causal_lm"))

MODELS = Allowed(
    "kd.hf.causal_lm / kd.hf.lora_causal_lm (a Hugging Face folder), or "
    "torchtune.models.<family>.<builder> decoders and lora_ builders such as "
    "torchtune.models.qwen2_5.qwen2_5_3b",
    "torchtune.models.qwen2_5.qwen2_5_3b",
    HF_MODEL_BUILDERS.union(
        *(
            _in(f"torchtune.models.{package}", (*names, *(f"lora_{n}" for n in names)))
            for package, names in _MODEL_BUILDERS.items()
        )
    ),
)

# kd.hf.tokenizer: a Hugging Face folder's tokenizer.json / tokenizer_config.json (kd/hf/tokenization.py;
# transformers reads them as text, never with trust_remote_code).
TOKENIZERS = Allowed(
    "kd.hf.tokenizer (a Hugging Face folder), or torchtune.models.<family>.<family>_tokenizer, "
    "e.g. torchtune.models.qwen2_5.qwen2_5_tokenizer",
    "torchtune.models.qwen2_5.qwen2_5_tokenizer",
    _in("kd.hf", ("tokenizer",)).union(
        *(_in(f"torchtune.models.{p}", names) for p, names in _TOKENIZER_BUILDERS.items())
    ),
)

# Only the Hugging Face checkpointer: it reads safetensors (other files with torch.load's
# weights_only=True) and kd saves Hugging Face folders. FullModelMetaCheckpointer and
# FullModelTorchTuneCheckpointer read pickle-format .pt files (the latter's load_checkpoint takes
# weights_only=False for quantized models); DistributedCheckpointer unpickles DCP's .metadata.
CHECKPOINTERS = Allowed(
    "torchtune.training.FullModelHFCheckpointer",
    "torchtune.training.FullModelHFCheckpointer",
    frozenset(
        {
            "torchtune.training.FullModelHFCheckpointer",
            "torchtune.training.checkpointing.FullModelHFCheckpointer",
        }
    ),
)

# Supervised and text-completion builders (Hugging Face `load_dataset`, which runs no loading
# scripts since datasets 4). Left out: preference datasets (chosen/rejected pairs), multimodal ones,
# and PackedDataset / ConcatDataset (they wrap datasets; kd packs and concatenates itself).
DATASETS = Allowed(
    "torchtune.datasets builders such as torchtune.datasets.instruct_dataset or chat_dataset",
    "torchtune.datasets.instruct_dataset",
    _in(
        "torchtune.datasets",
        (
            "alpaca_dataset",
            "alpaca_cleaned_dataset",
            "chat_dataset",
            "cnn_dailymail_articles_dataset",
            "grammar_dataset",
            "instruct_dataset",
            "samsum_dataset",
            "slimorca_dataset",
            "text_completion_dataset",
            "wikitext_dataset",
            "SFTDataset",
            "TextCompletionDataset",
        ),
    )
    | frozenset({"kd.data.pretokenized_dataset"}),
)

MESSAGE_TRANSFORMS = Allowed(
    "torchtune.data message transforms, e.g. torchtune.data.InputOutputToMessages",
    "torchtune.data.InputOutputToMessages",
    _in(
        "torchtune.data",
        ("AlpacaToMessages", "InputOutputToMessages", "OpenAIToMessages", "ShareGPTToMessages"),
    ),
)

# Left out: Optimizer (the base class), LBFGS (its step needs a closure), SparseAdam (sparse
# gradients only) and torchao's CPUOffloadOptimizer (set optimizer_in_cpu instead).
OPTIMIZERS = Allowed(
    "torch.optim optimizers such as torch.optim.AdamW, or torchao.optim.AdamW8bit and its kin",
    "torch.optim.AdamW",
    _in(
        "torch.optim",
        (
            "Adadelta",
            "Adafactor",
            "Adagrad",
            "Adam",
            "Adamax",
            "AdamW",
            "ASGD",
            "Muon",
            "NAdam",
            "RAdam",
            "RMSprop",
            "Rprop",
            "SGD",
        ),
    )
    | _in(
        "torchao.optim",
        ("Adam4bit", "Adam8bit", "AdamFp8", "AdamW4bit", "AdamW8bit", "AdamWFp8", "_AdamW"),
    ),
)

# Left out: LambdaLR and MultiplicativeLR (they take a function), SequentialLR and ChainedScheduler
# (they take schedulers), ReduceLROnPlateau (its step takes a metric).
LR_SCHEDULERS = Allowed(
    "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup or a "
    "torch.optim.lr_scheduler class such as LinearLR",
    "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
    _in("torchtune.training.lr_schedulers", ("get_cosine_schedule_with_warmup",))
    | _in("torchtune.training", ("get_cosine_schedule_with_warmup",))
    | _in(
        "torch.optim.lr_scheduler",
        (
            "ConstantLR",
            "CosineAnnealingLR",
            "CosineAnnealingWarmRestarts",
            "CyclicLR",
            "ExponentialLR",
            "LinearLR",
            "MultiStepLR",
            "OneCycleLR",
            "PolynomialLR",
            "StepLR",
        ),
    ),
)

METRIC_LOGGERS = Allowed(
    "kd.metrics.StdoutLogger, kd.metrics.WandBLogger or a torchtune.training.metric_logging logger",
    "kd.metrics.StdoutLogger",
    _in("kd.metrics", ("StdoutLogger", "WandBLogger"))
    | _in(
        "torchtune.training.metric_logging",
        ("DiskLogger", "StdoutLogger", "TensorBoardLogger", "WandBLogger"),
    ),
)

# torchtune imports and calls a tokenizer's string `prompt_template` (a mapping is used as is).
PROMPT_TEMPLATES = Allowed(
    "torchtune's prompt templates, e.g. torchtune.data.ChatMLTemplate, or a mapping of role to "
    "[prepend, append]",
    "torchtune.data.ChatMLTemplate",
    _in(
        "torchtune.data",
        (
            "ChatMLTemplate",
            "GrammarErrorCorrectionTemplate",
            "QuestionAnswerTemplate",
            "SummarizeTemplate",
        ),
    )
    | _in("torchtune.models.llama2", ("Llama2ChatTemplate",))
    | _in("torchtune.models.mistral", ("MistralChatTemplate",)),
)

# The table: config key (nested keys dotted, list indices dropped) -> what it may build.
ALLOWED: dict[str, Allowed] = {
    "model": MODELS,
    "teacher_model": MODELS,
    "tokenizer": TOKENIZERS,
    "checkpointer": CHECKPOINTERS,
    "teacher_checkpointer": CHECKPOINTERS,
    "dataset": DATASETS,
    "dataset.message_transform": MESSAGE_TRANSFORMS,
    "dataset.model_transform": TOKENIZERS,
    # The held-out data of `validation:` is built like `dataset`.
    "validation.dataset": DATASETS,
    "validation.dataset.message_transform": MESSAGE_TRANSFORMS,
    "validation.dataset.model_transform": TOKENIZERS,
    "optimizer": OPTIMIZERS,
    "lr_scheduler": LR_SCHEDULERS,
    "metric_logger": METRIC_LOGGERS,
}

# Node keys whose string value torchtune imports and calls.
_IMPORTED_VALUES: dict[str, Allowed] = {"prompt_template": PROMPT_TEMPLATES}

_INDEX = re.compile(r"\[\d+\]")


def rule_key(key: str) -> str:
    """The table key of a config key: list indices dropped (``dataset[1].x`` -> ``dataset.x``)."""
    return _INDEX.sub("", key)


def allowed(key: str) -> Allowed | None:
    """What ``key`` may build, or None when the key builds nothing without trust."""
    return ALLOWED.get(rule_key(key))


def _closest(target: str, targets: frozenset[str]) -> str | None:
    """An allowed target close to ``target`` (a typo), preferring ones in the same module."""
    module, _, name = target.rpartition(".")
    names = sorted(t.rpartition(".")[2] for t in targets if t.rpartition(".")[0] == module)
    if names:
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
        return f"{module}.{close[0]}" if close else None
    close = difflib.get_close_matches(target, sorted(targets), n=1, cutoff=0.9)
    return close[0] if close else None


def _refused(what: str, value: str, rule: Allowed | None, verb: str) -> str:
    if rule is None:
        nested = ", ".join(k for k in ALLOWED if k.rpartition(".")[0] in ALLOWED)
        allowed_text = f"nothing; nested components are built only at {nested}"
    else:
        close = _closest(value, rule.targets)
        allowed_text = rule.summary + (f"; did you mean {close}?" if close else "")
    return f"{value} is not something {what} may {verb} (allowed: {allowed_text}); {TRUST_FIX}"


def target_problem(key: str, target: Any, *, trust: bool) -> str | None:
    """What is wrong with ``key``'s ``_component_`` value, from its text alone, or None.

    Args:
        key: the config key of the node (``optimizer``, ``dataset[0]``,
            ``dataset.message_transform``), named in the message.
        target: the ``_component_`` value.
        trust: the config's ``trust_remote_components``: any non-empty string is allowed.

    Returns:
        A message ending in the fix (without the ``key._component_:`` prefix), or None.
    """
    rule = allowed(key)
    example = rule.example if rule is not None else "torch.optim.AdamW"
    if not isinstance(target, str):
        shown = (
            "a list"
            if isinstance(target, list)
            else "a mapping"
            if isinstance(target, dict)
            else repr(target)
        )
        return f"{shown} is not a string; set it to a dotted path such as {example}"
    if not target.strip():
        return f"is empty; set it to a dotted path such as {example}"
    if trust or (rule is not None and target in rule.targets):
        return None
    public = public_name(target)
    if rule is not None and public != target and public in rule.targets:
        return (
            f"{target} is a private module path (a module whose name starts with _); use its "
            f"public name {public}"
        )
    return _refused(key, target, rule, "build")


def public_name(target: str) -> str:
    """``target`` without its private modules (``torchtune.models.qwen2._component_builders.qwen2``
    -> ``torchtune.models.qwen2.qwen2``): the name a package exports a builder under."""
    parts = target.split(".")
    return ".".join([p for p in parts[:-1] if not p.startswith("_")] + parts[-1:])


def value_problems(key: str, node: Mapping[str, Any], *, trust: bool) -> list[tuple[str, str]]:
    """Node values that torchtune would import (a string ``prompt_template``) and may not.

    Args:
        key: the node's config key.
        node: the node's mapping.
        trust: the config's ``trust_remote_components``.

    Returns:
        ``(dotted key, message ending in the fix)`` for each refused value.
    """
    out = []
    for name, rule in _IMPORTED_VALUES.items():
        value = node.get(name)
        if isinstance(value, str) and not trust and value not in rule.targets:
            dotted = f"{key}.{name}"
            out.append((dotted, _refused(dotted, value, rule, "name")))
    return out


def component_nodes(key: str, node: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``node`` and every nested ``_component_`` node it builds, with their dotted keys.

    Nested nodes are the values that are mappings with a ``_component_`` (at any depth through
    such nodes), exactly the ones :func:`kd.config.instantiate.instantiate` builds.

    Args:
        key: the node's config key.
        node: a mapping (the node itself need not have ``_component_``).
    """
    yield key, node
    for name, value in node.items():
        if isinstance(value, Mapping) and "_component_" in value:
            yield from component_nodes(f"{key}.{name}", value)


def tree_problems(key: str, node: Mapping[str, Any], *, trust: bool) -> list[tuple[str, str]]:
    """Every refused target and imported value in ``node`` and its nested nodes.

    A node without ``_component_`` is skipped (the caller reports it as missing).

    Returns:
        ``(dotted key, message)`` pairs; the key of a target ends in ``._component_``.
    """
    out: list[tuple[str, str]] = []
    for dotted, sub in component_nodes(key, node):
        if "_component_" in sub:
            reason = target_problem(dotted, sub["_component_"], trust=trust)
            if reason is not None:
                out.append((f"{dotted}._component_", reason))
        out += value_problems(dotted, sub, trust=trust)
    return out
