"""vLLM's LoRA and dev-mode answers of :class:`kd.testing_rollout_server.RolloutTestServer`:
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``),
``/collective_rpc``, ``/sleep`` and ``/wake_up`` (``VLLM_SERVER_DEV_MODE=1``), with the statuses
and bodies vLLM's source gives (see that module's docstring).

A failed adapter load, as ``OpenAIServingModels.load_lora_adapter``
(``vllm/entrypoints/openai/models/serving.py``) answers it: the engine core's failed utility
call reads "Call to add_lora method failed: <the worker's error>" (``EngineCore``: "LoRA rank 32
is greater than max_lora_rank 16." from ``PEFTHelper.validate_legal``, "LoRA is not enabled."
without ``--enable-lora``). vLLM's main branch of 2026 answers it HTTP 500
``InternalServerError``, and a folder without an adapter (the worker's
``LoRAAdapterNotFoundError``) 404 ``NotFoundError`` "Loading lora X failed: No adapter found for
P"; vLLM 0.11-0.12 answered every failure 400 ``BadRequestError`` with the engine's message (404
``NotFoundError`` when it said "No adapter found"): ``legacy_lora_errors``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["VLLMAnswers"]


class VLLMAnswers:
    """The vLLM LoRA and dev-mode endpoints, mixed into the test server (which holds the model,
    the loaded adapters, the sleep state and :meth:`vllm_error`)."""

    model: Any
    lora_paths: dict[str, str]
    enable_lora: bool
    max_lora_rank: int
    legacy_lora_errors: bool
    model_path: str
    reload_path: str | None
    sleep_mode: bool
    asleep: set[str]
    dropped: bool
    paused: bool
    _model_lock: threading.Lock
    vllm_error: Callable[..., Any]  # the server's ErrorResponse builder

    def vllm_load_lora(self, body: dict[str, Any]) -> tuple[int, Any, bytes | None]:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            message = "Both 'lora_name' and 'lora_path' must be provided."
            return 400, self.vllm_error(400, message, "InvalidUserInput"), None
        if not body.get("load_inplace") and name in self.lora_paths:
            message = (
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
            return 400, self.vllm_error(400, message, "InvalidUserInput"), None
        try:
            if not self.enable_lora:
                raise RuntimeError("LoRA is not enabled.")
            adapter = self.model.load_adapter(path, max_rank=self.max_lora_rank)
        except FileNotFoundError:  # the worker's LoRAAdapterNotFoundError
            message = f"Loading lora {name} failed: No adapter found for {path}"
            if self.legacy_lora_errors:
                message = f"Call to add_lora method failed: {message}"
            return 404, self.vllm_error(404, message, "NotFoundError"), None
        except Exception as e:  # noqa: BLE001 - the engine core's failed utility call
            message = f"Call to add_lora method failed: {e}"
            if self.legacy_lora_errors:
                return 400, self.vllm_error(400, message, "BadRequestError"), None
            return 500, self.vllm_error(500, message, "InternalServerError"), None
        with self._model_lock:
            self.model.adapters[name] = adapter
            self.lora_paths[name] = path
        return 200, None, f"Success: LoRA adapter '{name}' added successfully.".encode()

    def vllm_unload_lora(self, body: dict[str, Any]) -> tuple[int, Any, bytes | None]:
        name = body.get("lora_name")
        if not name:
            message = "'lora_name' needs to be provided to unload a LoRA adapter."
            return 400, self.vllm_error(400, message, "InvalidUserInput"), None
        if name not in self.lora_paths:
            message = f"The lora adapter '{name}' cannot be found."
            return 404, self.vllm_error(404, message, "NotFoundError"), None
        with self._model_lock:
            del self.lora_paths[name]
            self.model.adapters.pop(name, None)
        return 200, None, f"Success: LoRA adapter '{name}' removed successfully.".encode()

    def vllm_sleep(self, query: dict[str, list[str]]) -> tuple[int, Any, bytes | None]:
        level = int(query.get("level", ["1"])[0])
        with self._model_lock:
            if self.sleep_mode and not self.asleep:
                self.dropped = self.dropped or level >= 2
            self.asleep |= {"weights", "kv_cache"} if level >= 1 else set()
            self.paused = True
        return 200, None, b""

    def vllm_wake_up(self, query: dict[str, list[str]]) -> tuple[int, Any, bytes | None]:
        tags = query.get("tags") or ["weights", "kv_cache"]
        with self._model_lock:
            if "weights" in tags and "weights" in self.asleep and self.dropped:
                self.model.drop_weights()  # remapped empty: a reload must fill them
            self.asleep -= set(tags)
            self.paused = False  # EngineCore.wake_up resumes scheduling at every wake
        return 200, None, b""

    def vllm_collective_rpc(self, body: dict[str, Any]) -> tuple[int, Any, bytes | None]:
        method = body.get("method")
        if method is None:  # an HTTPException, through vLLM's handler
            message = "Missing 'method' in request body"
            return 400, self.vllm_error(400, message, "Bad Request"), None
        args = body.get("args") or []
        try:
            if method == "update_config":
                overrides = args[0] if args else {}
                for name, values in overrides.items():
                    if name not in ("load_config", "model_config"):
                        raise AssertionError(
                            f"Config `{name}` not supported. Allowed configs: "
                            "{'load_config', 'model_config'}"
                        )
                    if name == "model_config" and "model" in values:
                        self.reload_path = str(values["model"])
            elif method == "reload_weights":
                with self._model_lock:
                    if self.sleep_mode and "weights" in self.asleep:
                        raise RuntimeError("CUDA error: an illegal memory access was encountered")
                    self.model.reload(self.reload_path or self.model_path)
                    self.dropped = False
            else:
                raise AttributeError(f"'Worker' object has no attribute '{method}'")
        except Exception as e:  # noqa: BLE001 - vLLM's exception handler: a 500 ErrorResponse
            message = f"{type(e).__name__}: {e}"
            return 500, self.vllm_error(500, message, "InternalServerError"), None
        return 200, {"results": [None]}, None
