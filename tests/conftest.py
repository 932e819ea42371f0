"""Shared fixtures: a tiny Qwen2-style tokenizer, tiny HF-format models and data, written to disk in
the real formats (vocab.json/merges.txt, safetensors + config.json, json lines) by kd.testing so the
real loading code runs. Models are written by transformers' classes (files made independently of
kd's weight conversions); the teacher has a larger padded vocab."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kd.memory.fake_device import register as register_fake_device
from kd.testing import (
    TinyModel,
    checkpointer_node,
    tokenizer_node,
    write_jsonl,
    write_tiny_model,
    write_tokenizer,
)

warnings.filterwarnings("ignore")

# The fake accelerator (kd.memory.fake_device) is registered before any test runs a backward:
# autograd sizes its per-device ready queues once, at the process's first backward, so a device
# registered later fails its backward (an internal assert in torch/csrc/autograd/engine.cpp).
# Never beside a real CUDA device: there torch sends pinned memory (and its accelerator hooks) to
# the registered PrivateUse1 backend, and every CUDA test failed (the H100 run of 2026-11-27,
# `pin_memory`: "You should register PrivateUse1HooksInterface"). The tests that use the fake
# accelerator are marked FAKE_ACCELERATOR and skip there.
REAL_CUDA = torch.cuda.is_available()
FAKE_ACCELERATOR = pytest.mark.skipif(
    REAL_CUDA, reason="the fake accelerator is for machines without a CUDA device"
)
if not REAL_CUDA:
    register_fake_device()

# Tiny models: one intra-op thread is much faster than two fighting over a 2-core machine, for this
# process and the `kd` subprocesses the tests start (they inherit the environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(1)

STUDENT = dict(vocab=288, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, tied=True)
TEACHER = dict(vocab=320, hidden=48, inter=96, layers=2, heads=4, kv_heads=2, tied=False)
MAX_SEQ_LEN = 64
MODEL_MAX_SEQ_LEN = 256  # the models' max_seq_len (max_position_embeddings)


def tiny_model(spec: dict[str, Any]) -> TinyModel:
    """The kd.testing shape of a STUDENT / TEACHER spec."""
    return TinyModel(
        vocab_size=spec["vocab"],
        num_layers=spec["layers"],
        num_heads=spec["heads"],
        num_kv_heads=spec["kv_heads"],
        embed_dim=spec["hidden"],
        intermediate_dim=spec["inter"],
        max_seq_len=MODEL_MAX_SEQ_LEN,
        tie_word_embeddings=spec["tied"],
    )


def write_hf_qwen2(dest: Path, spec: dict[str, Any], seed: int) -> Path:
    """A random-init Qwen2 of ``spec``'s shape, written by transformers' ``save_pretrained``."""
    return write_tiny_model(dest, tiny_model(spec), seed=seed, writer="transformers")


def builder(spec: dict[str, Any], lora: bool = False) -> dict[str, Any]:
    """The torchtune ``model:`` node of ``spec`` (LoRA: rank 4 on q/v projections and the MLP)."""
    node = tiny_model(spec).builder(lora=lora)
    if lora:
        node.update(
            lora_attn_modules=["q_proj", "v_proj"],
            apply_lora_to_mlp=True,
            lora_rank=4,
            lora_alpha=8,
        )
    return node


def write_data(path: Path, n: int, seed: int) -> Path:
    """``n`` json lines of two-number additions (``{"input": "12+30", "output": "42"}``)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"input": f"{a}+{b}", "output": str(a + b)})
    return write_jsonl(path, rows)


def write_assets(root: Path) -> dict[str, Path]:
    """The tiny assets of the ``assets`` fixture, under ``root``."""
    return {
        "tokenizer": write_tokenizer(root / "tokenizer"),
        "student": write_hf_qwen2(root / "student", STUDENT, seed=1),
        "teacher": write_hf_qwen2(root / "teacher", TEACHER, seed=2),
        "data": write_data(root / "train.jsonl", 64, seed=3),
    }


# The handlers a test must leave as it found them: a test (or the code it runs) that leaves its own
# SIGINT handler behind makes Ctrl-C, and every later test that sends a real SIGINT, misbehave.
_GUARDED_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


def _signal_state() -> tuple[dict[int, Any], frozenset[int]]:
    handlers = {sig: signal.getsignal(sig) for sig in _GUARDED_SIGNALS}
    blocked: frozenset[int] = frozenset()
    if hasattr(signal, "pthread_sigmask"):
        blocked = frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    return handlers, blocked


