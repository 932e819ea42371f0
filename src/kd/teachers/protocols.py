"""The two HTTP protocols a served teacher speaks: vLLM's and SGLang's, token ids in, top-k out.

Each protocol builds the JSON body of one request for a batch of rows (token id lists, never
text) and reads the answer back into, per row, the top-k ``(ids, logprobs)`` of every position
after the first: entry ``i`` (``i >= 1``) is the teacher's distribution of token ``i`` given the
tokens before it. Anything else in an answer (a missing or null position, a row of the wrong
length, fewer than k entries, a NaN or positive log-prob, an id outside the vocabulary) is refused
with the row and the position, never patched.

* vLLM (``POST /v1/completions``): ``prompt`` as id lists, ``max_tokens: 1``, ``prompt_logprobs:
  k``. ``choices[r].prompt_logprobs`` has one entry per prompt token; the first is null; each
  other is a dict keyed by token id (a string) of ``{logprob, rank, decoded_token}`` holding the
  top-k and also the actual prompt token when it ranks below k, so entries are sorted by rank and
  the first k kept (never the first k keys). The server's ``--max-logprobs`` (default 20) caps k.
  The values are the model's own log-softmax (temperature 1) under the default
  ``--logprobs-mode raw_logprobs``; kd re-tempers the top-k itself.
* SGLang (``POST /generate``): ``input_ids``, ``return_logprob: true``, ``logprob_start_len: 0``,
  ``top_logprobs_num: k``, ``sampling_params.max_new_tokens: 0``. ``meta_info.input_top_logprobs``
  has one entry per input token (the first null or empty), each a list of ``[logprob, id, text]``
  triples.

Which model a server serves: both answer ``GET /v1/models`` with an OpenAI model list whose ids
are the served names (``--served-model-name``, else the model path). Read from their source:
vLLM ``vllm/entrypoints/openai/api_server.py`` (``served_model_names = args.served_model_name or
[args.model]``) and ``vllm/entrypoints/openai/models/serving.py`` (``show_available_models``,
``check_model``: 404 "The model `X` does not exist."), commits 0001948bc769 / 00153c8b7948 of
2025-26; SGLang ``python/sglang/srt/entrypoints/http_server.py`` (``available_models``: the
``tokenizer_manager.served_model_name``), commits 9c0549b727fe and 0025436eab05, whose
``/get_model_info`` gives ``model_path`` and never the served name.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["PROTOCOLS", "BadAnswer", "RowTopK", "ServerProtocol", "SGLangProtocol", "VLLMProtocol"]

# A log-prob this far above 0 is float rounding of a certain token, kept as 0; more is refused.
_POSITIVE_SLACK = 1e-4


class BadAnswer(ValueError):
    """A server answer that is not what the protocol promises (the message names where).

    Attributes:
        fix: what to do about it, when more is known than "check the protocol"
            (:func:`kd.teachers.answer_checks.check_answer`); None otherwise.
    """

    fix: str | None = None


@dataclass
class RowTopK:
    """One row's answer.

    Attributes:
        ids: ``[n - 1, k]`` int64: the top-k ids of positions ``1 .. n - 1``, by rank.
        logprobs: ``[n - 1, k]`` float32, the matching log-probs (descending).
        texts: the server's text of each actual prompt token ``1 .. n - 1`` (None where it
            gave none): the vocabulary probe compares them with the student's tokenizer.
    """

    ids: np.ndarray
    logprobs: np.ndarray
    texts: list[str | None]


class ServerProtocol(Protocol):
    """How one kind of server is asked for top-k log-probs of prompts."""

    name: str
    path: str
    models_path: str

    def body(self, model: str, rows: Sequence[Sequence[int]], k: int) -> dict[str, Any]:
        """The JSON body asking for the top-k log-probs of every position of ``rows``."""
        ...

    def parse(
        self, answer: Any, rows: Sequence[Sequence[int]], k: int, vocab: int
    ) -> list[RowTopK]:
        """The answer read back, one :class:`RowTopK` per row; :class:`BadAnswer` otherwise."""
        ...

    def served_models(self, answer: Any) -> list[str]:
        """The model names the models endpoint lists; :class:`BadAnswer` when it is no list."""
        ...

    def refusal_fix(self, status: int, text: str, k: int) -> str | None:
        """A fix for a refused request (HTTP 4xx) this protocol knows, or None."""
        ...


def _model_list(answer: Any) -> list[str]:
    """The ids of an OpenAI model list (``GET /v1/models``: ``{"object": "list", "data": [{"id":
    ...}, ...]}``, as vLLM and SGLang both answer it); :class:`BadAnswer` for anything else."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        got = f"keys {sorted(answer)[:4]}" if isinstance(answer, dict) else type(answer).__name__
        raise BadAnswer(f"no model list (data) in the answer, got {got}")
    return [str(m["id"]) for m in data if isinstance(m, dict) and m.get("id") is not None]


