"""On-policy distillation (GKD): generation speed, step cost and quality. Writes
docs/on_policy_benchmark.md.

Three measurements:

1. **Generation throughput** at 128 new tokens after 32-token prompts, batch 1 and 8, on two tiny
   random-init Qwen2 shapes (the demo's student, and a 4x wider one): :func:`kd.rollouts.sampling.rollout`
   (the KV cache) against a loop that recomputes the whole sequence every token through the same
   sampler (same per-row generators: the tokens must come out identical), and, as library
   reference points, torchtune's ``generate`` with and without ``local_kv_cache`` and
   transformers' ``generate(use_cache=True/False)`` on the same weights loaded as a transformers
   model (where kd's rollout runs transformers' cache). No stop token: every row samples exactly
   128 tokens. The methods alternate within each repeat; medians of tokens per CPU-second of this
   single-threaded process (wall-clock on an idle machine, and robust to a shared one).
2. **Step cost**: the seconds of one optimizer step of the student runs below with ``on_policy``
   lmbda 1 (and 0.5) against the same config with ``on_policy: null``, and the split the recipe
   logs (``time_generate_s``, ``time_teacher_s``, ``time_student_s``) in ``metrics.jsonl``.
3. **Quality on the demo task**: ``kd demo``'s student runs (its config building,
   :func:`kd.demo.configs.run_config`: same data, 160 steps, lr), off-policy and on-policy with
   forward KL and with JSD, from the demo's random-init student and from its CE-only student,
   at equal optimizer steps and seeds; each evaluated on the demo's 512 held-out prompts with
   :class:`kd.demo.evaluate.HeldOut` (greedy exact match of the 8-letter answer, held-out loss,
   KL to the teacher) and greedily end to end from the user turn (:class:`EndToEnd`).

    python scripts/bench_on_policy.py --work /tmp/kd_onpolicy   # ~15 min on 2 shared cores
    python scripts/bench_on_policy.py --work /tmp/kd_onpolicy --only generation  # re-time part 1
    python scripts/bench_on_policy.py --work /tmp/kd_op_quick --quick  # smoke run, doc not written

Everything runs in this process, single-threaded (``--threads``); the training runs go through the
recipe as ``kd demo`` runs them (:func:`kd.demo.app.train`), each from a YAML written under
``<work>/runs/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "on_policy_benchmark.md"
PROMPT_LEN = 32
NEW_TOKENS = 128
BATCHES = (1, 8)
PAD_ID = 0


# ------------------------------------------------------------------- 1. generation throughput
def _gen_shapes() -> dict[str, Any]:
    from kd.demo.configs import STUDENT
    from kd.testing import TinyModel

    seq = PROMPT_LEN + NEW_TOKENS
    return {
        "demo student (2 layers, dim 64)": dataclasses.replace(STUDENT, max_seq_len=seq),
        "wider student (2 layers, dim 256)": TinyModel(288, 2, 4, 2, 256, 768, max_seq_len=seq),
    }


def _flops_per_token(shape: Any) -> int:
    """Multiply-accumulates x2 of the decoder's matmuls per token (attention scores excluded)."""
    d, f, kv = shape.embed_dim, shape.intermediate_dim, shape.embed_dim // shape.num_heads
    per_layer = d * (d + 2 * kv * shape.num_kv_heads + d) + 3 * d * f
    return 2 * (shape.num_layers * per_layer + shape.vocab_size * d)


