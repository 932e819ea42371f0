"""The served sampler (``on_policy.sampler: served``) through ``kd run``, against
:class:`kd.testing_rollout_server.RolloutTestServer` (vLLM's and SGLang's generation and
weight-update endpoints over the student's own folder on the CPU, answering as they do):

* greedy rollouts from the server equal the local sampler's at every step after a sync (LoRA and
  full students, both protocols), each carrying the version it was sampled with; a server never
  synced samples other completions (so the comparison can fail);
* ``kd validate`` probes the server: its model, runtime LoRA loading, a full reload route, its
  length; each refusal one line, exit 2;
* a server that dies mid-run stops the run with a step checkpoint and exit 2 in one line, and the
  resumed run (a new server) ends with the weights of a run never stopped;
* ``kill -9`` during a weight push, then resume, loses nothing (same final weights).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

import kd.rollouts.local
import kd.rollouts.served
from kd import cli
from kd.testing import hf_tokenizer_node, write_tiny_model
from kd.testing_rollout_server import RolloutTestServer
from tests.conftest import MAX_SEQ_LEN, STUDENT, make_config, read_metrics, tiny_model, write_config

SERVED_NAME = "tiny-student"
CASES = [("vllm", False), ("vllm", True), ("sglang", False), ("sglang", True)]
IDS = ["vllm-full", "vllm-lora", "sglang-full", "sglang-lora"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def assets(assets, tmp_path_factory) -> dict:
    """The tiny assets with a student whose greedy completions depend on the prompt (perturbed
    weights: the plain random init answers every prompt with one token repeated)."""
    folder = tmp_path_factory.mktemp("served") / "student"
    write_tiny_model(folder, tiny_model(STUDENT), seed=5, writer="transformers", perturb=0.3)
    return {**assets, "student": folder}


def student_node(folder: Path, lora: bool) -> dict:
    if not lora:
        return {"_component_": "kd.hf.causal_lm", "path": str(folder)}
    return {
        "_component_": "kd.hf.lora_causal_lm",
        "path": str(folder),
        "lora_attn_modules": ["q_proj", "v_proj"],
        "apply_lora_to_mlp": True,
        "lora_rank": 4,
        "lora_alpha": 8,
    }


def config(assets: dict, out: Path, *, lora: bool, on_policy: dict, **top) -> dict:
    """A greedy on-policy run of the HF student (every micro-batch samples), learning fast
    enough that its greedy completions change from step to step."""
    cfg = make_config(assets, out, **top)
    cfg["tokenizer"] = hf_tokenizer_node(assets["tokenizer"], MAX_SEQ_LEN)
    cfg["model"] = student_node(assets["student"], lora)
    del cfg["checkpointer"]
    cfg["optimizer"] = {"_component_": "torch.optim.AdamW", "lr": 0.05 if lora else 0.02}
    node = {"lmbda": 1.0, "max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0}
    node.update(on_policy)
    cfg["on_policy"] = node
    return cfg


def served(server: RolloutTestServer, api: str, **kw) -> dict:
    return {
        "sampler": "served",
        "server_url": server.url,
        "server_api": api,
        "server_model": SERVED_NAME,
        **kw,
    }


def record(monkeypatch, cls) -> list[tuple[int, tuple[int, ...], list[list[int]], int]]:
    """Every ``cls.sample`` call: (step, rows, each row's completion, version)."""
    seen: list = []
    original = cls.sample

    def spy(self, prompts, *, rows, epoch, step, student):
        done = original(self, prompts, rows=rows, epoch=epoch, step=step, student=student)
        ids = [done.tokens[i, : int(n)].tolist() for i, n in enumerate(done.lengths)]
        seen.append((step, tuple(int(r) for r in rows), ids, done.version))
        return done

    monkeypatch.setattr(cls, "sample", spy)
    return seen


def is_rollout(path: str, body) -> bool:
    """A POST asking completions (not the first rollout's model check, which asks the
    prompt's log-probs on the same route)."""
    asks = isinstance(body, dict) and ("prompt_logprobs" in body or body.get("return_logprob"))
    return path in ("/v1/completions", "/generate") and not asks


def kd_run(cfg: dict, path: Path, *extra: str) -> int:
    return cli.main(["run", "kd", "--config", str(write_config(path, cfg)), *extra])


def final_weights(out: Path, lora: bool) -> dict[str, torch.Tensor]:
    name = "adapter/adapter_model.safetensors" if lora else "model.safetensors"
    return load_file(out / "final" / name)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


# ---------------------------------------------------------------------------------------------
# Rollouts: the served sampler samples what the local one does, with the weights it was pushed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("api", "lora"), CASES, ids=IDS)
def test_greedy_rollouts_equal_the_local_samplers_after_every_sync(
    assets, tmp_path, monkeypatch, api, lora
):
    local = record(monkeypatch, kd.rollouts.local.LocalSampler)
    remote = record(monkeypatch, kd.rollouts.served.ServedSampler)
    cfg = config(assets, tmp_path / "local", lora=lora, on_policy={})
    assert kd_run(cfg, tmp_path / "local.yaml") == 0
    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME) as server:
        cfg = config(assets, tmp_path / "served", lora=lora, on_policy=served(server, api))
        assert kd_run(cfg, tmp_path / "served.yaml") == 0
        pushes = [p for p, _ in server.log if p not in ("/v1/completions", "/generate")]
    # 3 steps x 2 micro-batches, the same rows and the same greedy tokens at every step.
    assert [(s, r, ids) for s, r, ids, _ in remote] == [(s, r, ids) for s, r, ids, _ in local]
    assert len(remote) == 6
    # Each rollout of step s was sampled with the weights after step s - 1 (synced every step).
    assert [v for *_, v in remote] == [s - 1 for s, *_ in remote]
    rows = read_metrics(tmp_path / "served")
    assert [r["rollout_version_lag"] for r in rows] == [0, 0, 0]
    # The weights changed what the student samples: not the same completions at every step.
    assert len({tuple(map(tuple, ids)) for _, _, ids, _ in remote}) > 1
    # What a push writes: a LoRA student's adapter alone (the server holds the base weights),
    # a full student's whole folder.
    pushed = sorted(p.name for p in (tmp_path / "served").glob("*/v*/**/*") if p.is_file())
    weights = [n for n in pushed if n.endswith(".safetensors")]
    if lora:
        assert weights and set(weights) == {"adapter_model.safetensors"}, pushed
    else:
        assert weights and set(weights) == {"model.safetensors"}, pushed
    # One push before step 1 and one after each step, in the protocol's requests.
    if lora:
        loads = [p for p in pushes if p.endswith("/load_lora_adapter")]
        assert len(loads) == 4
    else:
        reloads = [p for p in pushes if p in ("/collective_rpc", "/update_weights_from_disk")]
        assert len(reloads) == 1 + (4 * 2 if api == "vllm" else 4)  # + the validate probe
    # Identical rollouts, identical training.
    losses = [r["loss"] for r in read_metrics(tmp_path / "local")]
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-6, abs=1e-7)


