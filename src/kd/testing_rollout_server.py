"""A test generation server: vLLM's and SGLang's sampling and weight-update endpoints over a real
(tiny) Hugging Face model on the CPU, answering as the servers do.

It stands in for the server a served sampler (:mod:`kd.rollouts.served`) talks to: it samples
completions of token-id prompts with the model it loaded, hot-loads PEFT adapters (read by
``peft``) and reloads full safetensors folders, and answers each request and each mistake with the
status and JSON body the real server gives. Written from their source (the files and versions
:mod:`kd.rollouts.served_protocols` names):

* vLLM (built against 0.11-0.12, the v1 engine): ``POST /v1/completions`` with ``prompt`` as id
  lists, ``n``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
  ``stop_token_ids``, ``logit_bias``, ``ignore_eos`` and ``return_token_ids`` (the choice's
  ``token_ids``; choice ``i * n + j`` is sample ``j`` of prompt ``i``; ``finish_reason`` ``stop``
  with ``stop_reason`` the stop id, ``null`` for the model's EOS, or ``length``); the model is a
  served name or a loaded adapter's (404 ``NotFoundError`` "The model `X` does not exist.");
  prompt + ``max_tokens`` over ``--max-model-len``: 400 ``BadRequestError``.
  ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` exist only with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (else FastAPI's 404 ``{"detail": "Not Found"}``);
  success is HTTP 200 with a plain-text line; a name already loaded without ``load_inplace`` is
  400 ``InvalidUserInput``, a path without an adapter 404 ``NotFoundError`` ("No adapter found"),
  a load the engine refuses (a rank above ``--max-lora-rank``, no ``--enable-lora``) 500 "Call to
  add_lora method failed: ..." (0.11-0.12: 400; :mod:`kd.testing_rollout_vllm`); an unknown name
  to unload 404 "The lora adapter 'X' cannot be found.". A request the engine aborted (another
  client's ``/pause``, an abort) is HTTP 200 with ``finish_reason`` ``abort``.
  ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1`` only) with ``update_config`` (``{"model_config":
  {"model": DIR}}``) then ``reload_weights``: ``{"results": [null]}``; a failing call 500
  ``InternalServerError``, a body without ``method`` 400.
* SGLang: ``POST /generate`` with ``input_ids`` (one list or a batch), ``sampling_params``
  (``max_new_tokens``, ``temperature`` (0: greedy), ``top_p``, ``top_k``, ``n``,
  ``stop_token_ids``, ``sampling_seed``, ``logit_bias``, ``ignore_eos``) and ``lora_path`` (a
  loaded adapter's name); each answer ``{"text", "output_ids", "meta_info": {"id",
  "finish_reason": {"type": "stop", "matched": id} | {"type": "length", "length": n},
  "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version"}}`` (no
  ``weight_version`` before August 2025, sgl-project/sglang PR #8795); an aborted request 200
  with ``finish_reason`` ``{"type": "abort", "message": "Abort before prefill"}``; a request it
  refuses 400 ``{"error": {"message"}}``. ``POST /update_weights_from_disk`` (``model_path``,
  ``weight_version``) and ``/load_lora_adapter`` / ``/unload_lora_adapter`` answer ``{"success",
  "message" | "error_message", ...}`` with HTTP 200 or 400 ("LoRA is not enabled. Please set
  `--enable-lora` to enable LoRA." without ``--enable-lora``). ``GET /get_model_info`` and
  ``/v1/models`` as :mod:`kd.testing_server` gives them, with ``max_model_len``; ``GET
  /server_info`` (``/get_server_info`` before) its server args, flat (``enable_lora``,
  ``max_lora_rank``, ...: ``dataclasses.asdict(server_args)`` in ``http_server.py``).
* vLLM's sleep mode (``--enable-sleep-mode``; the dev routes ``POST /sleep?level=1|2``, ``POST
  /wake_up`` with repeated ``tags``, ``GET /is_sleeping``; ``GET /server_info`` with
  ``model_config.enable_sleep_mode``; ``vllm/entrypoints/serve/dev/sleep/api_router.py`` and
  ``docs/features/sleep_mode.md``; ``EngineCore.sleep`` / ``wake_up``): a sleep pauses the
  scheduler (a rollout asked then waits for a wake, counted in
  :attr:`RolloutTestServer.asked_asleep`) and every wake resumes it, so a rollout scheduled while
  the KV cache still sleeps is the engine's crash (500); level 1 keeps the weights (CPU
  memory), level 2 drops them: woken, they are "remapped empty" (zeros here) until
  ``reload_weights`` fills them, and a reload into weights still asleep is the engine's crash
  (500). Waking an awake tag, or sleeping a sleeping one, is a no-op. Without sleep mode a sleep
  frees nothing (it answers 200 all the same).
* Tokens (``--api-key``; SGLang's ``--admin-api-key``): vLLM's guards the ``/v1`` paths only
  (``AuthenticationMiddleware``, ``vllm/entrypoints/openai/server_utils.py``); SGLang's every path
  but ``/health*`` and ``/metrics*``, and once an admin key is set its ``ADMIN_OPTIONAL`` routes
  (``/update_weights_from_disk``, ``/load_lora_adapter``, ``/unload_lora_adapter``) take only that
  key (``decide_request_auth``, ``python/sglang/srt/utils/auth.py``). A refused token is 401
  ``{"error": "Unauthorized"}``, before routing (a middleware). SGLang's
  ``/update_weights_from_disk`` without ``model_path`` is FastAPI's 422.

The plumbing (127.0.0.1 only, a bounded serving loop in a daemon thread, FastAPI's 404 / 405, the
faults ``500`` / ``hang`` / ``kill``, :meth:`RolloutTestServer.kill` as a crash) is
:mod:`kd.testing_server`'s. It samples one row at a time without a KV cache: slow, for tests and
for trying a served sampler without a GPU::

    python -m kd.testing_rollout_server --model DIR --api vllm --port 8000 --enable-lora
"""

