"""On-policy rollout speed on the real SmolLM2 student (99.1M parameters), both backends (CPU).

The student of ``bench_vs_trl.py`` (SmolLM2-135M-Instruct with every third layer dropped, 20 of
30 layers) samples ``--new-tokens`` tokens after prompts of real text (the first ``--prompt-len``
tokens of the Python reference paragraphs), batch 1 and 4, temperature 1, no stop token, with
every method of ``bench_on_policy.py``'s generation part:

- kd's rollout (:func:`kd.rollouts.sampling.rollout`) on the torchtune module (its KV cache) and
  on the transformers module (``DynamicCache``), the two backends ``kd run`` uses;
- recomputing the whole prefix every token through the same sampler (the tokens must come out
  identical to the cached rollout's);
- torchtune's ``generate`` with and without ``local_kv_cache``, and transformers'
  ``generate(use_cache=True/False)`` on the same weights, as library reference points.

Tokens per CPU-second of this single-threaded process (``--threads``), medians of ``--repeats``
alternating repeats: on an idle machine that is tokens/s, and it does not count time spent
waiting for a core shared with other jobs.

    python scripts/bench_generation_real.py --work /tmp/kd_gen_real     # ~10 min

Writes ``<work>/generation_real.json`` and prints one line per batch and method.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_on_policy as gen  # noqa: E402
import bench_vs_trl as peer  # noqa: E402

CACHED = "kd rollout, torchtune model (KV cache)"
RECOMPUTE = "recompute the prefix, same sampler"


def load_models(base: Path) -> tuple[Any, Any, Any]:
    """The student as kd builds it from kd init's config (torchtune builder + checkpointer), the
    same folder through transformers, and its tokenizer."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kd.config import instantiate

    cfg = OmegaConf.load(base)
    tt_model = instantiate(cfg.model, key="model")
    ckpt = instantiate(cfg.checkpointer, key="checkpointer")
    tt_model.load_state_dict(ckpt.load_checkpoint()["model"])
    folder = cfg.checkpointer.checkpoint_dir
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa", trust_remote_code=False
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    return tt_model.eval(), hf_model, tokenizer


def prompts(tokenizer: Any, batch: int, length: int) -> Any:
    """The first ``length`` tokens of the first ``batch`` long reference paragraphs."""
    import torch

    rows = []
    for line in peer.DATA.read_text().splitlines():
        ids = tokenizer(json.loads(line)["text"])["input_ids"]
        if len(ids) >= length and gen.PAD_ID not in ids[:length]:
            rows.append(ids[:length])
        if len(rows) == batch:
            return torch.tensor(rows)
    raise SystemExit("not enough reference paragraphs for the prompts")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/kd_gen_real"))
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--batches", default="1,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    start = {"load": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"start {start['time']}: load average {start['load']} on {os.cpu_count()} CPUs")
    assets = peer.write_assets(args.work, "smollm2", n_rows=16)
    tt_model, hf_model, tokenizer = load_models(assets["base"])
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        prompt = prompts(tokenizer, b, args.prompt_len)
        methods = gen._methods(tt_model, hf_model, prompt, seed=7)
        for run in methods.values():
            run(2)  # warm-up
        cpu_s: dict[str, list[float]] = {m: [] for m in methods}
        wall_s: dict[str, list[float]] = {m: [] for m in methods}
        identical = True
        for _ in range(args.repeats):
            got = {}
            for m, run in methods.items():
                t0, c0 = time.perf_counter(), time.process_time()
                out = run(args.new_tokens)
                cpu_s[m].append(time.process_time() - c0)
                wall_s[m].append(time.perf_counter() - t0)
                got[m] = out[:, -args.new_tokens :]
            identical &= bool(torch.equal(got[CACHED], got[RECOMPUTE]))
        n = b * args.new_tokens
        row = {
            "batch": b,
            "tokens_per_cpu_s": {m: n / statistics.median(s) for m, s in cpu_s.items()},
            "tokens_per_wall_s": {m: n / statistics.median(s) for m, s in wall_s.items()},
            "cpu_s": cpu_s,
            "wall_s": wall_s,
            "cached_equals_recompute": identical,
        }
        rows.append(row)
        for m, rate in row["tokens_per_cpu_s"].items():
            print(f"batch {b}  {m:48s} {rate:8.1f} tokens/CPU-s", flush=True)
        print(f"batch {b}  cached rollout tokens == recomputed tokens: {identical}", flush=True)
    out = {
        "argv": sys.argv,
        "start": start,
        "end_load": os.getloadavg(),
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "threads": args.threads,
        "rows": rows,
    }
    (args.work / "generation_real.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"end: load average {out['end_load']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
