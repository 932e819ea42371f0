"""A served teacher that misbehaves cannot hang a run, and no credential is printed (issue 41).

Every request ends by its deadline: an answer trickled byte by byte (status line, headers or
body), a ``Retry-After`` of an hour, each ends ``kd run``, ``kd run teacher_logits`` and ``kd
validate`` with exit 2, one line naming ``teacher_server.url`` / ``timeout``, and what was done
kept (a step checkpoint; the store's whole shards). The servers' real answers: SGLang's served
name is read from ``/v1/models`` (its ``/get_model_info`` names the model path), and a models
endpoint answering HTML is one line. A password in ``teacher_server.url`` and the API token
never reach an error line, a log, the plan or a store's manifest.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kd import cli
from kd.config.teacher_kinds.served import TeacherServerSettings
from kd.teachers.served import TeacherClient, TeacherUnavailable
from kd.testing_server import TeacherTestServer, model_logprobs
from tests.conftest import MAX_SEQ_LEN, STUDENT, TEACHER, make_config, tiny_model
from tests.conftest import write_config as write_yaml

K = 8
PASSWORD = "pw-Zq81"  # noqa: S105 - a test credential
TOKEN = "tok-Vx93"  # noqa: S105 - a test credential


@pytest.fixture(scope="module")
def tokenizer(assets):
    from kd.config.instantiate import instantiate
    from kd.testing import tokenizer_node

    return instantiate(tokenizer_node(assets["tokenizer"], MAX_SEQ_LEN), key="tokenizer")


@pytest.fixture(scope="module")
def teacher_fn(assets, tmp_path_factory):
    scratch = tmp_path_factory.mktemp("teacher_scratch")
    return model_logprobs(assets["teacher"], tiny_model(TEACHER), scratch, vocab=STUDENT["vocab"])


def _server(teacher_fn, tokenizer, **kwargs) -> TeacherTestServer:
    kwargs.setdefault("decode", lambda t: tokenizer.decode([t]))
    kwargs.setdefault("trickle_s", 0.2)  # a whole answer would take many minutes
    return TeacherTestServer(teacher_fn, **kwargs)


def _settings(url: str, **kw) -> TeacherServerSettings:
    base = dict(url=url, api="vllm", model="tiny-teacher", top_k=K, timeout=1, retries=1, backoff=0)
    base.update(kw)
    return TeacherServerSettings(**base)


def served_config(assets, tmp: Path, name: str, url: str, **server) -> Path:
    section = {"url": url, "model": "tiny-teacher", "top_k": K, "timeout": 1, "retries": 1}
    section.update(backoff=0, prefetch=0)
    section.update(server)
    cfg = make_config(assets, tmp / name, teacher_server=section)
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    return write_yaml(tmp / f"{name}.yaml", cfg)


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kd: error:")]


def _with_password(url: str) -> str:
    return url.replace("http://", f"http://kd-user:{PASSWORD}@")


@contextmanager
def raw_server(handle: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """A bare HTTP server on 127.0.0.1 whose every request ``handle`` answers (network
    misbehaviour and foreign servers, not an imitation of vLLM or SGLang)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            handle(self)

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            handle(self)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _send(handler: BaseHTTPRequestHandler, status: int, body: bytes, kind: str) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", kind)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


# ------------------------------------------------------------------------- the client
def test_the_request_budget_adds_attempts_and_backoff_waits():
    from kd.teachers.transport import request_budget

    # 3 attempts of 2 s; waits before retry 2 only (none before the first): 1 x 2^1.
    assert request_budget(timeout=2, retries=2, backoff=1) == 3 * 2 + 2
    # Each wait is at most 60 s, however large the factor.
    assert request_budget(timeout=1, retries=3, backoff=60) == 4 + 60 + 60
    assert request_budget(timeout=5, retries=0, backoff=1) == 5


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_a_trickled_answer_ends_at_the_deadline_and_a_retry_can_still_answer(
    api, teacher_fn, tokenizer
):
    ids = tokenizer.encode("1+2=3", add_bos=False, add_eos=False)
    with _server(teacher_fn, tokenizer, api=api) as s:
        client = TeacherClient(_settings(s.url, api=api), vocab=STUDENT["vocab"])
        s.faults.extend(["trickle"] * 2)  # both attempts trickle
        start = time.monotonic()
        with pytest.raises(TeacherUnavailable) as err:
            client.topk([ids], K)
        took = time.monotonic() - start
        assert took < client.deadline_s + 1.5, took
        assert "teacher_server.url" in str(err.value) and "teacher_server.timeout" in str(err.value)
        s.faults.append("trickle")  # one attempt trickles, its retry answers
        (row,) = client.topk([ids], K)
        assert row.ids.shape == (len(ids) - 1, K)


