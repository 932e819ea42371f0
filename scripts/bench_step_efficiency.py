"""How close kd's real-model training step gets to this machine's matmul ceiling (CPU, fp32).

The step is the one ``bench_vs_trl.py`` times: SmolLM2-135M-Instruct teaching its 20-of-30-layer
student, batch 4 x 128 tokens, JSD (beta 0.5) alone, AdamW, off-policy, fp32, ``--threads``
intra-op threads. Three child processes, each with those threads:

1. **ceiling**: ``torch.mm`` in fp32 on a large square (``--square``) and on every GEMM shape the
   step itself runs (collected by the profiler in 3.); the machine's ceiling is the best of them.
2. **timed run**: ``kd run kd`` for ``--steps`` optimizer steps; the step time is the median of
   steps 2..N from ``metrics.jsonl`` (labelled tokens / tokens per second).
3. **profile**: the same run in-process under ``torch.profiler`` (steps 3..N, after warm-up,
   everything between two optimizer steps: data, teacher, student, loss, backward, optimizer,
   logging), and once more under ``torch.utils.flop_counter.FlopCounterMode`` for one step's
   floating-point operations (matmuls and attention, forward and backward).

Achieved GFLOP/s = one step's FLOPs / the median step time of 2.; the ratio to 1.'s ceiling is the
figure ``docs/step_efficiency.md`` reports, with the profiler's table of where the time goes.

    python scripts/bench_step_efficiency.py --work /tmp/kd_eff            # ~10 min at 1 thread
    python scripts/bench_step_efficiency.py --work /tmp/kd_eff --compile-study --steps 12

``--compile-study`` times kd's ``compile: true`` against eager on the same rows instead (each
step's FLOPs counted, steps after ``--warmup`` compared) and ends with ``COMPILE eager_ratio=X
compiled_ratio=Y speedup=Z``.

Ends with ``EFFICIENCY gflops=X ceiling=Y ratio=Z``. Raw numbers: ``<work>/efficiency.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_trl as peer  # noqa: E402

# aten ops by what they do, for the profiler table (self CPU time of each op).
CATEGORIES: dict[str, tuple[str, ...]] = {
    "matmul (mm, addmm, bmm)": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention (SDPA kernels)": ("scaled_dot_product", "flash_attention"),
    "optimizer (AdamW)": (
        "_foreach",
        "adamw",
        "aten::lerp",
        "aten::addcdiv",
        "aten::addcmul",
        "aten::sqrt",
    ),
    "copies and layout": (
        "aten::copy_",
        "aten::clone",
        "aten::cat",
        "aten::contiguous",
        "aten::to",
        "aten::_to_copy",
        "aten::index",
        "aten::fill_",
        "aten::zero_",
        "aten::zeros",
        "aten::empty",
    ),
}


def categorize(name: str) -> str:
    for category, keys in CATEGORIES.items():
        if any(k in name for k in keys):
            return category
    return "elementwise, norms, softmax and the rest"


# ------------------------------------------------------------------------------ child modes
def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def child_profile(spec: dict[str, Any]) -> dict[str, Any]:
    """One in-process kd run under the profiler (steps 3..N) and one under the FLOP counter."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule
    from torch.utils.flop_counter import FlopCounterMode

    from kd.cli import main as kd_main

    _set_threads(spec["threads"])
    steps = spec["steps"]
    prof = profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=1, warmup=1, active=steps - 2, repeat=1),
        record_shapes=True,
    )
    original = torch.optim.AdamW.step

    def step_and_mark(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        prof.step()  # the profiler's step boundary is the optimizer step
        return out

    torch.optim.AdamW.step = step_and_mark  # type: ignore[method-assign]
    try:
        with prof:
            code = kd_main(["run", "kd", "--config", spec["config"], *spec["overrides"]])
    finally:
        torch.optim.AdamW.step = original  # type: ignore[method-assign]
    if code != 0:
        raise SystemExit(f"kd run failed under the profiler ({code})")
    ops: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    gemms: dict[str, int] = defaultdict(int)
    for e in prof.key_averages(group_by_input_shape=True):
        ops[e.key] += e.self_cpu_time_total / 1e6
        counts[e.key] += e.count
        if e.key in ("aten::mm", "aten::addmm") and e.input_shapes:
            shapes = [s for s in e.input_shapes if isinstance(s, list) and len(s) == 2]
            if len(shapes) >= 2:
                (m, k), (_, n) = shapes[-2], shapes[-1]
                gemms[f"{m}x{k}x{n}"] += e.count
    # One step's FLOPs: a second run of one step under the counter (it slows the run, so it
    # is not timed).
    out1 = spec["config_one_step"]
    with FlopCounterMode(display=False) as counter:
        code = kd_main(["run", "kd", "--config", out1, *spec["overrides"]])
    if code != 0:
        raise SystemExit(f"kd run failed under the FLOP counter ({code})")
    by_op = {str(k): int(v) for k, v in counter.get_flop_counts().get("Global", {}).items()}
    return {
        "profiled_steps": steps - 2,
        "self_cpu_s_by_op": dict(ops),
        "calls_by_op": dict(counts),
        "gemm_shapes": dict(gemms),
        "step_flops": int(counter.get_total_flops()),
        "step_flops_by_op": by_op,
    }


def child_ceiling(spec: dict[str, Any]) -> dict[str, Any]:
    """fp32 ``torch.mm`` GFLOP/s on a square and on each GEMM shape of the step (median of
    ``repeats`` timed calls after warm-up)."""
    import torch

    _set_threads(spec["threads"])
    torch.manual_seed(0)
    shapes = [tuple(int(x) for x in s.split("x")) for s in spec["shapes"]]
    sq = spec["square"]
    results = {}
    for m, k, n in [(sq, sq, sq), *shapes]:
        a, b = torch.randn(m, k), torch.randn(k, n)
        flops = 2 * m * k * n
        reps = max(3, min(200, int(2e10 / flops)))
        for _ in range(2):
            torch.mm(a, b)
        times = []
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b)
            times.append((time.perf_counter() - t0) / reps)
        results[f"{m}x{k}x{n}"] = flops / statistics.median(times) / 1e9
    return {"gflops_by_shape": results}