def _methods(tt_model: Any, hf_model: Any, prompt: Any, seed: int) -> dict[str, Callable]:
    """Each method samples ``new`` tokens after ``prompt`` (no stop token) and returns them."""
    import torch

    from kd import models
    from kd._torchtune import generate_tokens, local_kv_cache
    from kd.rollouts import sampling
    from kd.training import on_policy

    b = prompt.shape[0]
    prompts = on_policy.Prompts(
        tokens=prompt,
        mask=torch.ones_like(prompt, dtype=torch.bool),
        lengths=torch.full((b,), prompt.shape[1]),
    )
    cpu = torch.device("cpu")

    def gens() -> list[torch.Generator]:
        return sampling.row_generators(seed, 0, range(b), device=cpu)

    def kd_rollout(model: Any) -> Callable[[int], torch.Tensor]:
        def run(new: int) -> torch.Tensor:
            models.set_hidden_output(model)
            try:
                return sampling.rollout(
                    model,
                    prompts,
                    max_new_tokens=new,
                    temperature=1.0,
                    top_p=1.0,
                    stop_ids=[],
                    pad_id=PAD_ID,
                    vocab_limit=None,
                    generators=gens(),
                ).tokens
            finally:
                models.set_hidden_output(model, False)

        return run

    @torch.no_grad()
    def recompute(new: int) -> torch.Tensor:
        # The peer: the whole sequence through the model for every token, same sampler.
        models.set_hidden_output(tt_model)
        try:
            generators, tokens = gens(), prompt
            for _ in range(new):
                hidden = tt_model(tokens)
                logits = models.logits_from_hidden(tt_model, hidden[:, -1])
                token = sampling.sample_next(
                    logits, temperature=1.0, top_p=1.0, vocab_limit=None, generators=generators
                )
                tokens = torch.cat([tokens, token[:, None]], dim=1)
            return tokens[:, prompt.shape[1] :]
        finally:
            models.set_hidden_output(tt_model, False)

    def torchtune(cache: bool) -> Callable[[int], torch.Tensor]:
        def run(new: int) -> torch.Tensor:
            rng = torch.Generator().manual_seed(seed)
            if not cache:  # no caches set up: torchtune recomputes the prefix every token
                return generate_tokens(
                    tt_model, prompt, max_generated_tokens=new, pad_id=PAD_ID, rng=rng
                )[0]
            with local_kv_cache(
                tt_model,
                batch_size=b,
                device=cpu,
                dtype=torch.float32,
                decoder_max_seq_len=prompt.shape[1] + new,
            ):
                return generate_tokens(
                    tt_model, prompt, max_generated_tokens=new, pad_id=PAD_ID, rng=rng
                )[0]

        return run

    def transformers(cache: bool) -> Callable[[int], torch.Tensor]:
        @torch.no_grad()
        def run(new: int) -> torch.Tensor:
            torch.manual_seed(seed)
            return hf_model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new,
                min_new_tokens=new,
                use_cache=cache,
                pad_token_id=PAD_ID,
            )

        return run

    return {
        "kd rollout, torchtune model (KV cache)": kd_rollout(tt_model),
        "recompute the prefix, same sampler": recompute,
        "torchtune generate + local_kv_cache": torchtune(True),
        "torchtune generate, no cache": torchtune(False),
        "kd rollout, transformers model (DynamicCache)": kd_rollout(hf_model),
        "transformers generate, use_cache=True": transformers(True),
        "transformers generate, use_cache=False": transformers(False),
    }


