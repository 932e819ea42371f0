"""The GPU check: kd's memory plan against the CUDA allocator, kd against TRL, and the GPU tests.

One command, run whenever a CUDA GPU is lent (one H100: well under 8 minutes), and on the CPU in
CI with ``--smoke`` (tiny shapes, the same code paths, the same JSON schema) so it cannot rot:

    python scripts/gpu_check.py --out /tmp/gpu                 # on the GPU
    python scripts/gpu_check.py --out /tmp/gpu_smoke --smoke   # anywhere (CPU)

It writes ``gpu_check.json`` and ``gpu_check.md`` (the tables of ``docs/gpu.md``) into ``--out``,
after every section, so a run cut short keeps what it measured. Sections:

1. **runtime**: what the caching allocator never sees, measured on the device itself: the CUDA
   context (device memory used after ``torch.cuda.init`` and one tensor, through NVML), the
   cuBLAS / cuBLASLt handles and workspaces of a first bf16 matmul, the allocator's segment for
   a 1-byte and a 1 MiB + 1-byte tensor, and the bf16 matmul rate (the MFU denominator).
2. **memory**: real-size configs (published ``config.json`` shapes: Qwen2.5-3B -> 0.5B on
   torchtune's builders, Llama-3.2-3B -> 1B on the transformers backend; random bf16 weights
   written as safetensors, no downloads), full and LoRA, activation checkpointing on and off,
   1024-4096 tokens, the on-policy generation phase, a validation pass, two teachers, the int8
   teacher, a LoRA self teacher and a served teacher (a vLLM-protocol test server), and the
   offloading rows (the same config resident, with activation offloading with and without
   checkpointing, with the teacher parked and streamed: measured peak and step time, rows 13-17
   of ``--row-ids``). Each row is
   ``kd run kd`` (2 optimizer steps) in its own process; kd's own ``metrics.jsonl`` gives
   ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` and the device's used memory
   (``cudaMemGetInfo``) after each step; the plan is ``kd plan``'s for the same config.
3. **rollout**: kd's local sampler against transformers' ``generate`` on the pair's student
   (``scripts/bench_rollout.py --folder ... --device cuda --dtype bf16``): ``generate``, ``kd
   fast`` and ``kd fast graphs`` (``on_policy.cuda_graphs``), batch 16, 128 new tokens.
4. **speed**: kd and TRL (``DistillationTrainer`` on-policy, ``GKDTrainer`` with ``lmbda=0``
   off-policy) on the same pair, rows, batch, sequence length, JSD loss and fused AdamW, bf16,
   through ``scripts/bench_vs_trl.py``'s runners: labelled tokens/s (median of steps 2..N), model
   FLOPs utilisation, and for on-policy the step split into sampling / teacher / student; then
   kd's faster local samplers on-policy, once each (``KD_SAMPLERS``: ``kd-fast`` samples a
   step's rollouts in one batch with a preallocated cache, ``kd-async`` samples the next step's
   on a background thread while this one trains, ``kd-graphs`` replays its decode steps from
   CUDA graphs, ``kd-compiled`` adds the compiled decode step).
5. **tests**: ``python -m pytest -m gpu`` (what only CUDA shows).

Needs, beyond torch / transformers / peft / safetensors / pyarrow: torchtune, torchao, omegaconf,
trl, datasets (``scripts/gpu_wheels.sh`` downloads them as wheels for a machine with no index).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import random
import shutil
import statistics
import string
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
GIB = 1 << 30
MIB = 1 << 20
H100_BF16_DENSE_TFLOPS = (
    989.0  # the datasheet's dense bf16 rate (SXM); the measured one is used too
)

PAIRS = {
    # pair: (teacher, student, kd init --backend)
    "qwen": ("Qwen2.5-3B", "Qwen2.5-0.5B", "torchtune"),
    "llama": ("Llama-3.2-3B", "Llama-3.2-1B", "transformers"),
}
# --smoke: the same architectures, tiny (CPU minutes in CI).
TINY = {
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


@dataclass
class Row:
    """One memory configuration.

    Attributes:
        name: the table's label.
        pair: a key of :data:`PAIRS`.
        base: which ``kd init`` config it starts from: full, lora or self.
        seq_len: tokens per example.
        batch: micro-batch.
        ac: activation checkpointing.
        sets: further top-level keys (a value of None deletes the key).
        feature: a special setup: served, teachers, validation (see :func:`row_config`).
    """

    name: str
    pair: str
    base: str
    seq_len: int
    batch: int
    ac: bool
    sets: dict[str, Any] = field(default_factory=dict)
    feature: str = ""


OFFLOAD_MODES = {
    # name: (activation checkpointing, the keys set)
    "resident": (True, {}),
    "activations offloaded": (True, {"enable_activation_offloading": True}),
    "activations offloaded, no AC": (False, {"enable_activation_offloading": True}),
    "teacher parked": (True, {"teacher_offload": "park"}),
    "teacher streamed": (True, {"teacher_offload": "stream"}),
}


def offload_rows() -> list[Row]:
    """Qwen2.5 3B -> 0.5B full at 2048 tokens, resident and in each offloading mode."""
    return [
        Row(f"Qwen2.5 3B->0.5B full, {name}", "qwen", "full", 2048, 1, ac, dict(sets))
        for name, (ac, sets) in OFFLOAD_MODES.items()
    ]


def rows_for(smoke: bool) -> list[Row]:
    """The memory grid, most important first (a run cut short by the budget keeps those)."""
    on_policy = {"lmbda": 1.0, "max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0}
    rows = [
        Row("Qwen2.5 3B->0.5B full", "qwen", "full", 4096, 1, True),
        Row("Qwen2.5 3B->0.5B LoRA", "qwen", "lora", 4096, 1, True),
        Row("Llama3.2 3B->1B full (hf)", "llama", "full", 4096, 1, True),
        Row("Llama3.2 3B->1B LoRA (hf)", "llama", "lora", 4096, 1, False),
        Row("Qwen2.5 3B->0.5B full", "qwen", "full", 2048, 1, False),
        Row("Qwen2.5 3B->0.5B LoRA", "qwen", "lora", 2048, 2, False),
        Row("Llama3.2 3B->1B full (hf)", "llama", "full", 1024, 2, False),
        Row(
            "Qwen2.5 on-policy (generation)",
            "qwen",
            "full",
            2048,
            1,
            True,
            {"on_policy": on_policy},
        ),
        Row("Qwen2.5 validation pass", "qwen", "full", 2048, 1, True, feature="validation"),
        Row("Qwen2.5 two teachers (3B + 0.5B)", "qwen", "full", 2048, 1, True, feature="teachers"),
        Row(
            "Qwen2.5 int8 teacher", "qwen", "full", 2048, 1, True, {"teacher_quantization": "int8"}
        ),
        Row("Qwen2.5 0.5B LoRA self teacher", "qwen", "self", 2048, 1, True),
        Row("Qwen2.5 0.5B served teacher (vLLM)", "qwen", "full", 2048, 1, True, feature="served"),
        # the offloading rows (docs/offloading.md): each mode's measured peak and step time
        # beside the same config resident (13); --row-ids 13,14,15,16,17 runs them alone
        *offload_rows(),
    ]
    if smoke:
        for r in rows:
            r.seq_len = 256 if r.base == "self" else 128
            if "on_policy" in r.sets:
                r.sets = {"on_policy": {**on_policy, "max_new_tokens": 16}}
    return rows


# ----------------------------------------------------------------------------------- results
class Results:
    """The JSON document, written after every section (``gpu_check.json`` + ``gpu_check.md``)."""

    def __init__(self, out: Path, smoke: bool):
        self.out = out
        self.doc: dict[str, Any] = {"schema": 1, "smoke": smoke, "sections": {}}

    def section(self, name: str, value: Any) -> None:
        self.doc["sections"][name] = value
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.doc, indent=1) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.doc))


def _error(exc: BaseException) -> dict[str, Any]:
    return {
        "status": "error",
        "error": f"{type(exc).__name__}: {exc}"[:2000],
        "traceback": traceback.format_exc()[-3000:],
    }


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------- environment
def environment(device: str) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "device": device,
        "versions": {},
    }
    for pkg in (
        "torch",
        "transformers",
        "peft",
        "torchtune",
        "torchao",
        "omegaconf",
        "trl",
        "datasets",
        "safetensors",
        "pyarrow",
        "accelerate",
    ):
        try:
            env["versions"][pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env["versions"][pkg] = None
    if device == "cuda":
        # NVML only: this process never makes a CUDA context, so the device memory the runs
        # measure is theirs alone
        env["cuda"] = torch.version.cuda
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(h)
            env["gpu"] = name.decode() if isinstance(name, bytes) else name
            env["gpu_total_gib"] = pynvml.nvmlDeviceGetMemoryInfo(h).total / GIB
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
            env["nvml_used_at_start_gib"] = pynvml.nvmlDeviceGetMemoryInfo(h).used / GIB
        except Exception as exc:  # noqa: BLE001 - NVML is optional
            env["driver"] = f"unknown ({exc})"
    return env


# ----------------------------------------------------------------------------------- runtime
def _nvml_used() -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
    except Exception:  # noqa: BLE001 - NVML is optional
        return None


class ProcessMemory:
    """The most device memory NVML saw each process use (``usedGpuMemory``), sampled every
    0.2 s: what a kd run holds on the device, context and all, even beside other processes."""

    def __init__(self) -> None:
        import threading

        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._thread.start()
        except Exception:  # noqa: BLE001 - no NVML: no per-process figure
            self._nvml = None

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                    used = int(p.usedGpuMemory or 0)
                    self.peak[p.pid] = max(self.peak.get(p.pid, 0), used)
            except Exception:  # noqa: BLE001
                pass
            self._stop.wait(0.2)

    def of(self, pid: int) -> int | None:
        return self.peak.get(pid)

    def stop(self) -> None:
        self._stop.set()


RUNTIME_CHILD = r"""
import json, os, sys, time
import torch
out = {}
def nvml():
    try:
        import pynvml
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:
        return None
