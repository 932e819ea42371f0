"""A served teacher (issue 25): `teacher_server:` asks a vLLM or SGLang server for the teacher's
top-k log-probs. A test server written from both protocols (kd.testing_server) serves the tiny
teacher's real log-probs: training against it equals training from kd's store of the same
model's top-k, faults (5xx, timeouts, garbage, a server killed mid-run) lose nothing, and every
wrong server is refused before training with one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kd import cli
from kd.config.teacher_kinds.served import TeacherServerSettings
from kd.errors import KDUserError
from kd.teachers.served import TeacherClient, TeacherUnavailable
from kd.testing_server import TeacherTestServer, model_logprobs
from tests.conftest import (
    MAX_SEQ_LEN,
    STUDENT,
    TEACHER,
    make_config,
    read_metrics,
    run_kd,
    tiny_model,
)
from tests.conftest import write_config as write_yaml

K = 8
LOSSES = ("loss", "ce_loss", "kd_loss")


@pytest.fixture(scope="module")
def tokenizer(assets):
    from kd.config.instantiate import instantiate
    from kd.testing import tokenizer_node

    return instantiate(tokenizer_node(assets["tokenizer"], MAX_SEQ_LEN), key="tokenizer")


@pytest.fixture(scope="module")
def teacher_fn(assets, tmp_path_factory):
    """The tiny teacher's log-softmax over the student's (= the tokenizer's) vocabulary."""
    scratch = tmp_path_factory.mktemp("teacher_scratch")
    return model_logprobs(assets["teacher"], tiny_model(TEACHER), scratch, vocab=STUDENT["vocab"])


def _server(teacher_fn, tokenizer, **kwargs) -> TeacherTestServer:
    kwargs.setdefault("decode", lambda t: tokenizer.decode([t]))
    return TeacherTestServer(teacher_fn, **kwargs)


@pytest.fixture
def server(teacher_fn, tokenizer):
    with _server(teacher_fn, tokenizer) as s:
        yield s


def served_config(assets, tmp: Path, name: str, url: str, **server) -> Path:
    """A KD config whose teacher is the server at ``url`` (no teacher nodes)."""
    section = {"url": url, "model": "tiny-teacher", "top_k": K, "timeout": 5, "backoff": 0}
    section.update(server)
    cfg = make_config(assets, tmp / name, teacher_server=section)
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    return write_yaml(tmp / f"{name}.yaml", cfg)


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kd: error:")]


# ------------------------------------------------------------------------- protocols
@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_client_reads_each_protocols_top_k_aligned_with_the_model(api, teacher_fn, tokenizer):
    """Position j of a row's answer is the model's top-k of token j + 1, by value (vLLM's
    dicts also hold the actual token, first, when it ranks below k: it is not taken)."""
    ids = tokenizer.encode("12+30=42 and 7+5=12", add_bos=False, add_eos=False)
    with _server(teacher_fn, tokenizer, api=api) as s:
        client = TeacherClient(_settings(s.url, api=api), vocab=STUDENT["vocab"])
        (row,) = client.topk([ids], K)
    values, top = torch.topk(teacher_fn(ids)[:-1], K)  # row i predicts token i + 1
    assert row.ids.shape == (len(ids) - 1, K)
    assert torch.equal(torch.from_numpy(row.ids), top)
    torch.testing.assert_close(torch.from_numpy(row.logprobs), values, rtol=0, atol=1e-6)
    # The probe texts are the actual tokens'.
    assert row.texts == [tokenizer.decode([t]) for t in ids[1:]]


def test_sglangs_flat_base64_form_reads_as_its_triples(teacher_fn, tokenizer):
    """SGLang's ``return_logprobs_in_base64`` answer (flat float32 / int32 arrays and per-position
    counts) gives the same top-k as its triples."""
    ids = tokenizer.encode("12+30=42 and 7+5=12", add_bos=False, add_eos=False)
    rows = []
    for flat in (False, True):
        with _server(teacher_fn, tokenizer, api="sglang", sglang_base64=flat) as s:
            client = TeacherClient(_settings(s.url, api="sglang"), vocab=STUDENT["vocab"])
            rows.append(client.topk([ids], K)[0])
    triples, flat_row = rows
    assert np.array_equal(triples.ids, flat_row.ids)
    assert np.array_equal(triples.logprobs, flat_row.logprobs)
    assert flat_row.texts == [None] * (len(ids) - 1)  # the flat form carries no texts


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda m: m.update(input_top_logprobs_k=m["input_top_logprobs_k"][1:]), "one count"),
        (lambda m: m.update(input_top_logprobs_val_b64="%%%"), "not valid base64"),
        (
            lambda m: m.update(input_top_logprobs_idx_b64=m["input_top_logprobs_idx_b64"][:16]),
            "for 3 ids",
        ),
        (lambda m: m["input_top_logprobs_k"].__setitem__(0, 1), "position 0"),
    ],
)
def test_a_malformed_flat_base64_answer_is_refused(edit, where, teacher_fn, tokenizer):
    from kd.teachers.protocols import PROTOCOLS, BadAnswer

    ids = tokenizer.encode("12+30=42", add_bos=False, add_eos=False)
    with _server(teacher_fn, tokenizer, api="sglang", sglang_base64=True) as s:
        status, answer = s.sglang({"input_ids": ids, "top_logprobs_num": K}, None)
    assert status == 200
    edit(answer["meta_info"])
    with pytest.raises(BadAnswer, match=where):
        PROTOCOLS["sglang"].parse(answer, [ids], K, STUDENT["vocab"])


