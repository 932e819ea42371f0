"""Device operations per decoded token: kd's samplers against transformers' ``generate``.

On a GPU, decoding a small model is paced by kernel launches, not by arithmetic: the H100 run of
2026-11-27 (``docs/gpu.md``) sampled 4 rows of Qwen2.5-0.5B at about 35 ms a token with kd's
sampler on the torchtune backend against 24 ms with ``generate`` (TRL's sampler), while each
token's arithmetic is well under a millisecond there. This script counts what a launch-bound
decode pays for, on the CPU: every aten operation dispatched per decoded token (views, which
launch nothing, left out), and the device-to-host reads (``_local_scalar_dense``: on a GPU the
host waits for every kernel queued). The model is Qwen2.5-0.5B's layout (24 layers, 14 query
heads, 2 key-value heads, tied embeddings) at a tiny width: the counts per token do not depend on
the width. Per token = (count at 24 new tokens - count at 8) / 16, so the prompt's prefill and
the setup cancel. The ``cuda_graphs`` rows count a replayed decode step as one operation (a
graph launch on a GPU; replayed here by ``kd.testing_graphs.tape_capture``, its operations not
counted) and everything kd dispatches around it (the sampling, the loop's bookkeeping).

    python scripts/decode_ops.py                         # prints the table, writes the JSON
    python scripts/decode_ops.py --json /tmp/ops.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kd import models  # noqa: E402
from kd.rollouts.base import Prompts  # noqa: E402
from kd.rollouts.decode import fast_rollout  # noqa: E402
from kd.rollouts.sampling import rollout, row_generators  # noqa: E402
from kd.testing_graphs import tape_capture  # noqa: E402

VIEWS = {
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "expand",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "as_strided",
    "alias",
    "permute",
    "detach",
    "reshape",
    "unbind",
    "split",
    "split_with_sizes",
    "lift_fresh",
    "_reshape_alias",
    "narrow",
    "unflatten",
    "flatten",
    "view_as",
    "expand_as",
}
LAYERS, HEADS, KV_HEADS, WIDTH, FFN, VOCAB = 24, 14, 2, 112, 256, 1024
BATCH, PROMPT = 4, 20
HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "embed_dim": "hidden_size",
    "intermediate_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
}


class Count(TorchDispatchMode):
    """Every non-view aten operation dispatched inside the block, by name; while ``paused`` (a
    replayed graph: one launch on a GPU), none."""

    active: Count | None = None

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.paused = False

    def __enter__(self) -> Count:
        Count.active = self
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        Count.active = None
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.__name__.split(".")[0]
        if name not in VIEWS and not self.paused:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def graph_capture(fn: Callable[[], torch.Tensor]):  # noqa: ANN201
    """``kd.testing_graphs.tape_capture`` counted as a GPU runs it: the capture's own step as
    it dispatches, each replay as one operation (``cuda graph replay``)."""
    first, replay = tape_capture(fn)

    def replayed() -> torch.Tensor:
        mode = Count.active
        if mode is None:
            return replay()
        mode.paused = True
        try:
            return replay()
        finally:
            mode.paused = False
            mode.ops["cuda graph replay"] += 1

    return first, replayed


def per_token(run: Callable[[int], None]) -> collections.Counter[str]:
    counts = {}
    for n in (8, 24):
        with torch.no_grad(), Count() as c:
            run(n)
        counts[n] = c.ops
    out: collections.Counter[str] = collections.Counter()
    for name in set(counts[8]) | set(counts[24]):
        out[name] = (counts[24][name] - counts[8][name]) / 16
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(REPO / "scripts/bench_data/decode_ops.json"))
    args = ap.parse_args(argv)
    import transformers
    from torchtune.models.qwen2 import qwen2

    torch.manual_seed(0)
    shape = {  # torchtune's names; transformers' are HF_NAMES's
        "vocab_size": VOCAB,
        "num_layers": LAYERS,
        "num_heads": HEADS,
        "num_kv_heads": KV_HEADS,
        "embed_dim": WIDTH,
        "intermediate_dim": FFN,
        "max_seq_len": 512,
        "tie_word_embeddings": True,
    }
    cfg = transformers.Qwen2Config(**{HF_NAMES.get(k, k): v for k, v in shape.items()})
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    tt = qwen2(**shape).eval()
    tokens = torch.randint(3, VOCAB - 24, (BATCH, PROMPT))
    mask = torch.ones(BATCH, PROMPT, dtype=torch.bool)
    mask[1, :4] = False  # left padding in two rows, as on-policy prompts have
    mask[3, :9] = False
    tokens[~mask] = 0
    prompts = Prompts(tokens, mask, mask.sum(1))
    common = dict(temperature=1.0, top_p=1.0, stop_ids=[], pad_id=0, vocab_limit=None)

    def gens() -> list[torch.Generator]:
        return row_generators(0, 0, list(range(BATCH)), device=torch.device("cpu"))

    def kd_run(model: torch.nn.Module, fast: bool, graphs: bool = False) -> Callable[[int], None]:
        def run(n: int) -> None:
            models.set_hidden_output(model, True)
            if graphs:
                fast_rollout(
                    model,
                    prompts,
                    max_new_tokens=n,
                    generators=gens(),
                    graphs=graph_capture,
                    **common,
                )
                return
            sample = fast_rollout if fast else rollout
            sample(model, prompts, max_new_tokens=n, generators=gens(), **common)

        return run

    def generate(n: int) -> None:
        models.set_hidden_output(hf, False)
        hf.generate(
            tokens,
            attention_mask=mask.long(),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )

    methods = {
        "transformers generate (TRL's sampler)": generate,
        "kd rollout, transformers backend": kd_run(hf, False),
        "kd fast, transformers backend": kd_run(hf, True),
        "kd rollout, torchtune backend": kd_run(tt, False),
        "kd fast, torchtune backend": kd_run(tt, True),
        "kd fast + cuda_graphs, transformers backend": kd_run(hf, True, graphs=True),
        "kd fast + cuda_graphs, torchtune backend": kd_run(tt, True, graphs=True),
    }
    rows = []
    for name, run in methods.items():
        ops = per_token(run)
        total = sum(ops.values())
        top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:8])
        rows.append(
            {
                "method": name,
                "ops_per_token": total,
                "ops_per_layer": total / LAYERS,
                "host_reads_per_token": ops.get("_local_scalar_dense", 0.0),
                "top": top,
            }
        )
    print(f"{'method':46s} {'ops/token':>10s} {'per layer':>10s} {'host reads':>11s}")
    for r in rows:
        print(
            f"{r['method']:46s} {r['ops_per_token']:10.1f} {r['ops_per_layer']:10.1f} "
            f"{r['host_reads_per_token']:11.1f}"
        )
    doc = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": {"layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "width": WIDTH},
        "batch": BATCH,
        "prompt": PROMPT,
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