def used():
    free, total = torch.cuda.mem_get_info(0)
    return total - free
out["nvml_before_init"] = nvml()
torch.cuda.init(); x = torch.ones(1, device="cuda"); torch.cuda.synchronize()
out["used_after_context"] = used()
out["nvml_after_context"] = nvml()
out["reserved_after_context"] = torch.cuda.memory_reserved()
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
r0, u0 = torch.cuda.memory_reserved(), used()
c = a @ b; torch.cuda.synchronize()
out["cublas_reserved_delta"] = torch.cuda.memory_reserved() - r0 - c.numel() * 2
out["cublas_used_delta"] = used() - u0
bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
r1, u1 = torch.cuda.memory_reserved(), used()
d = torch.nn.functional.linear(a, b, bias); torch.cuda.synchronize()
out["cublaslt_reserved_delta"] = torch.cuda.memory_reserved() - r1 - d.numel() * 2
out["cublaslt_used_delta"] = used() - u1
g = a.float().requires_grad_(); (g @ b.float()).sum().backward(); torch.cuda.synchronize()
out["used_after_fp32_backward"] = used()
del a, b, c, d, g, bias
torch.cuda.empty_cache()
for nbytes in (1, 512, (1 << 20) + 1, (10 << 20) + 1, (100 << 20) + 1):
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    r = torch.cuda.memory_reserved()
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out[f"segment_for_{nbytes}"] = torch.cuda.memory_reserved() - r
    out[f"allocated_for_{nbytes}"] = torch.cuda.memory_allocated() - 0
    del t
torch.cuda.empty_cache()
# bf16 matmul rate, 8192^3, median of 10 after 3 warm-ups (random data).
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
ts = []
for _ in range(10):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); a @ b; e.record(); e.synchronize()
    ts.append(s.elapsed_time(e) / 1e3)
