"""What lm-eval feeds the model for each of a run's ``eval:`` tasks, in tokens: the memory plan's
view of the end-of-training evaluation (:mod:`kd.memory.eval_phase`).

lm-eval turns a task's rows into requests (``lm_eval.api.task.ConfigurableTask``): a multiple
choice row into one ``loglikelihood`` request per choice (context, then the target delimiter and
the choice), a generation row into one ``generate_until`` request (the context; at most
``max_gen_toks`` new tokens). HFLM scores ``batch_size`` requests together, the longest first: a
loglikelihood batch is ``[rows, longest context + continuation - 1]`` tokens, a generation batch
left-pads the contexts to the longest. The planner needs the longest request of each task and how
many requests there are; nothing here runs a model.

Tokens are counted with the ``tokenizers`` library on the run's ``tokenizer.json`` (the tokenizer
``final/`` is saved with); where the run has none, a task's text is counted in UTF-8 bytes, which
no byte-level or byte-fallback tokenizer exceeds. lm-eval's own tasks (by name) are not read: their
length is unknown here. No torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kd.harness.tasks import TaskSpec, row_texts

Counter = Callable[[str], int]
TOKENIZER_JSON = "tokenizer.json"


@dataclass(frozen=True)
class TaskRequests:
    """One task's requests, as lm-eval batches them.

    Attributes:
        name: the task.
        kind: ``loglikelihood`` (multiple choice) or ``generate``.
        lengths: tokens of each request's model input (loglikelihood: context and continuation
            less the last token; generate: the context), longest first.
        new_tokens: the most tokens a generation request samples (0 for loglikelihood).
    """

    name: str
    kind: str
    lengths: tuple[int, ...]
    new_tokens: int = 0


def byte_count(text: str) -> int:
    """Tokens at most: no byte-level (or byte-fallback) tokenizer makes more tokens than bytes."""
    return len(text.encode("utf-8"))


def token_counter(folders: Sequence[Path | None]) -> tuple[Counter, Path | None]:
    """A token counter from the first ``tokenizer.json`` in ``folders`` (the file a path names,
    or in the folder it names), else :func:`byte_count`.

    Returns:
        The counter and the tokenizer file it reads (None: bytes are counted).
    """
    for folder in folders:
        if folder is None:
            continue
        path = Path(folder).expanduser()
        candidate = (
            path if path.name == TOKENIZER_JSON else (path if path.is_dir() else path.parent)
        )
        if candidate.is_dir():
            candidate = candidate / TOKENIZER_JSON
        if candidate.is_file():
            from tokenizers import Tokenizer

            try:
                tokenizer = Tokenizer.from_file(str(candidate))
            except Exception:  # a file the library cannot read: try the next, else count bytes
                continue
            return _counter(tokenizer), candidate
    return byte_count, None


def _counter(tokenizer: Any) -> Counter:
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def task_requests(
    spec: TaskSpec,
    count: Counter,
    *,
    limit: int | None,
    num_fewshot: int | None,
    max_length: int,
) -> TaskRequests:
    """The requests lm-eval makes of ``spec``'s rows (the first ``limit``), in tokens.

    A few-shot context is planned as ``num_fewshot`` times the task's longest answered example
    (text, target delimiter, target, few-shot delimiter) before the row's own text: the longest
    the sampler can draw. Every length is cut as HFLM cuts it: a loglikelihood input to
    ``max_length`` tokens, a generation context to ``max_length - max_new_tokens``.
    """
    rows = row_texts(spec, limit=limit)
    shots = (spec.num_fewshot or 0) if num_fewshot is None else num_fewshot
    shot = 0
    if shots:
        shot = max(
            count(text + spec.target_delimiter + max(targets, key=count) + spec.fewshot_delimiter)
            for text, targets in rows
        )
    prefix = shots * shot
    if spec.type == "multiple_choice":
        lengths = [
            min(max_length, prefix + count(text + spec.target_delimiter + choice) - 1)
            for text, choices in rows
            for choice in choices
        ]
        return TaskRequests(spec.name, "loglikelihood", tuple(sorted(lengths, reverse=True)))
    room = max(1, max_length - spec.max_new_tokens)
    lengths = [min(room, prefix + count(text)) for text, _ in rows]
    return TaskRequests(
        spec.name, "generate", tuple(sorted(lengths, reverse=True)), spec.max_new_tokens
    )