def generation(work: Path, *, repeats: int, new_tokens: int, shapes: dict[str, Any]) -> list[dict]:
    """Tokens/s of every method, per shape and batch size (medians over ``repeats``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kd.testing import load_tiny_model, write_tiny_model

    out = []
    for i, (name, shape) in enumerate(shapes.items()):
        folder = write_tiny_model(work / "gen" / f"model{i}", shape, seed=1)
        tt_model = load_tiny_model(folder, shape, work / "gen" / "scratch")
        hf_model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        for b in BATCHES:
            gen = torch.Generator().manual_seed(100 + b)
            prompt = torch.randint(1, 256, (b, PROMPT_LEN), generator=gen)  # no pad id
            methods = _methods(tt_model, hf_model, prompt, seed=7)
            for run in methods.values():
                run(4)  # warm-up
            seconds: dict[str, list[float]] = {m: [] for m in methods}
            walls: dict[str, list[float]] = {m: [] for m in methods}
            identical = True
            for _ in range(repeats):
                tokens = {}
                for m, run in methods.items():
                    start, cpu = time.perf_counter(), time.process_time()
                    got = run(new_tokens)
                    seconds[m].append(time.process_time() - cpu)
                    walls[m].append(time.perf_counter() - start)
                    assert got.shape[-1] >= new_tokens, (m, got.shape)
                    tokens[m] = got[:, -new_tokens:]
                identical &= bool(
                    torch.equal(
                        tokens["kd rollout, torchtune model (KV cache)"],
                        tokens["recompute the prefix, same sampler"],
                    )
                )
            # Per CPU-second of this single-threaded process: what tokens/s is on an idle machine,
            # without the time spent waiting for a core shared with other jobs.
            rates = {m: b * new_tokens / statistics.median(s) for m, s in seconds.items()}
            wall_rates = {m: b * new_tokens / statistics.median(s) for m, s in walls.items()}
            row = {
                "shape": name,
                "mflops_per_token": _flops_per_token(shape) / 1e6,
                "batch": b,
                "rates": rates,
                "wall_rates": wall_rates,
                "cpu_seconds": seconds,
                "wall_seconds": walls,
                "identical_tokens": identical,
            }
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


# ------------------------------------------------------------------ 2 and 3. the demo's runs
@dataclasses.dataclass(frozen=True)
class Arm:
    """One student config of the comparison.

    Attributes:
        key: short name (run folders, report keys).
        divergence: ``kd_loss.divergence`` (JSD with beta 0.5).
        kd_ratio: weight of the divergence against the cross-entropy.
        lmbda: ``on_policy.lmbda``; None = ``on_policy: null`` (off-policy).
        sft: start from the demo's CE-only student instead of its random-init student.
    """

    key: str
    divergence: str
    kd_ratio: float
    lmbda: float | None
    sft: bool = False

    @property
    def label(self) -> str:
        policy = "off-policy" if self.lmbda is None else f"on-policy lmbda {self.lmbda:g}"
        loss = "forward KL" if self.divergence == "forward_kl" else "JSD beta 0.5"
        start = "CE-only student + " if self.sft else ""
        return f"{start}{policy}, {loss}, kd_ratio {self.kd_ratio:g}"


ARMS = (
    # From the demo's random-init student: off_fkl is the demo's KD student.
    Arm("off_fkl", "forward_kl", 0.9, None),
    Arm("on05_fkl", "forward_kl", 0.9, 0.5),
    Arm("on1_fkl", "forward_kl", 0.9, 1.0),
    Arm("off_jsd", "jsd", 1.0, None),
    Arm("on05_jsd", "jsd", 1.0, 0.5),  # GKD's defaults (TRL GKDConfig)
    Arm("on1_jsd", "jsd", 1.0, 1.0),
    # From the demo's CE-only student (supervised first, as GKD starts).
    Arm("sft_off_fkl", "forward_kl", 0.9, None, sft=True),
    Arm("sft_on1_fkl", "forward_kl", 0.9, 1.0, sft=True),
    Arm("sft_off_jsd", "jsd", 1.0, None, sft=True),
    Arm("sft_on05_jsd", "jsd", 1.0, 0.5, sft=True),
)
# (on-policy arm, its off-policy peer): the same config but on_policy.
PAIRS = (
    ("on05_fkl", "off_fkl"),
    ("on1_fkl", "off_fkl"),
    ("on05_jsd", "off_jsd"),
    ("on1_jsd", "off_jsd"),
    ("sft_on1_fkl", "sft_off_fkl"),
    ("sft_on05_jsd", "sft_off_jsd"),
)


def write_arm_config(
    demo: Path, run_dir: Path, arm: Arm, *, seed: int, new_tokens: int, quick: bool
) -> Path:
    """The demo's student config (:func:`kd.demo.configs.run_config`) with ``arm``'s loss, start
    and ``on_policy``, no step checkpoints."""
    from kd.demo.configs import STUDENT, TEACHER, run_config, write_config
    from kd.demo.task import FULL, QUICK

    plan = QUICK if quick else FULL
    init = demo / "runs" / "ce_student" / "final" if arm.sft else demo / "models" / "student_init"
    cfg = run_config(
        root=demo,
        run_dir=run_dir,
        model=STUDENT,
        model_dir=init,
        data_file=demo / "data" / "student_train.jsonl",
        epochs=plan.student_epochs,
        batch_size=plan.student_batch_size,
        save_every=10**6,
        lr=plan.lr,
        seed=seed,
        kd_ratio=arm.kd_ratio,
        teacher=TEACHER,
        teacher_dir=demo / "runs" / "teacher" / "final",
    )
    cfg["kd_loss"] = {"divergence": arm.divergence, "beta": 0.5}
    if arm.lmbda is not None:
        # kd's defaults otherwise (temperature 0.9, top_p 1, no seq_kd: TRL GKDConfig's)
        cfg["on_policy"] = {"lmbda": arm.lmbda, "max_new_tokens": new_tokens}
    return write_config(
        run_dir.parent / f"{run_dir.name}.yaml", cfg, f"bench_on_policy: {arm.label}, seed {seed}"
    )


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.mean(values) if values else None


def step_costs(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Mean step seconds and their split per arm, over all seeds' steps after step 2 (means:
    with lmbda 0.5 a step samples or not, and the mean is what a step costs on average)."""
    out = {}
    for key, metrics in runs.items():
        rows = [r for m in metrics for r in m["rows"] if "loss" in r and r["step"] > 2]
        for r in rows:
            r["step_s"] = r.get("time_generate_s", 0.0) + r["time_teacher_s"] + r["time_student_s"]
            batches = r.get("sampled_batches_student", 0)
            if batches:
                r["tokens_per_sampled_batch"] = r["sampled_tokens_student"] / batches
        out[key] = {
            name: _mean(rows, name)
            for name in (
                "step_s",
                "time_generate_s",
                "time_teacher_s",
                "time_student_s",
                "tokens_per_sampled_batch",
            )
        }
        out[key]["steps"] = len(rows)
        out[key]["wall_s"] = statistics.median(m["wall"] for m in metrics)
    return out


