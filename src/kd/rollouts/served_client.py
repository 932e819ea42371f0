"""HTTP to a sampling server (:mod:`kd.rollouts.served`): every request ends by its deadline
(:mod:`kd.teachers.transport`: each attempt within ``on_policy.server_timeout``, the retries and
backoff waits inside ``(retries + 1) x timeout`` + the waits), retried on timeouts, connection
errors, 429 and 5xx; a server that stays down raises :class:`ServerUnavailable`, one line naming
the key and the fix. No URL password or token is printed (:func:`kd.errors.redact`).
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

__all__ = ["PROBE_TIMEOUT_S", "ServerClient", "ServerUnavailable"]

_RETRY_STATUS = (429, 500, 502, 503, 504)
_KEY = "on_policy"
# The probe before training waits at most this long per attempt, as the served teacher's.
PROBE_TIMEOUT_S = 30.0


class ServerUnavailable(RolloutStopped):
    """The sampling server stayed down (every retry failed, or the deadline passed)."""


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
        self._secrets: tuple[str, ...] = ()
        env = settings.server_token_env
        if env is not None:
            token = os.environ.get(env, "")
            if not token:
                raise KDUserError(
                    f"{_KEY}.server_token_env: the environment variable {env} is not set or "
                    "empty; export it with the server's API token, or set "
                    f"{_KEY}.server_token_env to null for a server without one"
                )
            self._headers["Authorization"] = f"Bearer {token}"
            self._secrets = (token,)
        self._local = threading.local()

    def shown(self, text: str) -> str:
        return one_line(redact(text, self._secrets))

    @property
    def deadline_s(self) -> float:
        s = self.settings
        return request_budget(
            timeout=self.timeout, retries=s.server_retries, backoff=s.server_backoff
        )

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            s = self.settings
            session = deadline_session(
                retries=s.server_retries,
                backoff=s.server_backoff,
                statuses=_RETRY_STATUS,
                methods=("GET", "POST"),
            )
            self._local.session = session
        return session

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, str, Any]:
        """``(status, text, JSON or None)`` of one request, retried by its deadline.

        Raises:
            ServerUnavailable: the server stayed down, too slow, or kept answering 429 / 5xx.
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
                response = self._session().request(
                    method,
                    f"{s.server_url}{path}",
                    json=body,
                    headers=self._headers,
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
        if response.status_code in _RETRY_STATUS:
            raise ServerUnavailable(
                f"{_KEY}.server_url: {shown} answered HTTP {response.status_code} after "
                f"{s.server_retries} retries ({self.shown(response.text[:160])}); fix the "
                "server and resume"
            )
        try:
            data = response.json()
        except ValueError:
            data = None
        return response.status_code, response.text, data