def _logprob(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadAnswer(f"{where}: log-prob {value!r} is not a number")
    x = float(value)
    if math.isnan(x) or x == math.inf:
        raise BadAnswer(f"{where}: log-prob {x} is not finite")
    if x > _POSITIVE_SLACK:
        raise BadAnswer(f"{where}: log-prob {x} is positive")
    return min(x, 0.0)


def _token_id(value: Any, vocab: int, where: str) -> int:
    try:
        i = int(value)
    except (TypeError, ValueError):
        raise BadAnswer(f"{where}: token id {value!r} is not an integer") from None
    if isinstance(value, bool) or isinstance(value, float) or not 0 <= i < vocab:
        raise BadAnswer(f"{where}: token id {value!r} is outside the vocabulary 0..{vocab - 1}")
    return i


def _rows_of(answer: list[Any], rows: Sequence[Sequence[int]], what: str) -> None:
    if len(answer) != len(rows):
        raise BadAnswer(f"{what}: {len(answer)} answers for {len(rows)} rows")


def _positions(entries: Any, row: Sequence[int], where: str) -> list[Any]:
    """The entries of positions 1 .. n - 1, the first (null) one checked and dropped."""
    if not isinstance(entries, list):
        raise BadAnswer(f"{where}: no per-position log-probs (got {type(entries).__name__})")
    if len(entries) != len(row):
        raise BadAnswer(f"{where}: {len(entries)} positions for a prompt of {len(row)} tokens")
    if entries and entries[0]:
        raise BadAnswer(f"{where}: position 0 holds log-probs (it has no context; null expected)")
    return entries[1:]


class VLLMProtocol:
    """vLLM's OpenAI-compatible completions server with ``prompt_logprobs``."""

    name = "vllm"
    path = "/v1/completions"
    models_path = "/v1/models"

    def body(self, model: str, rows: Sequence[Sequence[int]], k: int) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": [list(map(int, r)) for r in rows],
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": int(k),
        }

    def parse(
        self, answer: Any, rows: Sequence[Sequence[int]], k: int, vocab: int
    ) -> list[RowTopK]:
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list):
            raise BadAnswer("the answer holds no choices list")
        _rows_of(choices, rows, "choices")
        try:
            ordered = sorted(choices, key=lambda c: int(c.get("index", 0)))
        except (AttributeError, TypeError, ValueError):
            raise BadAnswer("a choice has no integer index") from None
        out = []
        for r, (choice, row) in enumerate(zip(ordered, rows, strict=True)):
            entries = _positions(choice.get("prompt_logprobs"), row, f"row {r}")
            out.append(self._row(entries, row, k, vocab, r))
        return out

    def _row(self, entries: list[Any], row: Sequence[int], k: int, vocab: int, r: int) -> RowTopK:
        n = len(entries)
        ids = np.zeros((n, k), dtype=np.int64)
        lps = np.zeros((n, k), dtype=np.float32)
        texts: list[str | None] = []
        for j, entry in enumerate(entries, start=1):
            where = f"row {r} position {j}"
            if not isinstance(entry, dict) or not entry:
                raise BadAnswer(f"{where}: missing (got {entry!r:.60})")
            ranked = []
            for key, value in entry.items():
                if not isinstance(value, dict):
                    raise BadAnswer(f"{where}: entry {key!r} is not an object")
                rank = value.get("rank")
                if isinstance(rank, bool) or not isinstance(rank, int):
                    raise BadAnswer(f"{where}: entry {key!r} has no integer rank")
                lp = _logprob(value.get("logprob"), where)
                ranked.append((rank, -lp, _token_id(key, vocab, where), lp))
            ranked.sort()
            if len(ranked) < k or ranked[k - 1][0] > k:
                raise BadAnswer(f"{where}: {len(ranked)} entries hold fewer than the top {k}")
            for c, (_, _, tid, lp) in enumerate(ranked[:k]):
                ids[j - 1, c], lps[j - 1, c] = tid, lp
            actual = entry.get(str(int(row[j])))
            texts.append(actual.get("decoded_token") if isinstance(actual, dict) else None)
        return RowTopK(ids, lps, texts)

    def served_models(self, answer: Any) -> list[str]:
        return _model_list(answer)

    def refusal_fix(self, status: int, text: str, k: int) -> str | None:
        if "logprobs" in text.lower() and ("max" in text.lower() or "greater" in text.lower()):
            return (
                f"the server caps the log-probs per position below teacher_server.top_k={k}; "
                f"start vLLM with --max-logprobs {k} (its default is 20), or set "
                "teacher_server.top_k to the server's cap"
            )
        return None


# SGLang's flat form of the input top-k (``return_logprobs_in_base64``): every position's
# log-probs as one base64 float32 little-endian array, the ids as one int32 array, and the
# entries per position (0 for the first, which has no context).
_B64_VALUES = "input_top_logprobs_val_b64"
_B64_IDS = "input_top_logprobs_idx_b64"
_B64_COUNTS = "input_top_logprobs_k"