ts.sort()
out["bf16_matmul_tflops"] = 2 * n**3 / ts[len(ts) // 2] / 1e12
del a, b
torch.cuda.empty_cache()
try:  # NCCL's own buffers: a one-rank group, one all_reduce
    import torch.distributed as dist
    u0 = used()
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t); torch.cuda.synchronize()
    out["nccl_used_delta"] = used() - u0 - (4 << 20)
    dist.destroy_process_group()
except Exception as exc:
    out["nccl_error"] = f"{type(exc).__name__}: {exc}"
out["expandable_segments"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
out["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
print("RUNTIME_JSON " + json.dumps(out))
"""


def runtime_probe(device: str) -> dict[str, Any]:
    """The CUDA runtime's own memory, measured in fresh processes (default allocator and
    ``expandable_segments:True``)."""
    if device != "cuda":
        return {"status": "skipped", "why": "no CUDA device (smoke)"}
    result: dict[str, Any] = {"status": "ok"}
    for label, conf in (("default", None), ("expandable", "expandable_segments:True")):
        env = dict(os.environ)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        proc = subprocess.run(
            [sys.executable, "-c", RUNTIME_CHILD],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("RUNTIME_JSON ")]
        result[label] = (
            json.loads(line[-1].split(" ", 1)[1]) if line else {"error": proc.stderr[-2000:]}
        )
    return result


PREFLIGHT = r"""
import importlib, json, sys
bad = {}
for name in ("torch", "transformers", "peft", "torchtune", "torchao", "omegaconf", "datasets",
             "trl", "kd.recipes.kd", "kd.training.train", "kd.teachers.build", "kd.hf.model",
             "kd.teachers.quantize", "kd.testing_server"):
    try:
        importlib.import_module(name)
    except BaseException as exc:
        bad[name] = f"{type(exc).__name__}: {exc}"
try:  # datasets against this machine's pyarrow: one json row, as torchtune's chat_dataset reads
    import os, tempfile
    import datasets
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "r.jsonl"), "w") as f:
        f.write('{"a": 1}\n')
    datasets.load_dataset("json", data_files=os.path.join(d, "r.jsonl"), split="train")
except BaseException as exc:
    bad["datasets.load_dataset"] = f"{type(exc).__name__}: {exc}"
print("PREFLIGHT_JSON " + json.dumps(bad))
"""


def kd_command(work: Path) -> str | None:
    """The ``kd`` command the runs start: the installed one, or (kd importable from
    ``PYTHONPATH`` but not installed, as on a GPU machine with no index) a two-line shim in
    ``work/bin`` put first on this process's ``PATH``, which its children inherit."""
    found = shutil.which("kd")
    if found is not None:
        return found
    shim = work / "bin" / "kd"
    shim.parent.mkdir(parents=True, exist_ok=True)
    shim.write_text(
        f'#!/bin/sh\nexec {sys.executable} -c "import sys; from kd.cli import main; '
        f'sys.exit(main())" "$@"\n'
    )
    shim.chmod(0o755)
    os.environ["PATH"] = f"{shim.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return shutil.which("kd")


def preflight() -> dict[str, Any]:
    """Every module the check needs imports in a fresh process (one line per failure)."""
    proc = subprocess.run(
        [sys.executable, "-c", PREFLIGHT], capture_output=True, text=True, timeout=300
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("PREFLIGHT_JSON ")]
    if not line:
        return {"status": "error", "error": proc.stderr[-3000:]}
    bad = json.loads(line[-1].split(" ", 1)[1])
    kd_cli = shutil.which("kd")
    if kd_cli is None:
        bad["kd (command)"] = "not on PATH"
    return {"status": "ok" if not bad else "error", "failed_imports": bad, "kd": kd_cli}


# -------------------------------------------------------------------------------------- assets
def write_model(root: Path, name: str, *, smoke: bool, device: str, seed: int) -> Path:
    """``name``'s published config.json + random bf16 weights (safetensors) + kd's test
    tokenizer, in ``root/<name>``: a folder both backends and TRL load."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from kd.memory.hf_accuracy import PUBLISHED, folder_name
    from kd.testing import write_hf_tokenizer

    cls_name, kwargs = PUBLISHED[name]
    if smoke:
        kwargs = {**kwargs, **TINY}
    dest = root / folder_name(name)
    if (dest / "model.safetensors").is_file():
        return dest
    config = getattr(transformers, cls_name)(**kwargs)
    dest.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    del device  # generated on the CPU: this process keeps no CUDA context
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if t.dim() == 1:
            fill = 1.0 if "norm" in key else 0.0
            tensors[key] = torch.full(t.shape, fill, dtype=torch.bfloat16)
        else:
            tensors[key] = torch.randn(t.shape, dtype=torch.bfloat16, generator=gen) * 0.02
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(dest)
    write_hf_tokenizer(dest)
    del tensors, model
    return dest


def prewarm(names: list[str]) -> None:
    """Import each model's transformers modules here: transformers' lazy imports are not
    thread-safe, and :func:`write_model` runs in threads."""
    import torch
    import transformers

    from kd.memory.hf_accuracy import PUBLISHED

    for name in names:
        cls_name, kwargs = PUBLISHED[name]
        config = getattr(transformers, cls_name)(**{**kwargs, **TINY})
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(config)
    import kd.testing  # noqa: F401


def write_data(path: Path, n: int, length: int) -> Path:
    """Chat rows whose assistant text is longer than any row's ``tokenizer.max_seq_len`` (kd's
    test tokenizer is byte-level: a character is a token), with a ``reference`` field (the self
    teacher's context) and a ``domain`` field."""
    rng = random.Random(0)
    letters = string.ascii_lowercase + " "
    rows = []
    for i in range(n):
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": "continue: " + "".join(rng.choices(letters, k=60))},
                    {"role": "assistant", "content": "".join(rng.choices(letters, k=length))},
                ],
                "reference": "".join(rng.choices(letters, k=40)),
                "domain": "a" if i % 2 else "b",
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def kd_init(
    work: Path,
    pair: str,
    kind: str,
    folders: dict[str, Path],
    data: Path,
    device: str,
    seq_len: int,
) -> Path:
    """``kd init``'s config for ``pair`` (``kind``: full, lora, self)."""
    teacher, student, backend = PAIRS[pair]
    out = work / f"base_{pair}_{kind}.yaml"
    if out.is_file():
        return out
    cmd = [
        "kd",
        "init",
        "--student",
        str(folders[student]),
        "--data",
        str(data),
        "--output-dir",
        str(work / "init"),
        "--config-out",
        str(out),
        "--max-seq-len",
        str(seq_len),
        "--device",
        device,
        "--backend",
        backend,
    ]
    if kind == "self":
        cmd += ["--self", "--context", "Reference: {reference}\n", "--lora"]
    else:
        cmd += ["--teacher", str(folders[teacher])]
    if kind == "lora":
        cmd.append("--lora")
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return out