class EndToEnd:
    """Greedy decoding from the user turn alone, as on-policy training samples: the assistant
    header (``<|im_start|>assistant\\n``, labelled in the demo's data, so part of what the
    student samples) and then the 8 letters.

    Args:
        heldout: the demo's held-out set.
        chain: the task's letter chain.
    """

    def __init__(self, heldout: Any, chain: Any):
        import torch

        from kd.demo.task import ANSWER_LETTERS

        labelled = heldout.labels != -100  # shifted: position i predicts token i + 1
        starts = {int(row.nonzero()[0]) + 1 for row in labelled}
        assert len(starts) == 1, "rows differ in where their answer starts"
        self.start = starts.pop()
        self.user = heldout.prompts[:, : self.start]
        self.header = heldout.prompts[:, self.start :]
        wanted = [
            heldout.tokenizer.encode(
                chain.most_likely_answer(r["input"]), add_bos=False, add_eos=False
            )
            for r in heldout.rows
        ]
        self.wanted = torch.tensor([w[:ANSWER_LETTERS] for w in wanted])
        self.new_tokens = self.header.shape[1] + ANSWER_LETTERS

    def __call__(self, model: Any) -> tuple[float, float]:
        """(fraction of rows whose greedy header is right, greedy exact match of header + 8
        letters) of ``model``, a torchtune decoder returning logits."""
        import torch

        tokens = self.user
        with torch.inference_mode():
            for _ in range(self.new_tokens):
                nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
                tokens = torch.cat([tokens, nxt], dim=1)
        generated = tokens[:, self.start :]
        h = self.header.shape[1]
        header_ok = (generated[:, :h] == self.header).all(dim=1)
        answer_ok = (generated[:, h:] == self.wanted).all(dim=1)
        return float(header_ok.float().mean()), float((header_ok & answer_ok).float().mean())


def demo_runs(work: Path, demo: Path, *, seeds: int, quick: bool) -> dict:
    """Train every arm for every seed (arms alternate within a seed) and evaluate on held-out."""
    from kd.config import load_config
    from kd.config.run import run_config as parse_run
    from kd.demo.app import train
    from kd.demo.configs import MAX_SEQ_LEN, STUDENT, TEACHER, dataset_node
    from kd.demo.evaluate import HeldOut, read_metrics
    from kd.demo.task import LetterChain
    from kd.testing import load_tiny_model, tokenizer_node

    root = work / "runs"
    shutil.rmtree(root, ignore_errors=True)
    task = json.loads((demo / "data" / "task.json").read_text())
    chain = LetterChain(task["successors"], tuple(task["probs"]))
    heldout = HeldOut(
        demo / "data" / "heldout.jsonl",
        tokenizer_node(demo / "tokenizer", MAX_SEQ_LEN),
        dataset_node(demo / "data" / "heldout.jsonl", root / "cache"),
    )
    end_to_end = EndToEnd(heldout, chain)
    # Completions as long as the labelled part of a row: the header and the 8 letters. (No
    # model of the demo learns to stop: the dataset leaves the closing <|im_end|> unlabelled.)
    new_tokens = end_to_end.new_tokens
    # "KL to teacher" is the demo's measure for every student: forward KL at T=1.
    settings = parse_run(load_config(str(demo / "configs" / "kd_student.yaml"), [])).loss
    scratch = root / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    teacher = load_tiny_model(demo / "runs" / "teacher" / "final", TEACHER, scratch)

    def evaluate(model: Any, against: Any) -> dict[str, float | None]:
        r = heldout.evaluate(model, chain, settings=settings, teacher=against)
        header, exact = end_to_end(model)
        return {
            "exact_match": r.exact_match,
            "loss": r.loss,
            "kl_to_teacher": r.kd_loss,
            "next_letter_acc": r.next_letter_acc,
            "header_ok": header,
            "end_to_end": exact,
        }

    runs: dict[str, list[dict]] = {a.key: [] for a in ARMS}
    for seed in range(seeds):
        for arm in ARMS:
            run_dir = root / f"{arm.key}_seed{seed}"
            config = write_arm_config(
                demo, run_dir, arm, seed=seed, new_tokens=new_tokens, quick=quick
            )
            start = time.perf_counter()
            train(config)
            wall = time.perf_counter() - start
            result = {
                "seed": seed,
                "wall": wall,
                **evaluate(load_tiny_model(run_dir / "final", STUDENT, scratch), teacher),
            }
            print(json.dumps({"arm": arm.key, **result}), flush=True)
            runs[arm.key].append({**result, "rows": read_metrics(run_dir)})
    references = {
        "teacher": evaluate(teacher, None),
        "CE-only student (the demo's; the start of the CE-only rows)": evaluate(
            load_tiny_model(demo / "runs" / "ce_student" / "final", STUDENT, scratch), teacher
        ),
    }
    quality = {
        key: {name: [r[name] for r in results] for name in QUALITY} for key, results in runs.items()
    }
    return {
        "quality": quality,
        "costs": step_costs(runs),
        "references": references,
        "new_tokens": new_tokens,
        "header_tokens": int(end_to_end.header.shape[1]),
        "prompt_tokens": int(end_to_end.start),
    }


