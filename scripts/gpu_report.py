"""The tables of ``docs/gpu.md`` from a GPU session's JSON (``scripts/gpu_check.py``'s documents).

The memory rows are planned again with today's :mod:`kd.memory`: each row's recorded config is
planned here (its models' published ``config.json`` written to a temporary folder in place of the
GPU run's; no weights are read), and the reserved and device peaks are derived from that with
today's runtime terms (:mod:`kd.memory.runtime`), so a change to the planner shows against the
same measurements.

    python scripts/gpu_report.py                      # bench_data/gpu_check_h100.json -> docs/gpu.md
    python scripts/gpu_report.py --json X.json --out /tmp/gpu.md
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

from gpu_check import OFFLOAD_MODES, offload_table

from kd.memory.runtime import runtime_terms

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
# Where gpu_check.py ran (--work /tmp/work): the rows' configs name their models under it.
GPU_WORK = "/tmp/work"
MIB = 1 << 20
BEGIN = "<!-- gpu_report.py: begin -->"
END = "<!-- gpu_report.py: end -->"


def memory_rows(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every measured row (the latest call's when a configuration ran twice)."""
    rows: dict[tuple, dict[str, Any]] = {}
    for call in calls:
        for r in call["doc"]["sections"].get("memory", {}).get("rows", []):
            if r.get("status") == "ok":
                rows[(r["name"], r["seq_len"], r["batch"], r["ac"])] = r
    return list(rows.values())


@functools.cache
def _published_models() -> Path:
    """A temporary folder with every published model's ``config.json`` (what planning reads)."""
    import tempfile

    import transformers

    from kd.memory.hf_accuracy import PUBLISHED, folder_name

    root = Path(tempfile.mkdtemp(prefix="kd_gpu_report_"))
    for name, (cls_name, kwargs) in PUBLISHED.items():
        getattr(transformers, cls_name)(**kwargs).save_pretrained(root / folder_name(name))
    return root


def planned_allocated(r: dict[str, Any]) -> float:
    """The row's allocated peak (GiB) as today's planner plans its recorded config (its models
    read from :func:`_published_models`, where the GPU run had written them)."""
    import contextlib
    import io
    import tempfile

    from kd.config import load_config
    from kd.memory import plan_from_config

    text = r["config"].replace(f"{GPU_WORK}/models/", f"{_published_models()}/")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "row.yaml"
        path.write_text(text)
        with contextlib.redirect_stderr(io.StringIO()):
            plan = plan_from_config(load_config(str(path), []), budget_gib=None)
    return plan.to_json()["allocated_peak_gib"]


def replan(r: dict[str, Any]) -> dict[str, float]:
    """Allocated, reserved and device peaks of the row planned with today's kd.memory."""
    alloc = planned_allocated(r) * GIB
    # an offloading row's keys (gpu_check.OFFLOAD_MODES, named at the end of the row's name)
    sets = next((v for m, (_, v) in OFFLOAD_MODES.items() if r["name"].endswith(f", {m}")), {})
    parked = r["plan"].get("host", {}).get("host_gib", {}).get("parked_teacher", 0.0) * GIB
    terms = runtime_terms(
        int(alloc),
        device_type="cuda",
        activation_checkpointing=r["ac"],
        num_ranks=1,
        activation_offloading=bool(sets.get("enable_activation_offloading")),
        teacher_offload=sets.get("teacher_offload", "none"),
        parked_teacher=int(parked),
    )
    reserved = alloc + terms.allocator_slack
    return {
        "allocated": alloc / GIB,
        "reserved": reserved / GIB,
        "device": (reserved + terms.cuda_runtime) / GIB,
    }


def memory_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| configuration | tokens | batch | AC | planned alloc. | max allocated | planned "
        "reserved | max reserved | plan / reserved | planned device | process (NVML) | "
        "plan / process |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p = replan(r)
        proc = r.get("process_used_gib")
        lines.append(
            f"| {r['name']} | {r['seq_len']} | {r['batch']} | {'on' if r['ac'] else 'off'} | "
            f"{p['allocated']:.2f} | {r['allocated_gib']:.2f} | {p['reserved']:.2f} | "
            f"{r['reserved_gib']:.2f} | {p['reserved'] / r['reserved_gib']:.3f} | "
            f"{p['device']:.2f} | {proc:.2f} | {p['device'] / proc:.3f} |"
            if proc
            else f"| {r['name']} | {r['seq_len']} | {r['batch']} | {'on' if r['ac'] else 'off'} | "
            f"{p['allocated']:.2f} | {r['allocated_gib']:.2f} | {p['reserved']:.2f} | "
            f"{r['reserved_gib']:.2f} | {p['reserved'] / r['reserved_gib']:.3f} | "
            f"{p['device']:.2f} | - | - |"
        )
    return lines