@contextlib.contextmanager
def signal_state_kept(name: str) -> Iterator[None]:
    """Fail (``pytest.fail``) when the body leaves a handler of SIGINT/SIGTERM/SIGHUP/SIGQUIT or
    the blocked-signal mask changed, naming ``name``; the state is put back first."""
    handlers, blocked = _signal_state()
    yield
    after_handlers, after_blocked = _signal_state()
    changed = [
        f"{signal.Signals(sig).name} handler {after_handlers[sig]!r}"
        for sig in _GUARDED_SIGNALS
        if after_handlers[sig] is not handlers[sig] and after_handlers[sig] != handlers[sig]
    ]
    for sig, handler in handlers.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if after_blocked != blocked:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        changed.append(f"blocked signals {sorted(after_blocked ^ blocked)}")
    if changed:
        pytest.fail(f"{name} left the signal state changed: {', '.join(changed)}")


@pytest.fixture(autouse=True)
def _signal_handlers_restored(request):
    """Each test leaves the signal handlers and the blocked-signal mask as it found them (a SIGINT
    handler left behind made a later Ctrl-C test fail in the full run only)."""
    if sys.platform == "win32" or threading.current_thread() is not threading.main_thread():
        yield
        return
    with signal_state_kept(request.node.nodeid):
        yield


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures(
    "one_thread")``): the same float reductions in every run, and tiny models run many times
    faster than with threads spinning on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    """Paths of the tiny assets: ``tokenizer`` (folder), ``student`` and ``teacher`` (HF model
    folders, shapes STUDENT and TEACHER) and ``data`` (64 json lines for instruct_dataset)."""
    return write_assets(tmp_path_factory.mktemp("assets"))


def make_config(
    assets: dict[str, Path], output_dir: Path, *, lora: bool = False, **top: Any
) -> dict:
    """A complete kd config (plain dict) for the tiny assets."""
    cfg: dict[str, Any] = {
        "output_dir": str(output_dir),
        "model": builder(STUDENT, lora=lora),
        "teacher_model": builder(TEACHER),
        "tokenizer": tokenizer_node(assets["tokenizer"], MAX_SEQ_LEN),
        "checkpointer": checkpointer_node(assets["student"], output_dir / "tt"),
        "teacher_checkpointer": checkpointer_node(assets["teacher"], output_dir / "tt"),
        "dataset": {
            "_component_": "torchtune.datasets.instruct_dataset",
            "source": "json",
            "data_files": str(assets["data"]),
            "split": "train",
        },
        "seed": 0,
        "shuffle": False,
        "batch_size": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
        "lr_scheduler": None,
        "kd_ratio": 0.5,
        "epochs": 1,
        "max_steps_per_epoch": 3,
        "device": "cpu",
        "dtype": "fp32",
        "loss_chunk_size": 16,
        "memory": {"budget_gib": 16, "check": "error"},
    }
    cfg.update(top)
    return cfg


def tiny_hidden_decoder(vocab: int = 64, dim: int = 32, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer torchtune Qwen2 decoder in hidden-output mode (for loss and step tests)."""
    from kd import _torchtune as tt
    from kd import models

    torch.manual_seed(seed)
    m = tt.qwen2(
        vocab_size=vocab,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=dim,
        intermediate_dim=2 * dim,
        max_seq_len=64,
    )
    models.set_hidden_output(m)
    return m


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_kd(config: dict[str, Any] | Path, *args: Any, recipe: str = "kd") -> int:
    """``kd run RECIPE --config CONFIG ARGS...`` in-process, through the CLI as a user runs it
    (``kd.cli.main``); its exit status. ``config`` is a config file, or a config dict written to
    the path that comes first in ``args`` (:func:`write_config`)."""
    from kd import cli

    if isinstance(config, dict):
        path, *args = args  # type: ignore[assignment]
        config = write_config(Path(path), config)
    return cli.main(["run", recipe, "--config", str(config), *map(str, args)])


def read_metrics(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# Metric-row fields that depend on wall time or memory, not on the training trajectory.
UNTIMED = {
    "tokens_per_second",
    "generate_tokens_per_second",
    "time_generate_s",
    "time_teacher_s",
    "time_student_s",
    "peak_memory_gib",
    "peak_memory_reserved_gib",
    "device_used_gib",
    "planned_peak_gib",
}


def sigterm_at_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Send this process a real SIGTERM right after ``step``'s row is logged (the recipe saves
    and stops)."""
    import signal

    from kd.training.run_log import RunLog

    original = RunLog.write_step

    def log_then_signal(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if kwargs["step"] == step:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(RunLog, "write_step", log_then_signal)
