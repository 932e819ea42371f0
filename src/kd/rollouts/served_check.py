"""What the served sampler checks of its server's answers
(:meth:`kd.rollouts.served.ServedSampler.sample`): each completion is one kd can train on,
sampled with the weights kd pushed last (:func:`check_sample`, :func:`weights_lost`), and, at the
first rollout of a process, the server samples the student (:func:`model_gap`).

The server's top-1 log-prob at each position of the rank's first prompt (``prompt_logprobs`` /
SGLang's input log-probs, read by the served teacher's reader, :mod:`kd.teachers.protocols`) is
compared with the student's own. The same weights in another engine and dtype differ by
hundredths of a nat on average; another model (a LoRA adapter on another base, a server serving
another model under the name) by much more. This is what a name check cannot see: a LoRA
student's base stays the server's, so a wrong base would be trained on silently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kd.config.on_policy_settings import OnPolicySettings
from kd.rollouts.base import RolloutStopped
from kd.rollouts.served_client import ServerClient
from kd.rollouts.served_protocols import BadAnswer, GenerationProtocol, Sample
from kd.teachers.protocols import PROTOCOLS
from kd.teachers.protocols import BadAnswer as ScoreBadAnswer

__all__ = ["SAID_NATS", "SAME_MODEL_NATS", "check_sample", "model_gap", "weights_lost"]

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


def check_sample(
    sample: Sample,
    settings: OnPolicySettings,
    vocab_limit: int,
    stop_ids: Sequence[int],
    *,
    where: str,
    version: int | None,
) -> None:
    """A completion kd can train on: at most ``max_new_tokens`` ids of the tokenizer, a stop id
    only at its end; with ``version`` (a full student's), sampled with it where the server says
    (SGLang's ``weight_version``).

    Raises:
        BadAnswer: a completion kd cannot train on.
        RolloutStopped: the server sampled with other weights (:func:`weights_lost`).
    """
    if len(sample.ids) > settings.max_new_tokens:
        raise BadAnswer(f"{len(sample.ids)} tokens, more than max_tokens {settings.max_new_tokens}")
    for j, t in enumerate(sample.ids):
        if not 0 <= t < vocab_limit:
            raise BadAnswer(
                f"token {j} is id {t}, outside the ids the tokenizer has (0..{vocab_limit - 1})"
            )
        if t in stop_ids and j != len(sample.ids) - 1:
            raise BadAnswer(f"stop id {t} at token {j} did not end the completion")
    if version is not None and sample.weight_version not in (None, str(version)):
        said = f"its answer says weight version {sample.weight_version!r}"
        raise weights_lost(where, version, said)


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