def _settings(url: str, **kw) -> TeacherServerSettings:
    base = dict(url=url, api="vllm", model="tiny-teacher", top_k=K, timeout=5, retries=2, backoff=0)
    base.update(kw)
    return TeacherServerSettings(**base)


@pytest.mark.parametrize("fault", ["nan", "positive", "unknown_id", "drop", "garbage"])
@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_malformed_answers_are_refused_with_the_position(api, fault, teacher_fn, tokenizer):
    ids = tokenizer.encode("12+30=42", add_bos=False, add_eos=False)
    with _server(teacher_fn, tokenizer, api=api) as s:
        s.faults.append(fault)
        client = TeacherClient(_settings(s.url, api=api), vocab=STUDENT["vocab"])
        with pytest.raises(KDUserError) as err:
            client.topk([ids], K)
    text = str(err.value)
    assert "malformed answer" in text and f"1 row(s) of {len(ids)} tokens" in text
    where = {
        "nan": "not finite",
        "positive": "is positive",
        "unknown_id": "outside the vocabulary",
        "drop": "positions for a prompt",
        "garbage": "not JSON",
    }[fault]
    assert where in text
    if fault not in ("drop", "garbage"):
        assert "row 0 position" in text


def test_retries_5xx_and_timeouts_then_answers(server, teacher_fn, tokenizer):
    ids = tokenizer.encode("1+2=3", add_bos=False, add_eos=False)
    server.hang_s = 3.0
    server.faults.extend(["500", "hang", "500"])
    client = TeacherClient(_settings(server.url, timeout=1.5, retries=3), vocab=STUDENT["vocab"])
    (row,) = client.topk([ids], K)
    assert server.requests == 4  # three failures, then the answer
    assert torch.equal(torch.from_numpy(row.ids), torch.topk(teacher_fn(ids)[:-1], K).indices)
    server.faults.extend(["500"] * 3)
    with pytest.raises(TeacherUnavailable, match="HTTP 500 after 2 retries"):
        TeacherClient(_settings(server.url, retries=2), vocab=STUDENT["vocab"]).topk([ids], K)


# ------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def stored_run(assets, tmp_path_factory) -> Path:
    """KD from kd's store of the same teacher's top-k (k = K): the reference (the store is
    ``<run>/../logits``)."""
    tmp = tmp_path_factory.mktemp("stored")
    store = {"path": str(tmp / "logits"), "k": K}
    pre = write_yaml(tmp / "pre.yaml", make_config(assets, tmp / "pre", teacher_logits=store))
    assert cli.main(["run", "teacher_logits", "--config", str(pre)]) == 0
    train = write_yaml(tmp / "kd.yaml", make_config(assets, tmp / "kd", teacher_logits=store))
    assert run_kd(train) == 0
    return tmp / "kd"