QUALITY = ("exact_match", "end_to_end", "header_ok", "loss", "kl_to_teacher", "next_letter_acc")


# ------------------------------------------------------------------------------- the doc
def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()}-core CPU ({cpu}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op thread(s)"
    )


def _mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _generation_reading(gen: list[dict], methods: list[str], new: int) -> list[str]:
    """The reading under the generation tables, from the numbers."""
    kd_cache, recompute, tt_cache = methods[0], methods[1], methods[2]

    def ratios(batch: int, fast: str, slow: str) -> list[float]:
        return [r["rates"][fast] / r["rates"][slow] for r in gen if r["batch"] == batch]

    def span(values: list[float]) -> str:
        lo, hi = min(values), max(values)
        return f"{lo:.1f}x" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}x to {hi:.1f}x"

    small, large = min(BATCHES), max(BATCHES)

    def at(batch: int) -> str:
        parts = []
        for r in gen:
            if r["batch"] == batch:
                ratio = r["rates"][kd_cache] / r["rates"][recompute]
                verdict = "meets it" if ratio >= 5 else "short of it"
                parts.append(f"{ratio:.1f}x for the {r['shape'].split(' (')[0]} ({verdict})")
        return " and ".join(parts)

    one = [r for r in gen if r["batch"] == small]
    ms = [1e3 / r["rates"][kd_cache] for r in one]
    flops = [r["mflops_per_token"] for r in one]
    vs_tt = [r["rates"][kd_cache] / r["rates"][tt_cache] for r in gen]
    return [
        f"**Reading.** The goal was at least 5x at {new} new tokens. kd's cache gives the "
        f"tokens/s of recomputing the prefix times {at(large)} at batch {large} (a micro-batch "
        f"of prompts, what training samples), and {at(small)} at batch {small}.",
        "",
        f"Why batch {small} gains less: a one-row decode step multiplies one vector by every "
        "weight matrix, which a CPU runs far below its matrix-matrix rate (the step is bound by "
        "reading the weights and by the fixed cost of each of the few hundred ops of a "
        "forward), while recomputing the prefix is a matrix-matrix product over all positions. "
        f"Here a cached token at batch {small} takes "
        + " and ".join(f"{t:.2f} ms" for t in ms)
        + " for shapes of "
        + " and ".join(f"{f:.2f}" for f in flops)
        + " MFLOP/token: "
        f"{flops[-1] / flops[0]:.0f}x the FLOPs cost {ms[-1] / ms[0]:.1f}x the time, so on "
        "these sizes the FLOPs the cache saves are not what a token costs. "
        f"At batch {large} the decode step reads the weights once for {large} rows and the "
        "saving shows; it grows with the prompt length and the number of new tokens (the "
        "recomputed prefix grows, a cached step does not).",
        "",
        f"kd's rollout runs at {min(vs_tt):.2f}x to {max(vs_tt):.2f}x the rate of torchtune's own "
        "cached `generate` on the same model (kd's adds per-row generators, stop-token "
        "bookkeeping and the padding masks of left-padded prompts, and returns no logits).",
    ]