def test_a_server_never_synced_samples_other_completions(assets, tmp_path, monkeypatch):
    """sync_every_n_steps beyond the run: the server keeps version 0, the rollouts of later
    steps are not the local sampler's, and the metrics say how stale they are."""
    local = record(monkeypatch, kd.rollouts.local.LocalSampler)
    remote = record(monkeypatch, kd.rollouts.served.ServedSampler)
    cfg = config(assets, tmp_path / "local", lora=False, on_policy={})
    assert kd_run(cfg, tmp_path / "local.yaml") == 0
    with RolloutTestServer(assets["student"], api="vllm", model_name=SERVED_NAME) as server:
        node = served(server, "vllm", sync_every_n_steps=100)
        cfg = config(assets, tmp_path / "stale", lora=False, on_policy=node)
        assert kd_run(cfg, tmp_path / "stale.yaml") == 0
    assert [v for *_, v in remote] == [0] * 6
    assert [r["rollout_version_lag"] for r in read_metrics(tmp_path / "stale")] == [0, 1, 2]
    assert remote[:2] == local[:2]  # step 1: both sample version 0
    assert [ids for _, _, ids, _ in remote[2:]] != [ids for _, _, ids, _ in local[2:]]


# ---------------------------------------------------------------------------------------------
# kd validate probes the server
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api", "lora", "server_kw", "node_kw", "says"),
    [
        ("vllm", False, {}, {"server_model": "other"}, "on_policy.server_model: the server at"),
        ("vllm", True, {"runtime_lora": False}, {}, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
        ("sglang", True, {"enable_lora": False}, {}, "start SGLang with --enable-lora"),
        ("vllm", False, {"dev_mode": False}, {}, "VLLM_SERVER_DEV_MODE=1"),
        ("sglang", False, {"max_model_len": 32}, {}, "--max-model-len 64 or more"),
        ("vllm", True, {"max_lora_rank": 2}, {}, "model.lora_rank: the student's rank 4 is"),
        ("sglang", True, {"max_lora_rank": 2}, {}, "--max-lora-rank 4 or more"),
        ("vllm", True, {"enable_lora": False}, {}, "runs without --enable-lora"),
    ],
    ids=[
        "model",
        "vllm-runtime-lora",
        "sglang-lora",
        "vllm-dev-mode",
        "length",
        "vllm-lora-rank",
        "sglang-lora-rank",
        "vllm-no-enable-lora",
    ],
)
def test_validate_probes_the_server(assets, tmp_path, capsys, api, lora, server_kw, node_kw, says):
    with RolloutTestServer(
        assets["student"], api=api, model_name=SERVED_NAME, **server_kw
    ) as server:
        node = served(server, api, **node_kw)
        cfg = config(assets, tmp_path / "out", lora=lora, on_policy=node)
        rc = cli.main(["validate", "--config", str(write_config(tmp_path / "c.yaml", cfg))])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1 and says in lines[0], err
    assert not (tmp_path / "out").exists()  # nothing written


def test_validate_needs_the_server_keys(assets, tmp_path, capsys):
    cfg = config(assets, tmp_path / "out", lora=False, on_policy={"sampler": "served"})
    rc = cli.main(["validate", "--config", str(write_config(tmp_path / "c.yaml", cfg))])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [x for x in err.splitlines() if x.startswith("kd: error:") or x.startswith("  ")]
    assert any("on_policy.server_url: on_policy.sampler is served" in x for x in lines), err
    assert any("on_policy.server_model: on_policy.sampler is served" in x for x in lines), err


# ---------------------------------------------------------------------------------------------
# A server that sleeps while the step trains (server_sleep, vLLM)
# ---------------------------------------------------------------------------------------------


def sleeping_and_awake_runs(
    assets, tmp_path, monkeypatch, *, lora, every, left_asleep=False, steps=3
) -> tuple[dict, list[str]]:
    """A run with server_sleep and one without, each against a fresh server with sleep mode
    (``left_asleep``: the sleeping run's server starts asleep at level 2); asserts they sampled
    the same tokens, trained alike and never asked the server while it slept. Returns the
    recorded rollouts by ``server_sleep`` (and ``left_asleep_at_end``: whether a server was left
    asleep) and the sleeping run's request paths."""
    remote = record(monkeypatch, kd.rollouts.served.ServedSampler)
    runs: dict = {"left_asleep_at_end": False}
    log: list[str] = []
    for sleep in (False, True):
        with RolloutTestServer(
            assets["student"], api="vllm", model_name=SERVED_NAME, sleep_mode=True
        ) as server:
            if sleep and left_asleep:
                server.answer("/sleep", {}, {"level": ["2"]})
            node = served(server, "vllm", server_sleep=sleep, sync_every_n_steps=every)
            cfg = config(assets, tmp_path / f"s{sleep}", lora=lora, on_policy=node)
            assert kd_run(cfg, tmp_path / f"s{sleep}.yaml", f"max_steps_per_epoch={steps}") == 0
            log = [p for p, _ in server.log]
            assert server.asked_asleep == 0
            runs["left_asleep_at_end"] |= bool(server.asleep or server.paused)
        runs[sleep], remote[:] = list(remote), []
    assert [(s, r, ids) for s, r, ids, _ in runs[True]] == [
        (s, r, ids) for s, r, ids, _ in runs[False]
    ]
    losses = [r["loss"] for r in read_metrics(tmp_path / "sFalse")]
    assert [r["loss"] for r in read_metrics(tmp_path / "sTrue")] == losses
    return runs, log


