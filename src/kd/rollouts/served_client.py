"""HTTP to a sampling server (:mod:`kd.rollouts.served`): every request ends by its deadline
(:mod:`kd.teachers.transport`: each attempt within ``on_policy.server_timeout``, the retries and
backoff waits inside ``(retries + 1) x timeout`` + the waits), retried on timeouts, connection
errors, 429 and 5xx; a server that stays down raises :class:`ServerUnavailable`, one line naming
the key and the fix. No URL password or token is printed (:func:`kd.errors.redact`).

Tokens, as the servers check them: vLLM's ``--api-key`` guards the ``/v1`` paths only
(``AuthenticationMiddleware`` in ``vllm/entrypoints/openai/server_utils.py``: ``/collective_rpc``
is open); SGLang's guards every path but ``/health*`` and ``/metrics*``, and its
``--admin-api-key``, once set, is the only key its ``ADMIN_OPTIONAL`` routes take
(``/update_weights_from_disk``, ``/load_lora_adapter``, ``/unload_lora_adapter``:
``decide_request_auth`` in ``python/sglang/srt/utils/auth.py``). Both answer a refused token with
HTTP 401 ``{"error": "Unauthorized"}``, which :class:`Unauthorized` turns into one line naming
``on_policy.server_token_env`` or ``on_policy.server_admin_token_env``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import requests

from kd.config.on_policy_settings import OnPolicySettings
from kd.errors import KDUserError, brief, one_line, redact
from kd.rollouts.base import RolloutStopped
from kd.teachers.transport import PastDeadline, deadline, deadline_session, request_budget

__all__ = ["PROBE_TIMEOUT_S", "ServerClient", "ServerUnavailable", "Unauthorized"]

_RETRY_STATUS = (429, 500, 502, 503, 504)
_KEY = "on_policy"
# The probe before training waits at most this long per attempt, as the served teacher's.
PROBE_TIMEOUT_S = 30.0


class ServerUnavailable(RolloutStopped):
    """The sampling server stayed down (every retry failed, or the deadline passed)."""


class Unauthorized(RolloutStopped):
    """The server refused kd's token (HTTP 401 / 403): the line names the key to fix."""


def _token(env: str | None, key: str) -> str | None:
    """The token in the variable ``env`` names (None when ``env`` is None)."""
    if env is None:
        return None
    token = os.environ.get(env, "")
    if not token:
        raise KDUserError(
            f"{_KEY}.{key}: the environment variable {env} is not set or empty; export it with "
            f"the server's token, or set {_KEY}.{key} to null for a server without one"
        )
    return token