from __future__ import annotations

import collections
import json
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kd.testing_rollout_engine import RolloutEngine, poison, prompt_table
from kd.testing_rollout_sglang import SGLangAnswers
from kd.testing_rollout_vllm import VLLMAnswers
from kd.testing_server import ServerLifecycle, _Handler

__all__ = ["RolloutTestServer", "main"]

# The paths each server has, by method, and the settings that add some (anything else: FastAPI's
# 404 / 405).
_BASE_ROUTES = {
    "vllm": {"GET": ("/v1/models", "/health"), "POST": ("/v1/completions",)},
    "sglang": {
        "GET": ("/v1/models", "/get_model_info", "/server_info", "/get_server_info", "/health"),
        "POST": (
            "/generate",
            "/update_weights_from_disk",
            "/load_lora_adapter",
            "/unload_lora_adapter",
        ),
    },
}
_VLLM_RUNTIME_LORA = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_VLLM_DEV = ("/collective_rpc", "/sleep", "/wake_up")
_VLLM_DEV_GET = ("/is_sleeping", "/server_info")
# SGLang's routes marked AuthLevel.ADMIN_OPTIONAL (its --admin-api-key, once set, is the only key).
_SGLANG_ADMIN = ("/update_weights_from_disk", "/load_lora_adapter", "/unload_lora_adapter")


class _RequestError(Exception):
    """A request the server refuses: the HTTP status and body it answers."""

    def __init__(self, status: int, payload: Any, raw: bytes | None = None):
        super().__init__(str(payload))
        self.status = status
        self.payload = payload
        self.raw = raw