def _b64_array(meta: dict[str, Any], key: str, dtype: str, where: str) -> np.ndarray:
    value = meta.get(key)
    if not isinstance(value, str):
        raise BadAnswer(f"{where}: {key} is not a base64 string (got {type(value).__name__})")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadAnswer(f"{where}: {key} is not valid base64") from None
    width = np.dtype(dtype).itemsize
    if len(raw) % width:
        raise BadAnswer(f"{where}: {key} holds {len(raw)} bytes, not whole {dtype} values")
    return np.frombuffer(raw, dtype=dtype)


def _flat_positions(meta: dict[str, Any], row: Sequence[int], where: str) -> list[Any]:
    """The flat base64 form read back as the triples' ``[[logprob, id], ...]`` per position
    ``1 .. n - 1`` (then checked as they are)."""
    values = _b64_array(meta, _B64_VALUES, "<f4", where)
    ids = _b64_array(meta, _B64_IDS, "<i4", where)
    if values.size != ids.size:
        raise BadAnswer(f"{where}: {values.size} log-probs for {ids.size} ids")
    counts = meta.get(_B64_COUNTS)
    if counts is None:  # no counts: the same number at every position with context
        per, extra = divmod(values.size, max(len(row) - 1, 1))
        if extra or len(row) < 2:
            raise BadAnswer(
                f"{where}: {values.size} flat entries do not divide over {len(row) - 1} positions"
            )
        counts = [0] + [per] * (len(row) - 1)
    if not isinstance(counts, list) or len(counts) != len(row):
        raise BadAnswer(f"{where}: {_B64_COUNTS} does not give one count per prompt token")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise BadAnswer(f"{where}: {_B64_COUNTS} holds something other than counts")
    if counts and counts[0]:
        raise BadAnswer(f"{where}: position 0 holds log-probs (it has no context; 0 expected)")
    if sum(counts) != values.size:
        raise BadAnswer(f"{where}: {_B64_COUNTS} adds up to {sum(counts)}, not {values.size}")
    ends = np.cumsum(counts)
    return [
        [[float(v), int(i)] for v, i in zip(values[e - c : e], ids[e - c : e], strict=True)]
        for c, e in zip(counts[1:], ends[1:], strict=True)
    ]


class SGLangProtocol:
    """SGLang's native ``/generate`` endpoint with input log-probs."""

    name = "sglang"
    path = "/generate"
    # Its OpenAI-compatible model list names --served-model-name (the model path when none is
    # given); /get_model_info gives the model path only, never the served name.
    models_path = "/v1/models"

    def body(self, model: str, rows: Sequence[Sequence[int]], k: int) -> dict[str, Any]:
        return {
            "input_ids": [list(map(int, r)) for r in rows],
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": int(k),
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        }

    def parse(
        self, answer: Any, rows: Sequence[Sequence[int]], k: int, vocab: int
    ) -> list[RowTopK]:
        items = answer if isinstance(answer, list) else [answer]
        _rows_of(items, rows, "answers")
        out = []
        for r, (item, row) in enumerate(zip(items, rows, strict=True)):
            meta = item.get("meta_info") if isinstance(item, dict) else None
            if not isinstance(meta, dict):
                raise BadAnswer(f"row {r}: no meta_info")
            if _B64_VALUES in meta:
                entries = _flat_positions(meta, row, f"row {r}")
            else:
                entries = _positions(meta.get("input_top_logprobs"), row, f"row {r}")
            actual = meta.get("input_token_logprobs")
            texts: list[str | None] = [None] * len(entries)
            if isinstance(actual, list) and len(actual) == len(row):
                texts = [t[2] if isinstance(t, list) and len(t) > 2 else None for t in actual[1:]]
            n = len(entries)
            ids = np.zeros((n, k), dtype=np.int64)
            lps = np.zeros((n, k), dtype=np.float32)
            for j, entry in enumerate(entries, start=1):
                where = f"row {r} position {j}"
                if not isinstance(entry, list) or len(entry) < k:
                    raise BadAnswer(f"{where}: fewer than the top {k} (got {entry!r:.60})")
                ranked = []
                for triple in entry:
                    if not isinstance(triple, list) or len(triple) < 2:
                        raise BadAnswer(f"{where}: {triple!r:.60} is not [logprob, id, text]")
                    lp = _logprob(triple[0], where)
                    ranked.append((-lp, _token_id(triple[1], vocab, where), lp))
                ranked.sort()
                for c, (_, tid, lp) in enumerate(ranked[:k]):
                    ids[j - 1, c], lps[j - 1, c] = tid, lp
            out.append(RowTopK(ids, lps, texts))
        return out

    def served_models(self, answer: Any) -> list[str]:
        return _model_list(answer)

    def refusal_fix(self, status: int, text: str, k: int) -> str | None:
        return None


PROTOCOLS: dict[str, ServerProtocol] = {"vllm": VLLMProtocol(), "sglang": SGLangProtocol()}
