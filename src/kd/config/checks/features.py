"""Rules between keys, one function per feature: stored teacher logits, on-policy distillation,
validation (keep_best, early_stopping), outputs, the device, a parked teacher."""

from __future__ import annotations

import re
from typing import Any

from kd.config import schema
from kd.config.checks.values import fmt
from kd.config.schema import Problem
from kd.errors import redact

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_teacher_logits(data: dict[str, Any], problems: list[Problem]) -> None:
    """A source temperature belongs to another tool's file, and re-tempering it leaves the
    mass outside the top-k unknown, so only ``tail: renorm`` is exact then."""
    node = data.get("teacher_logits")
    if not isinstance(node, dict) or node.get("source_temperature") is None:
        return
    source = node["source_temperature"]
    if node.get("format", schema.TEACHER_LOGITS["format"].default) == "kd":
        problems.append(
            Problem(
                "teacher_logits.source_temperature",
                "is for another tool's file (format axolotl or distillkit); kd's store records "
                "its temperature itself: remove source_temperature",
            )
        )
        return
    temperature = data.get("temperature", schema.TOP_LEVEL["temperature"].default)
    if (
        node.get("tail", schema.TEACHER_LOGITS["tail"].default) == "bucket"
        and isinstance(source, (int, float))
        and isinstance(temperature, (int, float))
        and float(source) != float(temperature)
    ):
        problems.append(
            Problem(
                "teacher_logits.tail",
                f"bucket needs the teacher mass outside the top-k, which re-tempering from "
                f"source_temperature {fmt(source)} to temperature {fmt(temperature)} leaves "
                "unknown; set teacher_logits.tail=renorm",
            )
        )


def check_teacher_server(data: dict[str, Any], problems: list[Problem]) -> None:
    """A served teacher replaces the teacher's nodes and answers top-k log-probs at
    temperature 1: what needs a local teacher's full distribution or its sampling is refused."""
    node = data.get("teacher_server")
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


def check_on_policy(data: dict[str, Any], problems: list[Problem]) -> None:
    """On-policy distillation needs a teacher that runs (it scores sequences that exist only
    during training) and room in ``tokenizer.max_seq_len`` for the completions."""
    node = data.get("on_policy")
    if not isinstance(node, dict):
        return
    if isinstance(data.get("teacher_logits"), dict):
        problems.append(
            Problem(
                "on_policy",
                "needs the online teacher (it scores the student's own completions, which no "
                "stored logits hold); remove on_policy, or set teacher_logits to null",
            )
        )
    elif (
        "teacher_model" in data
        and data["teacher_model"] is None
        and not isinstance(data.get("teacher_server"), dict)
        and not isinstance(data.get("self_teacher"), dict)
    ):
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
    if node.get("sampler") == "served":  # kd.rollouts.served
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


