"""On-policy distillation (``on_policy:``) on 2 CPU ranks (gloo, FSDP2) against one device with the
same global batch, through the command a user types (``kd run --nproc_per_node 2 kd_distributed``).

The student samples its completions while sharded (FSDP2 gathers each layer per decoding step), so
every rank must run the same number of decoding steps; each row draws from its own generator
(seed, epoch, row), so the same rows sample the same tokens on 1 or 2 ranks. Every launch records
each rank's rollouts (a ``sitecustomize`` wraps :func:`kd.rollouts.sampling.rollout`) so the tests check
the sampled tokens themselves, not only the losses they lead to. fp32, shuffle off.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kd import cli
from kd.rollouts import sampling
from kd.testing import run_launch
from tests.conftest import make_config, read_metrics, write_config
from tests.integration.runtime.test_distributed_run import (
    _RANK0_ONLY_GUARD,
    COMPARED,
    TOL,
    _assert_same_files,
)

STEPS = 3
ON_POLICY = {"lmbda": 1.0, "max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0}


def _recording(rollout: Callable, path: str) -> Callable:
    """``rollout`` that appends each call (the sampling model's vocabulary, the decoding steps run,
    every row's prompt and completion) as a json line to ``path``. Its source is also the
    workers' ``sitecustomize``, hence the import inside."""
    import json

    def recorded(model, prompts, **kwargs):
        out = rollout(model, prompts, **kwargs)
        width = prompts.tokens.shape[1]
        rows = [
            {
                "prompt": prompts.tokens[i, width - n :].tolist(),
                "completion": out.tokens[i, : int(out.lengths[i])].tolist(),
            }
            for i, n in enumerate(prompts.lengths.tolist())
        ]
        vocab = model.tok_embeddings.num_embeddings
        line = {"vocab": vocab, "steps": out.steps, "rows": rows}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return out

    return recorded


# Every process of a launch: the rank-0-only weight guard, and each rank's rollouts recorded.
_SITECUSTOMIZE = f"""{_RANK0_ONLY_GUARD}
from collections.abc import Callable

{inspect.getsource(_recording)}

if "RANK" in os.environ:
    from kd.rollouts import sampling

    sampling.rollout = _recording(
        sampling.rollout,
        os.path.join(os.environ["KD_TEST_ROLLOUTS"], f"rank{{os.environ['RANK']}}.jsonl"),
    )
"""


def _launch(cfg_path: Path, *overrides: str, records: Path, timeout: float = 300) -> None:
    """``kd run --nproc_per_node 2 kd_distributed``; each rank's rollouts go to ``records``. The
    launch and its workers are killed after ``timeout`` seconds (a deadlock fails the test)."""
    site = cfg_path.parent / f"{cfg_path.stem}_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    records.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": path,
        "KD_TEST_ROLLOUTS": str(records),
    }
    cmd = [sys.executable, "-m", "kd.cli", "run", "--nproc_per_node", "2", "kd_distributed"]
    try:
        proc = run_launch([*cmd, "--config", str(cfg_path), *overrides], env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"2-rank launch still running after {timeout} s (killed with its workers)")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out[-2000:] + err[-4000:]


def _single(cfg_path: Path, records: Path) -> None:
    """The config on one device, in this process, its rollouts recorded to ``records``."""
    records.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sampling, "rollout", _recording(sampling.rollout, str(records / "rank0.jsonl")))
        assert cli.main(["run", "kd_single_device", "--config", str(cfg_path)]) == 0


def _records(folder: Path, ranks: int) -> list[list[dict]]:
    """Each rank's rollout calls, in order."""
    return [
        [json.loads(line) for line in (folder / f"rank{r}.jsonl").read_text().splitlines()]
        for r in range(ranks)
    ]


