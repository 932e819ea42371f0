"""The rollout component through ``kd run``: ``on_policy.batch_rollouts`` (one generation per step,
the fast decode) trains on the completions today's sampler makes, ``on_policy.async_steps: 0`` is
today's run, ``async_steps: 1`` samples one step ahead (lag logged) and resumes exactly."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kd.rollouts.local
from kd import checkpoint, cli
from kd.rollouts.base import RolloutStopped
from tests.conftest import UNTIMED, make_config, read_metrics, sigterm_at_step, write_config

RECIPE = ["run", "kd"]
TIMED = UNTIMED | {"time_wait_rollout_s"}


pytestmark = pytest.mark.usefixtures("one_thread")


def on_policy(**kw) -> dict:
    node = {"lmbda": 1.0, "max_new_tokens": 8, "temperature": 1.0, "top_p": 0.95}
    node.update(kw)
    return node


def run(tmp_path: Path, name: str, assets: dict, **top) -> Path:
    out = tmp_path / name
    config = write_config(tmp_path / f"{name}.yaml", make_config(assets, out, **top))
    assert cli.main([*RECIPE, "--config", str(config)]) == 0
    return out


def losses(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMED} for r in read_metrics(out)]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_batch_rollouts_train_on_todays_completions(assets, tmp_path, monkeypatch, temperature):
    """One generation per step over both micro-batches (groups of 3 rows, by length), the fast
    decode: the same completions, so the same losses and weights, as a generation per
    micro-batch; and the sampler ran once per step."""
    calls: list[int] = []
    original = kd.rollouts.local.fast_rollout

    def spy(model, prompts, **kw):
        calls.append(prompts.tokens.shape[0])
        return original(model, prompts, **kw)

    monkeypatch.setattr(kd.rollouts.local, "fast_rollout", spy)
    today = run(tmp_path, "today", assets, on_policy=on_policy(temperature=temperature))
    fast = run(
        tmp_path,
        "fast",
        assets,
        on_policy=on_policy(temperature=temperature, batch_rollouts=True, rollout_batch_size=3),
    )
    assert calls == [8, 8, 8]  # 3 steps, 2 micro-batches of 4 rows each, one call a step
    assert losses(fast) == losses(today)
    assert_same_weights(today, fast)


def test_async_steps_0_is_todays_run(assets, tmp_path):
    today = run(tmp_path, "today", assets, on_policy=on_policy(lmbda=0.5))
    zero = run(tmp_path, "zero", assets, on_policy=on_policy(lmbda=0.5, async_steps=0))
    assert [r["loss"] for r in read_metrics(zero)] == [r["loss"] for r in read_metrics(today)]
    assert losses(zero) == losses(today)
    assert_same_weights(today, zero)


def test_async_steps_1_samples_one_step_ahead(assets, tmp_path, monkeypatch):
    """Step 1 samples with the initial weights on the main thread; steps 2 and 3 are sampled on
    the background thread while the step before trains, by the frozen copy one optimizer step
    behind; each row says the lag and the wait, and step 1 equals the synchronous run."""
    seen: list[tuple[int, int, str]] = []
    original = kd.rollouts.local.LocalSampler.sample

    def spy(self, prompts, *, step, **kw):
        seen.append((step, self.version, threading.current_thread().name.split("_")[0]))
        return original(self, prompts, step=step, **kw)

    monkeypatch.setattr(kd.rollouts.local.LocalSampler, "sample", spy)
    sync = run(tmp_path, "sync", assets, on_policy=on_policy(temperature=0.0))
    seen.clear()
    ahead = run(tmp_path, "ahead", assets, on_policy=on_policy(temperature=0.0, async_steps=1))
    main = threading.main_thread().name
    assert seen == [
        (1, 0, main),
        (1, 0, main),
        (2, 0, "kd-rollout"),
        (2, 0, "kd-rollout"),
        (3, 1, "kd-rollout"),
        (3, 1, "kd-rollout"),
    ]
    rows = read_metrics(ahead)
    assert [r["rollout_version_lag"] for r in rows] == [0, 1, 1]
    assert all(r["time_wait_rollout_s"] >= 0 for r in rows)
    assert losses(ahead)[0] == {
        **losses(sync)[0],
        "rollout_version_lag": 0,
    }


def test_async_steps_1_counts_the_wait_for_rollouts_in_the_step(assets, tmp_path, monkeypatch):
    """The background sampling of the next step takes 2 s (two micro-batches of 1 s), far longer
    than a tiny step trains: the step waits for it after its optimizer step, and that wait is the
    step's time (its tokens/s and its ``generate`` phase), not hidden between steps (the H100 run
    of 2026-11-27 logged 0.27 s steps while each took 4.6 s of wall time)."""
    import time

    original = kd.rollouts.local.LocalSampler.sample

    def slow(self, prompts, **kw):
        if threading.current_thread().name.startswith("kd-rollout"):
            time.sleep(1.0)
        return original(self, prompts, **kw)

    monkeypatch.setattr(kd.rollouts.local.LocalSampler, "sample", slow)
    out = run(tmp_path, "ahead", assets, on_policy=on_policy(temperature=0.0, async_steps=1))
    rows = read_metrics(out)
    seconds = [r["num_tokens"] / r["tokens_per_second"] for r in rows]
    # steps 1 and 2 wait for the next step's completions (step 3 has none after it)
    assert seconds[0] >= 2.0 and seconds[1] >= 2.0, seconds
    for r, s in zip(rows[:2], seconds[:2], strict=True):
        assert r["time_wait_rollout_s"] <= s
        assert r["time_generate_s"] + r["time_teacher_s"] + r["time_student_s"] == pytest.approx(s)
        assert r["time_generate_s"] >= r["time_wait_rollout_s"] > 0


BF16 = {"sampling_dtype": "bf16"}


@pytest.mark.parametrize(
    "extra",
    [
        {"async_steps": 1},
        {"batch_rollouts": True},
        BF16,
        {**BF16, "async_steps": 1},
        {**BF16, "batch_rollouts": True},
    ],
    ids=["async", "batched", "bf16-sync", "bf16-async", "bf16-fast"],
)
def test_interrupted_run_resumes_exactly(assets, tmp_path, monkeypatch, extra):
    """Stopped after step 2 (saved there, the step-3 completions sampled ahead kept in the
    checkpoint) and resumed: the losses and the final weights of the uninterrupted run. With
    ``sampling_dtype: bf16`` the sampler's bf16 copy is rebuilt from the saved weights."""
    top = dict(
        max_steps_per_epoch=4,
        save_every_n_steps=2,
        on_policy=on_policy(lmbda=0.5, **extra),
    )
    reference = run(tmp_path, "reference", assets, **top)
    out = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", make_config(assets, out, **top))
    with monkeypatch.context() as m:
        sigterm_at_step(m, 2)
        assert cli.main([*RECIPE, "--config", str(config)]) == 0
    assert not (out / "final").exists()
    assert checkpoint.read_checkpoint_marker(checkpoint.find_latest_checkpoint(out))["step"] == 2
    assert cli.main([*RECIPE, "--config", str(config), "resume_from_checkpoint=true"]) == 0
    assert losses(out) == losses(reference)
    assert_same_weights(reference, out)


