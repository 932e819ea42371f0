"""The two HTTP protocols a served sampler speaks: vLLM's and SGLang's token-id generation and
their weight updates (no torch: the requests and the answers as plain values).

Each protocol builds the JSON body of one generation request (one prompt of token ids, never
text: ``n`` 1, ``max_tokens``, temperature, top-p, the stop ids, a seed, a logit bias that keeps
the ids no tokenizer has out) and reads the answer back into the completion's ids and whether a
stop id ended it; and it names the requests that hot-load a LoRA adapter and reload a full
folder. Anything else in an answer is refused (:class:`BadAnswer`), never patched.

Read from their source (the files and what they answer):

* vLLM, built against 0.11-0.12 (the v1 engine): ``vllm/entrypoints/openai/completion/protocol.py``
  (``CompletionRequest``: ``prompt: list[int] | list[list[int]] | str | ...``, ``seed``,
  ``stop_token_ids``, ``logit_bias``, ``return_token_ids`` -> ``CompletionResponseChoice.token_ids``,
  ``finish_reason`` / ``stop_reason``: ``abort`` for a request the engine aborted, HTTP 200
  with the ids sampled so far; ``error`` is always a 500);
  ``vllm/entrypoints/serve/lora/api_router.py`` (the LoRA
  routes are attached only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set: FastAPI's 404
  otherwise; success is ``Response(status_code=200, content=str)``) and
  ``vllm/entrypoints/openai/models/serving.py`` (``load_lora_adapter``: 400 ``InvalidUserInput``
  for a name already loaded, 404 ``NotFoundError`` for "No adapter found", otherwise the engine's
  "Call to add_lora method failed: ..." with 400 in 0.11-0.12 and 500 ``InternalServerError`` on
  the main branch of 2026, see ``VLLMGeneration.refused_load``; ``unload_lora_adapter``: 404
  "cannot be found"); the full-weight reload is
  ``POST /collective_rpc`` (``vllm/entrypoints/serve/dev/rpc/api_router.py``, attached only with
  ``VLLM_SERVER_DEV_MODE=1``) calling the worker's ``update_config({"model_config": {"model":
  DIR}})`` and then ``reload_weights()`` (``gpu_model_runner``: ``get_model_loader(load_config)
  .load_weights(model, model_config)`` reads ``model_config.model``'s safetensors in place).
  Re-read against vLLM's main branch of November 2026: the route still passes ``args`` /
  ``kwargs`` (``dev/rpc/api_router.py``); both model runners still have ``update_config`` and
  ``reload_weights`` (``v1/worker/gpu/model_runner.py``, the v2 runner, delegates both to the v1
  runner's), and ``reload_weights`` now reloads layer by layer in checkpoint format
  (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``) from ``model_config.model``
  (or its new ``weights_path``). The native weight-transfer routes (``dev/rlhf``:
  ``/init_weight_transfer_engine``, ``/pause``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``, ``/resume``; 0.16+) move tensors over NCCL or CUDA IPC from a trainer
  in the server's process group, not a folder; their shared-disk backend (``disk_engine.py``,
  vLLM PR #52152) and a weight-checksum route (PR #51350) are open pull requests, not releases,
  so kd does not use them yet.
* SGLang: ``python/sglang/srt/entrypoints/http_server.py`` (``/generate``, ``/update_weights_from_disk``
  -> ``{"success", "message", "num_paused_requests"}`` 200 / 400, ``/load_lora_adapter`` and
  ``/unload_lora_adapter`` -> ``LoadLoRAAdapterReqOutput`` 200 / 400);
  ``python/sglang/srt/sampling/sampling_params.py`` (``max_new_tokens``, ``stop_token_ids``,
  ``temperature`` 0 is ``top_k`` 1, ``top_k`` -1 is the whole vocabulary, ``sampling_seed``,
  ``logit_bias``); ``tokenizer_manager.py`` (the answer ``{"text", "output_ids", "meta_info":
  {"finish_reason": {"type": "stop", "matched": id} | {"type": "length", ...}, "weight_version",
  ...}}``, ``weight_version`` since August 2025, PR #8795; an aborted request 200 with
  ``{"type": "abort", "message": "Abort before prefill"}`` and no ``output_ids``
  (``_handle_abort_req``); "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."),
  commits of 2025-26.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["GEN_PROTOCOLS", "Aborted", "BadAnswer", "Sample", "SGLangGeneration", "VLLMGeneration"]

# The logit bias that keeps an id out of every sample (both servers clamp biases to +-100).
_NEVER = -100.0


class BadAnswer(ValueError):
    """A server answer that is not what the protocol promises (the message says where)."""


class Aborted(Exception):  # noqa: N818 - the server's word, not kd's error
    """The server aborted the request (vLLM's ``finish_reason`` ``abort``; SGLang's
    ``{"type": "abort", "message"}``): another client paused or aborted its requests, or a weight
    update did; asked again, it may run (the message is the server's word)."""


@dataclass(frozen=True)
class Sample:
    """One completion.

    Attributes:
        ids: the sampled ids, the stop id that ended it included.
        stopped: a stop id (or the model's EOS) ended it; False: ``max_tokens`` did.
        weight_version: the server's weight version when it says one (SGLang's
            ``meta_info.weight_version``); None otherwise.
    """

    ids: list[int]
    stopped: bool
    weight_version: str | None = None


def _ints(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise BadAnswer(f"{where} is not a list of token ids ({type(value).__name__})")
    return list(value)


def _bias(vocab_limit: int, vocab: int) -> dict[str, float] | None:
    """``logit_bias`` keeping ids ``vocab_limit .. vocab - 1`` (a model's padded rows, no
    tokenizer's tokens) out of every sample; None when there are none."""
    if vocab <= vocab_limit:
        return None
    return {str(i): _NEVER for i in range(vocab_limit, vocab)}


class GenerationProtocol(Protocol):
    """How one kind of server samples and takes new weights."""

    name: str
    generate_path: str
    load_lora_path: str
    unload_lora_path: str
    reload_probe_path: str

    def body(
        self,
        *,
        model: str,
        adapter: str | None,
        prompt: Sequence[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_ids: Sequence[int],
        seed: int | None,
        vocab_limit: int,
        vocab: int,
    ) -> dict[str, Any]:
        """The JSON body asking ``max_tokens`` tokens after ``prompt``."""
        ...

    def parse(self, answer: Any, *, adapter: str | None, model: str) -> Sample:
        """The answer read back; :class:`BadAnswer` otherwise."""
        ...

    def load_lora(self, name: str, path: str) -> tuple[str, dict[str, Any]]:
        """The path and body that hot-load the PEFT adapter folder ``path`` as ``name``."""
        ...

    def score_body(self, *, model: str, adapter: str | None, prompt: Sequence[int]) -> Any:
        """The body asking the top-1 log-prob at each position of ``prompt`` (its answer is
        read by :mod:`kd.teachers.protocols`, the served teacher's reader)."""
        ...

    def reload(self, folder: str, version: int) -> list[tuple[str, dict[str, Any]]]:
        """The requests, in order, that reload the full weights from ``folder``."""
        ...

    def lora_disabled(self, status: int, text: str) -> bool:
        """Whether an answer to the LoRA probe says runtime LoRA loading is off."""
        ...

    def refused_load(self, data: Any) -> bool:
        """Whether an HTTP 500 answer (its JSON) to a LoRA load is the server's own refusal of
        the adapter, which it gives again when asked again (not a passing failure)."""
        ...


class VLLMGeneration:
    """vLLM: ``POST /v1/completions`` with ``return_token_ids``; LoRA at ``/v1/*_lora_adapter``;
    full weights through ``/collective_rpc``."""

    name = "vllm"
    generate_path = "/v1/completions"
    load_lora_path = "/v1/load_lora_adapter"
    unload_lora_path = "/v1/unload_lora_adapter"
    reload_probe_path = "/collective_rpc"

    def body(
        self,
        *,
        model: str,
        adapter: str | None,
        prompt: Sequence[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_ids: Sequence[int],
        seed: int | None,
        vocab_limit: int,
        vocab: int,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": adapter or model,  # a LoRA adapter is asked by its name
            "prompt": [int(t) for t in prompt],
            "n": 1,
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
            "top_k": -1,  # all tokens (a generation_config.json default would otherwise apply)
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "stop_token_ids": [int(t) for t in stop_ids],
            "ignore_eos": False,
            "return_token_ids": True,
            "stream": False,
        }
        if seed is not None:
            body["seed"] = int(seed)
        bias = _bias(vocab_limit, vocab)
        if bias is not None:
            body["logit_bias"] = bias
        return body

    def parse(self, answer: Any, *, adapter: str | None, model: str) -> Sample:
        if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
            raise BadAnswer("the answer has no choices")
        if len(answer["choices"]) != 1:
            raise BadAnswer(f"{len(answer['choices'])} choices for one prompt and n 1")
        # An adapter's answer names it; a base model's names the server's first
        # --served-model-name (``OpenAIServingModels.model_name``), which server_model may alias.
        if adapter is not None and answer.get("model") not in (None, adapter):
            raise BadAnswer(f"the answer is of model {answer.get('model')!r}, not {adapter!r}")
        choice = answer["choices"][0]
        if not isinstance(choice, dict):
            raise BadAnswer("choice 0 is not an object")
        reason = choice.get("finish_reason")
        if reason == "abort":  # the engine aborted it (a pause, an abort): 200, partial ids
            raise Aborted("finish_reason abort")
        if choice.get("token_ids") is None:
            raise BadAnswer(
                "choice 0 has no token_ids (return_token_ids needs vLLM 0.10.2 or later)"
            )
        ids = _ints(choice.get("token_ids"), "choices[0].token_ids")
        if reason not in ("stop", "length"):
            raise BadAnswer(f"choices[0].finish_reason is {reason!r}")
        stop = choice.get("stop_reason")
        if reason == "stop" and isinstance(stop, int) and (not ids or ids[-1] != stop):
            ids.append(stop)
        return Sample(ids=ids, stopped=reason == "stop")

    def load_lora(self, name: str, path: str) -> tuple[str, dict[str, Any]]:
        return self.load_lora_path, {"lora_name": name, "lora_path": path}

    def score_body(self, *, model: str, adapter: str | None, prompt: Sequence[int]) -> Any:
        """The request for the served model's top-1 log-prob at each position of ``prompt``
        (``prompt_logprobs``, as kd's served teacher asks it)."""
        return {
            "model": adapter or model,
            "prompt": [int(t) for t in prompt],
            "max_tokens": 1,
            "temperature": 1.0,  # the served teacher's request: log-probs of the raw logits
            "prompt_logprobs": 1,
        }

    def reload(self, folder: str, version: int) -> list[tuple[str, dict[str, Any]]]:
        return [
            (
                "/collective_rpc",
                {"method": "update_config", "args": [{"model_config": {"model": folder}}]},
            ),
            ("/collective_rpc", {"method": "reload_weights"}),
        ]

    def lora_disabled(self, status: int, text: str) -> bool:
        # The routes are not attached without VLLM_ALLOW_RUNTIME_LORA_UPDATING: FastAPI's 404.
        return status == 404 and '"detail"' in text

    def refused_load(self, data: Any) -> bool:
        # load_lora_adapter catches whatever the engine's add_lora raised ("Call to add_lora
        # method failed: LoRA rank 32 is greater than max_lora_rank 16.", an engine that died)
        # and answers it as its own ErrorResponse: 500 InternalServerError on vLLM's main branch
        # of 2026 (400 in 0.11-0.12); a proxy's or a crash's 500 has not that body.
        error = data.get("error") if isinstance(data, dict) else None
        return isinstance(error, dict) and error.get("type") == "InternalServerError"

    # Sleep mode (``vllm/entrypoints/serve/dev/sleep/api_router.py``, dev mode; the memory is
    # the server's own only with --enable-sleep-mode, docs/features/sleep_mode.md): ``POST
    # /sleep?level=1|2`` (1: weights to CPU memory, KV cache dropped; 2: both dropped), ``POST
    # /wake_up`` with repeated ``tags`` (``weights``, ``kv_cache``; none: all), ``GET
    # /is_sleeping`` -> ``{"is_sleeping": bool}``, true until every tag is awake. A level-2
    # sleep's weights wake "remapped empty": a reload (``reload_weights``) must fill them before
    # the KV cache wakes. ``GET /server_info?config_format=json`` (dev mode) holds
    # ``vllm_config.model_config.enable_sleep_mode``.
    is_sleeping_path = "/is_sleeping"
    server_info_path = "/server_info?config_format=json"

    @staticmethod
    def sleep_path(level: int) -> str:
        return f"/sleep?level={int(level)}"

    @staticmethod
    def wake_path(tag: str | None = None) -> str:
        return "/wake_up" if tag is None else f"/wake_up?tags={tag}"


class SGLangGeneration:
    """SGLang: ``POST /generate`` with ``input_ids``; LoRA at ``/*_lora_adapter``; full weights
    through ``/update_weights_from_disk``."""

    name = "sglang"
    generate_path = "/generate"
    load_lora_path = "/load_lora_adapter"
    unload_lora_path = "/unload_lora_adapter"
    reload_probe_path = "/update_weights_from_disk"

    def body(
        self,
        *,
        model: str,
        adapter: str | None,
        prompt: Sequence[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_ids: Sequence[int],
        seed: int | None,
        vocab_limit: int,
        vocab: int,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": int(max_tokens),
            "temperature": float(temperature),  # 0: greedy (top_k 1)
            "top_p": float(top_p),
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "stop_token_ids": [int(t) for t in stop_ids],
            "ignore_eos": False,
            "n": 1,
        }
        if seed is not None:
            params["sampling_seed"] = int(seed)
        bias = _bias(vocab_limit, vocab)
        if bias is not None:
            params["logit_bias"] = bias
        body: dict[str, Any] = {
            "input_ids": [int(t) for t in prompt],
            "sampling_params": params,
            "stream": False,
        }
        if adapter is not None:
            body["lora_path"] = adapter  # the name of a loaded adapter
        return body

    def parse(self, answer: Any, *, adapter: str | None, model: str) -> Sample:
        if isinstance(answer, list) and len(answer) == 1:
            answer = answer[0]
        if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
            raise BadAnswer("the answer has no meta_info")
        reason = answer["meta_info"].get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else None
        if kind == "abort":  # aborted before prefill: no output_ids (HTTP 200)
            raise Aborted(f"finish_reason abort: {reason.get('message')}")
        if "output_ids" not in answer:
            raise BadAnswer("the answer has no output_ids")
        ids = _ints(answer["output_ids"], "output_ids")
        if kind not in ("stop", "length"):
            raise BadAnswer(f"meta_info.finish_reason is {reason!r}")
        matched = reason.get("matched")
        if (
            kind == "stop"
            and isinstance(matched, int)
            and not isinstance(matched, bool)
            and (not ids or ids[-1] != matched)
        ):
            ids.append(matched)
        version = answer["meta_info"].get("weight_version")
        return Sample(
            ids=ids,
            stopped=kind == "stop",
            weight_version=None if version is None else str(version),
        )

    def load_lora(self, name: str, path: str) -> tuple[str, dict[str, Any]]:
        return self.load_lora_path, {"lora_name": name, "lora_path": path}

    def score_body(self, *, model: str, adapter: str | None, prompt: Sequence[int]) -> Any:
        """The request for the served model's top-1 log-prob at each position of ``prompt``
        (input log-probs, as kd's served teacher asks them; an adapter by ``lora_path``)."""
        body: dict[str, Any] = {
            "input_ids": [int(t) for t in prompt],
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 1,
            "return_text_in_logprobs": False,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        }
        if adapter is not None:
            body["lora_path"] = adapter
        return body

    def reload(self, folder: str, version: int) -> list[tuple[str, dict[str, Any]]]:
        body = {"model_path": folder, "weight_version": str(version), "abort_all_requests": False}
        return [("/update_weights_from_disk", body)]

    def lora_disabled(self, status: int, text: str) -> bool:
        return status == 400 and "LoRA is not enabled" in text

    def refused_load(self, data: Any) -> bool:
        return False  # SGLang refuses a load with 400 success false; a 500 is a crash's


GEN_PROTOCOLS: dict[str, GenerationProtocol] = {
    "vllm": VLLMGeneration(),
    "sglang": SGLangGeneration(),
}
