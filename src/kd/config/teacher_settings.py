"""The teacher sections of :class:`kd.config.run.RunConfig`, each key declared once.

One settings dataclass per teacher section a config may hold: stored teacher log-probs
(``teacher_logits:``), a served teacher (``teacher_server:``), several teachers (``teachers:``),
a teacher with another tokenizer (``cross_tokenizer:``), self-distillation (``self_teacher:``) and
hidden-state distillation (``hidden_states:``). :class:`~kd.config.run.RunConfig` holds each as a
group that is None when its section is absent; the teacher kinds
(:mod:`kd.config.teacher_kinds`) say which of them a run's teacher reads.

This module imports no torch: ``kd plan`` and the config checks stay fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig

from kd.config.declare import (
    MAY_CHANGE,
    MISSING,
    MUST_MATCH,
    base_url,
    frozen_node,
    setting,
    settings,
)


@settings
class TeacherLogitsSettings:
    """Stored teacher top-k log-probs (``teacher_logits:``; :mod:`kd.teachers.store_format`):
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


@settings
class TeacherServerSettings:
    """A served teacher (``teacher_server:``; :mod:`kd.teachers.served`): top-k log-probs over
    HTTP from vLLM or SGLang, in place of ``teacher_model`` and ``teacher_checkpointer``."""

    url: str = setting(
        "teacher_server.url",
        MISSING,
        "the server's base URL (http://host:port), without /v1",
        read=base_url,
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
