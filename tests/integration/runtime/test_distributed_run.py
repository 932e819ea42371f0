"""kd_distributed on 2 CPU processes (gloo, FSDP2) against kd_single_device with the same global batch.

Each 2-rank launch goes through the command a user types (``kd run --nproc_per_node 2
kd_distributed``) and costs ~15-30 s of process start-up and imports, so every launch checks as much
as it can: per-step metrics, final weights, the saved resume state. fp32, shuffle off.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kd import cli
from kd.testing import run_launch
from tests.conftest import STUDENT, TEACHER, builder, make_config, read_metrics, write_config

TOL = 1e-5
COMPARED = ("loss", "ce_loss", "kd_loss", "grad_norm", "lr", "num_tokens")


# Loaded at start-up by every process of a 2-rank launch: a rank other than 0 that opens a
# safetensors file (a checkpoint) fails, so each launch checks that only rank 0 reads weights.
_RANK0_ONLY_GUARD = """
import json
import os
if os.environ.get("RANK", "0") != "0":
    import safetensors

    def _refuse(path, *args, **kwargs):
        raise RuntimeError(f"rank {os.environ['RANK']} opened {path}; only rank 0 may read weights")

    safetensors.safe_open = _refuse
"""


def _launch(cfg_path: Path, *overrides: str) -> None:
    cmd = [sys.executable, "-m", "kd.cli", "run", "--nproc_per_node", "2", "kd_distributed"]
    guard = cfg_path.parent / f"{cfg_path.stem}_guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(_RANK0_ONLY_GUARD)
    path = os.pathsep.join(p for p in (str(guard), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = run_launch([*cmd, "--config", str(cfg_path), *overrides], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _single(cfg_path: Path, *overrides: str) -> None:
    assert cli.main(["run", "kd_single_device", "--config", str(cfg_path), *overrides]) == 0


def _pair(
    assets, root: Path, name: str, *, global_batch: int, accum: int, **top
) -> tuple[Path, Path]:
    """Run one config on one device (batch = global) and on 2 ranks (batch = global / 2)."""
    one, two = root / f"{name}_1", root / f"{name}_2"
    per_step = global_batch // accum
    _single(write_config(root / f"{name}_1.yaml", _config(assets, one, per_step, accum, **top)))
    _launch(
        write_config(root / f"{name}_2.yaml", _config(assets, two, per_step // 2, accum, **top))
    )
    return one, two


def _config(assets, out: Path, batch: int, accum: int, **top) -> dict:
    model = top.pop("model", None)
    teacher = top.pop("teacher_model", None)
    cfg = make_config(assets, out, batch_size=batch, gradient_accumulation_steps=accum, **top)
    if model is not None:
        cfg["model"], cfg["teacher_model"] = model, teacher
    return cfg


def _assert_same_metrics(a: Path, b: Path, steps: int) -> None:
    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] and len(ra) == steps
    for x, y in zip(ra, rb, strict=True):
        for key in COMPARED:
            assert y[key] == pytest.approx(x[key], abs=TOL, rel=0), (x["step"], key)


def _assert_same_tensors(a: dict, b: dict, tol: float = TOL) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=tol, rtol=0, msg=k)


def _assert_same_files(a: Path, b: Path, name: str = "model.safetensors") -> None:
    _assert_same_tensors(load_file(a / name), load_file(b / name))


@pytest.fixture(scope="module")
def full_runs(assets, tmp_path_factory) -> tuple[Path, Path]:
    """Tied full student, accumulation 2, activation checkpointing, clipping, LR schedule, a step
    checkpoint at step 2: 8 x 2 on one device vs 4 x 2 ranks x 2."""
    root = tmp_path_factory.mktemp("full")
    return _pair(
        assets,
        root,
        "full",
        global_batch=16,
        accum=2,
        enable_activation_checkpointing=True,
        clip_grad_norm=0.5,  # below the ~1.1 norms: clipping is active
        save_every_n_steps=2,
        lr_scheduler={
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 1,
            "num_cycles": 0.25,  # lr never reaches 0, so the last step still moves the weights
        },
    )


@pytest.mark.slow
def test_full_student_same_loss_weights_and_resume_state(full_runs):
    one, two = full_runs
    _assert_same_metrics(one, two, steps=3)
    _assert_same_files(one / "final", two / "final")
    _assert_same_files(one / "step_000002", two / "step_000002")
    # The resume state holds the full optimizer state keyed by parameter name at any world size.
    sa = torch.load(one / "step_000002" / "recipe_state.pt", weights_only=True)
    sb = torch.load(two / "step_000002" / "recipe_state.pt", weights_only=True)
    assert "tok_embeddings.weight" in sb["optimizer"]["state"]
    assert sorted(sa["optimizer"]["state"]) == sorted(sb["optimizer"]["state"])
    for name, entry in sa["optimizer"]["state"].items():
        _assert_same_tensors(entry, sb["optimizer"]["state"][name])
    assert sb["global_step"] == 2 and sb["lr_scheduler"] == sa["lr_scheduler"]


@pytest.mark.slow
def test_resume_on_two_ranks(full_runs, tmp_path):
    one, two = full_runs
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(two / "step_000002", out / "step_000002")
    # The 2-rank run's own config, with the output folder that holds the copied checkpoint.
    _launch(two.parent / f"{two.name}.yaml", f"output_dir={out}", "resume_from_checkpoint=true")
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [3]
    assert rows[0]["loss"] == pytest.approx(read_metrics(one)[2]["loss"], abs=TOL, rel=0)
    _assert_same_files(one / "final", out / "final")


@pytest.mark.slow
def test_lora_student(assets, tmp_path):
    """Tied LoRA student without accumulation: 8 x 1 on one device vs 4 x 2 ranks x 1."""
    one, two = _pair(assets, tmp_path, "lora", global_batch=8, accum=1, lora=True)
    _assert_same_metrics(one, two, steps=3)
    _assert_same_files(one / "final", two / "final")
    _assert_same_files(one / "final", two / "final", "adapter/adapter_model.safetensors")


@pytest.mark.slow
def test_untied_full_student_with_cpu_offload(assets, tmp_path):
    """Untied student (its embedding is its own FSDP group) and a tied teacher, with the CPU
    offload policy and layers kept gathered after forward."""
    swapped = {**assets, "student": assets["teacher"], "teacher": assets["student"]}
    one, two = _pair(
        swapped,
        tmp_path,
        "untied",
        global_batch=8,
        accum=1,
        model=builder(TEACHER),
        teacher_model=builder(STUDENT),
        fsdp={"cpu_offload": True, "reshard_after_forward": False, "reduce_dtype": "fp32"},
    )
    _assert_same_metrics(one, two, steps=3)
    _assert_same_files(one / "final", two / "final")


def test_fsdp_trace_shards_per_rank():
    """The FSDP2 trace (fake process group) sees 1/N of the parameters and optimizer states."""
    from omegaconf import OmegaConf

    from kd.config.parse import fill_defaults
    from kd.config.run import run_config
    from kd.memory.trace import trace_run

    cfg = OmegaConf.create(
        {
            "model": builder(STUDENT),
            "teacher_model": builder(TEACHER),
            "kd_ratio": 0.5,
            "batch_size": 2,
            "tokenizer": {"max_seq_len": 32},
            "enable_activation_checkpointing": True,
            "loss_chunk_size": 16,
        }
    )
    fill_defaults(cfg)
    run = run_config(cfg)
    one = trace_run(run)
    two, four = (trace_run(run, world_size=n) for n in (2, 4))
    params = one.categories["forward"]["Parameter"]  # student + teacher, bf16
    assert two.categories["forward"]["Sharded Param"] == params // 2
    assert four.categories["forward"]["Sharded Param"] == params // 4
    opt2, opt4 = (r.categories["forward"]["OptState"] for r in (two, four))
    assert opt4 < opt2 < one.categories["forward"]["Optstate"]
    # The layer being computed is gathered in full on every rank.
    assert four.categories["forward"]["Unsharded Param"] > 0
    for phase in ("forward", "backward", "optimizer_step"):
        assert four.phase_peaks[phase] < two.phase_peaks[phase] <= one.phase_peaks[phase]


def test_any_rank_and_broadcast_on_a_one_rank_group(tmp_path):
    """The helpers the loop uses to keep ranks on the same branch run on a real (gloo) group."""
    import torch.distributed as dist

    from kd.runtime import distributed

    world = distributed.WorldInfo(world_size=2, rank=0, local_rank=0)  # take the collective path
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        cpu = torch.device("cpu")
        assert distributed.any_rank(True, device=cpu) is True
        assert distributed.any_rank(False, device=cpu) is False
        assert distributed.broadcast_object({"step": 3}, world=world) == {"step": 3}
        assert distributed.all_reduce_sum(torch.tensor([2.0])).item() == 2.0
    finally:
        dist.destroy_process_group()


# Each rank's step checkpoint takes 3 s longer: longer than the launcher's --shutdown_timeout 1.
_SLOW_SAVE = """
import time

