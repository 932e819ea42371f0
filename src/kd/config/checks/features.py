"""Rules between keys, one function per feature: on-policy distillation, validation (keep_best,
early_stopping), outputs, the device.

What a teacher kind says about on-policy distillation and validation is declared by the kind
(:attr:`kd.config.teacher_kinds.TeacherKind.on_policy` and ``.validation``) and read here through
the registry; this module reads no teacher kind's section itself (a guard test checks)."""

from __future__ import annotations

from typing import Any

from kd.config import schema
from kd.config import teacher_kinds as kinds
from kd.config.checks.values import DEVICE_RE
from kd.config.schema import Problem


def _no_teacher(data: dict[str, Any]) -> bool:
    """``teacher_model: null`` and no kind's section teaching in its place: plain fine-tuning."""
    return (
        "teacher_model" in data
        and data["teacher_model"] is None
        and not kinds.replacing_sections(data)
    )


def check_on_policy(data: dict[str, Any], problems: list[Problem]) -> None:
    """On-policy distillation needs a teacher that runs (it scores sequences that exist only
    during training) and room in ``tokenizer.max_seq_len`` for the completions."""
    node = data.get("on_policy")
    if not isinstance(node, dict):
        return
    refused = kinds.refusal(data, "on_policy")
    if refused is not None:
        problems.append(Problem("on_policy", refused))
    elif _no_teacher(data):
        problems.append(
            Problem(
                "on_policy",
                "needs a teacher to score the completions, but teacher_model is null; set "
                "teacher_model, or remove on_policy",
            )
        )
    new = node.get("max_new_tokens")
    tokenizer = data.get("tokenizer")
    limit = tokenizer.get("max_seq_len") if isinstance(tokenizer, dict) else None
    if isinstance(tokenizer, dict) and limit is None:
        problems.append(
            Problem(
                "tokenizer.max_seq_len",
                "is null, but on_policy needs it: prompt + completion must fit the sequence "
                "length the memory plan covers; set tokenizer.max_seq_len (e.g. 2048)",
            )
        )
    if (
        isinstance(new, int)
        and isinstance(limit, int)
        and not isinstance(new, bool)
        and not isinstance(limit, bool)
        and new >= limit
    ):
        problems.append(
            Problem(
                "on_policy.max_new_tokens",
                f"{new} leaves no room for a prompt in tokenizer.max_seq_len {limit} (prompt and "
                f"completion are one sequence); set on_policy.max_new_tokens below {limit}, or "
                "raise tokenizer.max_seq_len",
            )
        )
    if node.get("sampler") == "served" and node.get("sampling_dtype") is not None:
        problems.append(
            Problem(
                "on_policy.sampling_dtype",
                "applies to the local sampler; with on_policy.sampler served the server's own "
                "--dtype decides what it samples in (vllm serve / sglang.launch_server --dtype "
                "bfloat16); set on_policy.sampling_dtype=null",
            )
        )
    if node.get("rollout_batch_size") is not None and node.get("batch_rollouts") is not True:
        problems.append(
            Problem(
                "on_policy.rollout_batch_size",
                "cuts the one generation per step of on_policy.batch_rollouts into groups; "
                "without it each micro-batch (batch_size rows) is sampled on its own and this is "
                "never read; set on_policy.batch_rollouts=true, or on_policy.rollout_batch_size="
                "null",
            )
        )
    if node.get("cuda_graphs") is True:
        _check_cuda_graphs(data, node, problems)
    if node.get("server_sleep") is True and node.get("sampler", "local") != "served":
        problems.append(
            Problem(
                "on_policy.server_sleep",
                "puts a served sampler's vLLM server to sleep while the step trains; with "
                "on_policy.sampler local there is no server: set on_policy.server_sleep=false, "
                "or on_policy.sampler=served",
            )
        )
    if node.get("sampler") == "served":  # kd.rollouts.served
        _check_served(node, problems)


def _check_served(node: dict[str, Any], problems: list[Problem]) -> None:
    """A served sampler's keys: the server named, and its knobs only where they apply."""
    for key, what in (
        ("server_url", "the server's base URL (http://host:port)"),
        ("server_model", "the name it serves the student under (--served-model-name)"),
    ):
        if node.get(key) is None:
            problems.append(
                Problem(
                    f"on_policy.{key}",
                    f"on_policy.sampler is served, which needs {what}; set "
                    f"on_policy.{key}, or on_policy.sampler=local",
                )
            )
    if node.get("server_sleep") is True:
        _check_server_sleep(node, problems)
    if node.get("server_admin_token_env") is not None and node.get("server_api") != "sglang":
        problems.append(
            Problem(
                "on_policy.server_admin_token_env",
                "only SGLang has an admin key (--admin-api-key); vLLM's --api-key "
                "(on_policy.server_token_env) guards its /v1 routes and no key guards "
                "/collective_rpc; set on_policy.server_admin_token_env=null",
            )
        )