class RolloutTestServer(SGLangAnswers, VLLMAnswers, ServerLifecycle):
    """A vLLM- or SGLang-protocol generation server of a Hugging Face folder on 127.0.0.1.

    Args:
        model_dir: the model it serves (the student's base folder).
        api: ``vllm`` or ``sglang``.
        model_name: the name it serves (``--served-model-name``; several: vLLM's aliases, its
            answers naming the first); None: the folder's path.
        tokenizer_dir: the tokenizer of the texts it sends beside the ids (None: empty texts).
        enable_lora: ``--enable-lora``.
        runtime_lora: vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (the LoRA endpoints
            exist); SGLang's are always there.
        dev_mode: vLLM's ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc`` and the sleep routes
            exist).
        sleep_mode: vLLM's ``--enable-sleep-mode``.
        max_lora_rank: ``--max-lora-rank``.
        legacy_lora_errors: vLLM 0.11-0.12's answer to a failed adapter load (400, not 500).
        weight_versions: SGLang's ``weight_version`` in its answers (False: a release before
            August 2025).
        max_model_len: ``--max-model-len`` (SGLang ``--context-length``).
        token: ``--api-key`` (None: none).
        admin_token: SGLang's ``--admin-api-key`` (None: none).
        sees: the only folder whose files the server can read (a server on another machine sees
            none of kd's disk but a shared one); None: all.
        port: the port (0: any free one).
        hang_s: how long a ``"hang"`` fault sleeps.
        max_requests: requests served before it stops by itself.
        lifetime_s: seconds it serves before it stops by itself.

    Attributes:
        faults: per POST request, in order: ``"500"``, ``"hang"``, ``"kill"`` (see
            :data:`kd.testing_server.FAULTS`), ``"bad_id"`` (a completion's first id replaced by
            the model's last row, which no tokenizer token has), ``"lost"`` (the request is
            carried out, then the connection closes before the answer: an answer lost on the
            way, which the client retries), ``"abort"`` (a rollout answered as the engine
            answers one aborted before it ran) or ``""``.
        kill_on: a path whose next request kills the server before it answers (a crash during a
            weight push); None: none.
        on_post: ``(path, body) -> None`` called with every POST before it is answered (a test's
            hook: kill the client mid-push); None: none.
        log: ``(path, body)`` of every POST, in order of arrival.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        api: str = "vllm",
        model_name: str | Sequence[str] | None = None,
        tokenizer_dir: Path | None = None,
        enable_lora: bool = True,
        runtime_lora: bool = True,
        dev_mode: bool = True,
        sleep_mode: bool = False,
        max_lora_rank: int = 16,
        legacy_lora_errors: bool = False,
        weight_versions: bool = True,
        max_model_len: int = 4096,
        token: str | None = None,
        admin_token: str | None = None,
        sees: Path | None = None,
        port: int = 0,
        hang_s: float = 2.0,
        max_requests: int = 1_000_000,
        lifetime_s: float = 900.0,
    ):
        assert api in ("vllm", "sglang"), api
        assert admin_token is None or api == "sglang", "only SGLang has an admin key"
        self.api = api
        self.token = token
        self.admin_token = admin_token
        self.model = RolloutEngine(Path(model_dir), tokenizer_dir)
        self.model_path = str(model_dir)
        names = [model_name] if isinstance(model_name, str) else list(model_name or ())
        self.model_names = tuple(names) or (self.model_path,)
        self.model_name = self.model_names[0]
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.legacy_lora_errors = legacy_lora_errors
        self.weight_versions = weight_versions
        self.max_model_len = max_model_len
        self.model.sees = None if sees is None else Path(sees).resolve()
        self.hang_s = hang_s
        self.retry_after = "1"
        self.trickle_s = 0.05
        self.max_requests = max_requests
        self.lifetime_s = lifetime_s
        self.weight_version = "default"  # SGLang's --weight-version
        self.reload_path: str | None = None  # vLLM's model_config.model after update_config
        self.sleep_mode = sleep_mode
        self.asleep: set[str] = set()  # the memory tags asleep ("weights", "kv_cache")
        self.dropped = False  # a level-2 sleep dropped the weights (until a reload fills them)
        self.paused = False  # the scheduler, paused by a sleep until every tag is awake
        self.asked_asleep = 0  # rollouts asked while the server slept
        self.lora_paths: dict[str, str] = {}
        routes = {m: tuple(p) for m, p in _BASE_ROUTES[api].items()}
        if api == "vllm":
            extra = (_VLLM_RUNTIME_LORA if runtime_lora else ()) + (_VLLM_DEV if dev_mode else ())
            routes["POST"] = routes["POST"] + extra
            routes["GET"] = routes["GET"] + (_VLLM_DEV_GET if dev_mode else ())
        self.routes = routes
        self.faults: collections.deque[str] = collections.deque()
        self.kill_on: str | None = None
        self.on_post: Any = None
        self.log: list[tuple[str, Any]] = []
        self.refused: set[tuple[int, ...]] = set()
        self.requests = 0
        self._lock = threading.Lock()
        self._model_lock = threading.Lock()
        self._bind(_RolloutHandler, port, "kd-rollout-server")

    # ------------------------------------------------------------ shared answers
    def authorized(self, path: str, header: str | None) -> bool:
        """Whether the server's token middleware lets ``header`` through to ``path``."""
        if self.api == "vllm":
            key = self.token if path.startswith("/v1") else None
        elif path.startswith(("/health", "/metrics")):
            key = None
        elif path in _SGLANG_ADMIN and self.admin_token is not None:
            key = self.admin_token
        else:
            key = self.token
        return key is None or header == f"Bearer {key}"

    def next_fault(self) -> str | None:
        with self._lock:
            return self.faults.popleft() if self.faults else None

    def model_list(self) -> dict[str, Any]:
        """``GET /v1/models``: the served name, then every loaded adapter, its parent the served
        name (vLLM's adapter cards carry no ``max_model_len``; SGLang lists adapters only with
        ``--enable-lora``)."""
        vllm = self.api == "vllm"

        def card(name: str, root: str, parent: str | None, length: int | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": self.api,
                "root": root,
                "parent": parent,
                "max_model_len": length,
            }

        root = self.model_path if vllm else self.model_name
        cards = [card(name, root, None, self.max_model_len) for name in self.model_names]
        if vllm or self.enable_lora:
            for name, path in self.lora_paths.items():
                length = None if vllm else self.max_model_len
                cards.append(card(name, path, self.model_name, length))
        return {"object": "list", "data": cards}

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            **({"weight_version": self.weight_version} if self.weight_versions else {}),
        }

    def aborted(self, path: str, body: dict[str, Any]) -> Any:
        """The answer to a rollout the engine aborted before it sampled a token."""
        if path == "/generate":
            return self.sglang_aborted(body)
        ids = [] if body.get("return_token_ids") else None
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "abort"}
        choice |= {"stop_reason": None, "token_ids": ids, "prompt_logprobs": None}
        usage = {"prompt_tokens": len(body.get("prompt") or ()), "completion_tokens": 0}
        model = body.get("model")
        return {
            "id": f"cmpl-{self.requests}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model if model in self.model.adapters else self.model_name,
            "choices": [choice],
            "usage": usage,
        }

    def vllm_error(self, status: int, message: str, kind: str, param: str | None = None) -> Any:
        """vLLM's ``ErrorResponse``."""
        return {"error": {"message": message, "type": kind, "param": param, "code": status}}

    def _refuse(self, message: str, status: int = 400) -> _RequestError:
        if self.api == "vllm":
            kind = "BadRequestError" if status == 400 else "NotFoundError"
            return _RequestError(status, self.vllm_error(status, message, kind))
        return _RequestError(status, {"error": {"message": message}})

    def _adapter(self, name: str | None) -> torch.nn.Module:
        if name is None:
            return self.model.base
        return self.model.adapters[name]

    def _generate(self, prompt: Any, params: dict[str, Any], adapter: str | None) -> list[dict]:
        """``n`` samples of one prompt: ``[{ids, stopped_by}]``."""
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise self._refuse("prompt must be a list of token ids")
        if any(t < 0 or t >= self.model.vocab for t in prompt):
            raise self._refuse(f"Token id out of vocabulary (vocab_size={self.model.vocab})")
        max_tokens = int(params["max_tokens"])
        if len(prompt) + max_tokens > self.max_model_len:
            if self.api == "vllm":
                message = (
                    f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                    f"model's maximum context length is {self.max_model_len} tokens and your "
                    f"request has {len(prompt)} input tokens ({max_tokens} > "
                    f"{self.max_model_len} - {len(prompt)})."
                )
                error = self.vllm_error(400, message, "BadRequestError", "max_tokens")
                raise _RequestError(400, error)
            raise self._refuse(
                "Requested token count exceeds the model's maximum context length of "
                f"{self.max_model_len} tokens. You requested a total of "
                f"{len(prompt) + max_tokens} tokens: {len(prompt)} tokens from the input messages "
                f"and {max_tokens} tokens for the completion. Please reduce the number of tokens "
                "in the input messages or the completion to fit within the limit."
            )
        stops = {int(t) for t in params.get("stop_token_ids") or ()}
        if not params.get("ignore_eos"):
            stops |= self.model.eos
        seed = params.get("seed")
        generator = torch.Generator()
        generator.manual_seed(int(seed) if seed is not None else int(time.time_ns()) % 2**62)
        bias = {int(k): float(v) for k, v in (params.get("logit_bias") or {}).items()}
        out = []
        with self._model_lock:
            model = self._adapter(adapter)
            for _ in range(int(params.get("n") or 1)):
                ids, stopped_by = self.model.sample(
                    model,
                    prompt,
                    max_tokens=max_tokens,
                    temperature=float(params["temperature"]),
                    top_p=float(params["top_p"]),
                    top_k=int(params["top_k"]),
                    stops=stops,
                    logit_bias=bias,
                    generator=generator,
                )
                out.append({"ids": ids, "stopped_by": stopped_by})
        return out

    def _text(self, ids: Sequence[int]) -> str:
        """The completion's text (empty when the server was given no tokenizer)."""
        if self.model.tokenizer is None:
            return ""
        return self.model.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ------------------------------------------------------------ vLLM
    def vllm_completions(self, body: dict[str, Any]) -> tuple[int, Any, bytes | None]:
        model = body.get("model")
        adapter = None
        if model and model not in self.model_names:
            if model not in self.model.adapters:
                message = f"The model `{model}` does not exist."
                return 404, self.vllm_error(404, message, "NotFoundError", "model"), None
            adapter = model
        prompts = body.get("prompt")
        prompts = prompts if prompts and isinstance(prompts[0], list) else [prompts]
        n = int(body.get("n") or 1)
        temperature = body.get("temperature")
        params = {
            "max_tokens": body.get("max_tokens", 16),
            "temperature": 1.0 if temperature is None else temperature,
            "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
            "top_k": body.get("top_k") if body.get("top_k") is not None else 0,
            "seed": body.get("seed"),
            "stop_token_ids": body.get("stop_token_ids"),
            "ignore_eos": body.get("ignore_eos", False),
            "logit_bias": body.get("logit_bias"),
            "n": n,
        }
        choices = []
        tokens_in = tokens_out = 0
        k = body.get("prompt_logprobs")
        for i, prompt in enumerate(prompts):
            if k is not None:  # scored first: the prompt's log-probs, then the completion
                with self._model_lock:
                    table = prompt_table(self._adapter(adapter), prompt, int(k))
                scored: list[Any] = [None] + [
                    {str(t): {"logprob": lp, "rank": r, "decoded_token": ""} for t, lp, r in e}
                    for e in table
                ]
            for j, sample in enumerate(self._generate(prompt, params, adapter)):
                stop = sample["stopped_by"]
                asked = set(params["stop_token_ids"] or ())
                choice = {
                    "index": i * n + j,
                    "text": self._text(sample["ids"]),
                    "logprobs": None,
                    "finish_reason": "stop" if stop is not None else "length",
                    "stop_reason": stop if stop is not None and stop in asked else None,
                    "token_ids": sample["ids"] if body.get("return_token_ids") else None,
                    "prompt_logprobs": scored if k is not None else None,
                    "prompt_token_ids": prompt if body.get("return_token_ids") else None,
                }
                choices.append(choice)
                tokens_out += len(sample["ids"])
            tokens_in += len(prompt)
        usage = {
            "prompt_tokens": tokens_in,
            "total_tokens": tokens_in + tokens_out,
            "completion_tokens": tokens_out,
            "prompt_tokens_details": None,
        }
        answer = {
            "id": f"cmpl-{self.requests}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": adapter or self.model_name,  # a base model's answer: the first name
            "choices": choices,
            "usage": usage,
        }
        return 200, answer, None

    def server_info(self) -> dict[str, Any]:
        """vLLM's ``GET /server_info?config_format=json`` (its config: the parts kd reads;
        ``lora_config`` null without ``--enable-lora``) or SGLang's ``GET /server_info`` (its
        server args, flat: the parts kd reads)."""
        if self.api == "sglang":
            return {
                "model_path": self.model_path,
                "served_model_name": self.model_name,
                "context_length": self.max_model_len,
                "enable_lora": self.enable_lora,
                "max_lora_rank": self.max_lora_rank if self.enable_lora else None,
                "lora_target_modules": ["all"] if self.enable_lora else None,
                "enable_memory_saver": False,
                "internal_states": [{}],
                "version": "0.5.6",
            }
        model = {"model": self.model_path, "enable_sleep_mode": self.sleep_mode}
        lora = {"max_lora_rank": self.max_lora_rank, "max_loras": 2} if self.enable_lora else None
        return {
            "vllm_config": {"model_config": model, "lora_config": lora},
            "vllm_env": {},
            "system_env": {},
        }

    def wait_awake(self) -> None:
        """A rollout asked while the server sleeps waits for a wake (the scheduler is paused),
        as long as the server serves; one scheduled while its KV cache still sleeps (a wake of
        the weights alone resumes scheduling) is the engine's crash."""
        if self.paused or self.asleep:
            with self._lock:
                self.asked_asleep += 1
        while self.paused and not self._stopped.is_set():
            time.sleep(0.01)
        if "kv_cache" in self.asleep:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def answer(
        self, path: str, body: Any, query: dict[str, list[str]] | None = None
    ) -> tuple[int, Any, bytes | None]:
        """The status, JSON payload (or raw body) of a POST to ``path``."""
        if path == "/sleep":
            return self.vllm_sleep(query or {})
        if path == "/wake_up":
            return self.vllm_wake_up(query or {})
        handlers = {
            "/v1/completions": self.vllm_completions,
            "/v1/load_lora_adapter": self.vllm_load_lora,
            "/v1/unload_lora_adapter": self.vllm_unload_lora,
            "/collective_rpc": self.vllm_collective_rpc,
            "/generate": self.sglang_generate,
            "/update_weights_from_disk": self.sglang_update_weights,
            "/load_lora_adapter": self.sglang_load_lora,
            "/unload_lora_adapter": self.sglang_unload_lora,
        }
        if not isinstance(body, dict):
            raise self._refuse("the request body must be a JSON object")
        return handlers[path](body)