def test_sampler_that_stops_saves_and_resume_finishes(assets, tmp_path, monkeypatch, capsys):
    """A sampler that cannot sample step 3's completions (on the background thread, while step 2
    trains): step 2 ends and is saved, the run stops with one line (exit 2), and a resumed run
    finishes from that save."""
    original = kd.rollouts.local.LocalSampler.sample

    def failing(self, prompts, *, step, **kw):
        if step == 3:
            raise RolloutStopped("on_policy: the sampler stopped (test)")
        return original(self, prompts, step=step, **kw)

    top = dict(max_steps_per_epoch=4, on_policy=on_policy(async_steps=1))
    out = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", make_config(assets, out, **top))
    with monkeypatch.context() as m:
        m.setattr(kd.rollouts.local.LocalSampler, "sample", failing)
        assert cli.main([*RECIPE, "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    saved = checkpoint.find_latest_checkpoint(out)
    assert err[-1] == (
        f"kd: error: on_policy: the sampler stopped (test); stopped after step 2; saved {saved} "
        "(resume_from_checkpoint=true continues from it)"
    )
    assert checkpoint.read_checkpoint_marker(saved)["step"] == 2
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert cli.main([*RECIPE, "--config", str(config), "resume_from_checkpoint=true"]) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert (out / "final" / "model.safetensors").exists()