def assert_same_steps(a: Path, b: Path, tol: float = 1e-5) -> None:
    ra, rb = read_metrics(a), read_metrics(b)
    assert len(ra) == len(rb) == 3
    for x, y in zip(ra, rb, strict=True):
        assert x["num_tokens"] == y["num_tokens"]
        for key in LOSSES:
            assert abs(x[key] - y[key]) <= tol, (x["step"], key, x[key], y[key])


@pytest.mark.parametrize("api", ["vllm", pytest.param("sglang", marks=pytest.mark.slow)])
def test_kd_against_the_server_equals_kd_from_the_store(
    api, assets, stored_run, teacher_fn, tokenizer, tmp_path, monkeypatch
):
    from kd.runtime.run_context import RunContext

    loaded = []
    original = RunContext.load_model
    monkeypatch.setattr(
        RunContext,
        "load_model",
        lambda self, key, *a, **kw: (loaded.append(key), original(self, key, *a, **kw))[1],
    )
    with _server(teacher_fn, tokenizer, api=api) as s:
        assert run_kd(served_config(assets, tmp_path, "served", s.url, api=api)) == 0
        asked = s.requests
    assert loaded == ["model"]  # no teacher weights
    # The probe, one request per row of the 6 micro-batches, and at most prefetch (4) more
    # micro-batches asked ahead that the 3 steps did not reach.
    assert 1 + 6 * 4 <= asked <= 1 + (6 + 4) * 4
    assert_same_steps(stored_run, tmp_path / "served")
    rows = read_metrics(tmp_path / "served")
    assert all(r["kd_loss"] > 0 and "time_teacher_s" in r for r in rows)


def test_faults_during_training_lose_nothing(assets, stored_run, server, tmp_path):
    """500s and a timeout are retried: the run equals the one that saw none."""
    server.hang_s = 4.0
    # After the probe: the first rows of the run meet failures (timeouts generous enough for a
    # loaded machine, shorter than the hang).
    server.faults.extend(["500", "500", "hang", "500"])
    config = served_config(assets, tmp_path, "faults", server.url, timeout=2, retries=6)
    assert run_kd(config) == 0
    assert not server.faults
    assert_same_steps(stored_run, tmp_path / "faults")


@pytest.mark.parametrize(
    ("fault", "line"),
    [("kill", "did not answer after 2 retries"), ("garbage", "gave a malformed answer")],
)
def test_a_server_failing_mid_run_saves_stops_and_resumes(
    fault, line, assets, stored_run, teacher_fn, tokenizer, tmp_path, capsys
):
    """The server dies (or answers garbage) during step 2: the run saves step 1, stops with
    exit 2 and one line; with the server back, resume finishes the run as if nothing happened."""
    with _server(teacher_fn, tokenizer) as s:
        port = s.port
        s.faults.extend([""] * (1 + 8 + 3) + [fault])  # the probe, step 1, 3 rows of step 2
        config = served_config(assets, tmp_path, "failed", s.url, retries=2, prefetch=0)
        capsys.readouterr()
        assert run_kd(config) == 2
    err = errors(capsys.readouterr().err)
    assert len(err) == 1 and line in err[0], err
    assert "stopped after step 1; saved" in err[0] and "step_000001" in err[0]
    assert (tmp_path / "failed" / "step_000001").is_dir()
    assert not (tmp_path / "failed" / "final").exists()
    with _server(teacher_fn, tokenizer, port=port):
        assert run_kd(config, "resume_from_checkpoint=true") == 0
    assert_same_steps(stored_run, tmp_path / "failed")


def test_on_policy_completions_are_scored_by_the_server(assets, server, tmp_path):
    config = served_config(assets, tmp_path, "gkd", server.url)
    overrides = ["on_policy.lmbda=1", "on_policy.max_new_tokens=4", "max_steps_per_epoch=2"]
    assert run_kd(config, *overrides) == 0
    rows = read_metrics(tmp_path / "gkd")
    assert all(r["sampled_batches_student"] == 2 and r["kd_loss"] > 0 for r in rows)
    data_rows = {tuple(p) for p in server.prompts[:1]}  # the probe
    assert len({tuple(p) for p in server.prompts} - data_rows) > 0