def child_optimizer(spec: dict[str, Any]) -> dict[str, Any]:
    """CPU seconds of one AdamW step over the student's parameter shapes (its safetensors
    header), for torch's three implementations: the for-loop (torch's CPU default when neither
    is set), ``foreach`` and ``fused``; median of ``repeats`` after two warm-up steps."""
    import torch
    from safetensors import safe_open

    _set_threads(spec["threads"])
    with safe_open(spec["weights"], framework="pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118
    out = {}
    for impl in ("for-loop", "foreach", "fused"):
        params = [torch.nn.Parameter(torch.randn(*shape) * 0.02) for shape in shapes]
        for q in params:
            q.grad = torch.randn_like(q) * 1e-3
        flags = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}}
        opt = torch.optim.AdamW(
            params, lr=1e-5, weight_decay=0.01, **flags.get(impl, {"fused": True})
        )
        times = []
        for i in range(spec["repeats"] + 2):
            c0 = time.process_time()
            opt.step()
            if i >= 2:
                times.append(time.process_time() - c0)
        out[impl] = statistics.median(times)
        del opt, params
    return {"adamw_step_cpu_s": out, "parameters": sum(int(torch.Size(s).numel()) for s in shapes)}


def child_step_flops(spec: dict[str, Any]) -> dict[str, Any]:
    """Each optimizer step's FLOPs: an in-process ``kd run`` under ``FlopCounterMode``, the
    counter read at every optimizer step (the run is slowed, so it is not timed)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from kd.cli import main as kd_main

    _set_threads(spec["threads"])
    marks: list[int] = []
    original = torch.optim.AdamW.step
    counter = FlopCounterMode(display=False)

    def step_and_mark(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        marks.append(int(counter.get_total_flops()))
        return out

    torch.optim.AdamW.step = step_and_mark  # type: ignore[method-assign]
    try:
        with counter:
            code = kd_main(["run", "kd", "--config", spec["config"]])
    finally:
        torch.optim.AdamW.step = original  # type: ignore[method-assign]
    if code != 0:
        raise SystemExit(f"kd run failed under the FLOP counter ({code})")
    return {"step_flops": [b - a for a, b in zip([0, *marks], marks, strict=False)]}


CHILDREN = {
    "_profile": child_profile,
    "_ceiling": child_ceiling,
    "_optimizer": child_optimizer,
    "_step_flops": child_step_flops,
}


# ------------------------------------------------------------------------------------ driver
def _child(mode: str, spec: dict[str, Any], work: Path, env: dict[str, str]) -> dict[str, Any]:
    path = work / f"{mode}.json"
    path.write_text(json.dumps(spec))
    out = work / f"{mode}.out.json"
    cmd = [sys.executable, __file__, mode, str(path), str(out)]
    with (work / f"{mode}.log").open("w") as log:
        subprocess.run(cmd, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(out.read_text())


def timed_run(config: Path, out: Path, env: dict[str, str]) -> dict[str, Any]:
    """``kd run kd`` in its own process; per-step seconds from its metrics."""
    log = out.parent / f"{out.name}.log"
    with log.open("w") as f:
        subprocess.run(
            ["kd", "run", "kd", "--config", str(config)],
            env=env,
            check=True,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_second" in r]
    step_s = [r["num_tokens"] / r["tokens_per_second"] for r in rows]
    return {
        "step_s": step_s,
        "median_step_s": statistics.median(step_s[1:]),
        "tokens_per_s": statistics.median(r["tokens_per_second"] for r in rows[1:]),
        "time_teacher_s": [r.get("time_teacher_s") for r in rows],
        "time_student_s": [r.get("time_student_s") for r in rows],
    }


def compile_study(args: argparse.Namespace, env: dict[str, str]) -> int:
    """``compile: true`` (kd's knob: ``torch.compile`` per decoder layer, inductor's C++ kernels
    on a CPU) against eager on the same rows: each step's FLOPs (:func:`child_step_flops`), both
    runs timed, the ceiling measured again; achieved / ceiling over steps after the compiler's
    warm-up (``--warmup`` steps, which hold its compilations and recompilations)."""
    import shutil

    work: Path = args.work
    peer.PAIRS["smollm2"]["steps"]["off_policy"] = args.steps
    assets = peer.write_assets(work, "smollm2", n_rows=4 * args.steps + 8)
    result: dict[str, Any] = {"argv": sys.argv, "threads": args.threads, "steps": args.steps}
    result["start"] = {"load": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M UTC")}
    configs = {}
    for name, over in (("eager", {}), ("compiled", {"compile": True})):
        out = work / "runs" / f"compile_study_{name}"
        shutil.rmtree(out, ignore_errors=True)
        configs[name] = peer.kd_config(assets, "smollm2", "off_policy", args.loss, out, over)
    flops_out = work / "runs" / "compile_study_flops"
    shutil.rmtree(flops_out, ignore_errors=True)
    flops_cfg = peer.kd_config(assets, "smollm2", "off_policy", args.loss, flops_out)
    flops = _child("_step_flops", {"threads": args.threads, "config": str(flops_cfg)}, work, env)
    result["step_flops"] = flops["step_flops"]
    for name, cfg in configs.items():
        result[name] = timed_run(cfg, work / "runs" / f"compile_study_{name}", env)
        print(f"{name}: step s {[round(x, 2) for x in result[name]['step_s']]}", flush=True)
    shapes = json.loads((peer.REPO / "scripts/bench_data/step_efficiency.json").read_text())
    shapes = sorted(shapes["profile"]["gemm_shapes"])
    spec = {"threads": args.threads, "shapes": shapes, "square": args.square, "repeats": 5}
    result["ceiling"] = _child("_ceiling", spec, work, env)
    ceiling = max(result["ceiling"]["gflops_by_shape"].values())
    w = args.warmup
    work_flops = sum(result["step_flops"][w:])
    for name in configs:
        seconds = sum(result[name]["step_s"][w:])
        result[name]["achieved_gflops"] = work_flops / seconds / 1e9
        result[name]["ratio"] = result[name]["achieved_gflops"] / ceiling
        result[name]["loss_step1"] = _first_loss(work / "runs" / f"compile_study_{name}")
    result.update(ceiling_gflops=ceiling, end_load=os.getloadavg())
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    for name in configs:
        r = result[name]
        print(
            f"{name:>8}: steps {w + 1}..{args.steps}: {r['achieved_gflops']:.1f} GFLOP/s of "
            f"{ceiling:.1f}, ratio {r['ratio']:.3f}; step-1 loss {r['loss_step1']:.6f}"
        )
    speedup = result["compiled"]["achieved_gflops"] / result["eager"]["achieved_gflops"]
    print(f"end: load average {result['end_load']}")
    print(
        f"COMPILE eager_ratio={result['eager']['ratio']:.3f} "
        f"compiled_ratio={result['compiled']['ratio']:.3f} speedup={speedup:.3f}"
    )
    return 0


def _first_loss(out: Path) -> float:
    return float(json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"])


def table(result: dict[str, Any]) -> str:
    """The profiler's self CPU time by category and its top ops, as Markdown."""
    ops = result["profile"]["self_cpu_s_by_op"]
    calls = result["profile"]["calls_by_op"]
    n = result["profile"]["profiled_steps"]
    total = sum(ops.values())
    by_cat: dict[str, float] = defaultdict(float)
    for name, s in ops.items():
        by_cat[categorize(name)] += s
    lines = ["| where | s per step | share |", "|---|---:|---:|"]
    for cat, s in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {cat} | {s / n:.3f} | {100 * s / total:.1f}% |")
    lines.append(f"| **all profiled CPU time** | **{total / n:.3f}** | 100% |")
    lines += ["", "| op | calls per step | s per step | share |", "|---|---:|---:|---:|"]
    for name, s in sorted(ops.items(), key=lambda kv: -kv[1])[:15]:
        lines.append(f"| `{name}` | {calls[name] / n:.0f} | {s / n:.3f} | {100 * s / total:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] in CHILDREN:
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(CHILDREN[sys.argv[1]](spec)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/kd_step_efficiency"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument("--square", type=int, default=2048, help="side of the square ceiling GEMM")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per ceiling shape")
    p.add_argument("--loss", default="jsd", choices=sorted(peer.LOSSES))
    p.add_argument(
        "--compile-study",
        action="store_true",
        help="only compare compile: true with eager (each step's FLOPs, both timed, ceiling)",
    )
    p.add_argument("--warmup", type=int, default=3, help="compile study: steps left out")
    p.add_argument(
        "--json",
        default=str(peer.REPO / "scripts/bench_data/step_efficiency_compile.json"),
        help="compile study: raw numbers",
    )
    args = p.parse_args(argv)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled")
    start = {"load": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"start {start['time']}: load average {start['load']} on {os.cpu_count()} CPUs")
    if args.compile_study:
        return compile_study(args, env)

    peer.PAIRS["smollm2"]["steps"]["off_policy"] = args.steps
    assets = peer.write_assets(work, "smollm2", n_rows=4 * args.steps + 8)
    runs = work / "runs"
    configs = {}
    for name, steps in (("timed", args.steps), ("profiled", args.steps), ("one_step", 1)):
        peer.PAIRS["smollm2"]["steps"]["off_policy"] = steps
        out = runs / name
        configs[name] = peer.kd_config(assets, "smollm2", "off_policy", args.loss, out)
    for name in configs:
        import shutil

        shutil.rmtree(runs / name, ignore_errors=True)

    result: dict[str, Any] = {"argv": sys.argv, "threads": args.threads, "start": start}
    result["timed"] = timed_run(configs["timed"], runs / "timed", env)
    print(f"timed: median step {result['timed']['median_step_s']:.3f} s", flush=True)
    spec = {
        "threads": args.threads,
        "steps": args.steps,
        "config": str(configs["profiled"]),
        "config_one_step": str(configs["one_step"]),
        "overrides": [],
    }
    result["profile"] = _child("_profile", spec, work, env)
    flops = result["profile"]["step_flops"]
    print(f"one step: {flops / 1e9:.1f} GFLOP", flush=True)
    shapes = sorted(result["profile"]["gemm_shapes"])
    ceiling_spec = {
        "threads": args.threads,
        "shapes": shapes,
        "square": args.square,
        "repeats": args.repeats,
    }
    result["ceiling"] = _child("_ceiling", ceiling_spec, work, env)
    optimizer_spec = {
        "threads": args.threads,
        "weights": str(assets["student"] / "model.safetensors"),
        "repeats": args.repeats,
    }
    result["optimizer"] = _child("_optimizer", optimizer_spec, work, env)
    gflops = result["ceiling"]["gflops_by_shape"]
    ceiling = max(gflops.values())
    achieved = flops / result["timed"]["median_step_s"] / 1e9
    result.update(achieved_gflops=achieved, ceiling_gflops=ceiling, end_load=os.getloadavg())
    result["ratio"] = achieved / ceiling
    (work / "efficiency.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print("GEMM GFLOP/s by shape (m x k x n):")
    for shape, g in sorted(gflops.items(), key=lambda kv: -kv[1]):
        calls = result["profile"]["gemm_shapes"].get(shape, 0) / result["profile"]["profiled_steps"]
        print(f"  {shape:>20s} {g:8.1f}  calls per step {calls:.0f}")
    print(
        "AdamW step over the student's parameters, CPU s:", result["optimizer"]["adamw_step_cpu_s"]
    )
    print(f"end: load average {result['end_load']}")
    print(f"EFFICIENCY gflops={achieved:.1f} ceiling={ceiling:.1f} ratio={result['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