# ------------------------------------------------------------------------------------- memory
def _served_fn(vocab: int):
    import torch

    def fn(ids):
        g = torch.Generator().manual_seed(len(ids))
        return torch.log_softmax(torch.randn(len(ids), vocab, generator=g), dim=-1)

    return fn


def row_config(row: Row, base: Path, out_dir: Path, device: str, extra: dict[str, Any]) -> Path:
    """The row's YAML: kd init's config with the row's knobs (and ``extra`` for a feature)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(base)
    sets: dict[str, Any] = {
        "output_dir": str(out_dir),
        "max_steps_per_epoch": 2,
        "gradient_accumulation_steps": 1,
        "log_every_n_steps": 1,
        "batch_size": row.batch,
        "enable_activation_checkpointing": row.ac,
        "device": device,
        "dtype": "bf16",
        "seed": 0,
        "shuffle": False,
    }
    sets.update(row.sets)
    sets.update(extra)
    cfg.tokenizer.max_seq_len = row.seq_len
    if device == "cuda":
        cfg.loss_chunk_size = 1024
    for key, value in sets.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    if cfg.get("memory") is not None:
        cfg.memory.budget_gib = None
    path = out_dir.parent / f"{out_dir.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path)
    return path


def feature_extra(
    row: Row, base: Path, folders: dict[str, Path], server_url: str | None
) -> dict[str, Any]:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(base)
    if row.feature == "validation":
        return {
            "validation": {
                "dataset": OmegaConf.to_container(cfg.dataset),
                "every_n_steps": 1,
                "max_batches": 2,
            }
        }
    if row.feature == "teachers":
        teacher, student, _ = PAIRS[row.pair]
        second = OmegaConf.to_container(cfg.model)
        second_ckpt = OmegaConf.to_container(cfg.checkpointer)
        if "checkpoint_dir" in second_ckpt:
            second_ckpt["checkpoint_dir"] = str(folders[student])
        members = [
            {
                "name": "big",
                "weight": 0.5,
                "teacher_model": OmegaConf.to_container(cfg.teacher_model),
                "teacher_checkpointer": OmegaConf.to_container(cfg.teacher_checkpointer),
            },
            {
                "name": "small",
                "weight": 0.5,
                "teacher_model": second,
                "teacher_checkpointer": second_ckpt,
            },
        ]
        return {
            "teacher_model": None,
            "teacher_checkpointer": None,
            "teachers": {"combine": "weights", "members": members},
        }
    if row.base == "self":
        # the self teacher's input (prompt + context + completion) must fit max_seq_len whole:
        # completions that leave room for the prompt and the context
        short = write_data(base.parent / f"data_self_{row.seq_len}.jsonl", 64, row.seq_len - 200)
        dataset = OmegaConf.to_container(cfg.dataset)
        dataset["data_files"] = str(short)
        return {"dataset": dataset}
    if row.feature == "served":
        return {
            "teacher_model": None,
            "teacher_checkpointer": None,
            "teacher_server": {
                "url": server_url,
                "api": "vllm",
                "model": "gpu-check-teacher",
                "top_k": 20,
                "timeout": 60,
                "backoff": 0,
            },
        }
    return {}


def _metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _step_seconds(metrics: list[dict[str, Any]]) -> float | None:
    """A step's seconds (sampling + teacher + student): the median of the steps after the
    first (which compiles and warms up), or the only one."""
    times = [
        m.get("time_generate_s", 0.0) + m["time_teacher_s"] + m["time_student_s"]
        for m in metrics
        if "time_teacher_s" in m and "time_student_s" in m
    ]
    later = times[1:] or times
    return statistics.median(later) if later else None


def memory_rows(
    work: Path,
    rows: list[Row],
    folders: dict[str, Path],
    bases: dict[str, Path],
    device: str,
    deadline: float,
    results: Results,
    jobs: int = 1,
) -> list[dict[str, Any]]:
    """Each row's plan, then ``kd run kd`` in its own process (``jobs`` at once)."""
    from concurrent.futures import ThreadPoolExecutor

    from kd.config import load_config
    from kd.memory.plan import plan_from_config
    from kd.testing_server import TeacherTestServer

    server = TeacherTestServer(
        _served_fn(278),
        api="vllm",
        model_name="gpu-check-teacher",
        max_logprobs=64,
        lifetime_s=3600,
    ).start()
    env = {
        **os.environ,
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    }
    out: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        rec: dict[str, Any] = {
            "name": row.name,
            "pair": row.pair,
            "base": row.base,
            "seq_len": row.seq_len,
            "batch": row.batch,
            "ac": row.ac,
            "feature": row.feature or next(iter(row.sets), ""),
            "jobs": jobs,
        }
        try:  # the plan first (no torch, this process), the runs after
            base = bases[f"{row.pair}_{row.base}"]
            run_dir = work / "runs" / f"mem{i:02d}"
            shutil.rmtree(run_dir, ignore_errors=True)
            extra = feature_extra(row, base, folders, server.url)
            cfg_path = row_config(row, base, run_dir, device, extra)
            rec["config"] = cfg_path.read_text()
            rec["plan"] = plan_from_config(load_config(str(cfg_path), [])).to_json()
            rec["_run"] = (str(cfg_path), str(run_dir))
        except Exception as exc:  # noqa: BLE001 - one row's failure is a result
            rec.update(_error(exc))
        out.append(rec)
    nvml = ProcessMemory()

    def run_one(rec: dict[str, Any]) -> None:
        if "_run" not in rec:
            return
        cfg_path, run_dir = (Path(x) for x in rec.pop("_run"))
        if time.monotonic() > deadline:
            rec["status"] = "skipped: time budget"
            return
        t0 = time.monotonic()
        log = run_dir.parent / f"{run_dir.name}.log"
        try:
            with log.open("w") as fh:
                proc = subprocess.Popen(
                    ["kd", "run", "kd", "--config", str(cfg_path)],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
                rc = proc.wait(timeout=max(30.0, deadline + 90 - time.monotonic()))
            metrics = [m for m in _metrics(run_dir / "metrics.jsonl") if "loss" in m]
            rec["rc"] = rc
            rec["steps"] = len(metrics)
            used = nvml.of(proc.pid)
            if used is not None:
                rec["process_used_gib"] = used / GIB
            if rc != 0 or not metrics:
                rec["status"] = "error"
                rec["log_tail"] = _tail(log)
            else:
                rec["status"] = "ok"
                rec["allocated_gib"] = max(m.get("peak_memory_gib", 0.0) for m in metrics)
                rec["reserved_gib"] = max(m.get("peak_memory_reserved_gib", 0.0) for m in metrics)
                rec["device_used_gib"] = max(m.get("device_used_gib", 0.0) for m in metrics)
                rec["tokens_per_second"] = metrics[-1].get("tokens_per_second")
                rec["step_s"] = _step_seconds(metrics)
        except Exception as exc:  # noqa: BLE001 - one row's failure is a result
            rec.update(_error(exc))
        rec["seconds"] = time.monotonic() - t0
        plan = rec.get("plan", {})
        print(
            f"memory {rec['name']:38s} s{rec['seq_len']} b{rec['batch']} AC "
            f"{'on ' if rec['ac'] else 'off'} {rec.get('status')}: plan "
            f"{plan.get('peak_gib', float('nan')):.2f} alloc "
            f"{rec.get('allocated_gib', float('nan')):.2f} reserved "
            f"{rec.get('reserved_gib', float('nan')):.2f} process "
            f"{rec.get('process_used_gib', float('nan')):.2f} GiB ({rec['seconds']:.0f} s)",
            flush=True,
        )
        if rec.get("status") != "ok":
            print("  " + (rec.get("error") or rec.get("log_tail", ""))[-1500:], flush=True)
        results.section("memory", {"rows": out})

    try:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            list(pool.map(run_one, out))
    finally:
        nvml.stop()
        server.kill()
    results.section("memory", {"rows": out})
    return out


# -------------------------------------------------------------------------------------- speed
def speed(
    work: Path,
    folders: dict[str, Path],
    data: Path,
    device: str,
    smoke: bool,
    deadline: float,
    params: dict[str, int],
    peak_tflops: float | None,
    only: set[str] | None = None,
    on_run: Any = None,
) -> dict[str, Any]:
    """kd against TRL on the Qwen pair (bench_vs_trl's runners, on ``device`` in bf16);
    ``on_run(out)`` after each run (the caller writes what was measured so far)."""
    import bench_vs_trl as bvt

    teacher, student, _ = PAIRS["qwen"]
    seq, batch = (128, 2) if smoke else (1024, 4)
    steps = 2 if smoke else 6
    bvt.PAIRS["gpu"] = {
        "seq_len": seq,
        "batch": batch,
        "steps": {"off_policy": steps, "on_policy": steps},
    }
    bvt.NEW_TOKENS = 16 if smoke else 128
    root = work / "speed"
    root.mkdir(parents=True, exist_ok=True)
    base = root / "base.yaml"
    if not base.is_file():
        cmd = [
            "kd",
            "init",
            "--teacher",
            str(folders[teacher]),
            "--student",
            str(folders[student]),
            "--data",
            str(data),
            "--output-dir",
            str(root / "init"),
            "--config-out",
            str(base),
            "--max-seq-len",
            str(seq),
            "--device",
            device,
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    assets = {
        "student": folders[student],
        "teacher": folders[teacher],
        "data": data,
        "base": base,
        "root": root,
    }
    n_rows = batch * steps + batch
    rows = bvt.kd_tokenized_rows(base, n_rows)
    chats = [json.loads(x) for x in data.read_text().splitlines()][:n_rows]
    prompts = [c["messages"][:1] for c in chats]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "8",
        "WANDB_MODE": "disabled",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    kd_over = {"device": device, "dtype": "bf16", "memory": {"budget_gib": None}}
    if device == "cuda":
        kd_over["loss_chunk_size"] = 1024
    trl_extra = {"device": device, "dtype": "bf16"}
    out: dict[str, Any] = {
        "status": "ok",
        "pair": f"{teacher} -> {student}",
        "seq_len": seq,
        "batch": batch,
        "steps": steps,
        "new_tokens": bvt.NEW_TOKENS,
        "loss": "jsd (beta 0.5)",
        "runs": [],
    }
    ns, nt = params.get(student, 0), params.get(teacher, 0)

    def measure(tool: str, mode: str, rep: int, run: Any, logs: str, **extra: Any) -> None:
        """``run()``'s result (or its error and log tail) as one row of ``out["runs"]``."""
        if time.monotonic() > deadline:
            out["runs"].append(
                {"tool": tool, "mode": mode, "repeat": rep, "status": "skipped: time budget"}
            )
            return
        try:
            r = run()
            r.update(tool=tool, mode=mode, repeat=rep, status="ok", **extra)
            # model FLOPs per labelled token: student forward + backward (6N), teacher
            # forward (2N), and on-policy the student's sampling (2N per sampled token)
            per_tok = 6 * ns + 2 * nt + (2 * ns if mode == "on_policy" else 0)
            r["model_tflops"] = per_tok * r["tokens_per_s"] / 1e12
            if peak_tflops:
                r["mfu"] = r["model_tflops"] / peak_tflops
        except BaseException as exc:  # noqa: BLE001 - a failed run is a result
            if isinstance(exc, KeyboardInterrupt):
                raise
            r = {"tool": tool, "mode": mode, "repeat": rep, **_error(exc)}
            found = sorted((root / "runs").glob(logs))
            if found:
                r["log_tail"] = _tail(found[-1])
        out["runs"].append(r)
        print(
            f"speed {mode:10s} {tool:3s} #{rep}: {r.get('status')} "
            f"{r.get('tokens_per_s', float('nan')):.1f} tok/s",
            flush=True,
        )

    def progress() -> None:
        out["table"] = speed_table(out["runs"])
        if on_run is not None:
            on_run(out)

    def samplers() -> None:
        # kd's faster local samplers, on-policy, once each (issue 37): every step's rollouts in
        # one batch with a preallocated cache, sampled ahead on a background thread, compiled
        for tool, sets in KD_SAMPLERS.items():
            if only is not None and f"{tool}:on_policy" not in only:
                continue
            run = functools.partial(
                bvt.run_kd, assets, "gpu", "on_policy", "jsd", tool, env, {**kd_over, **sets}
            )
            measure(tool, "on_policy", 0, run, f"kd_on_policy_jsd_{tool}*.log", sets=sets)
            progress()

    def core(tool: str, mode: str, rep: int) -> None:
        if only is not None and f"{tool}:{mode}" not in only:
            return
        if tool == "kd":
            run = functools.partial(bvt.run_kd, assets, "gpu", mode, "jsd", str(rep), env, kd_over)
        else:
            run = functools.partial(
                bvt.run_trl, assets, "gpu", mode, "jsd", str(rep), env, rows, prompts, trl_extra
            )
        measure(tool, mode, rep, run, f"{tool}_{mode}_jsd_{rep}*.log")
        progress()

    # on-policy first (both tools, then kd's faster samplers), then off-policy, then the second
    # repeats in the other order: a run cut short by the budget still compares the tools
    orders = (("kd", "trl"),) if smoke else (("kd", "trl"), ("trl", "kd"))
    for rep, order in enumerate(orders):
        for mode in ("on_policy", "off_policy"):
            for tool in order:
                core(tool, mode, rep)
            if rep == 0 and mode == "on_policy":
                samplers()
    out["table"] = speed_table(out["runs"])
    return out


# kd's on-policy samplers beyond the default (``kd``: a ``generate``-like loop per micro-batch),
# run once each by the speed section: the tool name -> the keys it sets.
KD_SAMPLERS: dict[str, dict[str, Any]] = {
    "kd-fast": {"on_policy.batch_rollouts": True},
    "kd-graphs": {"on_policy.batch_rollouts": True, "on_policy.cuda_graphs": True},
    "kd-async": {"on_policy.batch_rollouts": True, "on_policy.async_steps": 1},
    "kd-compiled": {"on_policy.batch_rollouts": True, "compile": True},
}


def rollout(
    work: Path, folders: dict[str, Path], device: str, smoke: bool, deadline: float
) -> dict:
    """kd's local sampler against transformers' ``generate`` on the Qwen pair's student
    (``scripts/bench_rollout.py`` in its own process, bf16 on the device): ``generate``, ``kd
    fast`` and, on CUDA, ``kd fast graphs`` (``on_policy.cuda_graphs``), the same rows, batch,
    new tokens and temperature; tokens/s medians of the repeats, each method warmed up once."""
    _, student, _ = PAIRS["qwen"]
    batch, new, repeats = (4, 8, 1) if smoke else (16, 128, 3)
    methods = "generate,kd fast" + (",kd fast graphs" if device == "cuda" else "")
    dest = work / "rollout.json"
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "bench_rollout.py"),
        "--folder",
        str(folders[student]),
        "--backends",
        "transformers",
        "--device",
        device,
        "--dtype",
        "bf16" if device == "cuda" else "fp32",
        "--batch",
        str(batch),
        "--new-tokens",
        str(new),
        "--repeats",
        str(repeats),
        "--threads",
        "8" if device == "cuda" else "1",
        "--methods",
        methods,
        "--json",
        str(dest),
    ]
    left = deadline - time.monotonic()
    if left < 30:
        return {"status": "skipped: time budget"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=min(left, 300))
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "timeout_s": min(left, 300)}
    if proc.returncode != 0:
        return {"status": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:]}
    return {"status": "ok", **json.loads(dest.read_text())}


