"""A test teacher server: vLLM's and SGLang's log-prob protocols over a real (tiny) model.

It answers as the servers do, written from their source (:mod:`kd.teachers.protocols` names the
files and commits read):

* vLLM: ``POST /v1/completions`` with ``prompt_logprobs`` (the first entry null, each other a dict
  keyed by token id as a string holding the top-k *and* the actual prompt token when it ranks
  below k, that token first); ``GET /v1/models`` (the served names, ``root`` the model path);
  errors as ``{"error": {"message", "type", "param", "code"}}``: 404 ``NotFoundError`` for a model
  it does not serve, 400 ``BadRequestError`` for more log-probs than ``--max-logprobs``, 500
  ``InternalServerError``; a Bearer token (``--api-key``) guards the ``/v1`` paths only, 401
  ``{"error": "Unauthorized"}``.
* SGLang: ``POST /generate`` (``input_top_logprobs`` of ``[logprob, id, text]`` triples,
  ``input_token_logprobs``; it reads no model name); ``GET /v1/models`` (the served name,
  ``--served-model-name``, else the model path); ``GET /get_model_info`` (the model path, never
  the served name); errors of ``/generate`` as 400 ``{"error": {"message"}}``, an unhandled one as
  500 ``Internal Server Error`` (text); the token guards every path but ``/health``, 401
  ``{"error": "Unauthorized"}``.
* Both (FastAPI): an unknown path is 404 ``{"detail": "Not Found"}``, a known path with the other
  method 405 ``{"detail": "Method Not Allowed"}``.

It listens on 127.0.0.1 only, on a port of its own; requests are served by a bounded loop
(``max_requests``, ``lifetime_s``) in a daemon thread, so a test that forgets it cannot leave it
running. ``faults`` injects failures request by request (tests and ``scripts/``), among them the
network's misbehaviour no real server imitates on purpose (a hang, an answer trickled byte by
byte, a ``Retry-After`` of an hour), and :meth:`TeacherTestServer.kill` stops it as a crashed
server would (connections refused).

Example::

    with TeacherTestServer(logprobs_fn, api="vllm", model_name="tiny") as server:
        ...  # teacher_server.url = server.url

As a command, it stands in for ``vllm serve`` / SGLang to try a served teacher (and test kd against
it) without a GPU: it serves a local Hugging Face folder, on 127.0.0.1 only, until Ctrl-C::

    python -m kd.testing_server --model DIR --api vllm --port 8000
    # teacher_server: {url: http://127.0.0.1:8000, api: vllm, model: DIR}

It is slow (one CPU forward per request, no batching): for trying and testing, not for training
at scale (docs/served_teacher.md).
"""

from __future__ import annotations

import base64
import collections
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

__all__ = ["FAULTS", "TeacherTestServer", "folder_logprobs", "main", "model_logprobs"]

# What faults may hold, one per POST request, in order ("" : none):
#   "500": answer HTTP 500 as the server does; "hang": sleep hang_s before answering (a client
#   timeout); "trickle": the answer's status line, headers and body one byte every trickle_s;
#   "429" / "503": that status with Retry-After: retry_after (a proxy or an overloaded server);
#   "garbage": a 200 whose body is not JSON; "nan" / "positive" / "unknown_id": one bad value;
#   "drop": one position missing; "kill": stop the server now (the request is not answered).
FAULTS = (
    "500",
    "hang",
    "trickle",
    "429",
    "503",
    "garbage",
    "nan",
    "positive",
    "unknown_id",
    "drop",
    "kill",
)

# The paths each server has, by method (anything else: FastAPI's 404 / 405).
_ROUTES = {
    "vllm": {"GET": ("/v1/models", "/health"), "POST": ("/v1/completions",)},
    "sglang": {
        "GET": ("/v1/models", "/get_model_info", "/health"),
        "POST": ("/generate",),
    },
}  # SGLang's other OpenAI endpoints (/v1/completions, /v1/chat/completions) kd never asks


def model_logprobs(model_dir: Path, tiny: Any, scratch: Path, *, vocab: int) -> Callable:
    """``ids -> [n, vocab]`` fp32 log-softmax of a tiny model written by :mod:`kd.testing`: row
    ``i`` is the distribution of token ``i + 1`` given ``ids[: i + 1]``, over the first ``vocab``
    entries (a served model whose vocabulary is its tokenizer's).

    Args:
        model_dir: the model's HF folder.
        tiny: its :class:`kd.testing.TinyModel` shape.
        scratch: an empty folder for the checkpointer.
        vocab: entries the softmax runs over.
    """
    from kd import models
    from kd.testing import load_tiny_model

    decoder = load_tiny_model(model_dir, tiny, scratch)
    models.set_hidden_output(decoder)

    @torch.no_grad()
    def fn(ids: Sequence[int]) -> torch.Tensor:
        hidden = decoder(torch.tensor([list(ids)]))[0]  # [n, d]
        logits = models.logits_from_hidden(decoder, hidden)  # [n, V]
        return torch.log_softmax(logits[:, :vocab].float(), dim=-1)

    return fn