def test_a_vllm_server_under_several_names_samples_under_any_of_them(assets, tmp_path):
    """``vllm serve --served-model-name main student``: kd asks by the second name, and vLLM's
    answers name the first (``OpenAIServingModels.model_name``); the rollouts are the server's
    all the same."""
    names = ("tiny-main", SERVED_NAME)
    with RolloutTestServer(assets["student"], api="vllm", model_name=names) as server:
        cfg = config(assets, tmp_path / "out", lora=False, on_policy=served(server, "vllm"))
        assert kd_run(cfg, tmp_path / "c.yaml") == 0
        answer = requests.post(
            f"{server.url}/v1/completions",
            json={"model": SERVED_NAME, "prompt": [1, 2], "max_tokens": 1},
        ).json()
    assert answer["model"] == "tiny-main"
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3]


@pytest.mark.parametrize(
    ("lora", "every", "levels"),
    [(False, 1, [2, 2, 2]), (False, 2, [1, 2, 1]), (True, 1, [1, 1, 1])],
    ids=["full", "full-every-2", "lora"],
)
def test_a_sleeping_server_samples_what_the_local_sampler_does(
    assets, tmp_path, monkeypatch, lora, every, levels
):
    """Each step's rollouts done, the server sleeps while the step trains: level 2 (weights
    dropped) when the push after the step reloads them, else level 1. It wakes for the push
    (weights, reload, KV cache: vLLM's order) or the rollouts, never asked while asleep, and the
    greedy rollouts are those of the same server never asleep (a level-2 wake without a reload
    samples zeros' tokens: the comparison can fail)."""
    runs, log = sleeping_and_awake_runs(assets, tmp_path, monkeypatch, lora=lora, every=every)
    assert not runs["left_asleep_at_end"]  # the run leaves the server awake
    assert len({tuple(map(tuple, ids)) for _, _, ids, _ in runs[True]}) > 1
    assert [int(p.rsplit("=", 1)[1]) for p in log if p.startswith("/sleep")] == levels
    if not lora:  # after a level-2 sleep: the weights' memory, the reload, then the KV cache
        deep = [i for i, p in enumerate(log) if p == "/sleep?level=2"]
        for i in deep:
            after = [p for p in log[i + 1 :] if p != "/v1/completions"][:4]
            assert after == [
                "/wake_up?tags=weights",
                "/collective_rpc",
                "/collective_rpc",
                "/wake_up?tags=kv_cache",
            ], after


def test_a_server_left_asleep_is_woken_in_order_by_the_next_run(assets, tmp_path, monkeypatch):
    """A server a killed run left asleep at level 2 (weights dropped): the next run's first
    push wakes the weights, reloads and wakes the KV cache, and samples what a server never
    asleep samples."""
    _, log = sleeping_and_awake_runs(
        assets, tmp_path, monkeypatch, lora=False, every=1, left_asleep=True, steps=1
    )
    first = [p for p in log if p != "/v1/completions"][:5]
    assert first[1:] == [
        "/wake_up?tags=weights",
        "/collective_rpc",
        "/collective_rpc",
        "/wake_up?tags=kv_cache",
    ], first


def test_a_level_2_sleep_woken_without_a_reload_samples_other_tokens(assets):
    """The negative control of the test above: the test server's dropped weights change what
    it samples, and a reload into weights still asleep is refused as vLLM's engine crashes."""
    body = {
        "model": SERVED_NAME,
        "prompt": [1, 5, 7, 9],
        "max_tokens": 6,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    with RolloutTestServer(
        assets["student"], api="vllm", model_name=SERVED_NAME, sleep_mode=True
    ) as server:
        before = server.answer("/v1/completions", dict(body))[1]["choices"][0]["token_ids"]
        server.answer("/sleep", {}, {"level": ["2"]})
        crash = server.answer("/collective_rpc", {"method": "reload_weights"})
        assert crash[0] == 500 and "illegal memory access" in json.dumps(crash[1])
        server.answer("/wake_up", {}, {})
        after = server.answer("/v1/completions", dict(body))[1]["choices"][0]["token_ids"]
        assert after != before
        server.answer("/collective_rpc", {"method": "reload_weights"})
        again = server.answer("/v1/completions", dict(body))[1]["choices"][0]["token_ids"]
        assert again == before
        # A wake of the weights alone resumes scheduling: a rollout then finds no KV cache.
        server.answer("/sleep", {}, {"level": ["1"]})
        server.answer("/wake_up", {}, {"tags": ["weights"]})
        with pytest.raises(RuntimeError, match="illegal memory access"):
            server.wait_awake()
        assert server.asked_asleep == 1


@pytest.mark.parametrize(
    ("server_kw", "node_kw", "says"),
    [
        ({"sleep_mode": False}, {}, "--enable-sleep-mode"),
        ({"sleep_mode": True, "dev_mode": False}, {}, "VLLM_SERVER_DEV_MODE=1"),
        ({"sleep_mode": True}, {"async_steps": 1}, "on_policy.server_sleep: sleeps the server"),
        ({"sleep_mode": True}, {"sampler": "local"}, "with on_policy.sampler local there is"),
    ],
    ids=["no-sleep-mode", "no-dev-mode", "async", "local"],
)
def test_validate_checks_the_server_can_sleep(assets, tmp_path, capsys, server_kw, node_kw, says):
    with RolloutTestServer(
        assets["student"], api="vllm", model_name=SERVED_NAME, runtime_lora=True, **server_kw
    ) as server:
        node = served(server, "vllm", server_sleep=True, **node_kw)
        cfg = config(assets, tmp_path / "out", lora=True, on_policy=node)
        rc = cli.main(["validate", "--config", str(write_config(tmp_path / "c.yaml", cfg))])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1 and says in lines[0], err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Tokens, as the servers check them
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api", "server_kw", "envs", "says"),
    [
        ("vllm", {"token": "s3cret"}, {"server_token_env": "wrong"}, "to the token in KD_T_API"),
        (
            "sglang",
            {"admin_token": "adm1n"},
            {},
            "kd sent no token; set on_policy.server_token_env to the variable holding the "
            "server's --api-key (and on_policy.server_admin_token_env",
        ),
        (
            "sglang",
            {"admin_token": "adm1n"},
            {"server_admin_token_env": "wrong"},
            "on_policy.server_admin_token_env: ",
        ),
    ],
    ids=["vllm-wrong-token", "sglang-admin-key-no-token", "sglang-wrong-admin-key"],
)
def test_validate_names_the_token_the_server_refused(
    assets, tmp_path, capsys, monkeypatch, api, server_kw, envs, says
):
    """Each refused token is one line naming the key that sent it (never the token itself):
    a wrong API token; an SGLang admin key and no token sent (its generation routes are open
    then, its weight pushes not); a wrong admin key."""
    node = {}
    for key, value in envs.items():
        var = "KD_T_API" if key == "server_token_env" else "KD_T_ADMIN"
        monkeypatch.setenv(var, value)
        node[key] = var
    with RolloutTestServer(
        assets["student"], api=api, model_name=SERVED_NAME, **server_kw
    ) as server:
        cfg = config(assets, tmp_path / "out", lora=False, on_policy=served(server, api, **node))
        rc = cli.main(["validate", "--config", str(write_config(tmp_path / "c.yaml", cfg))])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1 and says in lines[0] and "HTTP 401" in lines[0], err
    assert "wrong" not in lines[0].replace("KD_T_", "") and "s3cret" not in err


