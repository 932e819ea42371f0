"""A served teacher vs an online local teacher vs stored logits: tokens/s and the teacher wait.
Writes docs/served_teacher_benchmark.md.

The same KD config (tiny Qwen2 models on kd.testing's tokenizer, the teacher ~4x the student's
FLOPs) trains four ways through ``kd run kd``:

* ``online``: ``teacher_model`` in the training process;
* ``stored``: ``teacher_logits`` (``kd run teacher_logits`` first, not timed);
* ``served``: ``teacher_server`` of kd's test server (kd.testing_server, vLLM protocol) in its own
  process on this machine, the default ``prefetch`` (micro-batches asked ahead);
* ``served_no_prefetch``: the same with ``prefetch: 0`` (every micro-batch waits for its answer).

Per mode: the median ``tokens_per_second`` of the steps after the second, and the share of step
time spent waiting for the teacher (``time_teacher_s`` over the step time). On a 2-core CPU the
server and the trainer share the cores, so the server is slower than a GPU server would be; the
overlap is what the wait share shows.

    python scripts/bench_served_teacher.py --work /tmp/kd_served     # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "served_teacher_benchmark.md"
STEPS = 10
BATCH = 8
REPS = 1
K = 20
ROWS = 512


def shapes():
    from kd.testing import TinyModel

    student = TinyModel(288, 2, 4, 2, 256, 768, max_seq_len=64)
    teacher = TinyModel(320, 4, 4, 2, 384, 1152, max_seq_len=64)
    return student, teacher


def assets(root: Path) -> dict[str, Path]:
    from kd.testing import write_jsonl, write_tiny_model, write_tokenizer

    student, teacher = shapes()
    rng = random.Random(3)
    rows = []
    for _ in range(ROWS):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        rows.append({"input": f"{a}+{b}+{a}", "output": f"{a + b + a} = {a}+{b}+{a}"})
    return {
        "tokenizer": write_tokenizer(root / "tokenizer"),
        "student": write_tiny_model(root / "student", student, seed=1),
        "teacher": write_tiny_model(root / "teacher", teacher, seed=2),
        "data": write_jsonl(root / "train.jsonl", rows),
    }


def config(root: Path, a: dict[str, Path]) -> dict:
    from kd.testing import checkpointer_node, tokenizer_node

    student, teacher = shapes()
    return {
        "output_dir": str(root / "run"),
        "model": student.builder(),
        "teacher_model": teacher.builder(),
        "tokenizer": tokenizer_node(a["tokenizer"], 64),
        "checkpointer": checkpointer_node(a["student"], root / "tt"),
        "teacher_checkpointer": checkpointer_node(a["teacher"], root / "tt"),
        "dataset": {
            "_component_": "torchtune.datasets.instruct_dataset",
            "source": "json",
            "data_files": str(a["data"]),
            "split": "train",
        },
        "seed": 0,
        "shuffle": False,
        "batch_size": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "lr_scheduler": None,
        "kd_ratio": 0.5,
        "epochs": 1,
        "max_steps_per_epoch": STEPS,
        "save_every_n_steps": None,
        "device": "cpu",
        "dtype": "fp32",
        "memory": {"budget_gib": 16, "check": "error"},
    }


def kd(args: list[str], log: Path) -> None:
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, "-m", "kd.cli", *args], stdout=out, stderr=out)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): kd {' '.join(args)}; see {log}")


def serve(root: Path) -> None:
    """``--serve``: the test server of the teacher, its URL on stdout, until killed."""
    import torch

    from kd.testing_server import TeacherTestServer, model_logprobs

    torch.set_num_threads(1)
    _, teacher = shapes()
    fn = model_logprobs(root / "teacher", teacher, root / "serve_scratch", vocab=288)
    with TeacherTestServer(fn, model_name="bench-teacher", max_logprobs=K, lifetime_s=1800) as s:
        print(s.url, flush=True)
        while True:
            time.sleep(1)


def measure(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if "loss" in r and r["step"] > 2]
    seconds = [r["num_tokens"] / r["tokens_per_second"] for r in rows]
    waits = [r["time_teacher_s"] for r in rows]
    return {
        "tok_s": statistics.median(r["tokens_per_second"] for r in rows),
        "wait_share": sum(waits) / sum(seconds),
        "wait_s": statistics.median(waits),
        "step_s": statistics.median(seconds),
    }


def bench(work: Path) -> dict:
    root = work / "served"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    a = assets(root)
    base = root / "base.yaml"
    base.write_text(yaml.safe_dump(config(root, a), sort_keys=False))
    store = root / "store"
    pre = ["run", "teacher_logits", "--config", str(base), f"teacher_logits.path={store}"]
    kd([*pre, f"teacher_logits.k={K}", f"output_dir={root / 'pre'}"], root / "pre.log")
    served_cfg = config(root, a)
    del served_cfg["teacher_model"], served_cfg["teacher_checkpointer"]
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(root)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        served_cfg["teacher_server"] = {"url": url, "model": "bench-teacher", "top_k": K}
        served = root / "served.yaml"
        served.write_text(yaml.safe_dump(served_cfg, sort_keys=False))
        modes = {
            "online": (base, []),
            "stored": (base, [f"teacher_logits.path={store}", f"teacher_logits.k={K}"]),
            "served": (served, []),
            "served_no_prefetch": (served, ["teacher_server.prefetch=0"]),
        }
        results: dict[str, list[dict]] = {m: [] for m in modes}
        for rep in range(REPS):
            for mode, (cfg, extra) in modes.items():
                out = root / f"{mode}{rep}"
                kd(
                    ["run", "kd", "--config", str(cfg), f"output_dir={out}", *extra],
                    root / f"{mode}{rep}.log",
                )
                results[mode].append(measure(out))
                print(mode, rep, results[mode][-1], flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    return {
        mode: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for mode, runs in results.items()
    }


def report_load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def write_doc(report: dict) -> None:
    lines = [
        "# Served teacher: tokens/s and the teacher wait",
        "",
        "`scripts/bench_served_teacher.py` on this machine's CPU (2 cores shared by the trainer "
        "and the server): the same KD config (student 2 x 256, teacher 4 x 384 Qwen2 layers, "
        f"vocabulary 288, batch {BATCH}, {STEPS} steps, top-{K}) with the teacher online in the "
        "training process, from kd's store (`kd run teacher_logits` first, not timed), and served "
        "by kd's test server (`kd.testing_server`, vLLM protocol, its own process on the same "
        "machine) with the default prefetch (4 micro-batches) and with `prefetch: 0`. Medians over "
        f"the steps after the second of {REPS} run(s) per mode; the machine's load average was "
        f"{report_load()} (other jobs share its cores), so the numbers compare modes measured "
        "together, not absolute speeds.",
        "",
        "| mode | tokens/s | step s | teacher wait s/step | share of step time waiting |",
        "|---|---|---|---|---|",
    ]
    for mode, r in report.items():
        lines.append(
            f"| {mode} | {r['tok_s']:.0f} | {r['step_s']:.3f} | {r['wait_s']:.3f} | "
            f"{100 * r['wait_share']:.1f}% |"
        )
    lines += [
        "",
        "`online`'s wait is the teacher's forward in the step; `stored`'s the read of the store; "
        "`served`'s the time a step waits for answers asked ahead while the previous steps "
        "trained, `served_no_prefetch`'s the whole round trip. On this CPU the server computes "
        "on the same two cores as the trainer, so the served path pays for the teacher's "
        "forward in another process plus JSON; with the server on its own GPU the wait falls to "
        "what the server cannot hide.",
        "",
        "Run it: `python scripts/bench_served_teacher.py --work /tmp/kd_served`.",
        "",
    ]
    DOC.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kd_served"))
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    report = bench(args.work)
    (args.work / "served_report.json").write_text(json.dumps(report, indent=2))
    write_doc(report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