from kd.runtime.run_checkpointer import RunCheckpointer

_save = RunCheckpointer.save


def _slow_save(self, *args, final, **kwargs):
    if not final:
        time.sleep(3)
    return _save(self, *args, final=final, **kwargs)


RunCheckpointer.save = _slow_save
"""


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_exits_0_and_resumes(assets, tmp_path):
    """SIGTERM to ``kd run --nproc_per_node 2`` (Slurm, Kubernetes): the workers finish the step
    and save, the launcher exits 0 without a traceback, and resume ends where one device does.
    torchrun's own handler stopped its agent with a traceback and exit status 1, and killed the
    workers --shutdown_timeout seconds (30 by default) after the signal, in the middle of a save
    that took longer."""
    import signal
    import subprocess
    import time

    one, two = tmp_path / "one", tmp_path / "two"
    common = {"gradient_accumulation_steps": 1, "epochs": 1, "max_steps_per_epoch": None}
    _single(write_config(tmp_path / "one.yaml", make_config(assets, one, batch_size=2, **common)))
    cfg = write_config(tmp_path / "two.yaml", make_config(assets, two, batch_size=1, **common))
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(_RANK0_ONLY_GUARD + _SLOW_SAVE)
    path = os.pathsep.join(p for p in (str(guard), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "kd.cli", "run", "--nproc_per_node", "2", "--shutdown_timeout"]
    cmd += ["1", "kd_distributed", "--config", str(cfg)]
    launcher = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 240
        rows = two / "metrics.jsonl"
        while launcher.poll() is None and not (rows.exists() and len(read_metrics(two)) >= 3):
            assert time.monotonic() < deadline, "no third step"
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-4000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-4000:]
    saved = sorted(two.glob("step_*"))
    assert len(saved) == 1 and (saved[0] / "recipe_state.pt").exists(), err[-4000:]
    stopped = int(saved[0].name.split("_")[1])
    assert f"kd: received SIGTERM; stopped after step {stopped}" in err
    assert [r["step"] for r in read_metrics(two)] == list(range(1, stopped + 1))
    _launch(cfg, "resume_from_checkpoint=true")
    # 32 steps: float noise between the two layouts grows past TOL in the weights.
    rows, reference = read_metrics(two), read_metrics(one)
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == list(range(1, 33))
    for x, y in zip(reference, rows, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-4, rel=0), x["step"]
    _assert_same_tensors(
        load_file(one / "final" / "model.safetensors"),
        load_file(two / "final" / "model.safetensors"),
        tol=1e-4,
    )


@pytest.mark.slow
def test_a_bad_row_one_rank_reads_stops_every_rank_with_its_line(assets, tmp_path):
    """Row 13 (read by rank 1 only, at step 2) has no output: every rank stops with rank 1's one
    line. Rank 0 waited in the step's first collective until rank 1's exit broke it (NCCL waits
    for its timeout), printed that traceback, and rank 1's line was never printed."""
    from kd.testing import write_jsonl

    rows = [json.loads(line) for line in assets["data"].read_text().splitlines()]
    rows[13]["output"] = None
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg = make_config(assets, tmp_path / "out", batch_size=2)
    cfg["dataset"]["data_files"] = str(data)
    cmd = [sys.executable, "-m", "kd.cli", "run", "--nproc_per_node", "2", "kd_distributed"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    path = write_config(tmp_path / "bad.yaml", cfg)
    proc = run_launch([*cmd, "--config", str(path)], env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kd: error:")]
    assert len(errors) == 1, proc.stderr[-4000:]
    assert errors[0].startswith(
        "kd: error: rank 1: dataset: reading the batches of step 2 failed ("
    )
    assert errors[0].endswith("; fix that row of the data file (the last checkpoint is kept)")
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1]