@pytest.mark.parametrize(
    ("api", "lora"), [("vllm", True), ("sglang", False)], ids=["vllm-lora", "sglang-full"]
)
def test_tokens_reach_the_routes_that_check_them(assets, tmp_path, monkeypatch, api, lora):
    """vLLM's --api-key guards its /v1 routes (rollouts, LoRA loading); SGLang's guards the
    rollouts and, with --admin-api-key, only the admin key opens the weight pushes: a run with
    both variables set trains; the same server refuses each key on the other's routes."""
    monkeypatch.setenv("KD_TEST_TOKEN", "s3cret")
    monkeypatch.setenv("KD_TEST_ADMIN", "adm1n")
    keys = {"token": "s3cret", "admin_token": "adm1n" if api == "sglang" else None}
    node = {"server_token_env": "KD_TEST_TOKEN"}
    if api == "sglang":
        node["server_admin_token_env"] = "KD_TEST_ADMIN"
    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME, **keys) as server:
        cfg = config(assets, tmp_path / "out", lora=lora, on_policy=served(server, api, **node))
        assert kd_run(cfg, tmp_path / "run.yaml") == 0
        pushes = [p for p, _ in server.log if p not in ("/v1/completions", "/generate")]
        push = "/v1/load_lora_adapter" if lora else "/update_weights_from_disk"
        generate = "/v1/completions" if api == "vllm" else "/generate"
        assert server.authorized(generate, "Bearer s3cret")
        assert server.authorized(push, f"Bearer {keys['admin_token'] or 's3cret'}")
        assert not server.authorized(generate, None)
        if api == "sglang":  # the API key no longer opens the admin routes, nor the reverse
            assert not server.authorized(push, "Bearer s3cret")
            assert not server.authorized(generate, "Bearer adm1n")
        else:  # vLLM's token guards /v1 only
            assert server.authorized("/collective_rpc", None)
    assert push in pushes
    assert len(read_metrics(tmp_path / "out")) == 3


def test_a_token_refused_mid_run_stops_with_a_checkpoint(assets, tmp_path, capsys, monkeypatch):
    """The SGLang server's admin key changes after step 1: the push after it is refused, the
    run saves step_1 and stops with one line naming the key, exit 2."""
    monkeypatch.setenv("KD_TEST_ADMIN", "adm1n")
    node = {"server_admin_token_env": "KD_TEST_ADMIN", "server_retries": 0}
    out = tmp_path / "out"
    with RolloutTestServer(
        assets["student"], api="sglang", model_name=SERVED_NAME, admin_token="adm1n"
    ) as server:

        def rotate(path, body):
            if path == "/generate":  # step 1 samples: version 0 was taken, version 1 is not
                server.admin_token = "rotated"

        server.on_post = rotate
        cfg = config(assets, out, lora=False, on_policy=served(server, "sglang", **node))
        capsys.readouterr()
        rc = kd_run(cfg, tmp_path / "run.yaml")
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1 and "on_policy.server_admin_token_env:" in lines[0], err
    assert "HTTP 401" in lines[0] and "KD_TEST_ADMIN" in lines[0] and "adm1n" not in err
    assert (out / "step_000001").is_dir() and not (out / "final").exists()


# ---------------------------------------------------------------------------------------------
# A server that dies, a kd killed mid-push: nothing is lost
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api", "lora"), [("vllm", True), ("sglang", False)], ids=["vllm-lora", "sglang-full"]
)
def test_a_server_that_dies_stops_the_run_cleanly_and_resume_finishes_it(
    assets, tmp_path, capsys, api, lora
):
    """Weights pushed every 2 steps; the server dies at step 2's first rollout: the run saves
    step_1 and stops (exit 2, one line). The resumed run, with a new server, pushes version 0
    again (the one step 1's checkpoint was sampling with, kept on disk) and ends with the
    weights of a run that never stopped."""
    fast = {"server_retries": 0, "server_timeout": 20, "sync_every_n_steps": 2}
    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME) as server:
        cfg = config(assets, tmp_path / "ref", lora=lora, on_policy=served(server, api, **fast))
        assert kd_run(cfg, tmp_path / "ref.yaml", "max_steps_per_epoch=4") == 0
    reference = final_weights(tmp_path / "ref", lora)

    out = tmp_path / "run"
    server = RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME).start()
    generate = "/v1/completions" if api == "vllm" else "/generate"
    state = {"rollouts": 0}

    def die_at_step_2(path, body):
        if is_rollout(path, body):  # step 1 asks 8 rollouts (2 micro-batches of 4 rows)
            state["rollouts"] += 1
            if state["rollouts"] == 9:  # the first of step 2: killed before it is answered
                server.kill_on = generate

    server.on_post = die_at_step_2
    capsys.readouterr()
    cfg = config(assets, out, lora=lora, on_policy=served(server, api, **fast))
    rc = kd_run(cfg, tmp_path / "run.yaml", "max_steps_per_epoch=4")
    server.kill()
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1 and "on_policy.server_url:" in lines[0], err
    assert "did not answer" in lines[0]
    assert (out / "step_000001").is_dir() and not (out / "final").exists()
    assert [r["step"] for r in read_metrics(out)] == [1]

    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME) as fresh:
        cfg = config(assets, out, lora=lora, on_policy=served(fresh, api, **fast))
        resume = ("max_steps_per_epoch=4", "resume_from_checkpoint=true")
        assert kd_run(cfg, tmp_path / "resume.yaml", *resume) == 0
        pushed = [_push_version(api, lora, p, b) for p, b in fresh.log]
    assert [v for v in pushed if v is not None] == [0, 2, 4]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert [r["rollout_version_lag"] for r in read_metrics(out)] == [0, 1, 0, 1]
    assert_same_weights(final_weights(out, lora), reference)