def _check_server_sleep(node: dict[str, Any], problems: list[Problem]) -> None:
    """``on_policy.server_sleep`` puts a vLLM server to sleep while the step trains; it must be
    idle then (no rollouts sampled ahead)."""
    if node.get("server_api") == "sglang":
        line = (
            "puts a vLLM server to sleep (/sleep, /wake_up); kd does not drive SGLang's "
            "/release_memory_occupation yet; set on_policy.server_sleep=false, or serve the "
            "student with vLLM"
        )
    elif node.get("async_steps") == 1:
        line = (
            "sleeps the server while the step trains, when async_steps: 1 samples the next "
            "step's rollouts from it; set on_policy.async_steps=0, or on_policy.server_sleep=false"
        )
    else:
        return
    problems.append(Problem("on_policy.server_sleep", line))


def _check_cuda_graphs(data: dict[str, Any], node: dict[str, Any], problems: list[Problem]) -> None:
    """``on_policy.cuda_graphs`` replays the local sampler's fast decode step
    (``batch_rollouts``) on a CUDA device, in the training thread; ``compile: true`` is the other
    way of that step."""
    if node.get("sampler") == "served":
        line = (
            "applies to the local sampler; a served sampler's server runs its own CUDA graphs "
            "(vLLM unless --enforce-eager, SGLang unless --disable-cuda-graph); set "
            "on_policy.cuda_graphs=false"
        )
    elif node.get("batch_rollouts") is not True:
        line = (
            "replays the fast local decode of on_policy.batch_rollouts; set "
            "on_policy.batch_rollouts=true, or on_policy.cuda_graphs=false"
        )
    elif data.get("compile") is True:
        line = (
            "and compile: true are two ways of one decode step; set on_policy.cuda_graphs=false "
            "or compile=false"
        )
    elif data.get("device") == "cpu":
        line = "needs device: cuda (device is cpu); set on_policy.cuda_graphs=false"
    elif node.get("async_steps") == 1:
        line = (
            "captures in the sampling thread, where async_steps: 1 samples while the training "
            "thread synchronizes the device (which breaks a capture); set "
            "on_policy.async_steps=0, or on_policy.cuda_graphs=false"
        )
    else:
        return
    problems.append(Problem("on_policy.cuda_graphs", line))


def check_validation(data: dict[str, Any], problems: list[Problem]) -> None:
    """``keep_best`` and ``early_stopping`` need ``validation`` (and early stopping evaluations
    during training); the teacher metrics need a teacher and a KD term (kd_ratio above 0)."""
    validation = data.get("validation")
    add = "add validation: {dataset: ..., every_n_steps: N}"
    for name, what in (
        ("keep_best", "it keeps the student of the best validation"),
        ("early_stopping", "it counts evaluations without improvement"),
    ):
        if data.get(name) is not None and validation is None:
            problems.append(Problem(name, f"needs validation ({what}); {add}, or remove {name}"))
    if (
        data.get("early_stopping") is not None
        and isinstance(validation, dict)
        and validation.get("every_n_steps") is None
    ):
        problems.append(
            Problem(
                "early_stopping",
                "validation.every_n_steps is null, so validation runs only at the end of "
                "training and cannot stop it early; set validation.every_n_steps, or remove "
                "early_stopping",
            )
        )
    refused = kinds.refusal(data, "validation") if isinstance(validation, dict) else None
    if refused is not None:
        problems.append(Problem("validation", refused))
    best = data.get("keep_best")
    metric = best.get("metric") if isinstance(best, dict) else None
    if metric not in schema.TEACHER_METRICS:
        return
    plain = " or ".join(m for m in schema.VAL_METRICS if m not in schema.TEACHER_METRICS)
    ratio = data.get("kd_ratio")
    if "teacher_model" in data and data["teacher_model"] is None:
        problems.append(
            Problem(
                "keep_best.metric",
                f"{metric} compares the student with the teacher, but teacher_model is null; "
                f"set keep_best.metric to {plain}",
            )
        )
    elif isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio == 0:
        # kd_ratio 0: no KD term, so validation asks the teacher for no logits (no val_kd_loss)
        problems.append(
            Problem(
                "keep_best.metric",
                f"{metric} compares the student with the teacher's logits, but kd_ratio is 0 "
                f"(no KD term: validation does not run the teacher); set keep_best.metric to "
                f"{plain}, or kd_ratio above 0",
            )
        )


def check_output_dir(data: dict[str, Any], problems: list[Problem]) -> None:
    """An empty ``output_dir`` (it would be the working directory) and contradictory outputs keys."""
    output_dir = data.get("output_dir")
    if isinstance(output_dir, str) and not output_dir.strip():
        problems.append(
            Problem(
                "output_dir",
                "is empty; set output_dir to the folder for this run's checkpoints, "
                "metrics.jsonl and final/ (a new or empty one)",
            )
        )
    if data.get("overwrite_output_dir") is True and data.get("resume_from_checkpoint") is True:
        problems.append(
            Problem(
                "overwrite_output_dir",
                "true moves aside the checkpoints resume_from_checkpoint=true continues from; "
                "set one of them to false",
            )
        )


def check_device(data: dict[str, Any], problems: list[Problem]) -> None:
    """``device`` is one kd runs on (its availability is checked when the run starts)."""
    device = data.get("device")
    if isinstance(device, str) and not DEVICE_RE.match(device):
        problems.append(
            Problem(
                "device",
                f"{device!r} is not a device kd runs on; set device to cuda, cuda:N or cpu",
            )
        )
