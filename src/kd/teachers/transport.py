"""HTTP requests that end by a deadline: ``requests`` + urllib3's ``Retry``, bounded as a whole.

requests' ``timeout`` bounds each socket operation, not a request: a server that sends its answer
one byte at a time, or asks for ``Retry-After: 3600``, holds a plain ``requests`` call (and its
retries) for as long as it likes. :func:`deadline_session` gives a session whose requests, made
inside :func:`deadline`, end in time:

* each attempt (connecting, sending, the status line, the headers and the whole body) ends within
  ``attempt_s``: every read from the socket first checks the attempt's deadline and waits at most
  until it (:class:`_DeadlineReader`), so a trickle cannot stretch it;
* retries (urllib3's ``Retry``: timeouts, connection errors, the listed statuses, and a body
  cut short or too slow, which :class:`_DeadlineAdapter` reads inside them) and the waits
  between them (backoff, or the server's ``Retry-After``) happen inside ``total_s``: a wait that
  would end past it is not waited, :class:`PastDeadline` is raised at once
  (:class:`_DeadlineRetry`).

The deadlines live in a thread-local (:data:`_CURRENT`): urllib3 makes every attempt of a request
in the calling thread, and each thread keeps its own session.
"""

from __future__ import annotations

import http.client
import io
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import InvalidHeader, MaxRetryError, ProtocolError
from urllib3.util.retry import Retry

__all__ = ["BACKOFF_MAX", "PastDeadline", "deadline", "deadline_session", "request_budget"]

BACKOFF_MAX = 60.0  # seconds: urllib3's longest backoff wait, kept


class PastDeadline(Exception):  # noqa: N818 - a state, not an error kind
    """The request cannot finish by its deadline.

    Attributes:
        retry_after: the wait the server asked for (``Retry-After``, seconds), when that is what
            would have gone past the deadline; None when time simply ran out.
        status: the HTTP status that asked for it.
    """

    def __init__(self, retry_after: float | None = None, status: int | None = None):
        super().__init__("past the request's deadline")
        self.retry_after = retry_after
        self.status = status


def request_budget(*, timeout: float, retries: int, backoff: float) -> float:
    """Seconds one request may take in all: ``retries + 1`` attempts of at most ``timeout``
    each, plus urllib3's backoff waits between them (none before the first retry, then
    ``backoff x 2^(n - 1)`` before retry ``n``, each at most :data:`BACKOFF_MAX`)."""
    waits = sum(min(BACKOFF_MAX, backoff * 2.0 ** (n - 1)) for n in range(2, retries + 1))
    return (retries + 1) * timeout + waits


class _Deadlines(threading.local):
    """The deadlines of the request this thread is making (monotonic seconds; None: none)."""

    attempt_s: float = 0.0
    request_end: float | None = None
    attempt_end: float | None = None

    def start_attempt(self) -> None:
        if self.request_end is not None:
            self.attempt_end = min(time.monotonic() + self.attempt_s, self.request_end)

    def left(self) -> float:
        if self.request_end is None:
            return float("inf")
        return self.request_end - time.monotonic()


_CURRENT = _Deadlines()