def _push_version(api: str, lora: bool, path: str, body) -> int | None:
    """The weight version a POST pushes (None: not a push)."""
    if not isinstance(body, dict):
        return None
    if lora and path.endswith("/load_lora_adapter"):
        return int(str(body["lora_name"]).rsplit("-v", 1)[1])
    if api == "vllm" and body.get("method") == "update_config":
        return int(Path(body["args"][0]["model_config"]["model"]).name[1:])
    if api == "sglang" and path == "/update_weights_from_disk" and "weight_version" in body:
        return int(body["weight_version"])  # (not the probe before training: an empty body)
    return None


@pytest.mark.slow  # kd in subprocesses
@pytest.mark.parametrize(
    ("api", "lora"), [("vllm", False), ("sglang", True)], ids=["vllm-full", "sglang-lora"]
)
def test_kill_9_during_a_weight_push_then_resume_loses_nothing(assets, tmp_path, api, lora):
    """kd is killed (SIGKILL) while the server takes version 2; the resumed run (same server,
    which did load it) pushes again and ends with the weights of a run never killed."""
    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME) as server:
        cfg = config(assets, tmp_path / "ref", lora=lora, on_policy=served(server, api))
        assert kd_run(cfg, tmp_path / "ref.yaml", "save_every_n_steps=1") == 0
    reference = final_weights(tmp_path / "ref", lora)

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME) as server:
        cfg = config(assets, out, lora=lora, on_policy=served(server, api))
        path = write_config(tmp_path / "run.yaml", cfg)
        run_kd = ["run", "kd", "--config", str(path), "save_every_n_steps=1"]
        argv = [sys.executable, "-m", "kd.cli", *run_kd]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        killed = {}

        def kill_during_push(path, body):
            if _push_version(api, lora, path, body) == 2 and not killed:
                killed["at"] = path
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)

        server.on_post = kill_during_push
        try:
            _, err = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
        assert killed
        assert not (out / "final").exists()
        assert (out / "served_weights" / "v000002").is_dir()  # sealed before the server took it
        server.on_post = None
        rc = kd_run(
            cfg, tmp_path / "resume.yaml", "save_every_n_steps=1", "resume_from_checkpoint=true"
        )
        assert rc == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert_same_weights(final_weights(out, lora), reference)
    # Nothing half-written is left; only the versions a kept checkpoint or the run needs.
    left = sorted(p.name for p in (out / "served_weights").iterdir())
    assert not [n for n in left if n.startswith(".tmp")]


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


def test_the_plan_counts_no_kv_cache_for_a_served_sampler(assets, tmp_path, capsys):
    """kd plan: the local sampler's generation phase (a KV cache on the training device) is
    gone with a served sampler; nothing else changes."""
    plans = {}
    for name, node in (
        ("local", {}),
        ("served", {"sampler": "served", "server_url": "http://127.0.0.1:9", "server_model": "x"}),
    ):
        cfg = config(assets, tmp_path / name, lora=False, on_policy=node)
        capsys.readouterr()
        path = write_config(tmp_path / f"{name}.yaml", cfg)
        assert cli.main(["plan", "--config", str(path), "--json"]) == 0
        plans[name] = json.loads(capsys.readouterr().out)
    phases = {
        k: [p["name"] if isinstance(p, dict) else p for p in v["phases"]] for k, v in plans.items()
    }
    assert phases["local"] == ["generation", "forward", "backward", "optimizer_step"]
    assert phases["served"] == ["forward", "backward", "optimizer_step"]
    assert plans["served"]["peak_gib"] <= plans["local"]["peak_gib"]
    assert plans["served"]["between_steps_gib"] is None


