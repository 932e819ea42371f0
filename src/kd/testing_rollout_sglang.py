"""SGLang's answers of :class:`kd.testing_rollout_server.RolloutTestServer`: ``/generate`` with
``input_ids`` and ``sampling_params``, ``/update_weights_from_disk``, ``/load_lora_adapter`` and
``/unload_lora_adapter``, with the bodies and statuses SGLang's ``http_server.py`` and
``tokenizer_manager.py`` give (see that module's docstring).
"""

from __future__ import annotations

import threading
from typing import Any

from kd.testing_rollout_engine import SAMPLING_EPS, prompt_table

__all__ = ["SGLangAnswers"]


class SGLangAnswers:
    """The SGLang endpoints, mixed into the test server (which holds the model, the loaded
    adapters, the weight version and the shared helpers these use)."""

    model: Any
    lora_paths: dict[str, str]
    enable_lora: bool
    max_lora_rank: int
    weight_version: str
    weight_versions: bool
    requests: int
    _model_lock: threading.Lock

    def sglang_generate(self, body: dict[str, Any]) -> tuple[int, Any, bytes | None]:
        prompts = body.get("input_ids")
        single = not (prompts and isinstance(prompts[0], list))
        prompts = [prompts] if single else prompts
        params = body.get("sampling_params") or {}
        per_row = params if isinstance(params, list) else [params] * len(prompts)
        loras = body.get("lora_path")
        loras = loras if isinstance(loras, list) else [loras] * len(prompts)
        if any(lora is not None for lora in loras) and not self.enable_lora:
            raise self._refuse("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        missing = sorted({x for x in loras if x is not None and x not in self.model.adapters})
        if missing:
            raise self._refuse(
                f"The following requested LoRA adapters are not loaded: {missing[0]}\n"
                f"Loaded adapters: {sorted(self.model.adapters)}."
            )
        out = []
        for index, (prompt, p, lora) in enumerate(zip(prompts, per_row, loras, strict=True)):
            temperature = p.get("temperature")
            temperature = 1.0 if temperature is None else float(temperature)
            top_k = p.get("top_k")
            top_k = -1 if top_k is None else int(top_k)
            if temperature < SAMPLING_EPS:  # SGLang: greedy is top_k 1
                temperature, top_k = 1.0, 1
            settings = {
                "max_tokens": p.get("max_new_tokens", 128),
                "temperature": temperature,
                "top_p": p.get("top_p") if p.get("top_p") is not None else 1.0,
                "top_k": 0 if top_k == -1 else top_k,
                "seed": p.get("sampling_seed"),
                "stop_token_ids": p.get("stop_token_ids"),
                "ignore_eos": p.get("ignore_eos", False),
                "logit_bias": p.get("logit_bias"),
                "n": p.get("n") or 1,
            }
            for j, sample in enumerate(self._generate(prompt, settings, lora)):
                stop = sample["stopped_by"]
                reason = (
                    {"type": "stop", "matched": stop}
                    if stop is not None
                    else {"type": "length", "length": len(sample["ids"])}
                )
                meta = {
                    "id": f"req-{self.requests}-{index}-{j}",
                    "finish_reason": reason,
                    "prompt_tokens": len(prompt),
                    "weight_version": self.weight_version,
                    "completion_tokens": len(sample["ids"]),
                    "cached_tokens": 0,
                    "e2e_latency": 0.0,
                }
                if not self.weight_versions:  # a release before August 2025
                    del meta["weight_version"]
                if body.get("return_logprob"):
                    meta.update(self._input_logprobs(prompt, body, lora))
                out.append(
                    {
                        "text": self._text(sample["ids"]),
                        "output_ids": sample["ids"],
                        "meta_info": meta,
                    }
                )
        return 200, (out[0] if single and len(out) == 1 else out), None

    def sglang_aborted(self, body: dict[str, Any]) -> dict[str, Any]:
        """A request aborted before it ran (``/abort_request``, a weight update or pause that
        aborts): ``TokenizerManager._handle_abort_req``'s answer, HTTP 200."""
        reason = {"type": "abort", "message": "Abort before prefill"}
        meta = {"id": f"req-{self.requests}", "finish_reason": reason}
        return {"text": "", "meta_info": {**meta, "prompt_tokens": 0, "completion_tokens": 0}}

    def _input_logprobs(self, prompt: list[int], body: dict[str, Any], lora: Any) -> dict:
        """``return_logprob`` with ``logprob_start_len`` 0: ``input_token_logprobs`` (``[logprob,
        id, text]`` per prompt token, the first logprob null) and ``input_top_logprobs`` (the
        top ``top_logprobs_num`` by rank per position, null first); texts null without
        ``return_text_in_logprobs``."""
        k = int(body.get("top_logprobs_num") or 0)
        with self._model_lock:
            table = prompt_table(self._adapter(lora), prompt, k)
        top: list[Any] = [None]
        for p in table:  # the actual token is among the top-k only when it ranks in
            ranked = sorted(p[1:] if p[0][2] > k else [*p[1:], p[0]], key=lambda e: e[2])
            top.append([[lp, t, None] for t, lp, _ in ranked[:k]])
        actual = [[None, prompt[0], None]] + [[p[0][1], p[0][0], None] for p in table]
        return {
            "input_token_logprobs": actual,
            "input_top_logprobs": top,
            "output_token_logprobs": [],
            "output_top_logprobs": [],
        }

    def sglang_update_weights(self, body: dict[str, Any]) -> tuple[int, Any, bytes | None]:
        if "model_path" not in body:  # FastAPI's validation of UpdateWeightFromDiskReqInput
            missing = {"type": "missing", "loc": ["body", "model_path"], "msg": "Field required"}
            return 422, {"detail": [{**missing, "input": body}]}, None
        path = body.get("model_path")
        try:
            with self._model_lock:
                self.model.reload(str(path))
        except Exception as e:  # noqa: BLE001 - SGLang answers success false
            message = f"Failed to get weights iterator: {e}."
            return 400, {"success": False, "message": message, "num_paused_requests": 0}, None
        message = "Succeeded to update model weights."
        version = body.get("weight_version")
        if version is not None and self.weight_versions:  # an older release ignores the field
            self.weight_version = str(version)
            message += f" Weight version updated to {version}."
        return 200, {"success": True, "message": message, "num_paused_requests": 0}, None

    def sglang_load_lora(self, body: dict[str, Any]) -> tuple[int, Any, bytes | None]:
        name, path = body.get("lora_name"), body.get("lora_path")

        def failed(message: str) -> tuple[int, Any, bytes | None]:
            return 400, {"success": False, "error_message": message, "loaded_adapters": None}, None

        if not self.enable_lora:
            return failed("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name in self.lora_paths:  # LoRARegistry._register_adapter's ValueError
            return failed(
                f"LoRA with name {name} already exists. Loaded LoRAs: "
                f"dict_keys({list(self.lora_paths)})"
            )
        try:
            adapter = self.model.load_adapter(str(path), max_rank=self.max_lora_rank)
        except ValueError:
            return failed(
                f"LoRA adapter {name} with rank above {self.max_lora_rank} is incompatible with "
                "the current LoRA memory pool configuration. Please ensure that the LoRA "
                "adapter's rank is within the configured `--max_lora_rank` and that the target "
                "modules are included in `--enable_lora_modules`."
            )
        except Exception as e:  # noqa: BLE001 - SGLang answers the loader's error
            return failed(str(e))
        with self._model_lock:
            self.model.adapters[name] = adapter
            self.lora_paths[name] = str(path)
        return (
            200,
            {"success": True, "error_message": None, "loaded_adapters": self.lora_paths},
            None,
        )

    def sglang_unload_lora(self, body: dict[str, Any]) -> tuple[int, Any, bytes | None]:
        name = body.get("lora_name")
        if not self.enable_lora:
            message = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
            return 400, {"success": False, "error_message": message, "loaded_adapters": None}, None
        if name not in self.lora_paths:
            message = (
                f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.lora_paths)}"
            )
            return 400, {"success": False, "error_message": message, "loaded_adapters": None}, None
        with self._model_lock:
            del self.lora_paths[name]
            self.model.adapters.pop(name, None)
        return (
            200,
            {"success": True, "error_message": None, "loaded_adapters": self.lora_paths},
            None,
        )