def top_positions(table: torch.Tensor, ids: Sequence[int], k: int) -> list[list[tuple]]:
    """Per position 1 .. n - 1 of ``ids``: the actual token's ``(id, logprob, rank)`` first,
    then the other top-``k`` ones by rank, from ``table`` ``[n, V]`` log-probs (row ``i``
    predicts token ``i + 1``), as vLLM's ``prompt_logprobs`` and SGLang's input log-probs hold
    them."""
    out = []
    for i in range(1, len(ids)):
        row, actual = table[i - 1], int(ids[i])
        values, top = torch.topk(row, k)
        rank = int((row > row[actual]).sum()) + 1
        entries = [(actual, float(row[actual]), rank)]
        entries += [
            (int(t), float(v), r + 1)
            for r, (v, t) in enumerate(zip(values, top, strict=True))
            if int(t) != actual
        ]
        out.append(entries)
    return out


def _flatten(meta: dict[str, Any], table: list[Any]) -> None:
    """SGLang's base64 form of ``meta``: the input top-k (``table``, triples per position, the
    first null) as flat float32 / int32 arrays and per-position counts; the actual tokens'
    log-probs as a float32 array (no texts)."""
    entries = [e for position in table[1:] for e in position]
    actual = meta.pop("input_token_logprobs")
    del meta["input_top_logprobs"]
    meta["input_top_logprobs_val_b64"] = _b64([e[0] for e in entries], "<f4")
    meta["input_top_logprobs_idx_b64"] = _b64([e[1] for e in entries], "<i4")
    meta["input_top_logprobs_k"] = [0] + [len(position) for position in table[1:]]
    meta["input_token_logprobs_val_b64"] = _b64([a[0] or 0.0 for a in actual], "<f4")