def _pair(
    assets,
    root: Path,
    name: str,
    *,
    global_batch: int,
    accum: int,
    timeout: float = 300,
    **top,
) -> tuple[Path, Path]:
    """Run one config on one device (batch = global) and on 2 ranks (batch = global / 2); their
    rollouts go to ``root/<name>_1_rollouts`` and ``root/<name>_2_rollouts``."""
    one, two = root / f"{name}_1", root / f"{name}_2"
    per_step = global_batch // accum
    cfg1 = make_config(assets, one, batch_size=per_step, gradient_accumulation_steps=accum, **top)
    cfg2 = make_config(
        assets, two, batch_size=per_step // 2, gradient_accumulation_steps=accum, **top
    )
    _single(write_config(root / f"{name}_1.yaml", cfg1), root / f"{name}_1_rollouts")
    _launch(
        write_config(root / f"{name}_2.yaml", cfg2),
        records=root / f"{name}_2_rollouts",
        timeout=timeout,
    )
    return one, two


def _stopping_student(student: Path, dest: Path) -> Path:
    """A copy of the student (HF folder) whose completions end early, at spread-out steps: every
    token embedding gets +1 on feature 0, so the hidden states share that feature, and
    ``<|im_end|>``'s (id 258, a stop token of the tiny tokenizer) 0.5 more, which raises its logit at
    every position (about one stop in 15 steps; a random student stops about once in 150)."""
    shutil.copytree(student, dest)
    weights = load_file(dest / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    embed[:, 0] += 1.0
    embed[258, 0] += 0.5
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def _assert_same_metrics(a: Path, b: Path, steps: int, keys: tuple[str, ...] = COMPARED) -> None:
    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] and len(ra) == steps
    for x, y in zip(ra, rb, strict=True):
        for key in keys:
            assert y[key] == pytest.approx(x[key], abs=TOL, rel=0), (x["step"], key)


def _assert_same_samples(single: list[dict], ranks: list[list[dict]]) -> dict[str, int]:
    """The 2 ranks' rollouts, call by call, sample for each row what one device samples for it;
    both ranks ran the same decoding steps. Returns counts of what was compared."""
    assert all(len(calls) == len(single) for calls in ranks) and single
    seen = {"rows": 0, "stopped": 0, "uneven": 0}
    for k, call in enumerate(single):
        here = [calls[k] for calls in ranks]
        assert {c["vocab"] for c in here} == {call["vocab"]}, k
        assert len({c["steps"] for c in here}) == 1, (k, [c["steps"] for c in here])
        by_prompt = {tuple(r["prompt"]): r["completion"] for r in call["rows"]}
        assert len(by_prompt) == len(call["rows"]), "two rows with one prompt: change the data seed"
        split = [r for c in here for r in c["rows"]]
        assert sorted(tuple(r["prompt"]) for r in split) == sorted(by_prompt)
        for r in split:
            assert r["completion"] == by_prompt[tuple(r["prompt"])], (k, r["prompt"])
        seen["rows"] += len(split)
        seen["stopped"] += sum(len(r["completion"]) < ON_POLICY["max_new_tokens"] for r in split)
        # A rank whose rows all ended before the other rank's kept stepping with it.
        longest = [max(len(r["completion"]) for r in c["rows"]) for c in here]
        assert call["steps"] == here[0]["steps"] == max(longest), (k, call["steps"], longest)
        seen["uneven"] += len(set(longest)) > 1
    return seen


@pytest.fixture(scope="module")
def full_runs(assets, tmp_path_factory) -> tuple[Path, Path]:
    """Full tied student, every micro-batch on-policy (lmbda 1, temperature 1), accumulation 2,
    activation checkpointing, clipping, LR schedule, a step checkpoint at step 2: 8 x 2 on one
    device vs 4 x 2 ranks x 2."""
    root = tmp_path_factory.mktemp("on_policy_full")
    return _pair(
        assets,
        root,
        "full",
        global_batch=16,
        accum=2,
        on_policy=ON_POLICY,
        enable_activation_checkpointing=True,
        clip_grad_norm=0.5,
        save_every_n_steps=2,
        lr_scheduler={
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 1,
            "num_cycles": 0.25,
        },
    )