# ------------------------------------------------------------------------- refused before training
def test_wrong_servers_are_refused_before_training(
    assets, server, teacher_fn, tokenizer, tmp_path, capsys, monkeypatch
):
    def refused(config: Path, *overrides: str) -> str:
        capsys.readouterr()
        assert cli.main(["validate", "--config", str(config), *overrides]) == 2
        lines = errors(capsys.readouterr().err)
        assert len(lines) == 1, lines
        return lines[0]

    config = served_config(assets, tmp_path, "wrong", server.url, retries=0)
    assert cli.main(["validate", "--config", str(config)]) == 0
    assert "serves tiny-teacher, not other" in refused(config, "teacher_server.model=other")
    server.max_logprobs = 4
    assert "--max-logprobs 8" in refused(config)
    server.max_logprobs = 20
    assert "token_env" in refused(config, "teacher_server.token_env=KD_TEST_TOKEN_UNSET")
    down = refused(config, "teacher_server.url=http://127.0.0.1:9")
    assert "did not answer" in down
    with _server(teacher_fn, tokenizer, decode=lambda t: f"<{t}>") as other:
        assert "tokenizer is not the student's" in refused(
            config, f"teacher_server.url={other.url}"
        )
    with _server(teacher_fn, tokenizer, token="s3cret") as locked:
        monkeypatch.setenv("KD_TEST_TOKEN", "s3cret")
        ok = [f"teacher_server.url={locked.url}", "teacher_server.token_env=KD_TEST_TOKEN"]
        assert cli.main(["validate", "--config", str(config), *ok]) == 0
        # A server with a token: none sent, or another one, names the key to fix.
        none = refused(config, f"teacher_server.url={locked.url}")
        assert none.startswith("kd: error: teacher_server.token_env:") and "HTTP 401" in none
        assert "kd sent no token" in none
        monkeypatch.setenv("KD_TEST_TOKEN", "wrong")
        wrong = refused(config, *ok)
        assert "to the token in KD_TEST_TOKEN" in wrong and "wrong" not in wrong.split("KD_TEST")[0]
    both = make_config(assets, tmp_path / "both", teacher_server={"url": server.url, "model": "m"})
    assert "beside teacher_server" in refused(write_yaml(tmp_path / "both.yaml", both))


def test_plan_counts_no_teacher_weights_and_states_the_prefetch(assets, server, tmp_path, capsys):
    config = served_config(assets, tmp_path, "plan", server.url, prefetch=6)
    capsys.readouterr()
    assert cli.main(["plan", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "teacher: served top-8 log-probs of tiny-teacher" in out
    assert "no teacher weights" in out and "prefetch buffer 6 micro-batches ahead" in out
    assert "params (frozen)" not in out


def test_teacher_logits_fills_a_store_from_the_server(
    assets, stored_run, server, tmp_path, monkeypatch
):
    """kd run teacher_logits with teacher_server writes the store the local teacher writes
    (same rows, ids and float16 log-probs); kd run kd with the same config trains from the store
    without asking the server."""
    import pyarrow.parquet as pq

    from kd.teachers import store_manifest

    config = served_config(assets, tmp_path, "fill", server.url)
    store = tmp_path / "served_logits"
    fill = [f"teacher_logits.path={store}", f"teacher_logits.k={K}"]
    assert cli.main(["run", "teacher_logits", "--config", str(config), *fill]) == 0
    local = stored_run.parent / "logits"
    ours, theirs = store_manifest.read_manifest(store), store_manifest.read_manifest(local)
    assert ours["complete"] and ours["teacher"]["component"] == "teacher_server vllm tiny-teacher"
    for key in ("num_rows", "k", "vocab", "dataset_fingerprint", "tokenizer_sha256"):
        assert ours[key] == theirs[key], key
    for name in (s["name"] for s in theirs["shards"]):
        a, b = pq.read_table(store / name), pq.read_table(local / name)
        for column in ("row", "row_hash", "num_tokens", "ids"):
            assert a.column(column).to_pylist() == b.column(column).to_pylist(), column
        lp_a = torch.tensor([x for r in a.column("logprobs").to_pylist() for x in r])
        lp_b = torch.tensor([x for r in b.column("logprobs").to_pylist() for x in r])
        torch.testing.assert_close(lp_a, lp_b, rtol=0, atol=2e-3)
    asked = server.requests
    assert run_kd(config, *fill) == 0
    assert server.requests == asked  # the store teaches
    assert_same_steps(stored_run, tmp_path / "fill")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["on_policy.seq_kd=true"], "on_policy.seq_kd: samples the teacher's completions"),
        (["temperature=2"], "teacher_server.tail: bucket needs the teacher mass"),
        (["teacher_server.url=127.0.0.1:8000"], "is not an http:// or https:// URL"),
        (["teacher_server.api=tgi"], "teacher_server.api"),
    ],
)
def test_config_mistakes_of_a_served_teacher_are_refused(
    assets, tmp_path, capsys, overrides, expected
):
    config = served_config(assets, tmp_path, "cfg", "http://127.0.0.1:9")
    capsys.readouterr()
    assert cli.main(["validate", "--config", str(config), *overrides]) == 2
    assert expected in capsys.readouterr().err


