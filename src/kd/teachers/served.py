"""A served teacher: a vLLM or SGLang server answers the teacher's top-k log-probs over HTTP.

``teacher_server:`` in place of ``teacher_model`` / ``teacher_checkpointer``. Requests carry
token ids, never text (:mod:`kd.teachers.protocols`), one row per request, ``concurrency`` in
flight. :meth:`ServedTeacher.look_ahead` asks for the next ``prefetch`` micro-batches while the
student trains on this one, so a step waits for the server (its ``time_teacher_s``) only when the
server is slower than training; rows made during training (on-policy completions) are asked when
the step needs them.

Every request ends by a deadline (:mod:`kd.teachers.transport`): each attempt within
``teacher_server.timeout`` (connecting, sending and the whole answer, however slowly it comes),
the request within ``(retries + 1) x timeout`` plus the backoff waits. Requests that time out,
cannot connect or get a 429 / 5xx are retried inside it with exponential backoff (urllib3's
``Retry``), or after the server's ``Retry-After`` when that fits; a server that stays down or too
slow raises :class:`TeacherUnavailable`, after which the recipe saves a step checkpoint and stops
with exit status 2 (:class:`kd.teachers.TeacherStopped`): resuming repeats the step that could not
finish. A malformed answer is refused with the row, the position and the request, never patched.
No URL password or token is printed (:func:`kd.errors.redact`).

Alignment: kd's :class:`~kd.teachers.TopKSignal` position ``j`` holds the distribution predicting
token ``j + 1`` (the shifted labels); a server's entry ``i`` is the distribution of token ``i``
given the tokens before it, so signal position ``j`` is the server's entry ``j + 1``. Log-probs
are kept as float16, as kd's store holds them, so a served answer and a stored one teach alike.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import queue
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np
import requests
import torch

from kd.config.teacher_kinds.served import TeacherServerSettings
from kd.errors import KDUserError, brief, one_line, redact
from kd.runtime import distributed
from kd.teachers.answer_checks import check_answer
from kd.teachers.base import Teacher, TeacherInput, TeacherStopped
from kd.teachers.protocols import PROTOCOLS, BadAnswer, RowTopK
from kd.teachers.signals import TopKSignal
from kd.teachers.transport import PastDeadline, deadline, deadline_session, request_budget

__all__ = [
    "ServedTeacher",
    "TeacherClient",
    "TeacherStopped",
    "TeacherUnavailable",
    "check_server",
    "served_identity",
]

log = logging.getLogger("kd")

# Retried (with backoff, or the server's Retry-After when it fits the deadline): overloaded, or
# failing for now.
_RETRY_STATUS = (429, 500, 502, 503, 504)
_KEY = "teacher_server"
# The probe before training (kd validate, and kd run before it loads a weight) waits at most this
# long for each attempt, and backs off at most this much between its retries: a server that is
# down (connections refused, or 503s) is reported in seconds, not after a training request's
# backoff waits (doubling from teacher_server.backoff), while a server failing now and then still
# passes as it would in training (the same number of retries).
PROBE_TIMEOUT_S = 30.0
PROBE_BACKOFF_S = 0.1


class TeacherUnavailable(TeacherStopped):
    """The served teacher stayed down (every retry failed)."""


def _retemper(logprobs: np.ndarray, alpha: float) -> np.ndarray:
    """``alpha log p - logsumexp_k(alpha log p)`` per position; unchanged for alpha = 1."""
    if alpha == 1.0:
        return logprobs
    scaled = logprobs.astype(np.float64) * alpha
    top = scaled.max(axis=-1, keepdims=True)
    lse = top + np.log(np.exp(scaled - top).sum(axis=-1, keepdims=True))
    return (scaled - lse).astype(np.float32)


class _DaemonPool:
    """A fixed set of daemon worker threads running submitted calls in order (a process that
    stops while requests to a dead server are being retried does not wait for them, as it
    would for :class:`concurrent.futures.ThreadPoolExecutor`'s workers)."""

    def __init__(self, workers: int):
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [
            threading.Thread(target=self._work, name=f"kd-teacher-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((future, fn))
        return future

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


def _url_secrets(url: str) -> tuple[str, ...]:
    """What a server could quote back of the URL's ``user:password``: the password, and the
    Basic credentials requests sends for it (base64 of ``user:password``)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return ()
    user = urllib.parse.unquote(parts.username or "")
    password = urllib.parse.unquote(parts.password or "")
    try:
        raw = f"{user}:{password}".encode("latin1")  # as requests encodes them
    except UnicodeEncodeError:
        raw = f"{user}:{password}".encode()
    basic = base64.b64encode(raw).decode()
    return (basic, password) if len(password) >= 4 else (basic,)


class TeacherClient:
    """Asks one server for top-k log-probs of token id rows; thread-safe (a session per thread).

    Every request ends by its deadline (:mod:`kd.teachers.transport`): each attempt within
    ``teacher_server.timeout`` (connecting, sending and the whole answer, however slowly it
    comes), the request with its retries and waits within :meth:`deadline_s`; a server's
    ``Retry-After`` is waited only when it fits. Every URL and server text it prints goes through
    :func:`kd.errors.redact` (no password of the URL, no token).

    Args:
        settings: ``teacher_server:``.
        vocab: ids at or above it are refused (the student's vocabulary).
    """

    def __init__(self, settings: TeacherServerSettings, *, vocab: int):
        self.settings = settings
        self.vocab = vocab
        self.protocol = PROTOCOLS[settings.api]
        self._local = threading.local()
        self._headers = {"Content-Type": "application/json"}
        self._secrets: tuple[str, ...] = ()
        if settings.token_env is not None:
            token = os.environ.get(settings.token_env, "")
            if not token:
                raise KDUserError(
                    f"teacher_server.token_env: the environment variable {settings.token_env} is "
                    "not set or empty; export it with the server's API token, or set "
                    "teacher_server.token_env to null for a server without one"
                )
            self._headers["Authorization"] = f"Bearer {token}"
            self._secrets = (token,)
        self._secrets += _url_secrets(settings.url)
        self.url = redact(settings.url)  # the base URL as kd prints it

    @property
    def deadline_s(self) -> float:
        """Seconds one request may take in all, its retries and waits included."""
        s = self.settings
        return request_budget(timeout=s.timeout, retries=s.retries, backoff=s.backoff)

    def shown(self, text: str) -> str:
        """A server's text or an error's, as kd may print it: one line, no credential."""
        return one_line(redact(text, self._secrets))

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            s = self.settings
            session = deadline_session(
                retries=s.retries,
                backoff=s.backoff,
                statuses=_RETRY_STATUS,
                methods=("GET", "POST"),
            )
            self._local.session = session
        return session

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer of one request, retried, by its deadline; :class:`TeacherUnavailable`
        when the server stays down or too slow, :class:`TeacherStopped` when it refuses the
        request, :class:`BadAnswer` when the answer is not JSON."""
        s = self.settings
        url, shown = f"{s.url}{path}", f"{self.url}{path}"
        limits = (
            f"{_KEY}.timeout {s.timeout:g} s per attempt, {_KEY}.retries {s.retries}: at most "
            f"{self.deadline_s:.0f} s a request"
        )
        start = time.monotonic()
        try:
            with deadline(attempt_s=s.timeout, total_s=self.deadline_s):
                response = self._session().request(
                    method, url, json=body, headers=self._headers, timeout=(s.timeout, s.timeout)
                )
        except PastDeadline as e:
            if e.retry_after is not None:
                raise TeacherUnavailable(
                    f"{_KEY}.url: {shown} asked to be retried after {e.retry_after:.0f} s "
                    f"(HTTP {e.status}, Retry-After), later than the request may wait "
                    f"({limits}); run again once the server takes requests (or raise "
                    f"{_KEY}.timeout / {_KEY}.retries)"
                ) from None
            raise TeacherUnavailable(
                f"{_KEY}.url: {shown} did not answer within {time.monotonic() - start:.0f} s "
                f"({limits}); fix the server (or raise {_KEY}.timeout) and run again"
            ) from None
        except requests.RequestException as e:
            raise TeacherUnavailable(
                f"{_KEY}.url: {shown} did not answer after {s.retries} retries over "
                f"{time.monotonic() - start:.0f} s ({self.shown(brief(e, 160))}; {limits}); "
                f"start the server (or raise {_KEY}.timeout / {_KEY}.retries) and run again"
            ) from None
        if response.status_code in _RETRY_STATUS:
            raise TeacherUnavailable(
                f"{_KEY}.url: {shown} answered HTTP {response.status_code} after {s.retries} "
                f"retries ({self.shown(response.text[:160])}); fix the server and run again"
            )
        if response.status_code in (401, 403):  # both servers' token middleware
            env = s.token_env
            said = f"to the token in {env}; export" if env else "and kd sent no token; set"
            where = "there" if env else f"in {_KEY}.token_env (the variable holding it)"
            raise TeacherStopped(
                f"{_KEY}.token_env: {shown} answered HTTP {response.status_code} "
                f"({self.shown(response.text[:80])}) {said} the server's --api-key {where}"
            )
        if response.status_code != 200:
            text = response.text[:300]
            k = int((body or {}).get("prompt_logprobs", (body or {}).get("top_logprobs_num", 0)))
            fix = self.protocol.refusal_fix(response.status_code, text, k)
            raise TeacherStopped(
                f"{_KEY}: {shown} refused the request with HTTP {response.status_code} "
                f"({self.shown(text)}); "
                + (fix or f"check {_KEY}.url, {_KEY}.api and {_KEY}.model against the server")
            )
        try:
            return response.json()
        except ValueError:
            kind = response.headers.get("Content-Type", "no Content-Type")
            raise BadAnswer(
                f"the answer is not JSON ({self.shown(kind)}: {self.shown(response.text[:80])!r})"
            ) from None

    def models(self) -> list[str]:
        """The model names the server serves (its ``GET /v1/models``)."""
        path = self.protocol.models_path
        try:
            return self.protocol.served_models(self._call("GET", path))
        except BadAnswer as e:
            raise TeacherStopped(
                f"{_KEY}.url: {self.url}{path} did not list the served models ({e}); point "
                f"{_KEY}.url at the {self.settings.api} server's base URL (without /v1), or set "
                f"{_KEY}.api to the server it is"
            ) from None

    def topk(self, rows: Sequence[Sequence[int]], k: int) -> list[RowTopK]:
        """The top-k of every position after the first of each row (one request).

        Raises:
            TeacherUnavailable: the server stayed down, or too slow.
            KDUserError: it refused the request, or answered something malformed.
        """
        body = self.protocol.body(self.settings.model, rows, k)
        try:
            answer = self.protocol.parse(
                self._call("POST", self.protocol.path, body), rows, k, self.vocab
            )
            check_answer(answer, vocab=self.vocab)  # distinct ids, finite, mass <= 1
            return answer
        except BadAnswer as e:
            lengths = ", ".join(str(len(r)) for r in rows[:4])
            raise TeacherStopped(
                f"{_KEY}: {self.url}{self.protocol.path} gave a malformed answer: "
                f"{self.shown(str(e))} (request: {len(rows)} row(s) of {lengths} tokens, {k} "
                "log-probs per position); "
                + (e.fix or f"check {_KEY}.api matches the server ({self.settings.api} now)")
            ) from None


def _key(tokens: torch.Tensor) -> str:
    """A micro-batch's identity: its token ids (on-policy rows differ from the dataset's)."""
    data = tokens.detach().cpu().contiguous()
    return hashlib.sha1(str(tuple(data.shape)).encode() + data.numpy().tobytes()).hexdigest()


def _lengths(tokens: torch.Tensor, labels: torch.Tensor | None, ignore_index: int) -> list[int]:
    """Tokens of each row the teacher must see: through the last labelled token (the
    distributions after it teach nothing); the whole row without labels."""
    b, s = tokens.shape
    if labels is None:
        return [s] * b
    out = []
    for row in labels.cpu():
        labelled = torch.nonzero(row != ignore_index).flatten()
        out.append(int(labelled[-1]) + 1 if labelled.numel() else 0)
    return out


class AnswerStore(Protocol):
    """Where a served teacher's answers are kept and read back (write-through;
    :class:`kd.teachers.store_folder.WriteThroughStore`)."""

    def holds(self, rows: Sequence[int]) -> bool:
        """Whether every one of these dataset rows is answered here."""
        ...

    def batch(
        self, rows: Sequence[int], tokens: torch.Tensor, labels: torch.Tensor, *, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept top-k of a batch of held rows: ``[b, s, k]`` ids and log-probs."""
        ...

    def add(
        self,
        rows: Sequence[int],
        labels: torch.Tensor,
        ids: torch.Tensor,
        logprobs: torch.Tensor,
        *,
        lengths: Sequence[int],
    ) -> None:
        """Keep a batch's answers (``[b, s, k]``, aligned with the shifted labels)."""
        ...

    def close(self) -> None:
        """Stop keeping (the answers not written yet are dropped; they are asked again)."""
        ...


class ServedTeacher(Teacher):
    """The teacher of a server: top-k log-probs asked ahead of training.

    Args:
        client: the checked client.
        k: log-probs per position (``teacher_server.top_k``).
        tail: ``teacher_server.tail``.
        temperature: the run's temperature (the server answers at 1; the top-k is re-tempered).
        device: where the student trains.
        concurrency: requests in flight.
        prefetch: micro-batches asked ahead.
        ignore_index: label of unlabelled positions.
        store: write-through (``teacher_server.store``): batches of dataset rows it holds are
            answered from it, and every answer to such a batch is kept in it; None: none.
        lengths: each dataset row's length (tokens), with ``store``.
    """

    def __init__(
        self,
        client: TeacherClient,
        *,
        k: int,
        tail: str,
        temperature: float,
        device: torch.device,
        concurrency: int,
        prefetch: int,
        ignore_index: int = -100,
        store: AnswerStore | None = None,
        lengths: Sequence[int] = (),
    ):
        self.client = client
        self.k = k
        self.tail = tail
        self.alpha = 1.0 / float(temperature)
        self.device = device
        self.prefetch = prefetch
        self.ignore_index = ignore_index
        self.pool = _DaemonPool(concurrency)
        # Asked micro-batches by token key, oldest first; bounded (see _remember).
        self._pending: OrderedDict[str, list[Future[RowTopK]]] = OrderedDict()
        self._lock = threading.Lock()
        self.store = store
        self.lengths = lengths

    def _stored(self, rows: Any) -> bool:
        """Whether the store answers a batch of these dataset rows (None: rows made in training)."""
        return self.store is not None and rows is not None and self.store.holds(rows)

    # ------------------------------------------------------------ asking
    def _submit(self, tokens: torch.Tensor, labels: torch.Tensor | None) -> list[Future[RowTopK]]:
        """One request per row (through its last labelled token), queued on the pool."""
        futures: list[Future[RowTopK]] = []
        for row, n in zip(tokens.cpu(), _lengths(tokens, labels, self.ignore_index), strict=True):
            if n < 2:  # no position with context: nothing to ask
                empty = RowTopK(
                    np.zeros((0, self.k), np.int64), np.zeros((0, self.k), np.float32), []
                )
                done: Future[RowTopK] = Future()
                done.set_result(empty)
                futures.append(done)
                continue
            ids = row[:n].tolist()
            futures.append(self.pool.submit(lambda ids=ids: self.client.topk([ids], self.k)[0]))
        return futures

    def _remember(self, key: str, futures: list[Future[RowTopK]]) -> None:
        with self._lock:
            self._pending[key] = futures
            # Batches asked but never used (an on-policy step trained on completions instead).
            while len(self._pending) > 2 * max(self.prefetch, 1) + 8:
                _, dropped = self._pending.popitem(last=False)
                for f in dropped:
                    f.cancel()

    def look_ahead(
        self, batches: Iterator[dict[str, torch.Tensor]]
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The batches, each asked ``prefetch`` micro-batches before it is trained on."""
        if self.prefetch == 0:
            yield from batches
            return
        window: list[dict[str, torch.Tensor]] = []
        for batch in batches:
            if not self._stored(batch.get("rows")):
                tokens = batch["tokens"]
                self._remember(_key(tokens), self._submit(tokens, batch.get("labels")))
            window.append(batch)
            if len(window) > self.prefetch:
                yield window.pop(0)
        yield from window

    # ------------------------------------------------------------ answering
    def signal(self, batch: TeacherInput) -> TopKSignal:
        """The batch's top-k (from the store when it holds the rows, else the server's).

        Under torchrun the ranks agree after each batch whether every one of them got its
        answer (one all-reduce of a flag; every rank asks its teacher for the same micro-batches):
        when one rank's server failed, every rank stops here with that rank's line, so the
        recipe's save is collective.
        """
        failure: TeacherStopped | None = None
        try:
            signal = self._answer(batch)
        except TeacherStopped as e:
            failure = e
        if not distributed.is_distributed():
            if failure is not None:
                raise failure
            return signal
        if distributed.any_rank(failure is not None, device=self.device):
            lines = distributed.all_gather_text(
                str(failure) if failure else None, device=self.device
            )
            rank, line = next((r, x) for r, x in enumerate(lines) if x is not None)
            raise TeacherStopped(
                line if failure is not None else f"rank {rank}: {line}", collective=True
            ) from failure
        return signal

    def _answer(self, batch: TeacherInput) -> TopKSignal:
        store, rows = self.store, batch.rows
        if store is not None and rows is not None and batch.labels is not None:
            if store.holds(rows):
                ids, logprobs = store.batch(rows, batch.tokens, batch.labels, k=self.k)
                return self._signal(ids, logprobs)
            signal = self._ask(batch)
            lengths = [self.lengths[int(r)] for r in rows]
            store.add(rows, batch.labels, signal.ids, signal.logprobs, lengths=lengths)
            return signal
        return self._ask(batch)

    def _signal(self, ids: torch.Tensor, logprobs: torch.Tensor) -> TopKSignal:
        return TopKSignal(
            ids=ids.to(self.device), logprobs=logprobs.to(self.device), vocab=None, tail=self.tail
        )

    def _ask(self, batch: TeacherInput) -> TopKSignal:
        """The server's answer to ``batch`` (asked ahead, or now)."""
        key = _key(batch.tokens)
        with self._lock:
            futures = self._pending.pop(key, None)
        if futures is None:  # not asked ahead: on-policy completions, or prefetch 0
            futures = self._submit(batch.tokens, batch.labels)
        b, s = batch.tokens.shape
        ids = torch.zeros(b, s, self.k, dtype=torch.int64)  # [b, s, k]
        logprobs = torch.zeros(b, s, self.k, dtype=torch.float16)  # [b, s, k]
        try:
            for i, future in enumerate(futures):
                row = future.result()
                n = row.ids.shape[0]
                # Signal position j is the server's entry j + 1 (row.ids[j]).
                ids[i, :n] = torch.from_numpy(row.ids)
                lps = _retemper(row.logprobs, self.alpha)
                logprobs[i, :n] = torch.from_numpy(lps.astype(np.float16))
        except BaseException:
            self.close()  # the run stops: drop every queued request
            raise
        return self._signal(ids, logprobs)

    def close(self) -> None:
        """Stop asking: queued requests are dropped, those in flight end with the process."""
        with self._lock:
            for futures in self._pending.values():
                for f in futures:
                    f.cancel()
            self._pending.clear()
        self.pool.shutdown()
        if self.store is not None:
            self.store.close()


def probe_client(settings: TeacherServerSettings, *, vocab: int) -> TeacherClient:
    """The client of :func:`check_server`: ``settings`` with attempts of at most
    :data:`PROBE_TIMEOUT_S` seconds and backoff of at most :data:`PROBE_BACKOFF_S` (training
    keeps ``settings``)."""
    import dataclasses

    short = dataclasses.replace(
        settings,
        timeout=min(settings.timeout, PROBE_TIMEOUT_S),
        backoff=min(settings.backoff, PROBE_BACKOFF_S),
    )
    return TeacherClient(short, vocab=vocab)


def check_server(client: TeacherClient, tokenizer: Any, *, k: int) -> None:
    """Before training: the server answers, serves the configured model, accepts ``k`` log-probs
    per position, and its tokenizer decodes a probe's ids as the student's does.

    Raises:
        KDUserError: the first problem, one line naming the key and the fix.
    """
    from kd.models import TOKENIZER_PROBE

    s = client.settings
    served = client.models()
    if served and s.model not in served:
        raise KDUserError(
            f"{_KEY}.model: the server at {client.url} serves "
            f"{client.shown(', '.join(served[:3]))}, not {s.model}; set "
            f"{_KEY}.model={client.shown(served[0])}, or start the server with the teacher you meant"
        )
    ids = [int(i) for i in tokenizer.encode(TOKENIZER_PROBE, add_bos=False, add_eos=False)]
    (answer,) = client.topk([ids], k)  # also: k accepted, ids in the vocabulary, finite values
    for j, text in enumerate(answer.texts, start=1):
        ours = tokenizer.decode([ids[j]])
        if text is not None and text.strip() != ours.strip():
            raise KDUserError(
                f"{_KEY}: the server's tokenizer is not the student's: probe token {ids[j]} is "
                f"{text!r} there and {ours!r} here (tokenizer); serve a teacher that shares the "
                "student's tokenizer"
            )
    log.info(
        "teacher_server: %s (%s at %s) answers top-%d log-probs; %s",
        s.model,
        s.api,
        client.url,
        k,
        "its tokenizer decodes the probe as the student's"
        if any(t is not None for t in answer.texts)
        else "it returned no token texts, so the tokenizers were not compared",
    )


def served_identity(settings: TeacherServerSettings) -> dict[str, Any]:
    """A served teacher's identity in a store's manifest (as
    :func:`kd.teachers.store_manifest.teacher_identity` gives a local one's): its protocol and model name;
    the URL stands where a local teacher's folder does (a moved server is the same teacher)."""
    return {
        "component": f"teacher_server {settings.api} {settings.model}",
        "folder": redact(settings.url),
        "files": [],
        "config_sha256": None,
    }
