"""Benchmark: kd's fused linear KD loss vs torchtune's chunked-output KD + CE losses.

Baseline (torchtune's usual use): the model's output projection yields logits in 8 bf16 chunks along
the sequence (``TransformerDecoder.chunked_output``) for the student and, without autograd, for the
teacher; ``ForwardKLWithChunkedOutputLoss`` + ``CEWithChunkedOutputLoss`` upcast one chunk at a time
to fp32; ``loss = 0.5 ce + 0.5 kd``; logits are deleted before backward (as torchtune's recipe does).
Ours: ``kd.losses.fused_linear_kd_loss`` on the final hidden states and output weights.

The loss phase is: output projections + losses + backward down to the hidden states and the
student output weight. Two measurements:

1. Memory (``--mem``): traced with ``MemTracker`` under ``FakeTensorMode`` on fake CPU tensors at full
   size (no real memory is used). Loss-phase peak = peak total bytes during the phase minus the
   bytes alive before it (hidden states, weights, labels). Also counts the logits-like tensors
   (last dim = vocab) each implementation saves for backward.
2. Time (``--time``): real CPU tensors, the two implementations alternated, repeated, medians.

Usage::

    python scripts/bench_loss.py --mem --time --time-tokens 512 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from kd._torchtune import CEWithChunkedOutputLoss, ForwardKLLoss, ForwardKLWithChunkedOutputLoss
from kd.losses import fused_linear_kd_loss

GiB = 2**30
IGN = -100
NUM_CHUNKS = 8  # torchtune's CEWithChunkedOutputLoss default


def make_inputs(
    batch: int, seq: int, dim: int, vocab: int, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Student/teacher final hidden states [B, S, D], output weights [V, D] and labels [B, S]."""
    g = torch.Generator().manual_seed(seed)
    scale = dim**-0.5
    inputs = {
        "h_s": torch.randn(batch, seq, dim, generator=g).to(dtype).requires_grad_(),
        "w_s": (torch.randn(vocab, dim, generator=g) * scale).to(dtype).requires_grad_(),
        "h_t": torch.randn(batch, seq, dim, generator=g).to(dtype),
        "w_t": (torch.randn(vocab, dim, generator=g) * scale).to(dtype),
        "labels": torch.randint(0, vocab, (batch, seq), generator=g),
    }
    inputs["labels"][:, :8] = IGN  # a short prompt per sequence, masked out
    return inputs


def run_torchtune(x: dict[str, torch.Tensor]) -> None:
    """torchtune's chunked-output path: 8 bf16 logit chunks per model, per-chunk fp32 losses."""
    kd_fn = ForwardKLWithChunkedOutputLoss(num_output_chunks=NUM_CHUNKS, ignore_index=IGN)
    ce_fn = CEWithChunkedOutputLoss(num_output_chunks=NUM_CHUNKS, ignore_index=IGN)
    logits = [h @ x["w_s"].t() for h in x["h_s"].tensor_split(NUM_CHUNKS, dim=1)]
    with torch.no_grad():
        t_logits = [h @ x["w_t"].t() for h in x["h_t"].tensor_split(NUM_CHUNKS, dim=1)]
    labels = x["labels"]
    # ForwardKLWithChunkedOutputLoss.forward with its `if sum_masks == 0` branch left out (a
    # data-dependent branch FakeTensorMode cannot evaluate): the same per-chunk kernel, summed, over
    # the number of labelled tokens. Called via .forward: MemTracker rejects a root module being
    # __call__ed several times in one iteration.
    n_valid = (labels != IGN).sum()
    lab_chunks = [c.reshape(-1) for c in labels.chunk(NUM_CHUNKS, dim=1)]
    kd = 0.0
    for s, t, lab in zip(logits, t_logits, lab_chunks, strict=True):
        kd = kd + ForwardKLLoss.forward(
            kd_fn.fkl_loss,
            s.reshape(-1, s.size(-1)),
            t.reshape(-1, t.size(-1)),
            lab,
            normalize=False,
        )
    kd = kd / n_valid
    ce = ce_fn.forward(logits, labels)
    loss = 0.5 * ce + 0.5 * kd
    del logits, t_logits, s, t  # the recipe deletes logits before backward
    loss.backward()


def run_fused(x: dict[str, torch.Tensor], chunk_size: int) -> None:
    loss, _, _ = fused_linear_kd_loss(
        x["h_s"], x["w_s"], x["h_t"], x["w_t"], x["labels"], kd_ratio=0.5, chunk_size=chunk_size
    )
    loss.backward()