def speed_table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode, each tool's medians (and each kd sampler's ratio to TRL)."""
    table = []
    for mode in ("off_policy", "on_policy"):
        row: dict[str, Any] = {"mode": mode}
        for tool in ("kd", *KD_SAMPLERS, "trl"):
            ok = [
                r
                for r in runs
                if r.get("mode") == mode and r.get("tool") == tool and r.get("status") == "ok"
            ]
            if not ok:
                continue
            row[f"{tool}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in ok)
            row[f"{tool}_model_tflops"] = statistics.median(r["model_tflops"] for r in ok)
            if all("mfu" in r for r in ok):
                row[f"{tool}_mfu"] = statistics.median(r["mfu"] for r in ok)
            if all("phases" in r for r in ok):
                row[f"{tool}_phases"] = {
                    k: statistics.median(r["phases"][k] for r in ok) for k in ok[0]["phases"]
                }
            row[f"{tool}_runs"] = len(ok)
        if "kd_tokens_per_s" in row and "trl_tokens_per_s" in row:
            row["ratio"] = row["kd_tokens_per_s"] / row["trl_tokens_per_s"]
        for tool in KD_SAMPLERS:
            if f"{tool}_tokens_per_s" in row and "trl_tokens_per_s" in row:
                row[f"{tool}_ratio"] = row[f"{tool}_tokens_per_s"] / row["trl_tokens_per_s"]
        table.append(row)
    return table


# -------------------------------------------------------------------------------------- tests
def start_gpu_tests() -> tuple[subprocess.Popen, Path]:
    """``pytest -m gpu`` in the background (tiny models: it runs beside the memory rows)."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "kd_gpu_tests.log"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/gpu",
        "--no-header",
        "-rfEs",
    ]
    fh = log.open("w")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=fh,
        stderr=subprocess.STDOUT,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    return proc, log


