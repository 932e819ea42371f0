"""The memory planner against its trace on every phase, backend, teacher kind and world size.

Each row is a tiny model pair (torchtune's Qwen2 builders, or transformers' Qwen3 student and
Llama teacher written as config.json folders) with on-policy sampling where the teacher kind
allows it. **Estimate**: the closed form ``kd plan`` uses (``kd.memory.estimate``, on the
fake-tensor path: no labelled-row gather). **Trace**: ``kd plan --trace``
(``kd.memory.trace.trace_run``): the recipe's step on fake CPU tensors under torch's MemTracker,
or as rank 0 of N FSDP2 ranks over a fake process group under FSDPMemTracker. Allocated bytes
per rank, without the runtime reserve. Teacher kinds: ``local`` (a teacher model),
``stored`` (``teacher_logits:``, top-k log-probs in the micro-batch), ``served``
(``teacher_server:``, the same tensors from a server), ``int8`` (``teacher_quantization: int8``,
one device only: the sharded trace does not quantize), ``cross`` (``cross_tokenizer:``, a
transformers Llama teacher with a larger vocabulary: GOLD's hybrid loss on full logits).

    python scripts/memory_accuracy_table.py                 # -> docs/memory_accuracy.md
    python scripts/memory_accuracy_table.py --worlds 1 --out /tmp/x.md   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_memory_accuracy  # noqa: E402

MIB = 1 << 20
BEGIN = "<!-- memory_accuracy_table.py: begin -->"
END = "<!-- memory_accuracy_table.py: end -->"
PHASE_ORDER = ("generation", "forward", "backward", "optimizer_step")
KINDS = ("local", "stored", "served", "int8", "cross")

TT_STUDENT = {
    "_component_": "torchtune.models.qwen2.qwen2",
    "vocab_size": 2048,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 128,
    "intermediate_dim": 320,
    "max_seq_len": 256,
    "tie_word_embeddings": True,
}
TT_TEACHER = dict(TT_STUDENT, embed_dim=192, intermediate_dim=512, tie_word_embeddings=False)
HF_STUDENT = (
    "Qwen3Config",
    {
        "vocab_size": 1536,
        "hidden_size": 96,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "tie_word_embeddings": True,
    },
)
HF_TEACHER = (
    "LlamaConfig",
    {
        "vocab_size": 1536,
        "hidden_size": 128,
        "intermediate_size": 320,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
)

# The cross-tokenizer teacher (kind ``cross``): the tiny Llama teacher with another vocabulary.
HF_CROSS_TEACHER = (HF_TEACHER[0], dict(HF_TEACHER[1], vocab_size=2560))


@dataclasses.dataclass
class Row:
    """One configuration: allocated bytes per phase, estimated and traced."""

    backend: str
    kind: str
    world: int
    estimate: dict[str, int]
    trace: dict[str, int]
    trace_s: float

    def phases(self) -> list[str]:
        return [p for p in PHASE_ORDER if p in self.trace]

    def ratio(self, phase: str) -> float:
        return self.estimate[phase] / max(1, self.trace[phase])


def hf_folders(root: Path) -> tuple[Path, Path, Path]:
    """The tiny transformers student, teacher and cross-tokenizer teacher folders (config.json
    only)."""
    import transformers

    out = []
    for name, (cls, kwargs) in (
        ("student", HF_STUDENT),
        ("teacher", HF_TEACHER),
        ("cross_teacher", HF_CROSS_TEACHER),
    ):
        getattr(transformers, cls)(**kwargs).save_pretrained(root / name)
        out.append(root / name)
    return out[0], out[1], out[2]


def config(backend: str, kind: str, folders: tuple[Path, Path, Path] | None) -> Any:
    """The run of one row: the tiny pair, the teacher kind and, where it can sample, on-policy."""
    from omegaconf import OmegaConf

    from kd.config.parse import fill_defaults
    from kd.config.run import run_config

    if backend == "torchtune":
        student, teacher = TT_STUDENT, TT_TEACHER
    else:
        assert folders is not None
        student = {"_component_": "kd.hf.causal_lm", "path": str(folders[0])}
        teacher = {"_component_": "kd.hf.causal_lm", "path": str(folders[1])}
    cfg: dict[str, Any] = {
        "model": student,
        "teacher_model": teacher,
        "kd_ratio": 0.5,
        "tokenizer": {"max_seq_len": 96},
        "batch_size": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
        "enable_activation_checkpointing": False,
        "loss_chunk_size": 64,
    }
    if kind in ("local", "int8"):
        cfg["on_policy"] = {"lmbda": 0.5, "seq_kd": True, "max_new_tokens": 16, "top_p": 0.9}
    if kind == "int8":
        cfg["teacher_quantization"] = "int8"
    if kind == "stored":
        cfg["teacher_logits"] = {"path": "/nonexistent/store", "k": 16}
    if kind == "cross":
        assert folders is not None
        cfg["teacher_model"] = {"_component_": "kd.hf.causal_lm", "path": str(folders[2])}
        cfg["cross_tokenizer"] = {"matched_weight": None}
    if kind == "served":
        cfg["teacher_model"] = None
        cfg["teacher_server"] = {"url": "http://127.0.0.1:9", "model": "m", "top_k": 16}
        cfg["on_policy"] = {"lmbda": 0.5, "max_new_tokens": 16, "top_p": 0.9}
    node = OmegaConf.create(cfg)
    fill_defaults(node)
    return run_config(node)


def measure(backend: str, kind: str, world: int, folders: tuple[Path, Path, Path] | None) -> Row:
    """Estimate and trace one row."""
    from kd.memory import estimate
    from kd.memory.plan import inputs_from_run
    from kd.memory.trace import trace_run

    run = config(backend, kind, folders)
    inputs = inputs_from_run(run, world_size=world)
    est = estimate(
        inputs.student, inputs.teacher, dataclasses.replace(inputs.knobs, select_labelled=False)
    )
    t0 = time.perf_counter()
    traced = trace_run(run, world_size=world).phase_peaks
    wall = time.perf_counter() - t0
    return Row(
        backend=backend,
        kind=kind,
        world=world,
        estimate={p: est.allocated(p) for p in traced if p in est.phases},
        trace={p: b for p, b in traced.items() if p in est.phases},
        trace_s=wall,
    )


def section(rows: list[Row], command: str, total_s: float) -> str:
    """The markdown section: the command, what the rows are, and the one table."""
    worst = max(abs(r.ratio(p) - 1) for r in rows for p in r.phases())
    gen = [abs(r.ratio("generation") - 1) for r in rows if "generation" in r.trace]
    one = [abs(r.ratio(p) - 1) for r in rows if r.world == 1 for p in r.phases()]
    lines = [
        BEGIN,
        "## Every phase, backend, teacher kind and world size",
        "",
        f"Generated by `{command}` ({time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"python {platform.python_version()}, {len(rows)} traces in {total_s / 60:.1f} min).",
        "",
        "Tiny models on the fake path (the shapes of `scripts/memory_accuracy_table.py`: "
        "torchtune Qwen2 2-layer pair, tied 128-wide student and untied 192-wide teacher; "
        "transformers Qwen3 student and Llama teacher from config.json), batch 2, 96 tokens, "
        "bf16, AdamW, fused forward KL. `local`, `int8` sample with student and teacher "
        "(`on_policy: {lmbda: 0.5, seq_kd: true, max_new_tokens: 16, top_p: 0.9}`), `served` "
        "with the student, `stored` not at all (a store covers the dataset's rows only); "
        "`cross` has a transformers Llama teacher of vocabulary 2560 and `cross_tokenizer: {}` "
        "(GOLD's hybrid loss on full logits, planned at the worse end of the shared "
        "vocabulary). "
        "Ranks > 1: rank 0 of N FSDP2 ranks over a fake process group. Allocated MiB per rank, "
        "no runtime reserve.",
        "",
        f"**Worst error, generation: {100 * max(gen, default=0):.2f}%; one device, any phase: "
        f"{100 * max(one, default=0):.2f}%; any row: {100 * worst:.1f}%** (the per-rank "
        "training phases are not calibrated; see FSDP2 per rank above).",
        "",
        "| backend | teacher | ranks | phase | estimate MiB | trace MiB | est/trace |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for p in r.phases():
            lines.append(
                f"| {r.backend} | {r.kind} | {r.world} | {p} | {r.estimate[p] / MIB:.3f} | "
                f"{r.trace[p] / MIB:.3f} | {r.ratio(p):.4f} |"
            )
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/memory_accuracy.md", help="markdown file to extend")
    ap.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated")
    ap.add_argument("--kinds", default=",".join(KINDS), help="teacher kinds, comma-separated")
    ap.add_argument("--backends", default="torchtune,transformers", help="comma-separated")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    rows: list[Row] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kd_accuracy_") as root:
        folders = hf_folders(Path(root))
        for backend in args.backends.split(","):
            for kind in args.kinds.split(","):
                for world in worlds:
                    if kind == "int8" and world > 1:
                        continue  # the sharded trace keeps the teacher in the dtype
                    row = measure(backend, kind, world, folders)
                    rows.append(row)
                    print(
                        f"{backend:12s} {kind:6s} ranks {world}  "
                        + "  ".join(f"{p[:4]} {row.ratio(p):.4f}" for p in row.phases())
                        + f"  ({row.trace_s:.0f} s)",
                        flush=True,
                    )
    command = "python scripts/memory_accuracy_table.py"
    for flag, value, default in (
        ("--worlds", args.worlds, "1,2,4"),
        ("--kinds", args.kinds, ",".join(KINDS)),
        ("--backends", args.backends, "torchtune,transformers"),
        ("--out", args.out, "docs/memory_accuracy.md"),
    ):
        if value != default:
            command += f" {flag} {value}"
    hf_memory_accuracy.write_section(
        section(rows, command, time.perf_counter() - t0), args.out, BEGIN, END
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