class ServerClient:
    """Requests to the sampling server (``on_policy.server_url``), thread-safe (a session per
    thread).

    Args:
        settings: ``on_policy:``.
        timeout: seconds per attempt (None: ``on_policy.server_timeout``; the probe's shorter).

    Raises:
        KDUserError: ``on_policy.server_token_env`` names an unset variable.
    """

    def __init__(self, settings: OnPolicySettings, *, timeout: float | None = None):
        self.settings = settings
        self.timeout = timeout if timeout is not None else settings.server_timeout
        self.url = redact(settings.server_url or "")
        self._headers = {"Content-Type": "application/json"}
        token = _token(settings.server_token_env, "server_token_env")
        admin = _token(settings.server_admin_token_env, "server_admin_token_env")
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        # kd's weight pushes: SGLang's admin key when one is given, else the API token.
        self._admin_headers = dict(self._headers)
        if admin is not None:
            self._admin_headers["Authorization"] = f"Bearer {admin}"
        self._secrets: tuple[str, ...] = tuple(t for t in (token, admin) if t is not None)
        self._local = threading.local()

    def shown(self, text: str) -> str:
        return one_line(redact(text, self._secrets))

    @property
    def deadline_s(self) -> float:
        s = self.settings
        return request_budget(
            timeout=self.timeout, retries=s.server_retries, backoff=s.server_backoff
        )

    def _session(self, retry_500: bool) -> requests.Session:
        sessions = getattr(self._local, "sessions", None)
        if sessions is None:
            sessions = self._local.sessions = {}
        if retry_500 not in sessions:
            s = self.settings
            sessions[retry_500] = deadline_session(
                retries=s.server_retries,
                backoff=s.server_backoff,
                statuses=tuple(x for x in _RETRY_STATUS if retry_500 or x != 500),
                methods=("GET", "POST"),
            )
        return sessions[retry_500]

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        push: bool = False,
        retry_500: bool = True,
    ) -> tuple[int, str, Any]:
        """``(status, text, JSON or None)`` of one request, retried by its deadline; ``push``:
        a weight push (SGLang's admin key, when ``on_policy.server_admin_token_env`` is set);
        ``retry_500`` False: an HTTP 500 is answered at once, not retried (a route whose 500 may
        be the server's own refusal, which the caller reads).

        Raises:
            ServerUnavailable: the server stayed down, too slow, or kept answering 429 / 5xx.
            Unauthorized: the server refused the token (HTTP 401 / 403).
        """
        s = self.settings
        shown = f"{self.url}{path}"
        limits = (
            f"{_KEY}.server_timeout {self.timeout:g} s per attempt, {_KEY}.server_retries "
            f"{s.server_retries}: at most {self.deadline_s:.0f} s a request"
        )
        start = time.monotonic()
        try:
            with deadline(attempt_s=self.timeout, total_s=self.deadline_s):
                response = self._session(retry_500).request(
                    method,
                    f"{s.server_url}{path}",
                    json=body,
                    headers=self._admin_headers if push else self._headers,
                    timeout=(self.timeout, self.timeout),
                )
        except PastDeadline as e:
            waited = (
                ""
                if e.retry_after is None
                else f" (it asked for Retry-After {e.retry_after:.0f} s)"
            )
            raise ServerUnavailable(
                f"{_KEY}.server_url: {shown} did not answer within "
                f"{time.monotonic() - start:.0f} s{waited} ({limits}); fix the server (or raise "
                f"{_KEY}.server_timeout) and resume"
            ) from None
        except requests.RequestException as e:
            raise ServerUnavailable(
                f"{_KEY}.server_url: {shown} did not answer after {s.server_retries} retries "
                f"over {time.monotonic() - start:.0f} s ({self.shown(brief(e, 160))}; {limits}); "
                "start the server (or raise on_policy.server_retries) and resume"
            ) from None
        if response.status_code in _RETRY_STATUS and (retry_500 or response.status_code != 500):
            raise ServerUnavailable(
                f"{_KEY}.server_url: {shown} answered HTTP {response.status_code} after "
                f"{s.server_retries} retries ({self.shown(response.text[:160])}); fix the "
                "server and resume"
            )
        if response.status_code in (401, 403):
            raise self._unauthorized(response.status_code, shown, push)
        try:
            data = response.json()
        except ValueError:
            data = None
        return response.status_code, response.text, data

    def _unauthorized(self, status: int, shown: str, push: bool) -> Unauthorized:
        """The line for a refused token: which key sent what, and what the server wants."""
        s = self.settings
        said = (
            f"{shown} answered HTTP {status} ({'Unauthorized' if status == 401 else 'Forbidden'})"
        )
        admin_route = push and s.server_api == "sglang"
        if admin_route and s.server_admin_token_env is not None:
            return Unauthorized(
                f"{_KEY}.server_admin_token_env: {said} to the token in "
                f"{s.server_admin_token_env}; export the SGLang server's --admin-api-key there"
            )
        if admin_route and s.server_token_env is not None:
            return Unauthorized(
                f"{_KEY}.server_admin_token_env: {said} to the token in {s.server_token_env}: "
                "an SGLang server started with --admin-api-key takes only that key for its "
                "weight-update and LoRA routes; set on_policy.server_admin_token_env to the "
                "variable holding it (or fix the token in on_policy.server_token_env)"
            )
        if s.server_token_env is not None:
            return Unauthorized(
                f"{_KEY}.server_token_env: {said} to the token in {s.server_token_env}; export "
                "the server's --api-key there"
            )
        also = (
            " (and on_policy.server_admin_token_env to its --admin-api-key's)"
            if admin_route
            else ""
        )
        return Unauthorized(
            f"{_KEY}.server_token_env: {said} and kd sent no token; set "
            f"{_KEY}.server_token_env to the variable holding the server's --api-key{also}"
        )
