"""Benchmark kd's KD recipe against torchtune 0.6.1's on the same setup (CPU).

Runs ``tune run knowledge_distillation_single_device --config <yaml>`` and
``kd run kd_single_device --config <yaml>`` as subprocesses on identical Qwen2-shaped models (real
padded vocab 151936, LoRA student since torchtune's KD recipe supports only LoRA, full teacher),
identical data (every example has the same length, so every step has the same labelled tokens),
batch, steps and sequence length; alternating the two tools, ``--repeats`` runs each.

Measured per run:
  - tokens/s of the training steps, from each tool's own log: torchtune's DiskLogger
    ``tokens_per_second_per_gpu``, kd's ``output_dir/metrics.jsonl`` ``tokens_per_second``; the
    median over steps 2..N (step 1 includes one-time warm-up);
  - whole-process wall time (start to exit, including imports, loading and the final save);
  - peak RSS of the process (``os.wait4`` rusage: the kernel's high-water mark, nothing missed).

Usage::

    python scripts/bench_vs_torchtune.py                    # small + large, 3 runs each
    python scripts/bench_vs_torchtune.py --sizes small --repeats 1

Prints a table and ends with ``RATIO tokens_per_s=<kd over torchtune> peak_mem=<kd over torchtune>``
for the largest size; raw numbers go to scripts/bench_data/bench_vs_torchtune.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import string
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from kd.testing import (
    TinyModel,
    checkpointer_node,
    tokenizer_node,
    write_jsonl,
    write_tiny_model,
    write_tokenizer,
)

VOCAB = 151936  # Qwen2.5-0.5B..3B padded vocabulary
GIB = 1024**3


@dataclass(frozen=True)
class Size:
    name: str
    student: TinyModel
    teacher: TinyModel
    seq_len: int
    batch_size: int
    steps: int


def _shape(layers: int, dim: int, seq_len: int) -> TinyModel:
    return TinyModel(VOCAB, layers, 4, 2, dim, 4 * dim, max_seq_len=seq_len)


SIZES = {
    # The size first measured by hand on this machine (student/teacher 2/4 layers, dims 64/128).
    "small": Size(
        "small", _shape(2, 64, 64), _shape(4, 128, 64), seq_len=64, batch_size=8, steps=10
    ),
    # 1024-token sequences: the [tokens, 151936] logits dominate time and memory, as at real scale.
    "large": Size(
        "large", _shape(2, 64, 1024), _shape(4, 128, 1024), seq_len=1024, batch_size=2, steps=4
    ),
}

LORA = {
    "lora_attn_modules": ["q_proj", "v_proj", "output_proj"],
    "apply_lora_to_mlp": True,
    "lora_rank": 8,
    "lora_alpha": 16,
}
PROMPT = "copy:"


# ------------------------------------------------------------------------------------ assets
def write_data(path: Path, *, seq_len: int, num_examples: int, tokenizer_dir: Path) -> int:
    """Examples of exactly ``seq_len`` tokens; short prompt, long answer (labelled).

    Returns the labelled tokens per example.
    """
    from kd import _torchtune as tt

    tok = _tokenizer(tokenizer_dir)
    messages = [tt.Message("user", PROMPT, masked=True), tt.Message("assistant", "")]
    overhead = len(tok.tokenize_messages(messages, add_eos=True)[0])
    answer_len = seq_len - overhead
    rng = random.Random(0)
    rows = [
        {
            "input": PROMPT,
            "output": "".join(rng.choice(string.ascii_lowercase) for _ in range(answer_len)),
        }
        for _ in range(num_examples)
    ]
    write_jsonl(path, rows)
    tokens, mask = tok.tokenize_messages(
        [tt.Message("user", PROMPT, masked=True), tt.Message("assistant", rows[0]["output"])]
    )
    assert len(tokens) == seq_len, (len(tokens), seq_len)
    return sum(1 for m in mask if not m)


def _tokenizer(tokenizer_dir: Path) -> Any:
    from kd.config import instantiate

    return instantiate(tokenizer_node(tokenizer_dir, None), key="tokenizer")


def _builder(shape: TinyModel, lora: bool) -> dict[str, Any]:
    node = shape.builder(lora=lora)
    if lora:
        node.update(LORA)
    return node


def _checkpointer(model_dir: Path, output_dir: Path) -> dict[str, Any]:
    return {**checkpointer_node(model_dir, output_dir), "recipe_checkpoint": None}


def common_config(size: Size, assets: dict[str, Path], out: Path) -> dict[str, Any]:
    """Keys both tools read with the same meaning."""
    return {
        "output_dir": str(out),
        "model": _builder(size.student, lora=True),
        "teacher_model": _builder(size.teacher, lora=False),
        "tokenizer": tokenizer_node(assets["tokenizer"], size.seq_len),
        "checkpointer": _checkpointer(assets["student"], out),
        "teacher_checkpointer": _checkpointer(assets["teacher"], out),
        "resume_from_checkpoint": False,
        "dataset": {
            "_component_": "torchtune.datasets.instruct_dataset",
            "source": "json",
            "data_files": str(assets["data"]),
            "split": "train",
            "train_on_input": False,
            "packed": False,
        },
        "seed": 0,
        "shuffle": True,
        "batch_size": size.batch_size,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 3e-4, "weight_decay": 0.01},
        "lr_scheduler": {
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 0,
        },
        "kd_ratio": 0.5,
        "epochs": 1,
        "max_steps_per_epoch": size.steps,
        "gradient_accumulation_steps": 1,
        "clip_grad_norm": None,
        "compile": False,
        "metric_logger": {
            "_component_": "torchtune.training.metric_logging.DiskLogger",
            "log_dir": str(out / "logs"),
        },
        "log_every_n_steps": 1,
        "log_peak_memory_stats": False,
        "device": "cpu",
        "dtype": "fp32",
        "enable_activation_checkpointing": False,
    }


def torchtune_config(size: Size, assets: dict[str, Path], out: Path) -> dict[str, Any]:
    cfg = common_config(size, assets, out)
    cfg.update(
        loss={"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        kd_loss={"_component_": "torchtune.modules.loss.ForwardKLWithChunkedOutputLoss"},
        enable_activation_offloading=False,
        profiler={"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    )
    return cfg


def kd_config(size: Size, assets: dict[str, Path], out: Path) -> dict[str, Any]:
    cfg = common_config(size, assets, out)
    # kd's defaults otherwise: fused linear + CE + KL loss over labelled tokens, chunks of 1024.
    cfg.update(kd_loss={"divergence": "forward_kl"}, temperature=1.0)
    return cfg


def write_assets(work: Path, size: Size) -> dict[str, Path]:
    root = work / size.name
    tok = write_tokenizer(root / "tokenizer")
    assets = {
        "tokenizer": tok,
        "student": write_tiny_model(root / "student", size.student, seed=1, tokenizer_dir=tok),
        "teacher": write_tiny_model(root / "teacher", size.teacher, seed=2, tokenizer_dir=tok),
        "data": root / "data.jsonl",
    }
    write_data(
        assets["data"],
        seq_len=size.seq_len,
        num_examples=size.batch_size * size.steps + size.batch_size,
        tokenizer_dir=tok,
    )
    return assets


# -------------------------------------------------------------------------------------- runs
@dataclass
class RunResult:
    tool: str
    size: str
    repeat: int
    wall_s: float
    peak_rss_gib: float
    tokens_per_s: float  # median over steps 2..N
    step_tokens_per_s: list[float]
    first_loss: float
    returncode: int
    user_s: float = 0.0  # CPU seconds in user space ...
    sys_s: float = 0.0  # ... and in the kernel (page faults of fresh multi-GiB buffers show here)


_TT_TPS = re.compile(r"tokens_per_second_per_gpu:(?:tensor\()?([0-9.eE+-]+)")
_TT_LOSS = re.compile(r"\bloss:(?:tensor\()?([0-9.eE+-]+)")


def parse_torchtune(out: Path) -> tuple[list[float], float]:
    logs = sorted((out / "logs").glob("log_*.txt"))
    assert logs, f"no torchtune log in {out / 'logs'}"
    lines = [line for line in logs[-1].read_text().splitlines() if line.startswith("Step ")]
    tps = [float(_TT_TPS.search(line).group(1)) for line in lines]
    return tps, float(_TT_LOSS.search(lines[0]).group(1))


def parse_kd(out: Path) -> tuple[list[float], float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return [float(r["tokens_per_second"]) for r in rows], float(rows[0]["loss"])


def run_once(
    tool: str, size: Size, assets: dict[str, Path], work: Path, repeat: int, env: dict
) -> RunResult:
    out = work / size.name / f"{tool}_{repeat}"
    cfg = (torchtune_config if tool == "torchtune" else kd_config)(size, assets, out)
    cfg_path = work / size.name / f"{tool}_{repeat}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    if tool == "torchtune":
        cmd = ["tune", "run", "knowledge_distillation_single_device", "--config", str(cfg_path)]
    else:
        cmd = ["kd", "run", "kd_single_device", "--config", str(cfg_path)]
    log = open(work / size.name / f"{tool}_{repeat}.log", "w")  # noqa: SIM115
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    log.close()
    rc = os.waitstatus_to_exitcode(status)
    proc.returncode = rc
    if rc != 0:
        print(
            f"{tool} {size.name} run {repeat} failed (exit {rc}); see {log.name}", file=sys.stderr
        )
        return RunResult(
            tool,
            size.name,
            repeat,
            wall,
            usage.ru_maxrss * 1024 / GIB,
            float("nan"),
            [],
            float("nan"),
            rc,
            usage.ru_utime,
            usage.ru_stime,
        )
    tps, first_loss = (parse_torchtune if tool == "torchtune" else parse_kd)(out)
    steady = tps[1:] if len(tps) > 1 else tps
    return RunResult(
        tool=tool,
        size=size.name,
        repeat=repeat,
        wall_s=wall,
        peak_rss_gib=usage.ru_maxrss * 1024 / GIB,  # ru_maxrss is in KiB on Linux
        tokens_per_s=statistics.median(steady),
        step_tokens_per_s=tps,
        first_loss=first_loss,
        returncode=rc,
        user_s=usage.ru_utime,
        sys_s=usage.ru_stime,
    )


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def summarize(results: list[RunResult], size: str) -> dict[str, dict[str, float]]:
    out = {}
    for tool in ("torchtune", "kd"):
        rs = [r for r in results if r.tool == tool and r.size == size and r.returncode == 0]
        out[tool] = {
            "runs": len(rs),
            "tokens_per_s": statistics.median(r.tokens_per_s for r in rs) if rs else float("nan"),
            "wall_s": statistics.median(r.wall_s for r in rs) if rs else float("nan"),
            "peak_rss_gib": statistics.median(r.peak_rss_gib for r in rs) if rs else float("nan"),
            "first_loss": statistics.median(r.first_loss for r in rs) if rs else float("nan"),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,large", help="comma list of: " + ", ".join(SIZES))
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per tool and size (alternated)"
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both tools")
    parser.add_argument("--work-dir", default="/tmp/kd_bench_vs_torchtune", help="scratch folder")
    parser.add_argument(
        "--json",
        default=str(Path(__file__).parent / "bench_data" / "bench_vs_torchtune.json"),
        help="where to write the raw results",
    )
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "WANDB_MODE": "offline",
    }
    sizes = [SIZES[s] for s in args.sizes.split(",")]
    results: list[RunResult] = []
    loads = [_load()]
    print(f"start: {loads[0]}; {args.threads} thread(s) per run", flush=True)
    for size in sizes:
        assets = write_assets(work, size)
        for repeat in range(args.repeats):
            # Alternate which tool goes first so a drift in machine load hits both equally.
            order = ("torchtune", "kd") if repeat % 2 == 0 else ("kd", "torchtune")
            for tool in order:
                r = run_once(tool, size, assets, work, repeat, env)
                results.append(r)
                print(
                    f"{size.name:<6} {tool:<9} run {repeat}: wall {r.wall_s:6.1f} s  peak RSS "
                    f"{r.peak_rss_gib:5.2f} GiB  tokens/s {r.tokens_per_s:9.1f}  step-1 loss "
                    f"{r.first_loss:.4f}  cpu user {r.user_s:.1f} s sys {r.sys_s:.1f} s",
                    flush=True,
                )
        loads.append(_load())
    print(f"end: {loads[-1]}")

    summary = {s.name: summarize(results, s.name) for s in sizes}
    print()
    print(f"{'size':<6} {'tool':<9} {'tokens/s (median)':>18} {'wall s':>8} {'peak RSS GiB':>13}")
    for s in sizes:
        for tool in ("torchtune", "kd"):
            m = summary[s.name][tool]
            print(
                f"{s.name:<6} {tool:<9} {m['tokens_per_s']:>18.1f} {m['wall_s']:>8.1f} {m['peak_rss_gib']:>13.2f}"
            )
        tt_, kd_ = summary[s.name]["torchtune"], summary[s.name]["kd"]
        print(
            f"{s.name:<6} {'kd / tt':<9} {kd_['tokens_per_s'] / tt_['tokens_per_s']:>18.2f} "
            f"{kd_['wall_s'] / tt_['wall_s']:>8.2f} {kd_['peak_rss_gib'] / tt_['peak_rss_gib']:>13.2f}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "argv": sys.argv,
                "threads": args.threads,
                "load": loads,
                "sizes": {
                    s.name: {
                        **asdict(s),
                        "student": asdict(s.student),
                        "teacher": asdict(s.teacher),
                    }
                    for s in sizes
                },
                "summary": summary,
                "runs": [asdict(r) for r in results],
            },
            indent=1,
        )
        + "\n"
    )
    last = summary[sizes[-1].name]
    ratio_tps = last["kd"]["tokens_per_s"] / last["torchtune"]["tokens_per_s"]
    ratio_mem = last["kd"]["peak_rss_gib"] / last["torchtune"]["peak_rss_gib"]
    print(f"RATIO tokens_per_s={ratio_tps:.2f} peak_mem={ratio_mem:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
