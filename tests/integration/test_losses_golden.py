"""Golden losses: the first steps of fixed tiny runs (CPU, fp32, fixed seed) must reproduce
``tests/assets/expected_losses.json``.

The golden file was written by the code at the time it was made, so any change to the training
trajectory (data order, loss math, accumulation, gradient clipping, optimizer, LR schedule, LoRA init,
weight loading) shows up here. A change that is meant to alter the numbers must say why, and the file
is then regenerated with ``python scripts/update_expected_losses.py``, which runs this very module in
update mode (``KD_UPDATE_EXPECTED_LOSSES=1``) so the file always comes from the code path tested here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kd import cli
from tests.conftest import make_config, read_metrics, write_config

GOLDEN = Path(__file__).resolve().parent.parent / "assets" / "expected_losses.json"
UPDATE_ENV = "KD_UPDATE_EXPECTED_LOSSES"
REGENERATE = "python scripts/update_expected_losses.py"
STEPS = 5
METRICS = ("loss", "ce_loss", "kd_loss", "grad_norm", "lr")
RTOL, ATOL = 1e-5, 1e-6

# The top-level settings of each run, on top of conftest.make_config (tiny Qwen2 student with a
# tied embedding, teacher with a larger padded vocab, fp32 on CPU). Both use the fused loss with
# chunks smaller than a micro-batch's labelled tokens, gradient accumulation 2 and a shuffled,
# seeded sampler.
RUNS: dict[str, dict[str, Any]] = {
    "full": dict(
        lora=False,
        seed=1234,
        shuffle=True,
        batch_size=4,
        gradient_accumulation_steps=2,
        max_steps_per_epoch=STEPS,
        fused_loss=True,
        loss_chunk_size=16,
        kd_ratio=0.5,
        temperature=2.0,
        kd_loss={"divergence": "forward_kl"},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.01},
        lr_scheduler={
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 2,
        },
        clip_grad_norm=1.0,
    ),
    "lora": dict(
        lora=True,
        seed=4321,
        shuffle=True,
        batch_size=4,
        gradient_accumulation_steps=2,
        max_steps_per_epoch=STEPS,
        fused_loss=True,
        loss_chunk_size=16,
        kd_ratio=0.7,
        temperature=1.0,
        kd_loss={"divergence": "forward_kl"},
        optimizer={"_component_": "torch.optim.AdamW", "lr": 3e-3, "weight_decay": 0.0},
        lr_scheduler=None,
        clip_grad_norm=None,
    ),
}


def golden_config(assets: dict[str, Path], output_dir: Path, run: str) -> dict[str, Any]:
    """The complete config of golden run ``run`` (the one place its settings are assembled)."""
    settings = dict(RUNS[run])
    lora = settings.pop("lora")
    return make_config(assets, output_dir, lora=lora, **settings)


def run_golden(assets: dict[str, Path], workdir: Path, run: str) -> list[dict[str, Any]]:
    """Run ``kd run kd_single_device`` on the golden config; the metric rows of steps 1..STEPS."""
    out = workdir / run
    path = write_config(workdir / f"{run}.yaml", golden_config(assets, out, run))
    assert cli.main(["run", "kd_single_device", "--config", str(path)]) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [
        {"step": r["step"], "num_tokens": r["num_tokens"], **{k: r[k] for k in METRICS}}
        for r in rows
    ]


def assets_fingerprint(assets: dict[str, Path]) -> dict[str, str]:
    """sha256 of the tiny models' tensors and of the data and tokenizer files the runs start from."""
    from safetensors.torch import load_file

    prints = {}
    for name in ("student", "teacher"):
        h = hashlib.sha256()
        for key, t in sorted(load_file(assets[name] / "model.safetensors").items()):
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        prints[name] = h.hexdigest()
    prints["data"] = hashlib.sha256(assets["data"].read_bytes()).hexdigest()
    tok = hashlib.sha256()
    for f in sorted(assets["tokenizer"].iterdir()):
        tok.update(f.name.encode() + f.read_bytes())
    prints["tokenizer"] = tok.hexdigest()
    return prints


def _versions() -> dict[str, str]:
    import transformers

    from kd import _torchtune as tt

    return {
        "torch": torch.__version__,
        "torchtune": tt.TORCHTUNE_VERSION,
        "transformers": transformers.__version__,
    }


def _write_golden(run: str, rows: list[dict[str, Any]], fingerprint: dict[str, str]) -> None:
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    golden["about"] = (
        f"First {STEPS} metric rows of the tiny runs in tests/integration/test_losses_golden.py "
        f"(compared with rtol {RTOL}, atol {ATOL}); written by {REGENERATE}. A change to these "
        "numbers must be justified in the commit that regenerates them."
    )
    golden["versions"] = _versions()
    golden["assets"] = fingerprint
    runs = golden.setdefault("runs", {})
    runs[run] = {"settings": RUNS[run], "rows": rows}
    golden["runs"] = dict(sorted(runs.items()))
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=2) + "\n")


def _mismatches(expected: list[dict], got: list[dict]) -> list[str]:
    out = []
    for exp, row in zip(expected, got, strict=True):
        step = exp["step"]
        if row["num_tokens"] != exp["num_tokens"]:
            out.append(
                f"step {step} num_tokens: got {row['num_tokens']}, expected {exp['num_tokens']} "
                "(the batches differ: data order, padding or label masking changed)"
            )
        for key in METRICS:
            a, b = float(row[key]), float(exp[key])
            if not math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL):
                rel = abs(a - b) / max(abs(b), 1e-30)
                out.append(f"step {step} {key}: got {a!r}, expected {b!r} (rel diff {rel:.2e})")
    return out


@pytest.mark.parametrize("run", sorted(RUNS))
def test_golden_losses(assets, tmp_path, run):
    fingerprint = assets_fingerprint(assets)
    rows = run_golden(assets, tmp_path, run)
    if os.environ.get(UPDATE_ENV) == "1":
        _write_golden(run, rows, fingerprint)
        return
    how = (
        f"If the change is intended, justify it in the commit message and regenerate the file with "
        f"`{REGENERATE}`."
    )
    assert GOLDEN.exists(), f"{GOLDEN} is missing; create it with `{REGENERATE}`"
    golden = json.loads(GOLDEN.read_text())
    assert run in golden["runs"], f"no golden rows for run {run!r} in {GOLDEN}; {how}"
    assert golden["assets"] == fingerprint, (
        f"the tiny test models/data/tokenizer differ from those {GOLDEN.name} was made from "
        f"(tests/conftest.py or transformers' random init changed: {golden['versions']} then, "
        f"{_versions()} now); this is not a recipe change. {how}"
    )
    assert golden["runs"][run]["settings"] == json.loads(json.dumps(RUNS[run])), (
        f"RUNS[{run!r}] in {Path(__file__).name} differs from the settings in {GOLDEN.name}. {how}"
    )
    problems = _mismatches(golden["runs"][run]["rows"], rows)
    assert not problems, (
        f"golden run {run!r}: the first {STEPS} steps no longer reproduce {GOLDEN.name}:\n  "
        + "\n  ".join(problems)
        + f"\nThe training trajectory changed. {how}"
    )