def finish_gpu_tests(started: tuple[subprocess.Popen, Path], deadline: float) -> dict[str, Any]:
    proc, log = started
    try:
        rc = proc.wait(timeout=max(10.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"status": "error", "error": "timed out", "output_tail": _tail(log, 80)}
    text = log.read_text(errors="replace")
    lines = text.strip().splitlines()
    return {
        "status": "ok" if rc in (0, 5) else "failed",
        "rc": rc,
        "summary": lines[-1] if lines else "",
        "output_tail": text[-6000:],
    }


# ----------------------------------------------------------------------------------- markdown
def _f(x: Any, fmt: str = ".2f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def offload_table(mem: list[dict[str, Any]]) -> list[str]:
    """The offloading rows: each mode's measured peak and step time, its planned host memory
    and transfer seconds (at the planner's assumed bandwidth), beside the resident row."""
    rows = [r for r in mem if any(r["name"].endswith(f", {m}") for m in OFFLOAD_MODES)]
    if not rows:
        return []
    lines = [
        "| offloading mode | AC | planned peak GiB | max allocated | max reserved | step s | "
        "planned host GiB | planned transfer s/step | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        host = r.get("plan", {}).get("host", {})
        lines.append(
            f"| {r['name']} | {'on' if r['ac'] else 'off'} | "
            f"{_f(r.get('plan', {}).get('peak_gib'))} | {_f(r.get('allocated_gib'))} | "
            f"{_f(r.get('reserved_gib'))} | {_f(r.get('step_s'), '.3f')} | "
            f"{_f(sum(host.get('host_gib', {}).values()))} | "
            f"{_f(host.get('transfer_s_per_step'), '.3f')} | {str(r.get('status', ''))[:40]} |"
        )
    return [*lines, ""]


def markdown(doc: dict[str, Any]) -> str:
    s = doc["sections"]
    env = s.get("environment", {})
    lines = [
        f"Device: {env.get('gpu', env.get('device', '?'))}; driver {env.get('driver', '-')}, "
        f"CUDA {env.get('cuda', '-')}; {env.get('date', '')}; versions: "
        + ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items()),
        "",
    ]
    rt = s.get("runtime", {})
    if rt.get("status") == "ok" and "default" in rt and "error" not in rt["default"]:
        d = rt["default"]
        lines += ["| runtime term | MiB |", "|---|---:|"]
        for key in (
            "used_after_context",
            "reserved_after_context",
            "cublas_reserved_delta",
            "cublas_used_delta",
            "cublaslt_reserved_delta",
            "cublaslt_used_delta",
            "segment_for_1",
            "segment_for_1048577",
            "segment_for_10485761",
        ):
            if key in d:
                lines.append(f"| {key} | {d[key] / MIB:.1f} |")
        lines += [f"| bf16 matmul 8192^3 (TFLOP/s) | {d.get('bf16_matmul_tflops', 0):.0f} |", ""]
    mem = s.get("memory", {}).get("rows", [])
    if mem:
        lines += [
            "| config | seq | batch | AC | planned peak GiB (alloc + reserve) | "
            "planned alloc GiB | max allocated | max reserved | process used (NVML) | "
            "plan / reserved | status |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in mem:
            plan = r.get("plan", {})
            ratio = (
                plan["peak_gib"] / r["reserved_gib"]
                if r.get("reserved_gib") and plan.get("peak_gib")
                else None
            )
            lines.append(
                f"| {r['name']} | {r['seq_len']} | {r['batch']} | {'on' if r['ac'] else 'off'} | "
                f"{_f(plan.get('peak_gib'))} | {_f(plan.get('allocated_peak_gib'))} | "
                f"{_f(r.get('allocated_gib'))} | {_f(r.get('reserved_gib'))} | "
                f"{_f(r.get('process_used_gib'))} | {_f(ratio, '.3f')} | "
                f"{str(r.get('status', ''))[:60]} |"
            )
        lines.append("")
        lines += offload_table(mem)
    sp = s.get("speed", {})
    if sp.get("table"):
        lines += [
            f"Speed: {sp.get('pair')}, seq {sp.get('seq_len')}, batch {sp.get('batch')}, "
            f"{sp.get('steps')} steps, {sp.get('loss')}, on-policy {sp.get('new_tokens')} "
            "new tokens; labelled tokens/s, median of steps 2..N and of the repeats",
            "",
            "| mode | kd tok/s | TRL tok/s | kd / TRL | kd MFU | TRL MFU |",
            "|---|---:|---:|---:|---:|---:|",
        ]
    for t in sp.get("table", []):
        lines.append(
            f"| {t['mode']} | {_f(t.get('kd_tokens_per_s'), '.0f')} | "
            f"{_f(t.get('trl_tokens_per_s'), '.0f')} | {_f(t.get('ratio'))} | "
            f"{_f(t.get('kd_mfu'), '.3f')} | {_f(t.get('trl_mfu'), '.3f')} |"
        )
    split = [t for t in sp.get("table", []) if "kd_phases" in t or "trl_phases" in t]
    if split:
        lines += [
            "",
            "| on-policy step (median s) | step | sampling | teacher | student |",
            "|---|---:|---:|---:|---:|",
        ]
        for t in split:
            for tool in ("kd", "trl"):
                ph = t.get(f"{tool}_phases")
                if ph:
                    lines.append(
                        f"| {tool} | {ph['step_s']:.3f} | {ph['generate_s']:.3f} | "
                        f"{ph['teacher_s']:.3f} | {ph['student_s']:.3f} |"
                    )
    ro = s.get("rollout", {})
    if ro.get("table"):
        lines += [
            "",
            "| rollout (transformers) | batch | new tokens | tokens/s | vs generate |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in ro["table"]:
            lines.append(
                f"| {r['method']} | {r['batch']} | {r['new_tokens']} | "
                f"{r['tokens_per_s']:.0f} | {r['ratio']:.2f}x |"
            )
    tests = s.get("tests")
    if tests:
        lines += ["", f"`pytest -m gpu`: {tests.get('summary') or tests.get('error', '')}"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------- main
def count_params(folder: Path) -> int:
    from safetensors import safe_open

    n = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            shape = f.get_slice(k).get_shape()
            p = 1
            for d in shape:
                p *= d
            n += p
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--work", default=None, help="scratch folder (models, runs); default a temp")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (CI)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting work after this")
    ap.add_argument("--sections", default="runtime,memory,rollout,speed,tests")
    ap.add_argument("--row-ids", default=None, help="only these memory rows (0,3,...)")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="memory rows run at once (each row's allocator figures are its own process's; the "
        "device memory each uses is read per process through NVML)",
    )
    ap.add_argument(
        "--speed-runs",
        default=None,
        help="only these (kd:off_policy,trl:on_policy,kd-fast:on_policy,kd-graphs:on_policy,"
        "kd-async:on_policy,kd-compiled:on_policy)",
    )
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    out = Path(args.out)
    work = Path(args.work) if args.work else Path(os.environ.get("TMPDIR", "/tmp")) / "kd_gpu_check"
    work.mkdir(parents=True, exist_ok=True)
    res = Results(out, args.smoke)
    wanted = set(args.sections.split(","))
    res.doc["argv"] = sys.argv[1:]
    res.section("environment", environment(device))
    print(json.dumps(res.doc["sections"]["environment"]), flush=True)
    deadline = t_start + args.budget_s
    kd_command(work)
    pre = preflight()
    res.section("preflight", pre)
    if pre["status"] != "ok":
        print(f"preflight failed: {json.dumps(pre)}", flush=True)
        return 3
    if "runtime" in wanted:
        try:
            res.section("runtime", runtime_probe(device))
        except Exception as exc:  # noqa: BLE001
            res.section("runtime", _error(exc))
    peak = res.doc["sections"].get("runtime", {}).get("default", {}).get("bf16_matmul_tflops")
    # assets: four models (written at once), the data, kd init's configs (at once)
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.monotonic()
    rows = rows_for(args.smoke)
    # --row-ids index the whole grid; --smoke alone runs one row of each code path
    ids = args.row_ids or ("0,2,7,8,9,11,12" if args.smoke else None)
    if ids:
        rows = [rows[int(i)] for i in ids.split(",")]
    # only the models the chosen rows (and the speed section's Qwen pair) load: writing a 3B
    # model's random weights is most of the assets' time
    pairs_used = {r.pair for r in rows} | ({"qwen"} if wanted & {"speed", "rollout"} else set())
    names = sorted({m for p in pairs_used for m in PAIRS[p][:2]})
    prewarm(names)
    with ThreadPoolExecutor(len(names)) as pool:
        made = list(
            pool.map(
                lambda nm: write_model(
                    work / "models", nm[1], smoke=args.smoke, device=device, seed=nm[0]
                ),
                enumerate(names),
            )
        )
    folders: dict[str, Path] = dict(zip(names, made, strict=True))
    params = {name: count_params(f) for name, f in folders.items()}
    data = write_data(work / "data.jsonl", 64, 4200 if not args.smoke else 300)
    keys = sorted(
        {f"{r.pair}_{r.base}" for r in rows} | ({"qwen_full"} if "speed" in wanted else set())
    )
    with ThreadPoolExecutor(max(1, len(keys))) as pool:
        made_bases = list(
            pool.map(lambda key: kd_init(work, *key.split("_"), folders, data, device, 4096), keys)
        )
    bases: dict[str, Path] = dict(zip(keys, made_bases, strict=True))
    res.doc["assets_s"] = time.monotonic() - t0
    res.doc["params"] = params
    print(f"assets in {res.doc['assets_s']:.0f} s: {params}", flush=True)
    # memory rows (and, beside them, the GPU tests) get 60% of the budget left after the
    # assets; speed runs alone after them, until the deadline
    left = deadline - time.monotonic()
    tests = None
    if "tests" in wanted:
        tests = start_gpu_tests()
    if "memory" in wanted:
        memory_rows(
            work, rows, folders, bases, device, time.monotonic() + 0.6 * left, res, args.jobs
        )
    if tests is not None:
        res.section("tests", finish_gpu_tests(tests, deadline))
    if "rollout" in wanted:
        res.section("rollout", rollout(work, folders, device, args.smoke, deadline))
    if "speed" in wanted:
        try:
            only = set(args.speed_runs.split(",")) if args.speed_runs else None
            res.section(
                "speed",
                speed(
                    work,
                    folders,
                    data,
                    device,
                    args.smoke,
                    deadline,
                    params,
                    peak,
                    only,
                    on_run=lambda part: res.section("speed", part),
                ),
            )
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                raise
            res.section("speed", _error(exc))
    res.doc["total_s"] = time.monotonic() - t_start
    res.write()
    print(markdown(res.doc))
    print(f"wrote {out / 'gpu_check.json'} in {res.doc['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