class _RolloutHandler(_Handler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        owner = self.server.owner
        if not self._route("GET"):
            return
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send(200, None, raw=b"")
        elif path == "/v1/models":
            self._send(200, owner.model_list())
        elif path == "/is_sleeping":
            self._send(200, {"is_sleeping": bool(owner.asleep) or owner.paused})
        elif path in ("/server_info", "/get_server_info"):
            self._send(200, owner.server_info())
        else:
            self._send(200, owner.model_info())

    def _failed(self, owner: RolloutTestServer, fault: str | None) -> bool:
        """Whether ``fault`` answered the request already (a crash, or a 500)."""
        if fault == "kill":
            owner.kill()
            self.close_connection = True
            return True
        if fault == "500":
            if owner.api == "sglang":
                self._send(500, None, raw=b"Internal Server Error", content_type="text/plain")
            else:
                self._send(500, owner.vllm_error(500, "injected fault", "InternalServerError"))
            return True
        return False

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        owner: RolloutTestServer = self.server.owner  # type: ignore[assignment]
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}"
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        with owner._lock:
            owner.requests += 1
            owner.log.append((self.path, body))
        if owner.on_post is not None:
            owner.on_post(self.path, body)
        fault = owner.next_fault()
        if owner.kill_on is not None and self.path == owner.kill_on:
            fault = "kill"
        if self._failed(owner, fault):
            return
        if fault == "hang":
            time.sleep(owner.hang_s)
        if not self._route("POST"):
            return
        path, _, query = self.path.partition("?")
        try:
            if path in ("/v1/completions", "/generate"):
                owner.wait_awake()
            status, payload, text = owner.answer(path, body, urllib.parse.parse_qs(query))
        except _RequestError as e:
            status, payload, text = e.status, e.payload, e.raw
        except Exception as e:  # noqa: BLE001 - a server answers 500 on its own errors
            if owner.api == "sglang":
                self._send(500, None, raw=b"Internal Server Error", content_type="text/plain")
                return
            status, payload, text = 500, owner.vllm_error(500, str(e), "InternalServerError"), None
        if fault == "bad_id" and status == 200:
            poison(payload, owner.model.vocab - 1)
        if fault == "abort" and status == 200:
            payload = owner.aborted(path, body)
        if fault == "lost":  # done, but the answer never reaches the client
            self.close_connection = True
            return
        if text is not None:  # vLLM's Response(content=str): a body without a media type
            self.send_response(status)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
            return
        self._send(status, payload)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kd.testing_rollout_server``: serve a folder's generation as vLLM or SGLang.

    Returns:
        The exit status: 0 after Ctrl-C, 2 for a bad folder or port.
    """
    import argparse
    import sys

    from kd.errors import KDUserError

    parser = argparse.ArgumentParser(
        prog="python -m kd.testing_rollout_server",
        description="A stand-in for vllm serve / SGLang to try a served sampler "
        "(on_policy.sampler: served) without a GPU: samples DIR's completions on 127.0.0.1 only, "
        "loads the adapters and weights kd pushes (slow: no batching, no KV cache).",
    )
    parser.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face folder")
    parser.add_argument("--api", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free one")
    parser.add_argument("--served-model-name", metavar="NAME", help="default: DIR")
    parser.add_argument("--tokenizer", metavar="TDIR", help="default: DIR")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--enable-sleep-mode", action="store_true", help="vLLM's sleep mode")
    parser.add_argument("--api-key", metavar="TOKEN", help="as the server's --api-key")
    parser.add_argument("--admin-api-key", metavar="TOKEN", help="SGLang's --admin-api-key")
    args = parser.parse_args(argv)
    if args.admin_api_key is not None and args.api != "sglang":
        parser.error("--admin-api-key: only SGLang has an admin key; drop it, or pass --api sglang")
    try:
        server = RolloutTestServer(
            Path(args.model),
            api=args.api,
            model_name=args.served_model_name,
            tokenizer_dir=Path(args.tokenizer or args.model),
            enable_lora=args.enable_lora,
            max_lora_rank=args.max_lora_rank,
            max_model_len=args.max_model_len,
            sleep_mode=args.enable_sleep_mode,
            token=args.api_key,
            admin_token=args.admin_api_key,
            port=args.port,
            lifetime_s=24 * 3600.0,
        )
    except KDUserError as e:
        print(f"kd.testing_rollout_server: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(
            f"kd.testing_rollout_server: error: --port {args.port}: cannot listen "
            f"({e.strerror or e}); pass another port (0 picks a free one)",
            file=sys.stderr,
        )
        return 2
    print(f"serving {args.model} as {server.model_name!r} ({args.api}) on {server.url}", flush=True)
    server.start()
    try:
        server._thread.join()
    except KeyboardInterrupt:
        server.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