def test_a_body_trickled_after_prompt_headers_ends_at_the_deadline():
    """Headers at once, then the body one byte at a time: each read is quick, the attempt is
    not."""

    def trickle(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", "100000")
        handler.end_headers()
        try:
            for _ in range(100000):
                handler.wfile.write(b" ")
                handler.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    with raw_server(trickle) as url:
        client = TeacherClient(_settings(url, retries=0), vocab=STUDENT["vocab"])
        start = time.monotonic()
        with pytest.raises(TeacherUnavailable, match="teacher_server.timeout"):
            client.topk([[1, 2, 3]], K)
        assert time.monotonic() - start < 3


@pytest.mark.parametrize("fault", ["cut", "trickle"])
def test_an_answer_whose_body_breaks_is_retried_within_the_deadline(fault):
    """The status line and headers come whole, then the body breaks: the connection closes
    short of its Content-Length, or the body trickles past the attempt's deadline. That is a
    failed attempt like any other: retried (the second attempt answers), not the end of the
    request."""
    from kd.teachers.transport import deadline, deadline_session

    asked: list[int] = []

    def breaks_once(handler: BaseHTTPRequestHandler) -> None:
        asked.append(1)
        if len(asked) > 1:
            _send(handler, 200, b'{"ok": true}', "application/json")
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        handler.close_connection = True
        try:
            for _ in range(1 if fault == "cut" else 1000):
                handler.wfile.write(b'{"ok": ')
                handler.wfile.flush()
                time.sleep(0 if fault == "cut" else 0.05)
        except OSError:
            pass

    session = deadline_session(retries=2, backoff=0, statuses=(), methods=("POST",))
    with raw_server(breaks_once) as url, deadline(attempt_s=1, total_s=3):
        start = time.monotonic()
        response = session.post(f"{url}/x", json={}, timeout=(1, 1))
        assert response.json() == {"ok": True}
        assert time.monotonic() - start < 2.5
    assert len(asked) == 2


@pytest.mark.parametrize("status", ["429", "503"])
def test_a_retry_after_past_the_deadline_stops_at_once_and_one_within_it_is_waited(
    status, teacher_fn, tokenizer
):
    ids = tokenizer.encode("1+2=3", add_bos=False, add_eos=False)
    with _server(teacher_fn, tokenizer) as s:
        client = TeacherClient(_settings(s.url, timeout=3, retries=2), vocab=STUDENT["vocab"])
        s.faults.append(status)  # Retry-After: 3600
        start = time.monotonic()
        with pytest.raises(TeacherUnavailable) as err:
            client.topk([ids], K)
        assert time.monotonic() - start < 2
        assert f"retried after 3600 s (HTTP {status}, Retry-After)" in str(err.value)
        s.retry_after = "1"
        s.faults.append(status)
        start = time.monotonic()
        (row,) = client.topk([ids], K)
        assert time.monotonic() - start >= 1  # the server's wait, kept
        assert row.ids.shape == (len(ids) - 1, K)


# ------------------------------------------------------------------------- kd run, teacher_logits
@pytest.mark.parametrize("fault", ["trickle", "429"])
def test_kd_run_against_a_server_turning_slow_saves_and_stops_with_one_line(
    fault, assets, teacher_fn, tokenizer, tmp_path, capsys, monkeypatch
):
    from kd.metrics import GuardedLogger

    logged: list[str] = []  # the config the metric sink (wandb...) receives
    monkeypatch.setattr(GuardedLogger, "log_config", lambda self, c: logged.append(str(c)))
    with _server(teacher_fn, tokenizer) as s:
        s.faults.extend([""] * (1 + 8) + [fault] * 40)  # the probe, step 1, then every request
        config = served_config(assets, tmp_path, "slow", _with_password(s.url))
        capsys.readouterr()
        start = time.monotonic()
        assert cli.main(["run", "kd", "--config", str(config)]) == 2
        took = time.monotonic() - start
    captured = capsys.readouterr()
    assert PASSWORD not in captured.out + captured.err
    assert logged and PASSWORD not in logged[0] and "http://***@127.0.0.1" in logged[0]
    err = errors(captured.err)
    assert len(err) == 1, err
    assert "teacher_server.url" in err[0] and "teacher_server.timeout" in err[0], err[0]
    assert "stopped after step 1; saved" in err[0] and "step_000001" in err[0], err[0]
    assert (tmp_path / "slow" / "step_000001").is_dir()
    assert not (tmp_path / "slow" / "final").exists()
    assert took < 120, took  # a trickled answer alone would take over an hour


def test_teacher_logits_against_a_server_turning_slow_keeps_its_shards_and_resumes(
    assets, teacher_fn, tokenizer, tmp_path, capsys
):
    from kd.teachers import store_format, store_manifest

    store = tmp_path / "store"
    fill = [f"teacher_logits.path={store}", f"teacher_logits.k={K}"]
    fill += ["teacher_logits.rows_per_shard=8"]
    with _server(teacher_fn, tokenizer) as s:
        url = _with_password(s.url)  # the test server reads no Basic auth: it still answers
        config = served_config(assets, tmp_path, "fill", url)
        s.faults.extend([""] * (1 + 8) + ["trickle"] * 40)  # the probe, shard 0, then slow
        capsys.readouterr()
        assert cli.main(["run", "teacher_logits", "--config", str(config), *fill]) == 2
        captured = capsys.readouterr()
        err = errors(captured.err)
        assert len(err) == 1 and "teacher_server.timeout" in err[0], err
        assert PASSWORD not in captured.out + captured.err
        first = store_format.shard_name(0, 0)
        assert (store / first).is_file()  # the whole shard is kept
        s.faults.clear()
        asked = s.requests
        assert cli.main(["run", "teacher_logits", "--config", str(config), *fill]) == 0
        assert s.requests - asked == 1 + 64 - 8  # the probe and the rows not kept
    manifest = store_manifest.read_manifest(store)
    assert manifest["complete"]
    assert PASSWORD not in (store / "manifest.json").read_text()
    assert "***@" in manifest["teacher"]["folder"]


# ------------------------------------------------------------------------- kd validate
@pytest.mark.parametrize("fault", ["trickle", "503"])
def test_kd_validate_against_a_slow_server_is_one_line(
    fault, assets, teacher_fn, tokenizer, tmp_path, capsys
):
    with _server(teacher_fn, tokenizer) as s:
        s.faults.extend([fault] * 4)
        config = served_config(assets, tmp_path, "v", s.url)
        capsys.readouterr()
        start = time.monotonic()
        assert cli.main(["validate", "--config", str(config)]) == 2
        took = time.monotonic() - start
    err = errors(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("kd: error: teacher_server.url: "), err
    assert "teacher_server.timeout" in err[0]
    assert took < 60, took


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1e300", "teacher_server.timeout: 1e+300 is above the maximum 3600"),
        ("0", "greater than 0 and at most 3600"),
    ],
)
def test_an_unbounded_timeout_is_refused_with_its_range(value, expected, assets, tmp_path, capsys):
    config = served_config(assets, tmp_path, "t", "http://127.0.0.1:9")
    capsys.readouterr()
    assert cli.main(["validate", "--config", str(config), f"teacher_server.timeout={value}"]) == 2
    err = errors(capsys.readouterr().err)
    assert len(err) == 1 and expected in err[0], err
    assert "Traceback" not in err[0]