def test_the_plan_says_what_kd_holds_while_a_sleeping_server_samples(assets, tmp_path, capsys):
    """server_sleep: the plan states what kd keeps on the device while the server is awake
    (the optimizer step's tensors and the CUDA runtime, its cache freed): the rest is the
    server's."""
    node = {"sampler": "served", "server_url": "http://127.0.0.1:9", "server_model": "x"}
    node["server_sleep"] = True
    cfg = config(assets, tmp_path / "out", lora=False, on_policy=node)
    path = write_config(tmp_path / "c.yaml", cfg)
    capsys.readouterr()
    assert cli.main(["plan", "--config", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    step = plan["phase_components"]["optimizer_step"]
    held = sum(v for c, v in step.items() if c != "allocator_slack")
    assert plan["between_steps_gib"] == pytest.approx(held, abs=1e-3)
    assert 0 < held < plan["phases"]["optimizer_step"]
    assert cli.main(["plan", "--config", str(path)]) == 0
    assert f"kd holds {held:.2f} GiB" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# torchrun: rank 0 pushes, every rank samples its own rows
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # kd in subprocesses
def test_two_ranks_push_once_and_sample_their_own_rows(assets, tmp_path):
    """2 CPU ranks (gloo, FSDP2) against one device with the same global batch: every version is
    pushed once (rank 0), every row is asked once (by the rank that holds it), and the two runs
    train alike."""
    from kd.testing import run_launch

    logs = {}
    for ranks in (1, 2):
        out = tmp_path / f"r{ranks}"
        with RolloutTestServer(assets["student"], api="vllm", model_name=SERVED_NAME) as server:
            cfg = config(
                assets,
                out,
                lora=True,
                on_policy=served(server, "vllm"),
                batch_size=4 // ranks,
            )
            path = write_config(tmp_path / f"r{ranks}.yaml", cfg)
            if ranks == 1:
                assert kd_run(cfg, path) == 0
            else:
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
                cmd = [sys.executable, "-m", "kd.cli", "run", "--nproc_per_node", "2"]
                proc = run_launch(
                    [*cmd, "kd_distributed", "--config", str(path)], env=env, timeout=600
                )
                assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
            logs[ranks] = list(server.log)
    for ranks, log in logs.items():
        loads = [b["lora_name"].rsplit("-v", 1)[1] for p, b in log if p == "/v1/load_lora_adapter"]
        assert loads == ["0", "1", "2", "3"], (ranks, loads)
    prompts = {
        r: sorted(tuple(b["prompt"]) for p, b in log if is_rollout(p, b)) for r, log in logs.items()
    }
    assert len(prompts[1]) == 24 and prompts[1] == prompts[2]
    one, two = read_metrics(tmp_path / "r1"), read_metrics(tmp_path / "r2")
    assert [r["num_tokens"] for r in one] == [r["num_tokens"] for r in two]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4, abs=1e-5)


def test_async_steps_sample_the_next_step_from_the_server_while_this_one_trains(
    assets, tmp_path, monkeypatch
):
    """async_steps 1: step s + 1's rollouts are asked while step s trains, with the version the
    server holds then (one step stale); the metrics say so."""
    remote = record(monkeypatch, kd.rollouts.served.ServedSampler)
    with RolloutTestServer(assets["student"], api="sglang", model_name=SERVED_NAME) as server:
        node = served(server, "sglang", async_steps=1)
        cfg = config(assets, tmp_path / "out", lora=True, on_policy=node)
        assert kd_run(cfg, tmp_path / "c.yaml") == 0
    assert [r["rollout_version_lag"] for r in read_metrics(tmp_path / "out")] == [0, 1, 1]
    assert sorted({(s, v) for s, _, _, v in remote}) == [(1, 0), (2, 0), (3, 1)]


# ---------------------------------------------------------------------------------------------
# What the server refuses or gets wrong: one line, exit 2
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("api", "lora"), [("vllm", True), ("sglang", False)], ids=IDS[1:3])
def test_a_server_that_cannot_read_the_pushed_folder_stops_before_training(
    assets, tmp_path, capsys, api, lora
):
    """The server runs elsewhere and sees only its own disk: the first push (version 0) is
    refused and the run stops before its first step, saying where the weights must go."""
    elsewhere = tmp_path / "server_disk"
    elsewhere.mkdir()
    with RolloutTestServer(
        assets["student"], api=api, model_name=SERVED_NAME, sees=elsewhere
    ) as server:
        cfg = config(assets, tmp_path / "out", lora=lora, on_policy=served(server, api))
        capsys.readouterr()
        rc = kd_run(cfg, tmp_path / "c.yaml")
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert "refused the student's" in lines[0] and "weight version v000000" in lines[0]
    assert "point on_policy.server_sync_dir at a folder it sees" in lines[0]
    assert (
        not read_metrics(tmp_path / "out")
        if (tmp_path / "out" / "metrics.jsonl").exists()
        else True
    )


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_a_server_on_another_base_model_is_refused_at_the_first_rollout(
    assets, tmp_path, capsys, api
):
    """A LoRA student's adapter pushed to a server serving another base model under the name:
    the first rollout's model check (the server's top-1 log-probs over the first prompt against
    the student's) stops the run before any step trains, in one line; the server of the
    student's own base passes it (every other test here)."""
    other = tmp_path / "other_base"
    write_tiny_model(other, tiny_model(STUDENT), seed=11, writer="transformers", perturb=0.3)
    with RolloutTestServer(other, api=api, model_name=SERVED_NAME) as server:
        cfg = config(assets, tmp_path / "out", lora=True, on_policy=served(server, api))
        capsys.readouterr()
        rc = kd_run(cfg, tmp_path / "c.yaml")
        asked = [p for p, b in server.log if is_rollout(p, b)]
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1 and "on_policy.server_model:" in lines[0], err
    assert "does not serve the student" in lines[0] and "base model" in lines[0]
    assert asked == []  # not one rollout asked, nothing trained
    assert read_metrics(tmp_path / "out") == [] and not (tmp_path / "out" / "final").exists()
    # The escape hatch: the same server, the check said and not enforced.
    with RolloutTestServer(other, api=api, model_name=SERVED_NAME) as server:
        node = served(server, api, server_check_model=False)
        cfg = config(assets, tmp_path / "off", lora=True, on_policy=node)
        assert kd_run(cfg, tmp_path / "off.yaml") == 0
    assert "check that the server serves the student's model" in capsys.readouterr().err


def test_a_malformed_rollout_stops_the_run_with_a_checkpoint(assets, tmp_path, capsys):
    """A completion holding an id no tokenizer token has (step 2's first rollout): refused, never
    trained on; step 1 is saved and the run exits 2 with the row's problem."""
    with RolloutTestServer(assets["student"], api="vllm", model_name=SERVED_NAME) as server:
        # The probe, version 0's push (2 requests), the model check, step 1's 8 rollouts and
        # version 1's push (2).
        server.faults.extend([""] * 14 + ["bad_id"])
        cfg = config(assets, tmp_path / "out", lora=False, on_policy=served(server, "vllm"))
        capsys.readouterr()
        rc = kd_run(cfg, tmp_path / "c.yaml")
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert (
        "gave a malformed rollout: token 0 is id 287, outside the ids the tokenizer has"
        in (lines[0])
    )
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1]
    assert (tmp_path / "out" / "step_000001").is_dir()


def _restart_after_taking(server: RolloutTestServer, version: int) -> None:
    """The server restarts right after it takes ``version``: its weights are those it was
    started with again, and it holds no adapter (SGLang: its --weight-version, "default")."""
    handler = "sglang" if server.api == "sglang" else "vllm"
    taking = {"lora": getattr(server, f"{handler}_load_lora")}
    taking["full"] = server.sglang_update_weights

    def restarted(kind: str):
        def take(body):
            answer = taking[kind](body)
            name = str(body.get("lora_name", body.get("weight_version", "")))
            if name.endswith(str(version)):
                server.model.reload(server.model_path)
                server.model.adapters.clear()
                server.lora_paths.clear()
                server.weight_version = "default"
            return answer

        return take

    setattr(server, f"{handler}_load_lora", restarted("lora"))
    server.sglang_update_weights = restarted("full")