def _b64(values: list[Any], dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass

    def _send(
        self,
        status: int,
        payload: Any,
        *,
        raw: bytes | None = None,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        body = raw if raw is not None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _trickle(self, status: int, payload: Any) -> None:
        """The whole answer (status line, headers, body) one byte every ``trickle_s``."""
        body = json.dumps(payload).encode()
        head = (
            f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            for byte in head + body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(self.server.owner.trickle_s)
        except OSError:  # the client gave up
            self.close_connection = True

    def _route(self, method: str) -> bool:
        """Whether the token lets the request through (else the server's 401) and the path
        exists for ``method`` (else FastAPI's 404 or 405)."""
        owner = self.server.owner
        routes = owner.routes
        path = self.path.split("?", 1)[0]  # routed without its query string, as Starlette does
        # The token middleware runs before routing: a guarded path is refused first.
        if not owner.authorized(path, self.headers.get("Authorization")):
            self._send(401, {"error": "Unauthorized"})
            return False
        if path not in routes.get(method, ()):
            if any(path in paths for paths in routes.values()):
                self._send(405, {"detail": "Method Not Allowed"})
            else:
                self._send(404, {"detail": "Not Found"})
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        owner = self.server.owner
        if not self._route("GET"):
            return
        if self.path == "/health":
            self._send(200, None, raw=b"")
        elif self.path == "/v1/models":
            self._send(200, owner.model_list())
        else:  # SGLang's /get_model_info: the model path, not the served name
            info = {
                "model_path": owner.model_path,
                "tokenizer_path": owner.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
            }
            self._send(200, info)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        owner = self.server.owner
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        owner.count(body)
        fault = owner.next_fault()
        prompts = body.get("prompt", body.get("input_ids")) if isinstance(body, dict) else None
        if owner.refused and isinstance(prompts, list):
            rows = prompts if prompts and isinstance(prompts[0], list) else [prompts]
            if any(tuple(r) in owner.refused for r in rows):
                fault = "500"
        if fault == "kill":
            owner.kill()
            self.close_connection = True
            return
        if fault == "500":
            status, payload = owner.internal_error("injected fault")
            if owner.api == "sglang":
                self._send(status, None, raw=b"Internal Server Error", content_type="text/plain")
            else:
                self._send(status, payload)
            return
        if fault in ("429", "503"):
            message = "Too Many Requests" if fault == "429" else "Service Unavailable"
            self._send(
                int(fault),
                {"detail": message},
                headers={"Retry-After": owner.retry_after},
            )
            return
        if fault == "hang":
            time.sleep(owner.hang_s)
        if fault == "garbage":
            self._send(200, None, raw=b"<html>502 Bad Gateway</html>", content_type="text/html")
            return
        if not self._route("POST"):
            return
        try:
            answer = owner.vllm if owner.api == "vllm" else owner.sglang
            status, payload = answer(body, fault)
        except Exception as e:  # noqa: BLE001 - a server answers 500 on its own errors
            status, payload = owner.internal_error(f"{type(e).__name__}: {e}")
        if fault == "trickle":
            self._trickle(status, payload)
            return
        self._send(status, payload)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: TeacherTestServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that gave up (its deadline passed during a hang) is no error of ours."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class ServerLifecycle:
    """How both test servers serve on 127.0.0.1: bound by :meth:`_bind`, one request at a time on
    a daemon thread until :meth:`kill` (as a crashed server: new connections are refused), at most
    ``max_requests`` requests or ``lifetime_s`` seconds; a context manager."""

    max_requests: int
    lifetime_s: float

    def _bind(self, handler: type[BaseHTTPRequestHandler], port: int, name: str) -> None:
        self._stopped = threading.Event()
        self._httpd = _HTTPServer(("127.0.0.1", port), handler)
        self._httpd.owner = self  # type: ignore[attr-defined]
        self._httpd.timeout = 0.1
        self.port = int(self._httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def _serve(self) -> None:
        deadline = time.monotonic() + self.lifetime_s
        served = 0
        try:
            while not self._stopped.is_set() and time.monotonic() < deadline:
                if served >= self.max_requests:
                    break
                self._httpd.handle_request()
                served += 1
        finally:
            self._httpd.server_close()

    def kill(self) -> None:
        """Stop serving at once, as a crashed server (new connections are refused)."""
        self._stopped.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.kill()


class TeacherTestServer(ServerLifecycle):
    """A vLLM- or SGLang-protocol server of ``logprobs_fn``'s log-probs on 127.0.0.1.

    Args:
        logprobs_fn: ``ids -> [n, V]`` log-probs (:func:`model_logprobs`).
        api: ``vllm`` or ``sglang``.
        model_name: the name it serves (``--served-model-name``; ``/v1/models`` lists it).
        model_path: the model it loaded (``--model`` / ``--model-path``; vLLM's ``root``,
            SGLang's ``/get_model_info``); None: ``model_name``.
        decode: ``id -> text`` (the texts vLLM's ``decoded_token`` and SGLang's triples carry);
            None: no texts.
        max_logprobs: the most log-probs per position it gives (vLLM ``--max-logprobs``).
        token: the Bearer token it requires (None: none).
        port: the port to listen on (0: any free one).
        hang_s: how long a ``"hang"`` fault sleeps.
        trickle_s: the pause between the bytes of a ``"trickle"`` fault's answer.
        retry_after: the ``Retry-After`` of a ``"429"`` / ``"503"`` fault (seconds, as sent).
        max_requests: requests it serves before it stops by itself.
        lifetime_s: seconds it serves before it stops by itself.
        sglang_base64: SGLang answers in its flat base64 form (``return_logprobs_in_base64``):
            ``input_top_logprobs_val_b64`` / ``_idx_b64`` / ``_k`` in place of the triples.

    Attributes:
        refused: prompts answered with HTTP 500 every time they are asked (a server that fails
            for some rows only, e.g. one rank's).
    """

    def __init__(
        self,
        logprobs_fn: Callable[[Sequence[int]], torch.Tensor],
        *,
        api: str = "vllm",
        model_name: str = "tiny-teacher",
        model_path: str | None = None,
        decode: Callable[[int], str] | None = None,
        max_logprobs: int = 20,
        token: str | None = None,
        port: int = 0,
        hang_s: float = 2.0,
        trickle_s: float = 0.05,
        retry_after: str = "3600",
        max_requests: int = 100_000,
        lifetime_s: float = 900.0,
        sglang_base64: bool = False,
    ):
        assert api in ("vllm", "sglang"), api
        self.logprobs_fn = logprobs_fn
        self.api = api
        self.routes = _ROUTES[api]  # method -> the paths the real server answers
        self.model_name = model_name
        self.model_path = model_path if model_path is not None else model_name
        self.decode = decode
        self.max_logprobs = max_logprobs
        self.token = token
        self.hang_s = hang_s
        self.trickle_s = trickle_s
        self.retry_after = retry_after
        self.max_requests = max_requests
        self.lifetime_s = lifetime_s
        self.sglang_base64 = sglang_base64
        self.refused: set[tuple[int, ...]] = set()
        self.faults: collections.deque[str] = collections.deque()
        self.requests = 0  # POST requests received
        self.prompts: list[list[int]] = []  # every prompt asked, in order of arrival
        self._lock = threading.Lock()
        self._model_lock = threading.Lock()
        self._bind(_Handler, port, "kd-test-server")

    # ------------------------------------------------------------ requests
    def authorized(self, path: str, header: str | None) -> bool:
        """Whether the token lets the request through: vLLM guards ``/v1`` paths, SGLang every
        path but ``/health``."""
        if self.token is None:
            return True
        guarded = path.startswith("/v1") if self.api == "vllm" else not path.startswith("/health")
        return not guarded or header == f"Bearer {self.token}"

    def model_list(self) -> dict[str, Any]:
        """``GET /v1/models``: an OpenAI model list of the served name."""
        card: dict[str, Any] = {
            "id": self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": self.api,
            "root": self.model_path if self.api == "vllm" else self.model_name,
            "max_model_len": 4096,
        }
        if self.api == "vllm":
            card["parent"] = None
            card["permission"] = [{"object": "model_permission", "allow_logprobs": True}]
        return {"object": "list", "data": [card]}

    def error(self, status: int, message: str, kind: str, param: str | None = None) -> Any:
        """An error body as the server writes it (vLLM's ``ErrorResponse``, SGLang's
        ``{"error": {"message"}}``)."""
        if self.api == "sglang":
            return {"error": {"message": message}}
        return {"error": {"message": message, "type": kind, "param": param, "code": status}}

    def internal_error(self, message: str) -> tuple[int, Any]:
        return 500, self.error(500, message, "InternalServerError")

    def count(self, body: Any) -> None:
        prompts = body.get("prompt", body.get("input_ids")) if isinstance(body, dict) else None
        with self._lock:
            self.requests += 1
            if isinstance(prompts, list) and prompts and isinstance(prompts[0], list):
                self.prompts.extend([list(p) for p in prompts])
            elif isinstance(prompts, list):
                self.prompts.append(list(prompts))

    def next_fault(self) -> str | None:
        with self._lock:
            return self.faults.popleft() if self.faults else None

    def _table(self, ids: list[int]) -> torch.Tensor:
        with self._model_lock:
            return self.logprobs_fn(ids)

    def _text(self, token: int) -> str | None:
        if self.decode is None:
            return None
        try:
            return self.decode(token)
        except Exception:  # noqa: BLE001 - an id the tokenizer has no text for (padded vocab)
            return ""

    def _positions(self, ids: list[int], k: int, fault: str | None) -> list[list[tuple]]:
        """Per position 1 .. n-1: the top-k ``(id, logprob, rank)`` plus the actual token's
        ``(id, logprob, rank)`` first; the fault, if any, applied to the middle position."""
        out = top_positions(self._table(ids), ids, k)
        if fault in ("nan", "positive", "unknown_id") and out:
            j = len(out) // 2
            tid, lp, rank = out[j][-1]
            out[j][-1] = {
                "nan": (tid, math.nan, rank),
                "positive": (tid, 0.5, rank),
                "unknown_id": (10**7, lp, rank),
            }[fault]
        return out

    def vllm(self, body: dict[str, Any], fault: str | None) -> tuple[int, Any]:
        model = body.get("model")
        if model and model != self.model_name:  # vLLM's check_model: no name is the first
            message = f"The model `{model}` does not exist."
            return 404, self.error(404, message, "NotFoundError", "model")
        k = int(body.get("prompt_logprobs") or 0)
        if k > self.max_logprobs:
            message = (
                f"Requested prompt logprobs of {k}, which is greater than max allowed: "
                f"{self.max_logprobs}"
            )
            return 400, self.error(400, message, "BadRequestError", "prompt_logprobs")
        prompts = body["prompt"]
        prompts = prompts if prompts and isinstance(prompts[0], list) else [prompts]
        choices = []
        for index, ids in enumerate(prompts):
            entries: list[Any] = [None]
            for position in self._positions(ids, k, fault):
                entries.append(
                    {
                        str(t): {"logprob": lp, "rank": rank, "decoded_token": self._text(t)}
                        for t, lp, rank in position
                    }
                )
            if fault == "drop":
                del entries[len(entries) // 2]
            choices.append(
                {
                    "index": index,
                    "text": "",
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_logprobs": entries,
                }
            )
        tokens = sum(len(p) for p in prompts)
        usage = {"prompt_tokens": tokens, "completion_tokens": len(prompts)}
        return 200, {
            "id": f"cmpl-{self.requests}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage,
        }

    def sglang(self, body: dict[str, Any], fault: str | None) -> tuple[int, Any]:
        k = int(body.get("top_logprobs_num") or 0)
        prompts = body["input_ids"]
        single = not (prompts and isinstance(prompts[0], list))
        prompts = [prompts] if single else prompts
        out = []
        for index, ids in enumerate(prompts):
            positions = self._positions(ids, k, fault)
            table: list[Any] = [None]
            for p in positions:
                # The top-k by rank: the actual token is among them only when it ranks in.
                top = sorted(p[1:] if p[0][2] > k else [*p[1:], p[0]], key=lambda e: e[2])
                table.append([[lp, t, self._text(t)] for t, lp, _ in top])
            actual = [[None, ids[0], self._text(ids[0])]] + [
                [p[0][1], p[0][0], self._text(p[0][0])] for p in positions
            ]
            if fault == "drop":
                del table[len(table) // 2]
            meta = {
                "id": f"req-{self.requests}-{index}",
                "prompt_tokens": len(ids),
                "completion_tokens": 0,
                "finish_reason": {"type": "length", "length": 0},
                "input_token_logprobs": actual,
                "input_top_logprobs": table,
                "output_token_logprobs": [],
                "output_top_logprobs": [],
            }
            if self.sglang_base64:
                _flatten(meta, table)
            out.append({"text": "", "meta_info": meta})
        return 200, out[0] if single else out


def folder_logprobs(model_dir: Path) -> tuple[Callable, Callable[[int], str]]:
    """``ids -> [n, V]`` fp32 log-softmax of a Hugging Face folder's model (loaded as ``kd
    generate`` loads it: offline, checked, no remote code), over its tokenizer's vocabulary, and
    ``id -> text`` (the texts the servers send beside each id).

    Raises:
        KDUserError: the folder is not a loadable model (names ``--model`` and the fix).
    """
    from kd.generate import load_model

    model, tokenizer = load_model(Path(model_dir))
    vocab = len(tokenizer)

    @torch.no_grad()
    def fn(ids: Sequence[int]) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0]  # [n, V]
        return torch.log_softmax(logits[:, :vocab].float(), dim=-1)

    return fn, lambda i: tokenizer.decode([i])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kd.testing_server``: serve a local model folder as vLLM or SGLang would.

    Returns:
        The exit status: 0 after Ctrl-C or ``--lifetime-s``, 2 for a bad folder or port.
    """
    import argparse
    import sys

    from kd.errors import KDUserError

    parser = argparse.ArgumentParser(
        prog="python -m kd.testing_server",
        description="A stand-in for vllm serve / SGLang to try and test a served teacher without "
        "a GPU: serves DIR's top-k log-probs on 127.0.0.1 only (slow: one CPU forward per "
        "request). kd's config: teacher_server: {url: http://127.0.0.1:PORT, api: API, model: "
        "NAME}; see docs/served_teacher.md.",
    )
    parser.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face folder")
    parser.add_argument("--api", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free one")
    parser.add_argument(
        "--served-model-name", metavar="NAME", help="the name it serves (default: DIR, as vLLM)"
    )
    parser.add_argument("--max-logprobs", type=int, default=20, metavar="K", help="default 20")
    parser.add_argument("--api-key", metavar="TOKEN", help="require this Bearer token")
    parser.add_argument(
        "--lifetime-s", type=float, default=24 * 3600.0, metavar="S", help="stop after S seconds"
    )
    args = parser.parse_args(argv)
    try:
        fn, decode = folder_logprobs(Path(args.model))
        server = TeacherTestServer(
            fn,
            api=args.api,
            model_name=args.served_model_name or args.model,
            model_path=args.model,
            decode=decode,
            max_logprobs=args.max_logprobs,
            token=args.api_key,
            port=args.port,
            lifetime_s=args.lifetime_s,
            max_requests=10**12,
        )
    except KDUserError as e:
        print(f"kd.testing_server: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the port is taken or not ours to bind
        print(
            f"kd.testing_server: error: --port {args.port}: cannot listen ({e.strerror or e}); "
            "pass another port (0 picks a free one)",
            file=sys.stderr,
        )
        return 2
    name = args.served_model_name or args.model
    print(f"serving {args.model} as {name!r} ({args.api} protocol) on {server.url}", flush=True)
    print(
        f"teacher_server: {{url: {server.url}, api: {args.api}, model: {name}}}  (Ctrl-C stops)",
        flush=True,
    )
    server.start()
    try:
        server._thread.join()
    except KeyboardInterrupt:
        server.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
