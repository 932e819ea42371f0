"""Every allocation of kd's chunked loss heads on the CPU, as torch's profiler records them, beside
the memory plan's figure for the same shapes (:mod:`kd.memory.loss_head`).

The planner's other checks trace steps under ``MemTracker`` and fake tensors, which see the
operations kd calls but not the temporaries an operation makes inside itself (``torch.logsumexp``
allocates an ``[n, V]`` fp32 ``x - max`` that neither sees). The profiler's memory timeline sees
the allocator itself, as CUDA's counters do on a GPU. Each head runs once, at small shapes where
the ``[chunk, vocab]`` buffers dominate; the peak is what it allocated beyond its inputs.

    python scripts/loss_head_peaks.py           # one JSON line per head: measured and planned
    python scripts/loss_head_peaks.py | grep '^{' > scripts/bench_data/loss_head_peaks.jsonl

``tests/unit/memory/test_loss_head.py`` runs it (in a process of its own: the profiler can hang
starting in a long-lived test worker) and holds each head to its plan.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import MemoryProfileTimeline

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kd.losses import (  # noqa: E402
    fused_linear_ce_loss,
    fused_linear_kd_loss,
    fused_linear_topk_kd_loss,
)
from kd.losses.divergences import DIVERGENCES  # noqa: E402
from kd.memory.knobs import TrainKnobs  # noqa: E402
from kd.memory.loss_head import chunked_loss_bytes, fused_loss_bytes  # noqa: E402
from kd.memory.shapes import ModelShape  # noqa: E402

V, D, N, C, K = 32_000, 16, 512, 256, 20
SHAPE = ModelShape(
    name="tiny_qwen2",
    family="qwen2",
    vocab_size=V,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=D,
    intermediate_dim=32,
    tie_word_embeddings=True,
    max_seq_len=N,
)


def allocated_peak(fn: Callable[[], object]) -> int:
    """Bytes allocated at the peak of ``fn()`` beyond what was allocated before it (every CPU
    allocation, those inside composite operations included)."""
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    totals = [sum(s) for s in sizes]
    return max(totals) - totals[0]


def knobs(**kw: object) -> TrainKnobs:
    return TrainKnobs(batch_size=1, seq_len=N, loss_chunk_size=C, **kw)  # type: ignore[arg-type]


def heads() -> dict[str, tuple[Callable[[], object], int]]:
    """Each head's call and its planned forward peak."""
    gen = torch.Generator().manual_seed(0)
    hs = torch.randn(N, D, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    ht = torch.randn(N, D, generator=gen, dtype=torch.bfloat16)
    ws = torch.randn(V, D, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    wt = torch.randn(V, D, generator=gen, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(N)])
    lp = torch.randn(N, K, generator=gen).log_softmax(-1).half()
    labels = torch.randint(0, V, (N,), generator=gen)
    out: dict[str, tuple[Callable[[], object], int]] = {
        "ce": (
            lambda: fused_linear_ce_loss(hs, ws, labels, chunk_size=C),
            chunked_loss_bytes(SHAPE, knobs())[0],
        ),
        "topk": (
            lambda: fused_linear_topk_kd_loss(hs, ws, ids, lp, labels, chunk_size=C),
            chunked_loss_bytes(SHAPE, knobs(stored_topk=K))[0],
        ),
    }
    for d in DIVERGENCES:
        out[f"fused {d}"] = (
            lambda d=d: fused_linear_kd_loss(hs, ws, ht, wt, labels, divergence=d, chunk_size=C),
            fused_loss_bytes(SHAPE, replace(SHAPE, name="tiny_teacher"), knobs(divergence=d))[0],
        )
    return out


def main() -> int:
    torch.set_num_threads(1)
    for name, (fn, planned) in heads().items():
        print(json.dumps({"head": name, "measured": allocated_peak(fn), "planned": planned}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
