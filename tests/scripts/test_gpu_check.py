"""scripts/gpu_check.py (issue 40): its CPU smoke run keeps the GPU run's code paths and JSON
alive in CI, and the committed GPU measurements hold today's runtime terms to account."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_report  # noqa: E402

GPU_JSON = REPO / "scripts" / "bench_data" / "gpu_check_h100.json"


# Rows the plan misses today, each with what is off (docs/gpu.md). The test below checks that
# each still is, so a fix must take its row off this list.
OFF = {
    # the measured allocated peak 0.66 GiB over the plan's: 0.58 of it was the top-k head's
    # logsumexp temporary, taken out of kd.losses.topk since (tests/unit/memory/test_loss_head.py);
    # the row stays here until a GPU run measures it again
    "Qwen2.5 0.5B served teacher (vLLM)": "under",
}


def test_the_plan_is_within_5_percent_of_every_measured_gpu_row_and_never_under():
    """The H100's rows, each config planned with today's kd.memory: the reserved peak and the
    device peak within 5% above what the CUDA allocator and NVML measured, never under (on-policy
    is planned at max_seq_len, so over, but never under either); but the rows of ``OFF``."""
    data = json.loads(GPU_JSON.read_text())
    rows = gpu_report.memory_rows(data["calls"])
    assert len(rows) >= 7
    for r in rows:
        if r["name"] in OFF:
            p = gpu_report.replan(r)
            under = p["reserved"] < r["reserved_gib"]
            assert under if OFF[r["name"]] == "under" else p["reserved"] > 1.05 * r["reserved_gib"]
            continue
        p = gpu_report.replan(r)
        assert p["reserved"] >= r["reserved_gib"], r["name"]
        if r.get("process_used_gib"):
            assert p["device"] >= r["process_used_gib"], r["name"]
        if r["feature"] != "on_policy":
            assert p["reserved"] <= 1.05 * r["reserved_gib"], r["name"]
            if r.get("process_used_gib"):
                assert p["device"] <= 1.05 * r["process_used_gib"], r["name"]


def test_the_gpu_doc_is_the_report_of_the_committed_json():
    doc = (REPO / "docs" / "gpu.md").read_text()
    data = json.loads(GPU_JSON.read_text())
    assert gpu_report.section(data, "scripts/bench_data/gpu_check_h100.json") in doc


def test_the_gpu_doc_shows_each_calls_rollout_section():
    """A call with a rollout section adds the rollouts table (a call without one adds none)."""
    table = [
        {"method": m, "model": "Qwen2.5-0.5B", "batch": 16, "new_tokens": 128, "tokens_per_s": t}
        for m, t in (("generate", 100.0), ("kd fast graphs", 450.0))
    ]
    for r in table:
        r["ratio"] = r["tokens_per_s"] / 100.0
    ro = {"status": "ok", "info": {"dtype": "bf16"}, "table": table}
    calls = [{"doc": {"sections": {}}}, {"doc": {"sections": {"rollout": ro}}}]
    lines = gpu_report.rollout_table(calls)
    assert "| 2 | Qwen2.5-0.5B | bf16 | 16 | 128 | kd fast graphs | 450 | 4.50x |" in lines
    assert gpu_report.rollout_table(calls[:1]) == []


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_section_on_the_cpu(tmp_path):
    """--smoke: tiny shapes of the same pairs, a memory row, a served-teacher row, the rollout
    section, kd and TRL off-policy, kd's batched sampler on-policy, and pytest -m gpu (skipped
    without CUDA), written as the GPU run writes them."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "gpu_check.py"),
        "--smoke",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "work"),
        "--row-ids",
        "0,12",
        "--jobs",
        "2",
        "--speed-runs",
        "kd:off_policy,trl:off_policy,kd-fast:on_policy",
        "--budget-s",
        "900",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    s = doc["sections"]
    assert s["preflight"]["status"] == "ok"
    rows = s["memory"]["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    for r in rows:
        assert r["allocated_gib"] > 0 and r["plan"]["allocated_peak_gib"] > 0
        assert "allocator_slack" in r["plan"]["components"]
    (off,) = [t for t in s["speed"]["table"] if t["mode"] == "off_policy"]
    assert off["kd_tokens_per_s"] > 0 and off["trl_tokens_per_s"] > 0
    # kd's batched local sampler on-policy: its own row, its keys recorded
    (fast,) = [r for r in s["speed"]["runs"] if r["tool"] == "kd-fast"]
    assert fast["status"] == "ok" and fast["tokens_per_s"] > 0, fast
    assert fast["sets"] == {"on_policy.batch_rollouts": True}
    assert fast["phases"]["generate_s"] > 0
    assert s["tests"]["status"] == "ok"
    # the rollout section: generate and kd's fast sampler on the pair's student (no graphs here)
    ro = s["rollout"]
    assert ro["status"] == "ok", ro
    assert {r["method"] for r in ro["table"]} == {"generate", "kd fast"}
    assert all(r["tokens_per_s"] > 0 for r in ro["table"])
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("Device: cpu") and "| rollout (transformers) |" in md


@pytest.mark.slow
def test_gpu_check_offloading_rows_on_the_cpu(tmp_path):
    """The offloading rows (13-17: resident, activations offloaded with and without AC, the
    teacher parked, streamed) run through --smoke as on the GPU: each row's measured peak, step
    time and planned host memory are written, and the markdown has their table."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "gpu_check.py"),
        "--smoke",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "work"),
        "--sections",
        "memory",
        "--row-ids",
        "13,14,15,16,17",
        "--jobs",
        "2",
        "--budget-s",
        "900",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "gpu_check.json").read_text())["sections"]["memory"]["rows"]
    assert [r["name"].split("full, ", 1)[1] for r in rows] == [
        "resident",
        "activations offloaded",
        "activations offloaded, no AC",
        "teacher parked",
        "teacher streamed",
    ]
    assert [r["status"] for r in rows] == ["ok"] * 5, rows
    for r in rows:
        assert r["allocated_gib"] > 0 and r["step_s"] > 0
    assert not rows[0]["plan"]["host"]["host_gib"]
    assert all(r["plan"]["host"]["moved_gib_per_step"] for r in rows[1:])  # tiny: 4 decimals
    assert "| offloading mode |" in (out / "gpu_check.md").read_text()