def write_doc(report: dict, doc: Path) -> None:
    gen, demo = report["generation"], report["demo"]
    new = report["new_tokens"]
    arms = {a.key: a for a in ARMS}
    seeds = report["seeds"]
    lines = [
        "# On-policy distillation: generation speed, step cost and quality",
        "",
        "Written by `scripts/bench_on_policy.py` (commands at the end; rerunning it rewrites "
        f"this file) on {report['generation_run']['machine']}. The two parts:",
        "",
        *(
            f"- {what}: `{r['command']}`, {r['date']}, {r['minutes']:.1f} min"
            + (
                ""
                if "demo_reused" not in r
                else (
                    " (reusing a finished `kd demo` folder)"
                    if r["demo_reused"]
                    else " (`kd demo` included)"
                )
            )
            + f", 1-minute load average {r['load'][0]:.1f} at the start and {r['load'][1]:.1f} "
            "at the end."
            for what, r in (
                ("Generation", report["generation_run"]),
                ("Student runs", report["runs_run"]),
            )
        ),
        "",
        "A load average above 1 means other jobs shared the 2 cores: the generation rates are "
        "per CPU-second of this process (see below), the training step times are wall-clock "
        "and noisier; the ratios compare methods and runs that alternate within the script.",
        "",
        f"## Generation: KV cache vs recomputing the prefix ({new} new tokens)",
        "",
        f"Random-init tiny Qwen2 models, {PROMPT_LEN}-token prompts, temperature 1, no stop "
        f"token (every row samples exactly {new} tokens), one intra-op thread. Tokens/s are "
        f"medians over {report['repeats']} repeats, the methods alternating within each "
        "repeat, and counted per CPU-second of the (single-threaded) process: the same as "
        "wall-clock on an idle machine, without the time spent waiting for a shared core "
        "(wall-clock rates are in report.json). "
        "*recompute the prefix* is the peer: a loop that runs the whole sequence through the "
        "model for every new token, through kd's sampler with the same per-row generators as "
        "`kd.rollouts.sampling.rollout`; the torchtune and transformers rows are the libraries' own "
        "`generate` on the same weights, as reference points (transformers' sampler and "
        "torchtune's differ from kd's, so only their speed compares).",
        "",
    ]
    methods = list(gen[0]["rates"])
    for shape in dict.fromkeys(r["shape"] for r in gen):
        rows = [r for r in gen if r["shape"] == shape]
        lines += [
            f"**{shape}**, {rows[0]['mflops_per_token']:.2f} MFLOP/token:",
            "",
            "| method | " + " | ".join(f"batch {r['batch']} tokens/s" for r in rows) + " |",
            "|---|" + "---|" * len(rows),
        ]
        for m in methods:
            lines.append(f"| {m} | " + " | ".join(f"{r['rates'][m]:.0f}" for r in rows) + " |")
        for label, fast, slow in (
            ("kd: cache / recompute", methods[0], methods[1]),
            ("torchtune: cache / no cache", methods[2], methods[3]),
            ("transformers: cache / no cache", methods[5], methods[6]),
        ):
            lines.append(
                f"| **{label}** | "
                + " | ".join(f"**{r['rates'][fast] / r['rates'][slow]:.1f}x**" for r in rows)
                + " |"
            )
        same = all(r["identical_tokens"] for r in rows)
        lines += [
            "",
            "kd's rollout and the recompute loop sampled "
            + ("identical tokens in every run." if same else "**different** tokens in some run.")
            + "",
            "",
        ]
    lines += _generation_reading(gen, methods, new)
    costs, quality = demo["costs"], demo["quality"]
    lines += [
        "",
        "## Cost of one on-policy step vs an off-policy step",
        "",
        "The student runs of the next section (the demo's 2-layer dim-64 student and 2-layer "
        f"dim-128 teacher, batch 16, prompts of {demo['prompt_tokens']} tokens, "
        f"`on_policy.max_new_tokens: {demo['new_tokens']}`): means over the steps after step 2 "
        f"of all {seeds} seeds, from each run's `metrics.jsonl` (`time_generate_s`, "
        "`time_teacher_s`, `time_student_s` = forward + backward + optimizer step; step s is "
        "their sum). Means, not medians: with lmbda 0.5 a step samples or it does not.",
        "",
        "| run | step s | generate s | teacher s | student s | sampled tokens per on-policy "
        "micro-batch (16 rows) | run wall s (median; train + save) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, c in costs.items():
        lines.append(
            f"| {arms[key].label} | {_f(c['step_s'], '.4f')} | {_f(c['time_generate_s'], '.4f')}"
            f" | {_f(c['time_teacher_s'], '.4f')} | {_f(c['time_student_s'], '.4f')} | "
            f"{_f(c['tokens_per_sampled_batch'], '.1f')} | {c['wall_s']:.1f} |"
        )
    lines += ["", "| on-policy run / its off-policy peer | step time ratio |", "|---|---|"]
    for on, off in PAIRS:
        ratio = costs[on]["step_s"] / costs[off]["step_s"]
        lines.append(f"| {arms[on].label} / {arms[off].label} | **{ratio:.2f}x** |")
    on1, off1 = costs["on1_fkl"], costs["off_fkl"]
    first = [r for r in gen if r["shape"] == gen[0]["shape"]]
    r1 = next(r for r in first if r["batch"] == min(BATCHES))["rates"][methods[0]]
    r8 = next(r for r in first if r["batch"] == max(BATCHES))["rates"][methods[0]]
    lines += [
        "",
        "**Reading.** With lmbda 1 every micro-batch samples before the teacher and the student "
        f"run: {on1['tokens_per_sampled_batch']:.0f} sampled tokens per micro-batch (16 rows x "
        f"{demo['new_tokens']} at most; few stop early, see below) take "
        f"{on1['time_generate_s'] / on1['step_s']:.0%} of the step, and the step costs "
        f"{on1['step_s'] / off1['step_s']:.1f}x an off-policy one (forward KL). Decoding runs one "
        "small forward per new token for the whole micro-batch, so its cost follows "
        "max_new_tokens far more than the batch (part 1: the demo student's cached rollout "
        f"yields {r8 / r1:.1f}x the tokens/s at batch {max(BATCHES)} as at batch "
        f"{min(BATCHES)}); with lmbda 0.5 about half the micro-batches sample.",
        "",
        "## Quality on the demo task: on-policy vs off-policy at equal steps",
        "",
        f"`kd demo`'s student config (64 labelled examples, batch 16, 160 steps, lr 3e-3, "
        f"cosine schedule) and its trained teacher, {seeds} training seeds (0..{seeds - 1}: the "
        "data order and the on-policy samples). Within a pair of rows only `on_policy` differs. "
        f"The first {sum(not a.sft for a in ARMS)} rows start from the demo's random-init "
        "student (the first row, seed 0, is the demo's own KD student); the last "
        f"{sum(a.sft for a in ARMS)} from the demo's CE-only student (160 "
        "supervised steps on the same 64 examples), as GKD starts from a supervised student. "
        "On-policy runs sample at kd's defaults (temperature 0.9, top_p 1: TRL GKDConfig's) "
        f"{demo['new_tokens']} tokens per prompt; the loss temperature is 1. JSD beta 0.5 with "
        "kd_ratio 1 (divergence only) is GKD's default loss (TRL `GKDTrainer`); forward KL with "
        "kd_ratio 0.9 is the demo's.",
        "",
        "Held-out: the demo's 512 prompts. *Exact match* is the demo's metric: given the prompt "
        "and the assistant header `<|im_start|>assistant\\n`, the 8 greedy letters equal the "
        "chain's most likely continuation. *End to end* starts from the user turn alone, "
        "where on-policy training starts sampling: the greedy header and the 8 letters must both "
        "be right; *header right* counts the first. Mean ± sd over seeds.",
        "",
        "| student | exact match | per seed | end to end | header right | held-out loss | "
        "KL to teacher |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, q in quality.items():
        lines.append(
            f"| {arms[key].label} | {_mean_sd(q['exact_match'])} | "
            + ", ".join(f"{x:.3f}" for x in q["exact_match"])
            + f" | {_mean_sd(q['end_to_end'])} | {_mean_sd(q['header_ok'])} | "
            f"{_mean_sd(q['loss'])} | {_mean_sd(q['kl_to_teacher'])} |"
        )
    for name, r in demo["references"].items():
        kl = "" if r["kl_to_teacher"] is None else f"{r['kl_to_teacher']:.3f}"
        lines.append(
            f"| {name} | {r['exact_match']:.3f} |  | {r['end_to_end']:.3f} | "
            f"{r['header_ok']:.3f} | {r['loss']:.3f} | {kl} |"
        )
    better = sum(
        statistics.mean(quality[on]["exact_match"]) > statistics.mean(quality[off]["exact_match"])
        for on, off in PAIRS
    )
    lines += [
        "",
        f"**Reading.** At equal steps, {better} of the {len(PAIRS)} on-policy configurations "
        "beat their off-policy peer on mean held-out exact match. On-policy minus its off-policy "
        "peer, same seeds:",
        "",
    ]
    for on, off in PAIRS:
        a, b = quality[on], quality[off]
        diff = statistics.mean(a["exact_match"]) - statistics.mean(b["exact_match"])
        e2e = statistics.mean(a["end_to_end"]) - statistics.mean(b["end_to_end"])
        wins = sum(x > y for x, y in zip(a["exact_match"], b["exact_match"], strict=True))
        lines.append(
            f"- {arms[on].label}: exact match {diff:+.3f} (higher in {wins} of "
            f"{len(a['exact_match'])} seeds), end to end {e2e:+.3f}."
        )
    slow = costs["on1_jsd"]["step_s"] / costs["off_jsd"]["step_s"]
    lines += [
        "",
        "What the runs show about the mechanics, whichever way the numbers go:",
        "",
        "- kd's on-policy prompt is the tokens before a row's last labelled span, plus the "
        "assistant header when the chat format labels it (`kd.models.assistant_header`; "
        f"torchtune's Qwen2.5 format labels it: {demo['header_tokens']} tokens here), as TRL's "
        "`GKDTrainer` puts the generation prompt in the prompt. On a sampled micro-batch the "
        "header is then never a target, so an lmbda-1 student never learns to write it (the "
        "*header right* and *end to end* columns); *exact match* gives it the header.",
        "- The demo's data leaves the closing `<|im_end|>` unlabelled (torchtune's Qwen2.5 "
        "tokenizer masks the eos it appends when `max_seq_len` is set), so neither teacher nor student learns to stop: a completion ends at "
        "`max_new_tokens`, set to the labelled length (header + 8 letters; the header is now in the prompt, so the completion runs past the 8 letters), unless it samples "
        "a stop token by chance.",
        "- kd's loss is (1 - kd_ratio) x CE on the batch's labels + kd_ratio x divergence; on a "
        "sampled micro-batch the labels are the samples, so the kd_ratio 0.9 rows also train "
        "0.1 x CE on the student's own samples. GKD's loss (kd_ratio 1) has no CE term.",
        "- From random init, the first on-policy samples are noise and the teacher's scores of "
        "them teach little about the held-out contexts; starting from the supervised student "
        "is the setting GKD is meant for.",
        f"- Equal steps is not equal time: an lmbda-1 JSD step costs {slow:.1f}x its off-policy "
        f"peer's here, so for the same seconds the off-policy student could run {slow:.1f}x "
        "the steps.",
        "",
        f"One small task, {seeds} seeds: read the differences against the spread over seeds, "
        "not as evidence about on-policy distillation in general.",
        "",
        "## Commands",
        "",
        "```bash",
        "pip install torch==2.13.0 && pip install -e '.[dev]'",
        "OMP_NUM_THREADS=1 python scripts/bench_on_policy.py --work /tmp/kd_onpolicy",
        "# one part again, the other taken from /tmp/kd_onpolicy/report.json:",
        "OMP_NUM_THREADS=1 python scripts/bench_on_policy.py --work /tmp/kd_onpolicy "
        "--only generation",
        "```",
        "",
        "It times generation, then runs `kd demo --output-dir <work>/demo` when that folder has "
        "no finished demo (the teacher and the student's initial weights; ~3 min), then the "
        "student runs, each through the recipe with the YAML it writes under "
        "`<work>/runs/` (`kd run kd_single_device --config <file>` reruns one).",
        "",
    ]
    doc.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch folder")
    parser.add_argument("--seed", type=int, default=0, help="the demo's seed")
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per student config")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per method")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--only",
        choices=("generation", "runs"),
        help="measure one part and take the other from <work>/report.json of an earlier run",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: kd demo --quick, 16 new tokens, 1 repeat, 1 seed; no doc",
    )
    parser.add_argument(
        "--rewrite-doc",
        action="store_true",
        help="only rewrite the doc from <work>/report.json of a finished run",
    )
    args = parser.parse_args()
    work = args.work.resolve()
    doc = work / "on_policy_benchmark.md" if args.quick else DOC
    if args.rewrite_doc:
        write_doc(json.loads((work / "report.json").read_text()), doc)
        return
    import torch

    from kd.demo.app import run_demo

    report: dict[str, Any] = {}
    if args.only is not None:
        report = json.loads((work / "report.json").read_text())
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    work.mkdir(parents=True, exist_ok=True)
    command = f"python scripts/bench_on_policy.py --work {args.work}" + (
        " --quick" if args.quick else ""
    )

    def part(name: str, flags: str) -> dict[str, Any]:
        return {
            "command": command + flags + ("" if args.only is None else f" --only {name}"),
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine(),
            "load": [os.getloadavg()[0]],
            "start": time.perf_counter(),
        }

    def done(info: dict[str, Any]) -> None:
        info["minutes"] = (time.perf_counter() - info.pop("start")) / 60
        info["load"].append(os.getloadavg()[0])

    if args.only in (None, "generation"):
        repeats = 1 if args.quick else args.repeats
        info = part("generation", f" --repeats {args.repeats}")
        shapes = _gen_shapes()
        if args.quick:
            shapes = dict(list(shapes.items())[:1])
        new_tokens = 16 if args.quick else NEW_TOKENS
        report["generation"] = generation(
            work, repeats=repeats, new_tokens=new_tokens, shapes=shapes
        )
        report.update(repeats=repeats, new_tokens=new_tokens)
        done(info)
        report["generation_run"] = info
    if args.only in (None, "runs"):
        seeds = 1 if args.quick else args.seeds
        info = part("runs", f" --seeds {args.seeds}")
        demo = work / "demo"
        info["demo_reused"] = (demo / "results.json").is_file()
        if not info["demo_reused"]:
            run_demo(demo, quick=args.quick, seed=args.seed)
            torch.set_num_threads(args.threads)
        report["demo"] = demo_runs(work, demo, seeds=seeds, quick=args.quick)
        report["seeds"] = seeds
        done(info)
        report["runs_run"] = info
    (work / "report.json").write_text(json.dumps(report, indent=1))
    write_doc(report, doc)
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