@pytest.mark.parametrize(("api", "lora"), CASES[1:], ids=IDS[1:])
def test_a_server_that_restarts_between_steps_stops_the_run_before_it_trains_on_its_weights(
    assets, tmp_path, capsys, api, lora
):
    """The server restarts after it took version 2 (its own weights again, no adapter): step 3's
    rollouts (an adapter it no longer has, SGLang's "default" weight version) stop the run with
    step_2 saved, saying what happened and that a resume pushes the version again."""
    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME) as server:
        _restart_after_taking(server, 2)
        cfg = config(assets, tmp_path / "out", lora=lora, on_policy=served(server, api))
        capsys.readouterr()
        rc = kd_run(cfg, tmp_path / "c.yaml")
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert "no longer samples weight version 2, which kd pushed" in lines[0], lines[0]
    assert "resume_from_checkpoint=true pushes the version again" in lines[0]
    assert "check on_policy.server_api" not in lines[0]
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2]
    assert (tmp_path / "out" / "step_000002").is_dir()


def test_the_test_server_answers_lora_mistakes_as_the_servers_do(assets, tmp_path):
    """The refusals kd reads, as vLLM's and SGLang's source writes them."""
    import requests

    adapter = tmp_path / "missing"
    with RolloutTestServer(assets["student"], api="vllm", model_name=SERVED_NAME) as v:
        r = requests.post(
            f"{v.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)}
        )
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "NotFoundError" and "No adapter found" in r.text
        r = requests.post(f"{v.url}/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "The lora adapter 'a' cannot be found."
        r = requests.post(f"{v.url}/v1/completions", json={"model": "a", "prompt": [1, 2]})
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "The model `a` does not exist."
    with RolloutTestServer(assets["student"], api="vllm", runtime_lora=False) as v:
        r = requests.post(
            f"{v.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "x"}
        )
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
    with RolloutTestServer(assets["student"], api="sglang", enable_lora=False) as s:
        r = requests.post(f"{s.url}/load_lora_adapter", json={"lora_name": "a", "lora_path": "x"})
        assert r.status_code == 400
        assert r.json()["error_message"] == (
            "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        )
    with RolloutTestServer(assets["student"], api="sglang") as s:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "lora_path": "a"}
        r = requests.post(f"{s.url}/generate", json=body)
        assert r.status_code == 400
        assert (
            "The following requested LoRA adapters are not loaded: a"
            in r.json()["error"]["message"]
        )
        # An aborted request (TokenizerManager._handle_abort_req): 200, no output_ids.
        s.faults.append("abort")
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        r = requests.post(f"{s.url}/generate", json=body)
        assert r.status_code == 200 and "output_ids" not in r.json()
        reason = {"type": "abort", "message": "Abort before prefill"}
        assert r.json()["meta_info"]["finish_reason"] == reason
    with RolloutTestServer(assets["student"], api="sglang", weight_versions=False) as s:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        assert "weight_version" not in requests.post(f"{s.url}/generate", json=body).json()
        assert "weight_version" not in requests.get(f"{s.url}/get_model_info").json()
    with RolloutTestServer(assets["student"], api="vllm", model_name=SERVED_NAME) as v:
        v.faults.append("abort")  # an engine abort (another client's /pause): 200
        body = {"model": SERVED_NAME, "prompt": [1, 2], "return_token_ids": True}
        r = requests.post(f"{v.url}/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == SERVED_NAME
        assert r.json()["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize(
    ("api", "lora"), [("vllm", True), ("sglang", False)], ids=["vllm-lora", "sglang-full"]
)
def test_a_server_that_dies_during_a_push_stops_with_that_step_saved(
    assets, tmp_path, capsys, api, lora
):
    """The server dies while it takes version 2 (after step 2 is applied): the run stops before
    step 3 trains, with step_2 saved as step 2 (never step 2's weights under step 1's name), and
    the resumed run pushes version 2 again and ends as a run that never stopped."""
    fast = {"server_retries": 0, "server_timeout": 20}
    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME) as server:
        cfg = config(assets, tmp_path / "ref", lora=lora, on_policy=served(server, api, **fast))
        assert kd_run(cfg, tmp_path / "ref.yaml") == 0
    reference = final_weights(tmp_path / "ref", lora)

    out = tmp_path / "run"
    server = RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME).start()

    def die_taking_version_2(path, body):
        if _push_version(api, lora, path, body) == 2:
            server.kill_on = path

    server.on_post = die_taking_version_2
    capsys.readouterr()
    cfg = config(assets, out, lora=lora, on_policy=served(server, api, **fast))
    rc = kd_run(cfg, tmp_path / "run.yaml")
    server.kill()
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1 and "stopped after step 2" in lines[0], err
    assert "the last weight push failed" not in err  # said once, in the error line
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert (out / "step_000002").is_dir() and not (out / "final").exists()

    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME) as fresh:
        cfg = config(assets, out, lora=lora, on_policy=served(fresh, api, **fast))
        assert kd_run(cfg, tmp_path / "resume.yaml", "resume_from_checkpoint=true") == 0
        pushed = [_push_version(api, lora, p, b) for p, b in fresh.log]
    assert [v for v in pushed if v is not None] == [2, 3]
    assert_same_weights(final_weights(out, lora), reference)


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_an_adapter_load_whose_answer_is_lost_is_retried_and_the_run_goes_on(assets, tmp_path, api):
    """The server loads version 1's adapter, but its answer is lost (the connection closes): the
    retry finds the name taken (vLLM "has already been loaded", SGLang "already exists"), so
    kd unloads it and loads it again, and the run ends as one never interrupted."""
    names: list[str] = []

    def lose_the_first_answer(path, body):
        if path.endswith("/load_lora_adapter") and str(body["lora_name"]).endswith("-v1"):
            names.append(body["lora_name"])
            if len(names) == 1:
                server.faults.appendleft("lost")

    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME) as server:
        server.on_post = lose_the_first_answer
        node = served(server, api, server_backoff=0)
        cfg = config(assets, tmp_path / "out", lora=True, on_policy=node)
        assert kd_run(cfg, tmp_path / "c.yaml") == 0
        assert len(names) == 3  # lost, refused as taken, loaded after the unload
        assert server.lora_paths and all(not n.endswith("-v1") for n in server.lora_paths)
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3]


