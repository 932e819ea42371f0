"""What ``kd validate`` (and ``kd run`` before it loads a weight) asks of a sampling server
(:class:`kd.rollouts.served.ServedSampler.check`): it answers ``/v1/models`` and serves
``on_policy.server_model`` with room for ``tokenizer.max_seq_len`` tokens, takes this student's
kind of weight push (runtime LoRA loading, or the full reload route) with the token kd pushes
with, and, with ``on_policy.server_sleep``, has vLLM's sleep routes and runs with
``--enable-sleep-mode``. Each problem is one :class:`~kd.errors.KDUserError` line naming the key
and the fix; nothing is loaded or written.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kd.config.on_policy_settings import OnPolicySettings
from kd.errors import KDUserError
from kd.rollouts.base import RolloutStopped
from kd.rollouts.plan import torchrun_problem
from kd.rollouts.served_client import PROBE_TIMEOUT_S, ServerClient
from kd.rollouts.served_protocols import GEN_PROTOCOLS, VLLMGeneration

__all__ = ["check_server"]

log = logging.getLogger("kd")

_KEY = "on_policy"


def check_server(
    settings: OnPolicySettings,
    *,
    lora_rank: int | None,
    max_seq_len: int | None,
    distributed: bool,
    sync_dir: Path,
    probe_adapter: str,
) -> None:
    """The server answers, serves ``server_model``, takes this student's kind of weight push
    (a LoRA student of rank ``lora_rank``: LoRA loading at runtime and, where the server says
    its ``--max-lora-rank``, room for the rank; None, a full student: a full reload) and holds ``max_seq_len`` tokens.
    ``distributed``: under torchrun; ``probe_adapter``: a LoRA name the probe unloads (never
    loaded); ``sync_dir``: where pushes go (said in the log line).

    Raises:
        KDUserError: the first problem, one line naming the key and the fix.
    """
    s = settings
    refused = torchrun_problem(s, copies=False) if distributed else None
    if refused is not None:  # the line kd plan --world-size N refuses it with too
        raise KDUserError(refused)
    probe = ServerClient(s, timeout=min(s.server_timeout, PROBE_TIMEOUT_S))
    try:
        status, text, data = probe.call("GET", "/v1/models")
    except RolloutStopped as e:  # down, or a refused token
        raise KDUserError(str(e)) from None
    cards = data.get("data") if isinstance(data, dict) else None
    if status != 200 or not isinstance(cards, list):
        raise KDUserError(
            f"{_KEY}.server_url: {probe.url}/v1/models did not list the served models (HTTP "
            f"{status}: {probe.shown(text[:120])}); point {_KEY}.server_url at the "
            f"{s.server_api} server's base URL (without /v1), or set {_KEY}.server_api"
        )
    names = [c.get("id") for c in cards if isinstance(c, dict)]
    card = next((c for c in cards if isinstance(c, dict) and c.get("id") == s.server_model), None)
    if card is None:
        raise KDUserError(
            f"{_KEY}.server_model: the server at {probe.url} serves "
            f"{probe.shown(', '.join(str(n) for n in names[:3]))}, not {s.server_model}; set "
            f"{_KEY}.server_model to the name it serves (vllm serve --served-model-name), or "
            "start it with the student's folder"
        )
    limit = card.get("max_model_len")
    need = max_seq_len
    if isinstance(limit, int) and need is not None and limit < need:
        raise KDUserError(
            f"{_KEY}.server_url: the server holds {limit} tokens a sequence "
            f"(--max-model-len), fewer than tokenizer.max_seq_len {need} (prompt + "
            f"on_policy.max_new_tokens); start it with --max-model-len {need} or more "
            "(SGLang: --context-length), or lower tokenizer.max_seq_len"
        )
    if s.server_sleep and distributed:
        raise KDUserError(
            "on_policy.server_sleep shares one GPU between the server and one training "
            "process; under torchrun set on_policy.server_sleep=false"
        )
    try:
        if lora_rank is not None:  # a LoRA student
            _probe_lora(s, probe, probe_adapter)
            _probe_lora_rank(s, probe, lora_rank)
        else:
            _probe_reload(s, probe)
        if s.server_sleep:
            _probe_sleep(probe)
    except RolloutStopped as e:  # a refused token, a server that went down
        raise KDUserError(str(e)) from None
    log.info(
        "on_policy: the %s server at %s samples the student (%s), its weights pushed every "
        "%d optimizer step(s) into %s",
        s.server_api,
        probe.url,
        s.server_model,
        s.sync_every_n_steps,
        sync_dir,
    )


def _probe_lora(settings: OnPolicySettings, probe: ServerClient, name: str) -> None:
    """Runtime LoRA loading is on: unloading ``name`` (never loaded) is answered, not 404."""
    status, text, _ = probe.call(
        "POST", GEN_PROTOCOLS[settings.server_api].unload_lora_path, {"lora_name": name}, push=True
    )
    if GEN_PROTOCOLS[settings.server_api].lora_disabled(status, text):
        fix = (
            "start vllm serve with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment "
            "and --enable-lora --max-lora-rank R (R >= the student's lora rank)"
            if settings.server_api == "vllm"
            else "start SGLang with --enable-lora --max-lora-rank R --lora-target-modules all"
        )
        raise KDUserError(
            f"{_KEY}.server_url: the server at {probe.url} does not load LoRA adapters at "
            f"runtime (HTTP {status}: {probe.shown(text[:120])}), and a LoRA student's "
            f"adapter is pushed to it every {_KEY}.sync_every_n_steps; {fix}"
        )


def _server_lora(settings: OnPolicySettings, probe: ServerClient) -> tuple[bool, int | None]:
    """Whether the server says it loads LoRA adapters, and its ``--max-lora-rank`` (None: not
    said): SGLang's ``/server_info`` (its server args; older releases: ``/get_server_info``),
    vLLM's ``/server_info?config_format=json`` (dev mode only; ``vllm_config.lora_config`` is
    null without ``--enable-lora``). A server that answers neither says nothing: (True, None)."""
    if settings.server_api == "sglang":
        for path in ("/server_info", "/get_server_info"):
            status, _, data = probe.call("GET", path)
            if status == 200 and isinstance(data, dict):
                rank = data.get("max_lora_rank")
                return data.get("enable_lora") is not False, rank if isinstance(rank, int) else None
        return True, None
    status, _, data = probe.call("GET", VLLMGeneration.server_info_path)
    config = data.get("vllm_config") if status == 200 and isinstance(data, dict) else None
    if not isinstance(config, dict) or "lora_config" not in config:
        return True, None
    lora = config["lora_config"]
    rank = lora.get("max_lora_rank") if isinstance(lora, dict) else None
    return lora is not None, rank if isinstance(rank, int) else None


def _probe_lora_rank(settings: OnPolicySettings, probe: ServerClient, rank: int) -> None:
    """The server holds adapters of the student's rank (a refusal otherwise waits for the
    first push, after every weight is loaded)."""
    enabled, limit = _server_lora(settings, probe)
    if not enabled:
        raise KDUserError(
            f"{_KEY}.server_url: the server at {probe.url} runs without --enable-lora, and a "
            "LoRA student's adapter is pushed to it; start it with --enable-lora "
            f"--max-lora-rank {rank} or more"
        )
    if limit is not None and limit < rank:
        raise KDUserError(
            f"model.lora_rank: the student's rank {rank} is above the server's --max-lora-rank "
            f"{limit} ({probe.url}), which would refuse its adapter; start the server with "
            f"--max-lora-rank {rank} or more, or set model.lora_rank={limit}"
        )


def _probe_reload(settings: OnPolicySettings, probe: ServerClient) -> None:
    """The full-weight reload route exists and takes kd's token: an empty body, which the
    server refuses before it loads anything (vLLM: 400 "Missing 'method'"; SGLang: FastAPI's
    422 for the missing ``model_path``)."""
    path = GEN_PROTOCOLS[settings.server_api].reload_probe_path
    status, text, _ = probe.call("POST", path, {}, push=True)
    if status != 404:
        return
    if settings.server_api == "vllm":
        fix = "start vllm serve with VLLM_SERVER_DEV_MODE=1 in its environment"
    else:
        fix = "point on_policy.server_url at an SGLang server, or set on_policy.server_api"
    name = {"vllm": "vLLM", "sglang": "SGLang"}[settings.server_api]
    raise KDUserError(
        f"{_KEY}.server_url: the {name} server at {probe.url} has no "
        f"{path} (HTTP 404: {probe.shown(text[:80])}), through which a full student's "
        f"weights are reloaded; {fix}, or train a LoRA student (lora adapters hot-load)"
    )


def _probe_sleep(probe: ServerClient) -> None:
    """The sleep routes exist (dev mode) and the server was started with sleep mode (else
    a sleep frees nothing)."""
    status, text, _ = probe.call("GET", VLLMGeneration.is_sleeping_path)
    if status == 404:
        raise KDUserError(
            f"{_KEY}.server_sleep: the vLLM server at {probe.url} has no /is_sleeping (HTTP "
            f"404: {probe.shown(text[:80])}); start vllm serve with VLLM_SERVER_DEV_MODE=1 "
            "in its environment and --enable-sleep-mode, or set on_policy.server_sleep=false"
        )
    status, _, data = probe.call("GET", VLLMGeneration.server_info_path)
    config = data.get("vllm_config") if isinstance(data, dict) else None
    model = config.get("model_config") if isinstance(config, dict) else None
    enabled = model.get("enable_sleep_mode") if isinstance(model, dict) else None
    if enabled is False:
        raise KDUserError(
            f"{_KEY}.server_sleep: the vLLM server at {probe.url} runs without sleep mode "
            "(its sleep would free no memory); start vllm serve with --enable-sleep-mode, or "
            "set on_policy.server_sleep=false"
        )
    if enabled is None:
        log.warning(
            "on_policy.server_sleep: the vLLM server at %s does not say whether it runs "
            "with --enable-sleep-mode (GET /server_info answered HTTP %d); without it a "
            "sleep frees no memory",
            probe.url,
            status,
        )
