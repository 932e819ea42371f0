"""The served kind: a vLLM or SGLang server answering the teacher's top-k log-probs over HTTP
(``teacher_server:``), optionally written through to kd's store (``teacher_server.store``).

Beside ``teacher_logits`` the server is the one that filled the store (``kd run
teacher_logits``) and the store kind teaches. Its source is
:class:`kd.teachers.build.ServedTeacherSource`; its teacher
:class:`kd.teachers.served.ServedTeacher`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kd.config.checks.values import fmt
from kd.config.declare import MAY_CHANGE, MISSING, MUST_MATCH, base_url, setting, settings
from kd.config.run import RunConfig
from kd.config.schema import Problem, Section
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan, no_quantization
from kd.errors import redact

__all__ = [
    "KIND",
    "SECTION",
    "SECTION_HELP",
    "TeacherServerSettings",
    "check_teacher_server",
    "prefetch_bytes",
]

SECTION = "teacher_server"


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


SECTION_HELP = Section(
    "a served teacher (vLLM or SGLang) answering top-k log-probs over HTTP: {url, api, "
    "model, top_k, tail, timeout, retries, backoff, concurrency, prefetch, store, store_rows_per_shard, token_env}; in "
    "place of teacher_model and teacher_checkpointer; null = no served teacher",
    MUST_MATCH,
    optional=True,
    words=("teacher_server", "server", "served", "vllm", "sglang"),
    after="teacher_logits",
)


def check_teacher_server(data: dict[str, Any], problems: list[Problem]) -> None:
    """A served teacher replaces the teacher's nodes and answers top-k log-probs at
    temperature 1: what needs a local teacher's full distribution or its sampling is refused."""
    node = data.get(SECTION)
    if not isinstance(node, dict):
        return
    drop = "remove teacher_model and teacher_checkpointer (the server is the teacher)"
    if data.get("teacher_model") is not None:
        problems.append(Problem("teacher_model", f"is set beside teacher_server; {drop}"))
    url = node.get("url")
    if isinstance(url, str) and not url.startswith(("http://", "https://")):
        problems.append(
            Problem(
                "teacher_server.url",
                f"{fmt(redact(url)[:80])} is not an http:// or https:// URL; set teacher_server.url to "
                "the server's base URL, e.g. http://127.0.0.1:8000",
            )
        )
    if isinstance(url, str) and redact(url) != url and node.get("token_env") is not None:
        problems.append(
            Problem(
                "teacher_server.token_env",
                "is set beside a user:password in teacher_server.url, and both would be sent as "
                "the Authorization header; keep one (the token for vLLM's / SGLang's --api-key)",
            )
        )
    if isinstance(data.get("validation"), dict) and not isinstance(
        data.get("teacher_logits"), dict
    ):
        problems.append(
            Problem(
                "validation",
                "needs a teacher's full distribution (val_kd_loss, val_top1_agreement), which a "
                "served teacher's top-k does not give; remove validation, or use teacher_model",
            )
        )
    on_policy = data.get("on_policy")
    if isinstance(on_policy, dict) and on_policy.get("seq_kd"):
        problems.append(
            Problem(
                "on_policy.seq_kd",
                "samples the teacher's completions, but kd only scores with a served teacher; "
                "set on_policy.seq_kd=false (the student's completions are scored by the server)",
            )
        )
    temperature = data.get("temperature", 1.0)
    if (
        node.get("tail", "bucket") == "bucket"
        and isinstance(temperature, (int, float))
        and not isinstance(temperature, bool)
        and float(temperature) != 1.0
    ):
        problems.append(
            Problem(
                "teacher_server.tail",
                f"bucket needs the teacher mass outside the top-k at temperature "
                f"{fmt(temperature)}, but the server answers at temperature 1 (kd re-tempers the "
                "top-k); set teacher_server.tail=renorm, or temperature=1",
            )
        )


def prefetch_bytes(settings: TeacherServerSettings, *, batch_size: int, seq_len: int) -> int:
    """Host memory of the answers asked ahead: ``prefetch + 1`` micro-batches of ``[b, s, k]``
    int64 ids and float32 log-probs (the parsed rows) plus the float16 signal."""
    per = batch_size * seq_len * settings.top_k * (8 + 4 + 8 + 2)
    return (settings.prefetch + 1) * per


def _selects(run: RunConfig) -> bool:
    return run.teacher_server is not None and run.teacher_logits is None


def _refuse(run: RunConfig) -> None:
    no_quantization(run, "this run's teacher is served (teacher_server)")


def _plan(p: TeacherPlan) -> None:
    """No teacher weights or forward; the table's line names the server and the host memory
    of its prefetch."""
    s, run = p.run.teacher_server, p.run
    assert s is not None
    p.stored_topk = s.top_k
    buffer = prefetch_bytes(s, batch_size=run.batch_size, seq_len=p.seq_len)
    p.line = (
        f"served top-{s.top_k} log-probs of {s.model} ({s.api} at {redact(s.url)}), no teacher weights "
        f"or forward; prefetch buffer {s.prefetch} micro-batches ahead, {buffer / 2**20:.1f} MiB "
        "of host memory"
    )


KIND = TeacherKind(
    name="served",
    section=SECTION,
    selects=_selects,
    source="kd.teachers.build:ServedTeacherSource",
    refuse=_refuse,
    precedence=20,
    replaces_teacher_model=True,
    checks=(check_teacher_server,),
    settings=TeacherServerSettings,
    section_help=SECTION_HELP,
    member=True,
    plan=_plan,
    stand_in="kd.memory.stand_ins:served",
    doc="docs/served_teacher.md",
    teacher="kd.teachers.served.ServedTeacher",
    modules=(
        "teachers/build.py",
        "teachers/served.py",
        "teachers/transport.py",
        "teachers/protocols.py",
        "teachers/store_folder.py",
        "recipes/teacher_logits.py",
    ),
)