def check_validation(data: dict[str, Any], problems: list[Problem]) -> None:
    """``keep_best`` and ``early_stopping`` need ``validation`` (and early stopping evaluations
    during training); the teacher metrics need a teacher."""
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
    if isinstance(validation, dict) and isinstance(data.get("teacher_logits"), dict):
        problems.append(
            Problem(
                "validation",
                "needs the online teacher (val_kd_loss and val_top1_agreement compare the "
                "student with the teacher's full distribution on held-out rows, which "
                "teacher_logits does not hold); remove validation, or set teacher_logits to null",
            )
        )
    best = data.get("keep_best")
    metric = best.get("metric") if isinstance(best, dict) else None
    if (
        metric in schema.TEACHER_METRICS
        and "teacher_model" in data
        and data["teacher_model"] is None
    ):
        plain = [m for m in schema.VAL_METRICS if m not in schema.TEACHER_METRICS]
        problems.append(
            Problem(
                "keep_best.metric",
                f"{metric} compares the student with the teacher, but teacher_model is null; "
                f"set keep_best.metric to {' or '.join(plain)}",
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
    if isinstance(device, str) and not _DEVICE_RE.match(device):
        problems.append(
            Problem(
                "device",
                f"{device!r} is not a device kd runs on; set device to cuda, cuda:N or cpu",
            )
        )


def check_hidden_states(data: dict[str, Any], problems: list[Problem]) -> None:
    """Hidden-state distillation reads the teacher's layers: it needs a teacher model that runs
    (stored top-k log-probs and a served teacher hold no hidden states)."""
    if not isinstance(data.get("hidden_states"), dict):
        return
    fix = "remove hidden_states, or distil from a local teacher_model"
    if isinstance(data.get("teachers"), dict):
        problems.append(
            Problem(
                "hidden_states",
                "is not supported with teachers: (it matches one teacher's layers to the "
                "student's); remove hidden_states, or distil from one teacher_model",
            )
        )
    elif isinstance(data.get("teacher_logits"), dict):
        problems.append(
            Problem(
                "hidden_states",
                f"needs the teacher's hidden states, which teacher_logits "
                f"(stored top-k log-probs) does not hold; {fix} (teacher_logits: null)",
            )
        )
    elif isinstance(data.get("teacher_server"), dict):
        problems.append(
            Problem(
                "hidden_states",
                f"needs the teacher's hidden states, which a served teacher "
                f"(teacher_server) does not answer; {fix}",
            )
        )
    elif "teacher_model" in data and data["teacher_model"] is None:
        problems.append(
            Problem("hidden_states", f"needs a teacher, but teacher_model is null; {fix}")
        )
    elif isinstance(data.get("cross_tokenizer"), dict):
        problems.append(
            Problem(
                "hidden_states",
                "matches positions of one tokenization, but cross_tokenizer gives the teacher "
                "another; remove hidden_states, or cross_tokenizer (a teacher sharing the "
                "student's tokenizer)",
            )
        )


def check_teacher_offload(data: dict[str, Any], problems: list[Problem]) -> None:
    """``teacher_offload`` parks a local teacher model (``teacher_model``, or the members of
    ``teachers:`` that have one) that is neither quantized, compiled, another tokenizer's, a
    source of stored logits nor the student itself."""
    mode = data.get("teacher_offload", "none")
    if mode in (None, "none"):
        return
    fix = "set teacher_offload=none"
    members = (
        data.get("teachers", {}).get("members") if isinstance(data.get("teachers"), dict) else None
    )
    local = data.get("teacher_model") is not None and data.get("teacher_logits") is None
    if isinstance(members, list):
        local = local or any(
            isinstance(m, dict)
            and m.get("teacher_model") is not None
            and m.get("teacher_logits") is None
            for m in members
        )
    reasons = []
    if not local or data.get("self_teacher") is not None:
        reasons.append("needs a local teacher model (teacher_model) to park")
    if data.get("teacher_quantization", "none") != "none":
        reasons.append("does not park an int8 teacher (teacher_quantization)")
    if data.get("compile"):
        reasons.append("does not park compiled layers (compile)")
    if data.get("cross_tokenizer") is not None:
        reasons.append("does not park a teacher with another tokenizer (cross_tokenizer)")
    if reasons:
        problems.append(Problem("teacher_offload", f"{mode} {reasons[0]}; {fix}"))


def check_teacher_device(data: dict[str, Any], problems: list[Problem]) -> None:
    """``teacher_device`` names a device and puts one local teacher model (``teacher_model``,
    neither parked, nor the student itself, nor one of several) there: what it runs that is not a
    plain forward (sampling, hidden-state hooks, another tokenizer) stays on one device."""
    where = data.get("teacher_device")
    if where is None:
        return
    fix = "remove teacher_device"
    if not isinstance(where, str) or not _DEVICE_RE.match(where):
        problems.append(
            Problem(
                "teacher_device",
                f"{where!r} is not a device kd runs on; set it to cuda:N or cpu, or {fix}",
            )
        )
        return
    local = data.get("teacher_model") is not None and data.get("teacher_logits") is None
    on_policy = data.get("on_policy")
    reasons = []
    if not local or data.get("self_teacher") is not None or data.get("teachers") is not None:
        reasons.append("needs one local teacher model (teacher_model; not self_teacher, teachers:)")
    if data.get("teacher_offload", "none") not in (None, "none"):
        reasons.append("and teacher_offload both say where the teacher's weights wait; pick one")
    if isinstance(on_policy, dict) and on_policy.get("seq_kd"):
        reasons.append("does not sample from the teacher (on_policy.seq_kd)")
    if data.get("hidden_states") is not None:
        reasons.append("does not match hidden states across devices (hidden_states)")
    if data.get("cross_tokenizer") is not None:
        reasons.append("does not run a teacher with another tokenizer (cross_tokenizer)")
    if reasons:
        problems.append(Problem("teacher_device", f"{where} {reasons[0]}; {fix}"))
