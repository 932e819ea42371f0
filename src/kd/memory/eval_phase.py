"""The end-of-training evaluation in the plan (``eval:``): ``final/`` scored by lm-eval on the
training device, planned as a phase of its own.

After ``final/`` is saved, rank 0 lets go of the trained student, the teacher, the optimizer and
the on-policy sampler (:meth:`kd.recipes.kd.KDRecipe._evaluate`), then :mod:`kd.harness.evaluate`
loads ``final/`` with transformers (the student's weights, a LoRA student's merged, in the dtype
``final/config.json`` records: the run's) and lm-eval's HFLM scores each task in batches of
``eval.batch_size`` requests (:mod:`kd.harness.requests` sizes them from the task rows):

* **loglikelihood** (multiple choice): one forward over ``[b, L]`` tokens returns the logits of
  every position ``[b, L, V]`` (the model's dtype), then their log-softmax ``[b, L, V]``; HFLM
  keeps the previous batch's log-probs referenced while the next batch runs. During the forward
  the model's own KV cache (``use_cache``) fills ``[b, kv_heads, L, head_dim]`` per layer;
* **generate** (``generate_until``): transformers' ``generate`` on ``b`` left-padded contexts of
  ``Lc`` tokens with a cache that grows to ``Lc + max_new_tokens`` positions (each step's
  ``torch.cat`` holds one layer's keys twice), the growing ids and attention mask (int64), the
  step's logits and their fp32 copy.

Nothing of the training state stays (the recipe frees it; ``tests/integration/
test_harness_eval_phase.py`` checks that no parameter of the run survives into the evaluation).
Pure arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kd.memory.activations import nograd_forward_bytes
from kd.memory.knobs import EvalBatch, FinalEvalKnobs, TrainKnobs
from kd.memory.shapes import TRANSFORMERS, ModelShape
from kd.memory.training_step import Components

GIB = 1 << 30


def evaluated_shape(student: ModelShape) -> ModelShape:
    """The model lm-eval scores: the student as transformers loads ``final/`` (no adapters: a
    LoRA student's are merged into its weights)."""
    return replace(student, backend=TRANSFORMERS, lora=None, rope_per_layer=False)


def _kv(shape: ModelShape, rows: int, tokens: int, a: int) -> int:
    """transformers' cache: keys and values ``[rows, kv_heads, tokens, head_dim]`` per layer."""
    return 2 * shape.num_layers * a * rows * shape.num_kv_heads * shape.head_dim * tokens


def loglikelihood_bytes(shape: ModelShape, e: EvalBatch, a: int) -> dict[str, int]:
    """The transient components of the largest loglikelihood batches: the first (the longest) on
    its own, and the second with the first's log-probs still referenced."""
    v = shape.vocab_size
    first = (e.rows, e.tokens, 0)
    second = (e.next_rows, e.next_tokens, a * e.rows * e.tokens * v)
    steps = []
    for b, n, held in (first, second) if e.next_rows else (first,):
        logits = a * b * n * v
        kv = _kv(shape, b, n, a)
        for step in (
            {"activations": nograd_forward_bytes(shape, b, n, a) + kv},
            {"activations": kv + a * b * n * shape.embed_dim, "logits_loss": logits},
            {"logits_loss": 2 * logits},
        ):
            step["logits_loss"] = step.get("logits_loss", 0) + held
            steps.append(dict(step, buffers=8 * b * n))
    return max(steps, key=lambda d: sum(d.values()))


def generation_bytes(shape: ModelShape, e: EvalBatch, a: int) -> dict[str, int]:
    """The transient components of the largest generation batch: the prefill over the contexts,
    then the last decoding step with the cache at its longest."""
    b, ctx, new, v = e.rows, e.tokens, e.new_tokens, shape.vocab_size
    total = ctx + new
    ids = 8 * b * total * 2 + 8 * b * total  # ids and mask, one of them concatenated
    step_logits = a * b * v + 2 * 4 * b * v  # the last position's logits, fp32 copy, scores
    one_layer = _kv(shape, b, total, a) // (2 * shape.num_layers)
    prefill = {
        "kv_cache": _kv(shape, b, ctx, a),
        "activations": nograd_forward_bytes(shape, b, ctx, a),
        "buffers": 8 * b * ctx * 2 + b * ctx * ctx,  # ids, mask, the padded contexts' 4-D mask
    }
    last = {
        "kv_cache": _kv(shape, b, total - 1, a) + one_layer,
        "activations": a * b * shape.embed_dim,
        "sampling": step_logits,
        "buffers": ids,
    }
    return max((prefill, last), key=lambda d: sum(d.values()))


def final_eval_phase(student: ModelShape, k: TrainKnobs) -> Components:
    """The ``eval:`` phase: ``final/``'s weights and buffers in the run's dtype, plus the largest
    batch of any task (:func:`loglikelihood_bytes`, :func:`generation_bytes`). The training's
    weights, gradients, optimizer states and teacher are gone (freed before ``final/`` loads)."""
    assert k.final_eval is not None
    shape, a = evaluated_shape(student), k.dtype_bytes
    resident: Components = {
        "student_weights": a * shape.base_params(),
        "buffers": shape.buffer_bytes(a),
    }
    best: dict[str, int] = {}
    for e in k.final_eval.batches:
        terms = (
            loglikelihood_bytes(shape, e, a)
            if e.kind == "loglikelihood"
            else generation_bytes(shape, e, a)
        )
        if sum(terms.values()) > sum(best.values()):
            best = terms
    phase = dict(resident)
    for comp, val in best.items():
        phase[comp] = phase.get(comp, 0) + val
    return phase


def _batches(requests: Any, batch_size: int, *, measured: bool) -> EvalBatch:
    lengths = requests.lengths
    rows = min(batch_size, len(lengths))
    second = lengths[batch_size : 2 * batch_size]
    return EvalBatch(
        task=requests.name,
        kind=requests.kind,
        rows=rows,
        tokens=lengths[0],
        next_tokens=second[0] if second and requests.kind == "loglikelihood" else 0,
        next_rows=len(second) if requests.kind == "loglikelihood" else 0,
        new_tokens=requests.new_tokens,
        measured=measured,
    )


def final_eval_knobs(
    run: Any, student: ModelShape, *, seq_len: int
) -> tuple[FinalEvalKnobs | None, list[str]]:
    """The ``eval:`` phase's knobs: each task's largest batches, from its rows counted with the
    run's tokenizer (:mod:`kd.harness.requests`); lm-eval's tasks by name at ``seq_len`` tokens.

    Returns:
        The knobs (None without ``eval:``) and notes for the plan.

    Raises:
        KDUserError: a task folder :func:`kd.harness.tasks.read_task_folder` refuses.
    """
    settings = run.eval
    if settings is None:
        return None, []
    from kd.harness.requests import TaskRequests, task_requests, token_counter
    from kd.harness.tasks import read_task_folder

    def path_of(key: str, field: str) -> Path | None:
        node = run.components.get(key)
        value = node.get(field) if node is not None else None
        return Path(str(value)) if value else None

    count, tokenizer = token_counter(
        [
            path_of("tokenizer", "path"),
            path_of("model", "path"),
            path_of("checkpointer", "checkpoint_dir"),
        ]
    )
    notes: list[str] = []
    batches: list[EvalBatch] = []
    b = settings.batch_size
    for value in settings.tasks:
        path = Path(value).expanduser()
        if not (path.exists() or "/" in value or value.startswith(".")):
            rows = (seq_len,) * (2 * b)
            batches.append(_batches(TaskRequests(value, "loglikelihood", rows), b, measured=False))
            notes.append(
                f"eval.tasks: lm-eval's task {value} is planned as {b} x {seq_len} tokens of "
                "logits (its rows are not read by the plan)"
            )
            continue
        for spec in read_task_folder(path, key="eval.tasks"):
            requests = task_requests(
                spec,
                count,
                limit=settings.limit,
                num_fewshot=settings.num_fewshot,
                max_length=student.max_seq_len,
            )
            batches.append(_batches(requests, b, measured=True))
    if tokenizer is None and any(e.measured for e in batches):
        notes.append("eval.tasks: no tokenizer.json found: task rows planned at one token a byte")
    if settings.chat:
        notes.append("eval.chat: the chat template's own tokens are not in the eval: phase's plan")
    return FinalEvalKnobs(batches=tuple(batches), batch_size=b), notes


def final_eval_lines(k: TrainKnobs) -> list[str]:
    """The plan table's line on the ``eval:`` phase."""
    if k.final_eval is None:
        return []
    parts = [
        f"{e.task} {e.rows} x {e.tokens}"
        + (f" + {e.new_tokens} new" if e.kind == "generate" else "")
        + ("" if e.measured else " (by name)")
        for e in k.final_eval.batches
    ]
    return [
        "  evaluation (eval:): final/ scored by lm-eval after training, the run's models and "
        f"optimizer freed first; largest batches {', '.join(parts)} tokens"
    ]


def final_eval_json(k: TrainKnobs) -> list[dict[str, Any]] | None:
    """The plan JSON's ``final_eval``: each task's largest batch."""
    if k.final_eval is None:
        return None
    return [
        {
            "task": e.task,
            "kind": e.kind,
            "rows": e.rows,
            "tokens": e.tokens,
            "new_tokens": e.new_tokens,
            "measured": e.measured,
        }
        for e in k.final_eval.batches
    ]