def runtime_table(calls: list[dict[str, Any]]) -> list[str]:
    rt = calls[0]["doc"]["sections"].get("runtime", {})
    if rt.get("status") != "ok":
        return []
    lines = [
        "| measured in a fresh process | default allocator | expandable_segments:True |",
        "|---|---:|---:|",
    ]
    labels = {
        "used_after_context": "device used after `torch.cuda.init` + one tensor (MiB)",
        "cublas_reserved_delta": "first bf16 matmul: allocator reserved (cuBLAS workspace, MiB)",
        "cublas_used_delta": "first bf16 matmul: device used (MiB)",
        "cublaslt_used_delta": "first matmul with bias (cuBLASLt): device used (MiB)",
        "segment_for_1048577": "segment reserved for a 1 MiB + 1 B tensor (MiB)",
        "segment_for_10485761": "segment reserved for a 10 MiB + 1 B tensor (MiB)",
        "nccl_used_delta": "one-rank NCCL group, first all-reduce: device used (MiB)",
    }
    d, e = rt["default"], rt.get("expandable", {})
    for key, label in labels.items():
        a = d.get(key)
        b = e.get(key)
        fa = f"{a / MIB:.0f}" if isinstance(a, int) else "-"
        fb = f"{b / MIB:.0f}" if isinstance(b, int) else "-"
        lines.append(f"| {label} | {fa} | {fb} |")
    lines.append(
        f"| bf16 matmul 8192^3, median of 10 (TFLOP/s) | {d.get('bf16_matmul_tflops', 0):.0f} | "
        f"{e.get('bf16_matmul_tflops', 0):.0f} |"
    )
    return lines


def speed_rows(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    runs = []
    for i, call in enumerate(calls):
        sp = call["doc"]["sections"].get("speed")
        if isinstance(sp, dict):
            for r in sp.get("runs", []):
                if r.get("status") == "ok":
                    runs.append({**r, "call": i + 1})
    return runs


def speed_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| mode | tool | call | labelled tokens/s | model TFLOP/s | MFU (of the measured 784) | "
        "step split (s): sampling / teacher / student | note |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in runs:
        ph = r.get("phases")
        split = (
            f"{ph['generate_s']:.3f} / {ph['teacher_s']:.3f} / {ph['student_s']:.3f}" if ph else "-"
        )
        lines.append(
            f"| {r['mode']} | {r['tool']} | {r['call']} | {r['tokens_per_s']:.0f} | "
            f"{r['model_tflops']:.1f} | {r['model_tflops'] / 784:.3f} | {split} | "
            f"{r.get('note', '')} |"
        )
    return lines


def rollout_table(calls: list[dict[str, Any]]) -> list[str]:
    """Every call's rollout section (``gpu_check.py``'s ``rollout``): kd's local sampler against
    transformers' ``generate``; no lines before a call has one."""
    lines: list[str] = []
    for i, call in enumerate(calls):
        ro = call["doc"]["sections"].get("rollout")
        if not isinstance(ro, dict) or ro.get("status") != "ok":
            continue
        if not lines:
            lines = [
                "### Rollouts: kd's local sampler against transformers' generate",
                "",
                "| call | model | dtype | batch | new tokens | method | tokens/s | vs generate |",
                "|---:|---|---|---:|---:|---|---:|---:|",
            ]
        info = ro.get("info", {})
        for r in ro["table"]:
            lines.append(
                f"| {i + 1} | {r['model']} | {info.get('dtype', '-')} | {r['batch']} | "
                f"{r['new_tokens']} | {r['method']} | {r['tokens_per_s']:.0f} | "
                f"{r['ratio']:.2f}x |"
            )
    return [*lines, ""] if lines else []


def section(data: dict[str, Any], json_path: str) -> str:
    calls = data["calls"]
    env = calls[-1]["doc"]["sections"]["environment"]
    v = env["versions"]
    lines = [
        BEGIN,
        f"Generated by `python scripts/gpu_report.py` from `{json_path}`.",
        "",
        f"Device: {env.get('gpu')} ({env.get('gpu_total_gib', 0):.1f} GiB), driver "
        f"{env.get('driver')}, CUDA {env.get('cuda')}, {env.get('cpus')} CPUs; measured "
        f"{data['date']}; torch {v['torch']}, transformers {v['transformers']}, peft "
        f"{v['peft']}, torchtune {v['torchtune']}, torchao {v['torchao']}, trl {v['trl']}, "
        f"datasets {v['datasets']}, pyarrow {v['pyarrow']}.",
        "",
        "### The CUDA runtime, term by term",
        "",
        *runtime_table(calls),
        "",
        "### Plan against the device (each row's config planned with today's `kd.memory`)",
        "",
        *memory_table(memory_rows(calls)),
        "",
        "### Offloading: each mode's peak and step time beside the same run resident",
        "",
        *offload_table(memory_rows(calls)),
        "",
        *rollout_table(calls),
        "### kd against TRL",
        "",
        *speed_table(speed_rows(calls)),
        "",
        END,
    ]
    return "\n".join(lines)


def write_section(text: str, path: Path) -> None:
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + text + rest.split(END, 1)[1]
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text + "\n"
    path.write_text(new, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="scripts/bench_data/gpu_check_h100.json")
    ap.add_argument("--out", default="docs/gpu.md")
    args = ap.parse_args(argv)
    data = json.loads((REPO / args.json).read_text())
    write_section(
        section(data, args.json),
        REPO / args.out if not Path(args.out).is_absolute() else Path(args.out),
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