# ------------------------------------------------------------------------- the servers' answers
def test_sglang_is_checked_against_its_served_name_not_its_model_path(
    assets, teacher_fn, tokenizer, tmp_path, capsys
):
    """SGLang started with --model-path org/big --served-model-name tiny-teacher: /v1/models
    names tiny-teacher, /get_model_info only the path."""
    import requests

    with _server(teacher_fn, tokenizer, api="sglang", model_path="org/big-teacher") as s:
        info = requests.get(f"{s.url}/get_model_info", timeout=5).json()
        assert info["model_path"] == "org/big-teacher" and "served_model_name" not in info
        config = served_config(assets, tmp_path, "sg", s.url, api="sglang")
        assert cli.main(["validate", "--config", str(config)]) == 0
        capsys.readouterr()
        wrong = "teacher_server.model=org/big-teacher"
        assert cli.main(["validate", "--config", str(config), wrong]) == 2
    err = errors(capsys.readouterr().err)
    assert len(err) == 1 and "serves tiny-teacher, not org/big-teacher" in err[0], err


@pytest.mark.parametrize(
    ("body", "kind"),
    [(b"<html><body>Welcome to nginx</body></html>", "text/html"), (b'{"ok": 1}', "json")],
)
def test_a_models_endpoint_that_lists_no_models_is_one_line(body, kind, assets, tmp_path, capsys):
    with raw_server(lambda h: _send(h, 200, body, kind)) as url:
        config = served_config(assets, tmp_path, "html", url)
        capsys.readouterr()
        assert cli.main(["validate", "--config", str(config)]) == 2
    captured = capsys.readouterr()
    err = errors(captured.err)
    assert len(err) == 1 and "/v1/models did not list the served models" in err[0], err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_the_test_server_answers_errors_as_the_real_servers(api, teacher_fn, tokenizer):
    import requests

    with _server(teacher_fn, tokenizer, api=api, token=TOKEN) as s:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        missing = requests.get(f"{s.url}/nowhere", headers=auth, timeout=5)
        assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
        wrong_method = requests.get(
            f"{s.url}{'/generate' if api == 'sglang' else '/v1/completions'}",
            headers=auth,
            timeout=5,
        )
        assert (wrong_method.status_code, wrong_method.json()) == (
            405,
            {"detail": "Method Not Allowed"},
        )
        unauthorized = requests.get(f"{s.url}/v1/models", timeout=5)
        assert (unauthorized.status_code, unauthorized.json()) == (401, {"error": "Unauthorized"})
        assert requests.get(f"{s.url}/health", timeout=5).status_code == 200  # never guarded
        models = requests.get(f"{s.url}/v1/models", headers=auth, timeout=5).json()
        assert models["object"] == "list" and models["data"][0]["id"] == "tiny-teacher"
        if api == "vllm":
            body = {"model": "other", "prompt": [1, 2], "max_tokens": 1, "prompt_logprobs": 2}
            answer = requests.post(f"{s.url}/v1/completions", json=body, headers=auth, timeout=5)
            assert answer.status_code == 404
            assert answer.json()["error"] == {
                "message": "The model `other` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }


# ------------------------------------------------------------------------- credentials
def test_no_password_or_token_is_printed_or_logged(
    assets, teacher_fn, tokenizer, tmp_path, capsys, caplog, monkeypatch
):
    import base64

    monkeypatch.setenv("KD_TEST_TOKEN", TOKEN)
    basic = base64.b64encode(f"kd-user:{PASSWORD}".encode()).decode()

    def echo(handler: BaseHTTPRequestHandler) -> None:  # a server quoting the request back
        quoted = json.dumps({"error": f"bad request: {handler.headers.get('Authorization')}"})
        _send(handler, 400, quoted.encode(), "application/json")

    def check(*args: str, url: str, **server: str | None) -> str:
        config = served_config(assets, tmp_path, "cred", url, **server)
        capsys.readouterr()
        caplog.clear()
        code = cli.main([*args, "--config", str(config)])
        captured = capsys.readouterr()
        everything = captured.out + captured.err + caplog.text
        for secret in (PASSWORD, TOKEN, basic):
            assert secret not in everything, everything
        assert code in (0, 2)
        return everything

    down = check("validate", url=_with_password("http://127.0.0.1:9"))
    assert "teacher_server.url: http://***@127.0.0.1:9/v1/models did not answer" in down
    with raw_server(echo) as url:
        assert "Bearer ***" in check("validate", url=url, token_env="KD_TEST_TOKEN")
        assert "Basic ***" in check("validate", url=_with_password(url))
    with _server(teacher_fn, tokenizer, token=TOKEN) as s:
        with caplog.at_level("INFO", logger="kd"):
            ok = check("validate", url=s.url, token_env="KD_TEST_TOKEN")
        assert "(vllm at http://127.0.0.1" in ok
    with _server(teacher_fn, tokenizer) as s:
        with caplog.at_level("INFO", logger="kd"):
            ok = check("validate", url=_with_password(s.url))
        assert "(vllm at http://***@127.0.0.1" in ok
        planned = check("plan", url=_with_password(s.url))
        assert "at http://***@127.0.0.1" in planned
    bad = check("validate", url=f"ftp://kd-user:{PASSWORD}@127.0.0.1:9")
    assert "'ftp://***@127.0.0.1:9' is not an http:// or https:// URL" in bad
    both = check("validate", url=_with_password("http://127.0.0.1:9"), token_env="KD_TEST_TOKEN")
    assert "teacher_server.token_env: is set beside a user:password" in both


def test_kd_validate_probes_a_failing_server_briefly_whatever_the_training_budget(
    assets, teacher_fn, tokenizer, tmp_path, capsys, monkeypatch
):
    # Training requests may wait long between retries (backoff 1: 15 s of waits over 5 retries
    # for a failing request, 30 s here); the probe before training waits at most 0.1 s x 2^n
    # (issue 42: a server that is down answers in seconds). Bounded by the waits kd asks of
    # urllib3's retry, not by a clock.
    from kd.teachers import transport
    from kd.teachers.served import PROBE_BACKOFF_S

    waits: list[float] = []
    original = transport._DeadlineRetry.get_backoff_time

    def recorded(self) -> float:
        waits.append(original(self))
        return waits[-1]

    monkeypatch.setattr(transport._DeadlineRetry, "get_backoff_time", recorded)
    with _server(teacher_fn, tokenizer, retry_after="0") as s:
        s.faults.extend(["503"] * 10)
        config = served_config(assets, tmp_path, "p", s.url, timeout=60, retries=5, backoff=1)
        capsys.readouterr()
        assert cli.main(["validate", "--config", str(config)]) == 2
        asked = s.requests
    err = errors(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("kd: error: teacher_server.url: "), err
    assert "answered HTTP 503 after 5 retries" in err[0]
    assert asked == 6  # the configured retries: a server failing now and then still passes
    assert len(waits) == 5 and sum(waits) <= PROBE_BACKOFF_S * (2 + 4 + 8 + 16) + 1e-9, waits
