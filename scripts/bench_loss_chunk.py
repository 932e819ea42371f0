"""kd's fused loss on a CPU: ``loss_chunk_size`` 1024 (the GPU default) against kd init's CPU
value (:func:`kd.scaffold.render.cpu_loss_chunk_size`: each ``[chunk, vocab]`` fp32 buffer under
glibc's 32 MiB mmap threshold; 128 for SmolLM2's 49152 tokens).

The work is ``scripts/bench_vs_trl.py``'s off-policy step on the real SmolLM2-135M-Instruct
teacher and its 20-of-30-layer student (fp32, batch 4 x 128 tokens, fused AdamW, 1 thread), the
config kd init writes with only ``loss_chunk_size`` set, JSD (beta 0.5) and forward KL. Each run
is its own ``kd run kd`` process; the two chunk sizes alternate (which goes first flips each
repeat). Per run: tokens/s (median of steps 2..N), peak RSS (``os.wait4``) and the step-1 loss
(equal up to float summation order: the same work).

    python scripts/bench_loss_chunk.py --work /tmp/kd_chunk            # ~8 min at 3 repeats

Ends with ``CHUNK loss=L chunk=C tokens_per_s=X peak_mem=Y`` (the CPU chunk over 1024) per loss.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_trl as peer  # noqa: E402

from kd.scaffold.render import cpu_loss_chunk_size  # noqa: E402

GPU_DEFAULT = 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/kd_chunk")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--losses", default="jsd,forward_kl")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=str(peer.REPO / "scripts/bench_data/loss_chunk_cpu.json"))
    args = p.parse_args(argv)
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled")
    spec = peer.PAIRS["smollm2"]
    n_rows = spec["batch"] * spec["steps"]["off_policy"] + spec["batch"]
    assets = peer.write_assets(Path(args.work), "smollm2", n_rows)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(assets["student"], trust_remote_code=False).vocab_size
    chunks = (GPU_DEFAULT, cpu_loss_chunk_size(vocab))
    start = {"load": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"start {start['time']}: load average {start['load']}; vocab {vocab}, chunks {chunks}")
    runs = []
    for loss in args.losses.split(","):
        for rep in range(args.repeats):
            for chunk in chunks if rep % 2 == 0 else chunks[::-1]:
                tag = f"chunk{chunk}_{rep}"
                r = peer.run_kd(
                    assets, "smollm2", "off_policy", loss, tag, env, {"loss_chunk_size": chunk}
                )
                r.update(loss=loss, chunk=chunk, repeat=rep, load1=os.getloadavg()[0])
                runs.append(r)
                print(
                    f"{loss:<10} chunk {chunk:5d} #{rep}: {r['tokens_per_s']:6.1f} tok/s  "
                    f"RSS {r['peak_rss_gib']:.3f} GiB  step-1 loss {r['step1_loss']:.6f}",
                    flush=True,
                )
    table = []
    for loss in args.losses.split(","):
        row: dict = {"loss": loss}
        for chunk in chunks:
            rs = [r for r in runs if r["loss"] == loss and r["chunk"] == chunk]
            for k in ("tokens_per_s", "peak_rss_gib", "step1_loss"):
                row[f"{k}_{chunk}"] = statistics.median(r[k] for r in rs)
        row["ratio_tps"] = row[f"tokens_per_s_{chunks[1]}"] / row[f"tokens_per_s_{chunks[0]}"]
        row["ratio_mem"] = row[f"peak_rss_gib_{chunks[1]}"] / row[f"peak_rss_gib_{chunks[0]}"]
        table.append(row)
    out = {"argv": sys.argv, "threads": args.threads, "start": start, "chunks": chunks}
    out.update(end_load=os.getloadavg(), table=table, runs=runs)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    for row in table:
        print(
            f"CHUNK loss={row['loss']} chunk={chunks[1]} tokens_per_s={row['ratio_tps']:.3f} "
            f"peak_mem={row['ratio_mem']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