def test_a_server_that_dies_during_async_sampling_stops_before_the_next_step_trains(
    assets, tmp_path, capsys
):
    """async_steps 1: step 3's rollouts are asked while step 2 trains and the server dies then;
    the run stops before step 3 trains, with step_2 saved, and resume finishes it."""
    fast = {"server_retries": 0, "server_timeout": 20, "async_steps": 1}
    server = RolloutTestServer(assets["student"], api="vllm", model_name=SERVED_NAME).start()
    state = {"rollouts": 0}

    def die_at_step_3(path, body):
        if is_rollout(path, body):  # steps 1 and 2 ask 8 rollouts each
            state["rollouts"] += 1
            if state["rollouts"] == 17:
                server.kill_on = path

    server.on_post = die_at_step_3
    out = tmp_path / "run"
    cfg = config(assets, out, lora=True, on_policy=served(server, "vllm", **fast))
    capsys.readouterr()
    rc = kd_run(cfg, tmp_path / "run.yaml")
    server.kill()
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1 and "stopped after step 2" in lines[0], err
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    with RolloutTestServer(assets["student"], api="vllm", model_name=SERVED_NAME) as fresh:
        cfg = config(assets, out, lora=True, on_policy=served(fresh, "vllm", **fast))
        assert kd_run(cfg, tmp_path / "resume.yaml", "resume_from_checkpoint=true") == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


@pytest.mark.parametrize("legacy", [False, True], ids=["vllm-main", "vllm-0.12"])
def test_an_adapter_rank_above_the_servers_stops_at_the_first_push_naming_the_flag(
    assets, tmp_path, capsys, legacy
):
    """A vLLM server without dev mode does not say its --max-lora-rank, so the probe passes and
    the first push (version 0) is refused: vLLM's main branch answers HTTP 500 "Call to add_lora
    method failed: LoRA rank 4 is greater than max_lora_rank 2." (0.11-0.12: 400). Asked once,
    not retried (it would refuse again), and the one line says the server's words and the flag."""
    with RolloutTestServer(
        assets["student"],
        api="vllm",
        model_name=SERVED_NAME,
        dev_mode=False,
        max_lora_rank=2,
        legacy_lora_errors=legacy,
    ) as server:
        node = served(server, "vllm", server_backoff=0)
        cfg = config(assets, tmp_path / "out", lora=True, on_policy=node)
        capsys.readouterr()
        rc = kd_run(cfg, tmp_path / "c.yaml")
        loads = [p for p, _ in server.log if p == "/v1/load_lora_adapter"]
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert f"with HTTP {400 if legacy else 500}" in lines[0], lines[0]
    assert "LoRA rank 4 is greater than max_lora_rank 2." in lines[0], lines[0]
    assert "start the server with --max-lora-rank 4 or more" in lines[0], lines[0]
    assert "retries" not in lines[0]
    assert len(loads) == 1  # a deterministic refusal is not asked again
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert not metrics.exists() or read_metrics(tmp_path / "out") == []  # nothing trained


def _abort_rollouts(server: RolloutTestServer, *, after: int, times: int | None) -> None:
    """Every rollout from the ``after + 1``-th on is answered as aborted (``times`` of them;
    None: all), as the server answers a request another client's pause or abort cut."""
    state = {"rollouts": 0, "aborted": 0}

    def abort(path, body):
        if is_rollout(path, body):
            state["rollouts"] += 1
            if state["rollouts"] > after and (times is None or state["aborted"] < times):
                state["aborted"] += 1
                server.faults.appendleft("abort")

    server.on_post = abort


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_an_aborted_rollout_is_asked_again_and_the_run_goes_on(assets, tmp_path, capsys, api):
    """One rollout answered aborted (vLLM finish_reason "abort", SGLang's "Abort before
    prefill" without output_ids): asked again, the run ends as one never aborted; aborted every
    time, the run stops after step 1 saying the server aborted it (not a malformed answer)."""
    lora = api == "vllm"
    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME) as server:
        _abort_rollouts(server, after=9, times=1)
        node = served(server, api, server_backoff=0)
        cfg = config(assets, tmp_path / "once", lora=lora, on_policy=node)
        assert kd_run(cfg, tmp_path / "once.yaml") == 0
    assert [r["step"] for r in read_metrics(tmp_path / "once")] == [1, 2, 3]

    with RolloutTestServer(assets["student"], api=api, model_name=SERVED_NAME) as server:
        _abort_rollouts(server, after=8, times=None)  # step 2's rollouts on
        node = served(server, api, server_backoff=0, server_retries=2)
        cfg = config(assets, tmp_path / "out", lora=lora, on_policy=node)
        capsys.readouterr()
        rc = kd_run(cfg, tmp_path / "c.yaml")
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert "aborted the rollout 3 time(s)" in lines[0], lines[0]
    assert "see the server's log" in lines[0] and "malformed" not in lines[0], lines[0]
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1]
    assert (tmp_path / "out" / "step_000001").is_dir()


def test_an_sglang_without_weight_versions_is_said_once(assets, tmp_path, capsys):
    """An SGLang before August 2025 answers without meta_info.weight_version: the run goes on
    (a vLLM full student has none either), and the log says once what kd cannot check."""
    with RolloutTestServer(
        assets["student"], api="sglang", model_name=SERVED_NAME, weight_versions=False
    ) as server:
        cfg = config(assets, tmp_path / "out", lora=False, on_policy=served(server, "sglang"))
        capsys.readouterr()
        assert kd_run(cfg, tmp_path / "c.yaml") == 0
    err = capsys.readouterr().err
    assert err.count("answers without meta_info.weight_version") == 1, err
    assert "SGLang before August 2025" in err
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3]