@pytest.mark.slow
def test_full_student_samples_the_same_tokens_loss_and_weights(full_runs):
    one, two = full_runs
    seen = _assert_same_samples(
        _records(one.parent / f"{one.name}_rollouts", 1)[0],
        _records(two.parent / f"{two.name}_rollouts", 2),
    )
    assert seen["rows"] == 16 * STEPS and 0 < seen["stopped"] < seen["rows"], seen
    _assert_same_metrics(one, two, steps=STEPS)
    for a, b in zip(read_metrics(one), read_metrics(two), strict=True):
        assert a["sampled_batches_student"] == 2 and a["sampled_batches_teacher"] == 0
        # Every labelled token is a sampled one.
        assert a["num_tokens"] == a["sampled_tokens_student"] == b["sampled_tokens_student"]
    _assert_same_files(one / "final", two / "final")
    _assert_same_files(one / "step_000002", two / "step_000002")


@pytest.mark.slow
def test_resume_on_two_ranks(full_runs, tmp_path):
    """The 2-rank run resumed from its step-2 checkpoint samples, per rank, what the uninterrupted
    run sampled at step 3 (the coin and the row generators depend on the step, epoch and row
    only), and ends with the same metrics and weights."""
    one, two = full_runs
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(two / "step_000002", out / "step_000002")
    records = tmp_path / "rollouts"
    # The 2-rank run's own config, with the output folder that holds the copied checkpoint.
    _launch(
        two.parent / f"{two.name}.yaml",
        f"output_dir={out}",
        "resume_from_checkpoint=true",
        records=records,
    )
    uninterrupted = _records(two.parent / f"{two.name}_rollouts", 2)
    resumed = _records(records, 2)
    for rank in range(2):
        assert resumed[rank] == uninterrupted[rank][-2:], rank  # step 3: 2 micro-batches
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [STEPS]
    for key in (*COMPARED, "sampled_tokens_student"):
        assert rows[0][key] == pytest.approx(read_metrics(two)[-1][key], abs=TOL, rel=0), key
    _assert_same_files(two / "final", out / "final")


@pytest.mark.slow
def test_lora_student_mixed_sources_and_uneven_lengths(assets, tmp_path):
    """LoRA student, lmbda 0.5 with seq_kd (the student or the sharded teacher samples, by a coin
    per micro-batch), top_p 0.9, one row per rank: the ranks' completions end at different decoding
    steps, and the launch finishes within a short timeout (a rank that stopped stepping alone
    would leave the other waiting in a collective). 2 x 2 on one device vs 1 x 2 ranks x 2."""
    settings = {**ON_POLICY, "lmbda": 0.5, "seq_kd": True, "top_p": 0.9}
    student = _stopping_student(assets["student"], tmp_path / "student")
    one, two = _pair(
        {**assets, "student": student},
        tmp_path,
        "lora",
        global_batch=4,
        accum=2,
        timeout=150,
        lora=True,
        on_policy=settings,
    )
    single = _records(tmp_path / "lora_1_rollouts", 1)[0]
    seen = _assert_same_samples(single, _records(tmp_path / "lora_2_rollouts", 2))
    # Both models sampled (student 288 ids, teacher 320), and some rank finished early.
    assert {c["vocab"] for c in single} == {288, 320}
    assert seen["uneven"] > 0 and seen["stopped"] > 0, seen
    sampled = ("sampled_batches_student", "sampled_batches_teacher")
    _assert_same_metrics(one, two, steps=STEPS, keys=(*COMPARED, *sampled))
    for a, b in zip(read_metrics(one), read_metrics(two), strict=True):
        assert a["sampled_batches_student"] + a["sampled_batches_teacher"] == 2
        for source in ("student", "teacher"):
            key = f"sampled_tokens_{source}"
            assert a[key] == b[key], (a["step"], key)
    _assert_same_files(one / "final", two / "final")
    _assert_same_files(one / "final", two / "final", "adapter/adapter_model.safetensors")
