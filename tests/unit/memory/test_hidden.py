"""The memory plan of hidden-state distillation (``hidden_states:``) against the traced step: the
captured teacher states, what the hidden loss saves for backward, and the width projections with
their gradients and optimizer states (component ``hidden_states``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from kd.config import load_config
from kd.config.run import run_config
from kd.memory.estimate import estimate
from kd.memory.plan import inputs_from_run
from kd.memory.trace import trace_run
from kd.scaffold.layer_map import uniform_map
from tests.unit.test_memory import TINY_STUDENT, TINY_TEACHER, _run

PHASES = ("forward", "backward", "optimizer_step")


def _layer_map(student_layers: int, teacher_layers: int) -> list[str]:
    pairs = enumerate(uniform_map(student_layers, teacher_layers))
    return ["embed:embed", *(f"{i}:{j}" for i, j in pairs), "norm:norm"]


def _compare(run) -> dict[str, tuple[int, int]]:
    traced = trace_run(run).phase_peaks
    inputs = inputs_from_run(run)
    est = estimate(inputs.student, inputs.teacher, replace(inputs.knobs, select_labelled=False))
    return {p: (est.allocated(p), traced[p]) for p in PHASES}, est


@pytest.mark.parametrize("loss", ["cosine", "mse", "nmse"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tiny_trace_matches_estimate_with_projections(loss, dtype):
    cfg = OmegaConf.create(
        {
            "model": TINY_STUDENT,  # width 128
            "teacher_model": TINY_TEACHER,  # width 192: every pair is projected
            "kd_ratio": 0.5,
            "dtype": dtype,
            "tokenizer": {"max_seq_len": 128},
            "batch_size": 2,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
            "loss_chunk_size": 64,
            "hidden_states": {"layer_map": _layer_map(2, 2), "loss": loss},
        }
    )
    rows, est = _compare(_run(cfg))
    # nmse at this tiny size: the plan is 3.1% over the trace in backward (some of the saved
    # differences are freed before the backward's peak; counted held, the safe side); 14B -> 3B
    # with nmse: 1.009.
    tolerance = 0.035 if loss == "nmse" else 0.03
    for phase, (planned, traced) in rows.items():
        assert planned == pytest.approx(traced, rel=tolerance), phase
    # 4 projections 128 -> 192 in fp32: weights and two AdamW states in every phase
    assert est.phases["forward"]["hidden_states"] >= 3 * 4 * 4 * 128 * 192
    without = inputs_from_run(_run(OmegaConf.merge(cfg, {"hidden_states": None})))
    base = estimate(without.student, without.teacher, without.knobs)
    assert all(base.phases[p]["hidden_states"] == 0 for p in PHASES)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,layers,overrides",
    [
        ("qwen2_5/14B_to_3B_full_single_device", (36, 48), []),  # widths 2048 -> 5120
        ("llama3_1/8B_to_8B_lora_single_device", (32, 32), []),
        (  # a pruned pair: Llama-3.1-8B with 8 of its 32 layers dropped, full fine-tuning
            "llama3_2/8B_to_1B_full_single_device",
            (24, 32),
            [
                "model={_component_: torchtune.models.llama3_1.llama3_1, vocab_size: 128256, "
                "num_layers: 24, num_heads: 32, num_kv_heads: 8, embed_dim: 4096, "
                "intermediate_dim: 14336, max_seq_len: 131072}"
            ],
        ),
    ],
    ids=["14B-3B-projected", "8B-8B-lora", "8B-pruned-24"],
)
def test_real_size_pairs_within_3_percent(config, layers, overrides):
    """Measured here (bf16, activation checkpointing, batch 1 x 512 tokens, the uniform map plus
    embed and norm): 14B -> 3B 1.000 / 1.015 / 1.000 (forward / backward / optimizer step),
    8B -> 8B LoRA 1.000 / 1.008 / 1.000, the pruned 8B 1.000 / 1.007 / 1.000."""
    entries = ",".join(f"'{e}'" for e in _layer_map(*layers))
    over = [
        "enable_activation_checkpointing=true",
        "tokenizer.max_seq_len=512",
        "batch_size=1",
        "gradient_accumulation_steps=1",
        f"hidden_states.layer_map=[{entries}]",
        "hidden_states.loss=cosine",
        *overrides,
    ]
    rows, _ = _compare(run_config(load_config(config, over)))
    for phase, (planned, traced) in rows.items():
        assert planned == pytest.approx(traced, rel=0.03), phase


def test_fsdp_trace_counts_the_replicated_projections(assets, tmp_path, capsys):
    """`kd plan --world-size 2 --trace` with width projections: the trace runs (the projections'
    plain gradients beside the student's DTensor shards are normed as the recipe norms them) and
    counts the projections, whole on every rank, as the estimate does: their weights, AdamW states
    and gradients (a for-loop step, ``foreach: false``, as the FSDP2 trace steps) within 3%."""
    import json

    from kd import cli
    from tests.conftest import make_config, write_config

    optimizer = {"_component_": "torch.optim.AdamW", "lr": 1e-4, "foreach": False}
    hidden = {"layer_map": ["embed:embed", "0:0", "1:1", "norm:norm"], "loss": "cosine"}
    user = make_config(assets, tmp_path / "out", hidden_states=hidden, optimizer=optimizer)
    path = write_config(tmp_path / "cfg.yaml", user)
    argv = ["plan", "--config", str(path), "--world-size", "2", "--trace", "--json"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 2 and data["components"]["hidden_states"] > 0

    cfg = OmegaConf.create(
        {
            "model": TINY_STUDENT,  # width 128
            "teacher_model": TINY_TEACHER,  # width 192
            "kd_ratio": 0.5,
            "tokenizer": {"max_seq_len": 128},
            "batch_size": 2,
            "optimizer": optimizer,
            "clip_grad_norm": 1.0,
            "loss_chunk_size": 64,
            "hidden_states": {"layer_map": _layer_map(2, 2), "loss": "cosine"},
        }
    )
    projections = 4 * 128 * 192  # 4 pairs, fp32
    with_hidden = trace_run(_run(cfg), world_size=2)
    without = trace_run(_run(OmegaConf.merge(cfg, {"hidden_states": None})), world_size=2)
    inputs = inputs_from_run(_run(cfg), world_size=2)
    est = estimate(inputs.student, inputs.teacher, inputs.knobs)

    def added(phase: str, category: str) -> int:
        return with_hidden.categories[phase][category] - without.categories[phase][category]

    assert added("forward", "Unsharded Param") == 4 * projections
    assert added("forward", "OptState") == pytest.approx(2 * 4 * projections, rel=0.03)
    # At the optimizer step: weights, states and gradients; nothing else of hidden_states is alive.
    step = with_hidden.phase_peaks["optimizer_step"] - without.phase_peaks["optimizer_step"]
    assert est.phases["optimizer_step"]["hidden_states"] == 4 * 4 * projections
    assert est.phases["optimizer_step"]["hidden_states"] == pytest.approx(step, rel=0.03)
