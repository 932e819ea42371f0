"""What the served sampler checks of its server's answers
(:meth:`kd.rollouts.served.ServedSampler.sample`): each completion is one kd can train on,
sampled with the weights kd pushed last (:class:`SampleCheck`, :func:`weights_lost`), a rollout
the server aborted is asked again (:func:`retry_aborted`), a LoRA load the server refuses is
said with its own words (:func:`load_lora`, :func:`push_refused`), and, at the first rollout of a
process, the server samples the student (:func:`model_gap`).

The server's top-1 log-prob at each position of the rank's first prompt (``prompt_logprobs`` /
SGLang's input log-probs, read by the served teacher's reader, :mod:`kd.teachers.protocols`) is
compared with the student's own. The same weights in another engine and dtype differ by
hundredths of a nat on average; another model (a LoRA adapter on another base, a server serving
another model under the name) by much more. This is what a name check cannot see: a LoRA
student's base stays the server's, so a wrong base would be trained on silently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kd.config.on_policy_settings import OnPolicySettings
from kd.rollouts.base import RolloutStopped
from kd.rollouts.served_client import ServerClient
from kd.rollouts.served_protocols import Aborted, BadAnswer, GenerationProtocol, Sample
from kd.teachers.protocols import PROTOCOLS
from kd.teachers.protocols import BadAnswer as ScoreBadAnswer
from kd.teachers.transport import BACKOFF_MAX

__all__ = [
    "SAID_NATS",
    "SAME_MODEL_NATS",
    "SampleCheck",
    "load_lora",
    "model_gap",
    "push_refused",
    "retry_aborted",
    "weights_lost",
]

log = logging.getLogger("kd")

_KEY = "on_policy"
# The mean absolute gap (nats) above which the run stops (on_policy.server_check_model), and
# above which it is said. kd's tiny test models, two random inits, differ by 0.65; the same weights
# in bf16 engines by a few hundredths (the per-token log-prob gaps RL frameworks track between
# vLLM and the trainer). Not yet measured between a real server and kd.
SAME_MODEL_NATS = 0.3
SAID_NATS = 0.1


def weights_lost(where: str, version: int, said: str) -> RolloutStopped:
    """The stop for a server that no longer holds the weights kd pushed (a restarted server
    holds those it started with, and none of kd's adapters): a resumed run pushes them again."""
    return RolloutStopped(
        f"{_KEY}.server_url: {where} no longer samples weight version {version}, which kd pushed "
        f"({said}): the server restarted, or another client changed its weights; with the server "
        "back, resume_from_checkpoint=true pushes the version again"
    )


class SampleCheck:
    """A completion kd can train on: at most ``max_new_tokens`` ids of the tokenizer, a stop id
    only at its end; with a version (a full student's), sampled with it where the server says
    (SGLang's ``weight_version``; an SGLang without it is said once: :meth:`unversioned`)."""

    def __init__(self, settings: OnPolicySettings, vocab_limit: int, stop_ids: Sequence[int]):
        self.settings = settings
        self.vocab_limit = vocab_limit
        self.stop_ids = stop_ids
        self._said = threading.Event()

    def __call__(self, sample: Sample, *, where: str, version: int | None) -> None:
        """
        Raises:
            BadAnswer: a completion kd cannot train on.
            RolloutStopped: the server sampled with other weights (:func:`weights_lost`).
        """
        n = self.settings.max_new_tokens
        if len(sample.ids) > n:
            raise BadAnswer(f"{len(sample.ids)} tokens, more than max_tokens {n}")
        for j, t in enumerate(sample.ids):
            if not 0 <= t < self.vocab_limit:
                raise BadAnswer(
                    f"token {j} is id {t}, outside the ids the tokenizer has "
                    f"(0..{self.vocab_limit - 1})"
                )
            if t in self.stop_ids and j != len(sample.ids) - 1:
                raise BadAnswer(f"stop id {t} at token {j} did not end the completion")
        if version is None:
            return
        if sample.weight_version is None and self.settings.server_api == "sglang":
            self.unversioned(where)
        elif sample.weight_version not in (None, str(version)):
            said = f"its answer says weight version {sample.weight_version!r}"
            raise weights_lost(where, version, said)

    def unversioned(self, where: str) -> None:
        """An SGLang answer without ``meta_info.weight_version`` (a release before August 2025,
        sgl-project/sglang PR #8795): said once. kd cannot see then that a server restarted
        between pushes samples its startup weights (as for a vLLM full student), until its
        next push; everything else holds."""
        if self._said.is_set():
            return
        self._said.set()
        log.warning(
            "on_policy: the SGLang server at %s answers without meta_info.weight_version "
            "(SGLang before August 2025): kd cannot check that its rollouts come from the "
            "weights it pushed, so a server restarted between pushes samples its startup "
            "weights unnoticed until the next push (on_policy.sync_every_n_steps); upgrade "
            "SGLang to have every rollout checked",
            where,
        )


def retry_aborted(ask: Callable[[], Sample], client: ServerClient, where: str) -> Sample:
    """``ask()``, asked again while the server aborts it (:class:`Aborted`: another client's
    pause or abort, a weight update that aborts requests), at most ``on_policy.server_retries``
    times with the backoff between, within the request's deadline; then a stop saying so."""
    s = client.settings
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return ask()
        except Aborted as e:
            said = client.shown(str(e))
        wait = min(BACKOFF_MAX, s.server_backoff * 2.0**attempt)
        spent = time.monotonic() - start
        if attempt >= s.server_retries or spent + wait >= client.deadline_s:
            break
        attempt += 1
        time.sleep(wait)
    raise RolloutStopped(
        f"{_KEY}.server_url: {where} aborted the rollout {attempt + 1} time(s) over "
        f"{time.monotonic() - start:.0f} s ({said}): something aborts the server's requests "
        "(another client's /pause or /abort_request, a weight update that aborts them, or the "
        f"engine itself: see the server's log); stop it (or raise {_KEY}.server_retries) and "
        "resume"
    )


def load_lora(
    client: ServerClient, protocol: GenerationProtocol, path: str, body: dict[str, Any]
) -> tuple[int, str, Any]:
    """A LoRA load: an HTTP 500 that is the server's own refusal of the adapter (vLLM's
    "Call to add_lora method failed", :meth:`GenerationProtocol.refused_load`) is answered at
    once, since asked again it refuses again; any other 5xx is retried as every request is."""
    answer = client.call("POST", path, body, push=True, retry_500=False)
    if answer[0] == 500 and not protocol.refused_load(answer[2]):
        answer = client.call("POST", path, body, push=True)
    return answer


# What the servers say of a folder they cannot read (vLLM's LoRA loader, its weight loader,
# SGLang's weight iterator and LoRA config reader).
_UNREADABLE = (
    "No adapter found",
    "Cannot find any model weights",
    "Failed to get weights iterator",
    "No such file",
    "does not exist",
    "not found",
)


def _said(data: Any, text: str) -> str:
    """The server's message in an error answer (vLLM's ``error.message``, SGLang's
    ``error_message`` / ``message``, FastAPI's ``detail``); the text otherwise."""
    if isinstance(data, dict):
        error = data.get("error")
        for said in (
            error.get("message") if isinstance(error, dict) else error,
            data.get("error_message"),
            data.get("message"),
            data.get("detail"),
        ):
            if isinstance(said, str) and said:
                return said
    return text


def push_refused(
    client: ServerClient,
    what: str,
    answer: tuple[int, str, Any],
    folder: Path,
    *,
    lora_rank: int | None,
    lora_disabled: bool,
) -> RolloutStopped:
    """The stop for a weight push the server refused: its message and the fix it points at
    (``lora_disabled``: the protocol says runtime LoRA loading is off)."""
    status, text, data = answer
    said = _said(data, text)
    if "LoRA is not enabled" in said:
        fix = "start the server with --enable-lora (and --max-lora-rank >= the student's rank)"
    elif "rank" in said and ("max_lora_rank" in said or "max-lora-rank" in said):
        fix = (
            f"start the server with --max-lora-rank {lora_rank} or more (model.lora_rank is "
            f"{lora_rank}), or lower model.lora_rank"
        )
    elif lora_disabled and lora_rank is not None:
        fix = "start vllm serve with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment"
    elif status == 404 and '"detail"' in text:
        fix = "start vllm serve with VLLM_SERVER_DEV_MODE=1 in its environment"
    elif "not supported in the v2 runner" in said:
        fix = "run vLLM's default model runner (reload_weights), or train a LoRA student"
    elif any(w in said for w in _UNREADABLE):
        fix = (
            f"the server must read {folder} at that path: point {_KEY}.server_sync_dir at a "
            "folder it sees (a shared disk on another machine), then resume"
        )
    else:
        fix = "see the server's log, fix it and resume"
    return RolloutStopped(
        f"{_KEY}.server_url: {client.url} refused {what} (weight version {folder.name}) with "
        f"HTTP {status} ({client.shown(said[:200])}); {fix}"
    )


def _served(
    client: ServerClient,
    protocol: GenerationProtocol,
    settings: OnPolicySettings,
    *,
    ids: Sequence[int],
    adapter: str | None,
    vocab: int,
) -> torch.Tensor:
    """The server's top-1 log-prob at positions 1 .. n - 1 of ``ids``."""
    body = protocol.score_body(model=settings.server_model, adapter=adapter, prompt=ids)
    status, text, data = client.call("POST", protocol.generate_path, body)
    where = f"{client.url}{protocol.generate_path}"
    if status != 200:
        raise RolloutStopped(
            f"{_KEY}.server_url: {where} refused the prompt log-probs of the model check (HTTP "
            f"{status}: {client.shown(text[:160])}); see the server's log"
        )
    try:
        rows = PROTOCOLS[settings.server_api].parse(data, [list(ids)], 1, vocab)
    except ScoreBadAnswer as e:
        raise RolloutStopped(
            f"{_KEY}.server_url: {where} gave malformed prompt log-probs for the model check: "
            f"{client.shown(str(e))}; check {_KEY}.server_api"
        ) from None
    return torch.as_tensor(rows[0].logprobs[:, 0], dtype=torch.float32)


def model_gap(
    client: ServerClient,
    protocol: GenerationProtocol,
    settings: OnPolicySettings,
    *,
    ids: Sequence[int],
    local: torch.Tensor,
    adapter: str | None,
    vocab: int,
    lora: bool,
) -> RolloutStopped | None:
    """The stop to raise when the server's top-1 log-probs over ``ids`` differ from ``local``
    (the student's) by more than :data:`SAME_MODEL_NATS` on average; None otherwise (the gap
    said in the log)."""
    try:
        remote = _served(client, protocol, settings, ids=ids, adapter=adapter, vocab=vocab)
    except RolloutStopped as e:
        return e
    gap = float((remote - local).abs().mean())
    said = (
        f"the server's top-1 log-probs over the first prompt ({len(ids) - 1} positions) differ "
        f"from the student's by {gap:.3f} nats on average"
    )
    if gap > SAME_MODEL_NATS and settings.server_check_model:
        what = "base model (the adapter's)" if lora else "model"
        return RolloutStopped(
            f"{_KEY}.server_model: {client.url} does not serve the student: {said} (the same "
            f"weights differ by hundredths; at most {SAME_MODEL_NATS:g}); serve the student's "
            f"{what} (model.path / checkpoint_dir) under {settings.server_model}, or set "
            f"{_KEY}.server_check_model=false if it does"
        )
    if gap > SAID_NATS:
        log.warning("on_policy: %s: check that the server serves the student's model", said)
    else:
        log.info("on_policy: %s", said)
    return None