def test_validation_needs_the_full_distribution(assets, tmp_path, capsys):
    cfg = make_config(
        assets,
        tmp_path / "val",
        teacher_server={"url": "http://127.0.0.1:9", "model": "m"},
        validation={"dataset": make_config(assets, tmp_path)["dataset"]},
    )
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    capsys.readouterr()
    assert cli.main(["validate", "--config", str(write_yaml(tmp_path / "v.yaml", cfg))]) == 2
    assert "validation: needs a teacher's full distribution" in capsys.readouterr().err


# ------------------------------------------------------------------------- write-through
def test_write_through_keeps_every_answer_and_later_runs_read_it(
    assets, stored_run, teacher_fn, tokenizer, tmp_path
):
    """teacher_server.store keeps the server's answers while kd run kd trains: shards whose
    rows were all answered are written, a rerun reads them instead of asking, kd run
    teacher_logits finishes the store (only the missing shards), and then a run needs no
    server at all. Every run equals training from the local teacher's store."""
    from kd.teachers import store_format, store_manifest

    store = tmp_path / "kept"
    through = {"store": str(store), "store_rows_per_shard": 8}
    with _server(teacher_fn, tokenizer) as s:
        first = served_config(assets, tmp_path, "first", s.url, **through)
        assert run_kd(first) == 0
        asked_first = s.requests
        assert asked_first == 1 + 24  # the probe, then the rows of 3 steps (none asked ahead)
        # 3 steps of 8 rows in order (shuffle false): rows 0..23, shards 0..2 are whole.
        manifest = store_manifest.read_manifest(store)
        assert manifest is not None and not manifest["complete"]
        written = sorted(p.name for p in store.glob("*.parquet"))
        assert written == [store_format.shard_name(0, i) for i in range(3)]
        again = served_config(assets, tmp_path, "again", s.url, **through)
        assert run_kd(again) == 0
        assert s.requests == asked_first + 1  # the probe only: the store answered every row
        fill = [
            f"teacher_logits.path={store}",
            f"teacher_logits.k={K}",
            "teacher_logits.rows_per_shard=8",
        ]
        assert cli.main(["run", "teacher_logits", "--config", str(again), *fill]) == 0
        assert s.requests == asked_first + 1 + 1 + (64 - 24)  # its probe, the 40 rows missing
    assert store_manifest.read_manifest(store)["complete"]
    dead = served_config(assets, tmp_path, "serverless", "http://127.0.0.1:9", **through)
    assert run_kd(dead) == 0  # the complete store teaches; the server is neither asked nor needed
    for name in ("first", "again", "serverless"):
        assert_same_steps(stored_run, tmp_path / name)