def _vocab_saved(fn: Callable[[], None], vocab: int) -> tuple[int, int]:
    """Distinct tensors saved for backward whose last dim is the vocab (logits-like): count, bytes.

    Deduplicated by storage (several ops often save the same tensor or views of it).
    """
    seen: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # keep storages alive so their ids stay unique

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 1 and t.size(-1) == vocab:
            st = t.untyped_storage()
            keep.append(t)
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return len(seen), sum(seen.values())


def measure_memory(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Trace the loss phase of both implementations on fake CPU tensors at full size."""
    results: dict[str, dict[str, float]] = {}
    impls: dict[str, Callable[[dict[str, torch.Tensor]], None]] = {
        "torchtune": run_torchtune,
        "fused": lambda x: run_fused(x, args.chunk_size),
    }
    for name, fn in impls.items():
        with FakeTensorMode():
            x = make_inputs(
                args.batch, args.tokens // args.batch, args.dim, args.vocab, torch.bfloat16
            )
            mt = MemTracker()
            mt.track_external(*x.values())
            with mt:
                before = sum(v["Total"] for v in mt.get_tracker_snapshot("current").values())
                mt.reset_mod_stats()
                fn(x)
                peak = sum(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
            for t in ("h_s", "w_s"):
                x[t].grad = None
            n_saved, saved_bytes = _vocab_saved(lambda x=x, fn=fn: fn(x), args.vocab)
        results[name] = {
            "before_gib": before / GiB,
            "peak_gib": peak / GiB,
            "loss_phase_gib": (peak - before) / GiB,
            "vocab_saved_tensors": n_saved,
            "vocab_saved_gib": saved_bytes / GiB,
            # logits tensors created: torchtune's chunked_output gives NUM_CHUNKS bf16 chunks per
            # model; the fused loss creates none (only [chunk, V] temporaries inside one chunk).
            "logits_chunks": 2 * NUM_CHUNKS if name == "torchtune" else 0,
            "logits_gib": (2 * args.tokens * args.vocab * 2 / GiB) if name == "torchtune" else 0.0,
        }
    return results


def measure_time(args: argparse.Namespace) -> dict[str, list[float]]:
    """Wall time of the loss phase on real CPU tensors, implementations alternated."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.time_dtype]
    x = make_inputs(args.batch, args.time_tokens // args.batch, args.dim, args.vocab, dtype)
    impls: dict[str, Callable[[], None]] = {
        "torchtune": lambda: run_torchtune(x),
        "fused": lambda: run_fused(x, args.chunk_size),
    }
    times: dict[str, list[float]] = {k: [] for k in impls}
    order = list(impls)
    for rep in range(args.repeats + 1):  # rep 0 is a warm-up, not recorded
        for name in order if rep % 2 == 0 else order[::-1]:
            x["h_s"].grad = x["w_s"].grad = None
            gc.collect()
            t0 = time.perf_counter()
            impls[name]()
            dt = time.perf_counter() - t0
            if rep > 0:
                times[name].append(dt)
            print(f"  rep {rep} {name}: {dt:.2f} s", flush=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mem", action="store_true", help="trace the loss-phase peak (fake tensors)")
    ap.add_argument("--time", action="store_true", help="time both on real CPU tensors")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens for the memory trace")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--chunk-size", type=int, default=1024, help="fused loss tokens per chunk")
    ap.add_argument("--time-tokens", type=int, default=512, help="tokens for the timing run")
    ap.add_argument("--time-dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.mem:
        res = measure_memory(args)
        print(f"\nMemory (fake CPU, bf16, N={args.tokens}, V={args.vocab}, D={args.dim}):")
        for name, r in res.items():
            print(
                f"  {name:9s} loss-phase peak {r['loss_phase_gib']:.3f} GiB (abs peak "
                f"{r['peak_gib']:.3f}, before {r['before_gib']:.3f}); vocab-last-dim tensors saved "
                f"for backward: {r['vocab_saved_tensors']} ({r['vocab_saved_gib']:.3f} GiB); bf16 logits "
                f"tensors created: {r['logits_chunks']} ({r['logits_gib']:.3f} GiB)"
            )
        ratio = res["fused"]["loss_phase_gib"] / res["torchtune"]["loss_phase_gib"]
        print(f"  ratio fused / torchtune: {ratio:.3f}")
    if args.time:
        print(
            f"\nTime (real CPU, {args.time_dtype}, N={args.time_tokens}, V={args.vocab}, "
            f"D={args.dim}, {args.repeats} repeats after 1 warm-up, alternating):"
        )
        times = measure_time(args)
        med = {k: statistics.median(v) for k, v in times.items()}
        for name, v in times.items():
            print(f"  {name:9s} median {med[name]:.2f} s  ({', '.join(f'{t:.2f}' for t in v)})")
        print(f"  ratio fused / torchtune: {med['fused'] / med['torchtune']:.3f}")


if __name__ == "__main__":
    main()