@contextmanager
def deadline(*, attempt_s: float, total_s: float) -> Iterator[None]:
    """Requests this thread makes inside the block: each attempt ends within ``attempt_s``, all of
    it (retries and waits included) within ``total_s``."""
    _CURRENT.attempt_s = attempt_s
    _CURRENT.request_end = time.monotonic() + total_s
    _CURRENT.attempt_end = None
    try:
        yield
    finally:
        _CURRENT.request_end = _CURRENT.attempt_end = None


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each waiting at most until ``end`` (then :class:`TimeoutError`, which
    urllib3 reads as a read timeout)."""

    def __init__(self, sock: Any, end: float):
        self._sock = sock
        self._raw = sock.makefile("rb", buffering=0)  # holds the socket open while it reads
        self._end = end

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        left = self._end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the attempt's deadline passed while the answer was read")
        per_read = self._sock.gettimeout()
        self._sock.settimeout(left if per_read is None else min(per_read, left))
        return self._raw.readinto(buffer)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    """http.client's response read through :class:`_DeadlineReader` (status line, headers and
    body) when an attempt deadline is set."""

    def __init__(self, sock: Any, *args: Any, **kwargs: Any):
        super().__init__(sock, *args, **kwargs)
        end = _CURRENT.attempt_end
        if end is not None:
            self.fp.close()
            self.fp = io.BufferedReader(_DeadlineReader(sock, end))  # type: ignore[assignment]


class _AttemptMixin:
    """A connection whose every request starts an attempt (urllib3 calls ``request`` once per
    attempt, retries included; the connection opens inside it)."""

    response_class = _DeadlineResponse

    def request(self, *args: Any, **kwargs: Any) -> None:
        _CURRENT.start_attempt()
        end = _CURRENT.attempt_end
        timeout = getattr(self, "timeout", None)
        if end is not None and isinstance(timeout, (int, float)):  # connecting, if it must
            self.timeout = max(min(float(timeout), end - time.monotonic()), 1e-3)
        sock = getattr(self, "sock", None)
        if sock is not None:  # a kept-alive socket: sending waits as connecting would
            sock.settimeout(self.timeout)
        super().request(*args, **kwargs)  # type: ignore[misc]


class _HTTPConnection(_AttemptMixin, HTTPConnection):
    pass


class _HTTPSConnection(_AttemptMixin, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection  # type: ignore[assignment]


_POOLS = {"http": _HTTPPool, "https": _HTTPSPool}


class _DeadlineRetry(Retry):
    """urllib3's ``Retry`` whose waits (backoff, ``Retry-After``) must end before the request's
    deadline, and which retries nothing once it has passed."""

    def increment(self, *args: Any, **kwargs: Any) -> _DeadlineRetry:
        retry = super().increment(*args, **kwargs)
        if _CURRENT.left() <= 0:
            response = kwargs.get("response")
            raise PastDeadline(status=getattr(response, "status", None))
        return retry

    def sleep(self, response: Any = None) -> None:
        asked: float | None = None
        if self.respect_retry_after_header and response is not None:
            try:
                asked = self.get_retry_after(response)
            except InvalidHeader:  # an unreadable Retry-After: the backoff instead
                asked = None
        wait = asked if asked else self.get_backoff_time()
        if wait >= _CURRENT.left():
            raise PastDeadline(asked or None, getattr(response, "status", None))
        if wait > 0:
            time.sleep(wait)


class _DeadlineAdapter(HTTPAdapter):
    """requests' adapter over :class:`_HTTPPool` / :class:`_HTTPSPool` (also through an HTTP
    proxy), which reads the body inside the retries: urllib3 retries an attempt up to its
    headers, and requests reads the body after it, so a body cut short or trickled past the
    attempt's deadline would otherwise end the request on its first try."""

    def send(self, request: Any, stream: bool = False, **kwargs: Any) -> requests.Response:
        retry = self.max_retries
        while True:
            response = super().send(request, stream=stream, **kwargs)
            if stream:
                return response
            try:
                response.content  # noqa: B018 - read now, where a broken body can be retried
                return response
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
                try:  # counted as a read error of the request's retries; PastDeadline when late
                    retry = retry.increment(request.method, request.url, error=ProtocolError(e))
                except MaxRetryError:
                    raise e from None
                retry.sleep()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOLS

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **kwargs)
        if not proxy.lower().startswith("socks"):  # SOCKS keeps its own connections
            manager.pool_classes_by_scheme = _POOLS
        return manager


def deadline_session(
    *, retries: int, backoff: float, statuses: Collection[int], methods: Collection[str]
) -> requests.Session:
    """A session retrying timeouts, connection errors and ``statuses`` (``Retry-After``
    honoured when it fits the deadline) whose requests end by :func:`deadline`'s deadlines."""
    retry = _DeadlineRetry(
        total=retries,
        connect=retries,
        read=retries,
        status=retries,
        backoff_factor=backoff,
        backoff_max=BACKOFF_MAX,
        status_forcelist=frozenset(statuses),
        allowed_methods=frozenset(methods),
        raise_on_status=False,
    )
    session = requests.Session()
    for scheme in ("http://", "https://"):
        session.mount(scheme, _DeadlineAdapter(max_retries=retry))
    return session
