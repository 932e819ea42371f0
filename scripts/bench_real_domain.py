"""KD's second use on a real pretrained teacher, offline, on this CPU: a small labelled set and a
teacher that knows the domain. Does KD from the domain teacher close a share of the CE-only ->
teacher gap of a depth-pruned student trained on a few hundred rows, at equal steps and tokens?
Writes ``<work>/results_domain.json`` (every run, and the gap figure on test).

1. The teacher (SmolLM2-135M-Instruct, scripts/bench_real_kd.py) is fine-tuned with kd itself on
   the full training split (CE only: ``kd_ratio: 0``, no teacher), ``--teacher-steps`` steps at
   batch 4 (default: one epoch, 257 steps of the 1031 rows).
2. ``--rows`` rows of the training split (seeded sample) are the labelled set. The block-pruned
   student (bench_real_kd's ``student_block``, layers 19-28 of 30 dropped) trains on them for
   ``--steps`` steps at batch 4, every run on the same rows in the same order: CE only (two
   learning rates) and KD from the fine-tuned teacher (forward KL, T 1, kd_ratio 0.5 and 1.0);
   with ``--hidden`` also KD + hidden states (kd init's map of the kept layers, cosine, weight 1).
3. kd's in-training validation on dev picks the best CE-only and the best KD run; both are
   reported on test (transformers alone on each ``final/``), with
   ``gap = (CE - KD) / (CE - teacher)`` against the fine-tuned teacher.

Finished runs are reused; a run stopped part-way (SIGTERM saves a step checkpoint) resumes with
``resume_from_checkpoint=true``.

    python scripts/bench_real_domain.py --work /tmp/dkd                   # the study
    python scripts/bench_real_domain.py --work /tmp/dkd --teacher-steps 2 --steps 2 --rows 16  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_real_hidden as hidden  # noqa: E402
import bench_real_kd as base  # noqa: E402
from bench_real_hidden import Setting  # noqa: E402

BATCH = 4  # bench_real_kd.save_run_config's micro-batch (no accumulation)
TRAIN_ROWS_SEED = 0

# Fixed before the first run: CE only at bench_real_kd's best lr and the one below it (a small set
# trained for several epochs may prefer a gentler lr), KD at the 30-step study's best setting and
# KD only.
SETTINGS: tuple[Setting, ...] = (
    Setting("ce lr=1e-4", 0.0, lr=1e-4),
    Setting("ce lr=3e-4", 0.0, lr=3e-4),
    Setting("kd fkl r=0.5 T=1 lr=3e-4", 0.5, lr=3e-4),
    Setting("kd fkl r=1.0 T=1 lr=3e-4", 1.0, lr=3e-4),
)
HIDDEN = Setting(
    "kd+hs cosine w=1 r=0.5 lr=3e-4", 0.5, lr=3e-4, hidden={"loss": "cosine", "weight": 1.0}
)


def _epochs(steps: int, rows: int) -> dict[str, int]:
    """``epochs`` and ``max_steps_per_epoch`` for ``steps`` steps over ``rows`` rows at batch 4
    (the last epoch may hold a few steps more when ``steps`` is not a multiple of them)."""
    per_epoch = max(rows // BATCH, 1)
    epochs = max(math.ceil(steps / per_epoch), 1)
    return {"epochs": epochs, "max_steps_per_epoch": math.ceil(steps / epochs)}


def _rows(path: Path) -> list[str]:
    return [json.loads(x)["text"] for x in path.read_text().splitlines() if x]


def labelled_set(paths: dict[str, Path], work: Path, rows: int, seed: int) -> Path:
    """``rows`` rows of the training split, sampled with ``seed`` (in the split's order)."""
    texts = _rows(paths["train"])
    if not 0 < rows <= len(texts):
        sys.exit(f"--rows: {rows} is not 1..{len(texts)} (the training split's rows)")
    keep = sorted(random.Random(seed).sample(range(len(texts)), rows))
    path = work / f"labelled_{rows}_seed{seed}.jsonl"
    path.write_text("".join(json.dumps({"text": texts[i]}) + "\n" for i in keep))
    return path


def teacher_config(paths: dict[str, Path], out: Path, steps: int, lr: float) -> Path:
    """The teacher as the trained model: CE only, no teacher, the full training split."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(paths["base"].read_text())
    cfg.output_dir = str(out)
    cfg.model = cfg.teacher_model
    cfg.checkpointer = cfg.teacher_checkpointer
    cfg.tokenizer.path = str(paths["teacher"])
    cfg.teacher_model = None
    cfg.teacher_checkpointer = None
    cfg.kd_ratio = 0.0
    OmegaConf.update(cfg, "optimizer.lr", lr)
    path = base.save_run_config(cfg, paths, out, steps, evals=5)
    return _set_epochs(path, steps, len(_rows(paths["train"])))


def _set_epochs(path: Path, steps: int, rows: int) -> Path:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    for key, value in _epochs(steps, rows).items():
        cfg[key] = value
    OmegaConf.save(cfg, path)
    return path


def student_config(
    paths: dict[str, Path], setting: Setting, out: Path, steps: int, labelled: Path, rows: int
) -> Path:
    """bench_real_hidden's config of ``setting`` on the labelled set, taught by the fine-tuned
    teacher."""
    from omegaconf import OmegaConf

    path = hidden.write_config(paths, setting, out, steps)
    cfg = OmegaConf.load(path)
    cfg.dataset.data_files = str(labelled)
    if setting.needs_teacher:
        cfg.teacher_checkpointer.checkpoint_dir = str(paths["teacher_ft"])
    OmegaConf.save(cfg, path)
    return _set_epochs(path, steps, rows)


def _result(name: str, out: Path, texts: dict[str, list[str]], **extra: Any) -> dict[str, Any]:
    train, val = base.read_metrics(out)
    return {
        "name": name,
        **extra,
        "steps": len(train),
        "val": val,
        "dev": val[-1]["val_ce_loss"],
        "test": base.heldout_loss(out / "final", texts["test"])[0],
        "tokens": sum(r["num_tokens"] for r in train),
        "tok_s": statistics.median(r["tokens_per_second"] for r in train),
        **json.loads((out / "bench_time.json").read_text()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (models, runs)")
    parser.add_argument(
        "--teacher-steps", type=int, default=None, help="teacher fine-tuning steps (one epoch)"
    )
    parser.add_argument("--teacher-lr", type=float, default=1e-4, help="teacher fine-tuning lr")
    parser.add_argument("--rows", type=int, default=256, help="labelled rows of the train split")
    parser.add_argument("--seed", type=int, default=TRAIN_ROWS_SEED, help="labelled-set seed")
    parser.add_argument(
        "--steps", type=int, default=192, help="student steps (192: 3 epochs of 256 rows)"
    )
    parser.add_argument("--hidden", action="store_true", help="also KD + hidden states")
    parser.add_argument("--only", default=None, help="run only this student setting (by name)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    paths = hidden.prepare(args.work)
    texts = {s: _rows(paths[s]) for s in ("train", "dev", "test")}
    teacher_steps = args.teacher_steps or len(texts["train"]) // BATCH  # one epoch
    runs = args.work / "runs" / "domain"

    out = runs / f"teacher_ft_{teacher_steps}s_lr{args.teacher_lr:g}"
    hidden.train_resumable(teacher_config(paths, out, teacher_steps, args.teacher_lr), out)
    paths["teacher_ft"] = out / "final"
    teacher = _result("teacher fine-tuned", out, texts, lr=args.teacher_lr)
    print(f"teacher fine-tuned: dev {teacher['dev']:.4f} test {teacher['test']:.4f}", flush=True)

    labelled = labelled_set(paths, args.work, args.rows, args.seed)
    results = []
    for setting in (*SETTINGS, HIDDEN) if args.hidden else SETTINGS:
        if args.only is not None and setting.name != args.only:
            continue
        tag = setting.name.replace(" ", "_").replace("=", "")
        taught = f"_t{teacher_steps}" if setting.needs_teacher else ""
        out = runs / f"{tag}_{args.rows}r{args.seed}_{args.steps}s{taught}"
        cfg = student_config(paths, setting, out, args.steps, labelled, args.rows)
        hidden.train_resumable(cfg, out)
        result = _result(setting.name, out, texts, setting=asdict(setting))
        results.append(result)
        print(f"{setting.name:32s} dev {result['dev']:.4f} test {result['test']:.4f}", flush=True)
    if args.only is not None:
        return
    ce = min((r for r in results if r["setting"]["kd_ratio"] == 0), key=lambda r: r["dev"])
    kd = min((r for r in results if r["setting"]["kd_ratio"] > 0), key=lambda r: r["dev"])
    gap = (ce["test"] - kd["test"]) / (ce["test"] - teacher["test"])
    for r in results:
        if r["setting"]["kd_ratio"] > 0:
            r["gap_test"] = (ce["test"] - r["test"]) / (ce["test"] - teacher["test"])
    reference = {
        name: {s: base.heldout_loss(folder, texts[s])[0] for s in ("dev", "test")}
        for name, folder in (
            ("teacher (not fine-tuned)", paths["teacher"]),
            ("untrained student", paths["student_block"]),
        )
    }
    summary = {
        "best_ce": ce["name"],
        "best_kd": kd["name"],
        "ce_test": ce["test"],
        "kd_test": kd["test"],
        "teacher_test": teacher["test"],
        "gap_test": gap,
    }
    print(f"gap (CE - KD) / (CE - teacher) on test: {gap:.1%} ({kd['name']} vs {ce['name']})")
    (args.work / "results_domain.json").write_text(
        json.dumps(
            {
                "summary": summary,
                "teacher": teacher,
                "runs": results,
                "reference": reference,
                "flags": {k: str(v) for k, v in vars(args).items()},
                "teacher_steps": teacher_steps,
                "labelled": str(labelled),
                "wall_s": time.perf_counter() - t0,
                "date": time.strftime("%Y-%m-%d"),
            },
            indent=1,
        )
    )
    print(f"wrote {args.work / 'results_domain.json'}")


if __name__ == "__main__":
    main()
