"""Memory planner: the evaluation phase (a validation batch between steps) against the traced
``kd.training.evaluate`` batch, its place in the plan, and ``kd run``'s refusal when only it does not fit."""

from __future__ import annotations

from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from kd.config import load_config
from kd.errors import KDUserError
from kd.memory import estimate
from kd.memory.estimate import EVAL_PHASE, PHASES
from tests.unit.memory.test_hf_terms import LORA, _hf_cfg, tiny_dirs  # noqa: F401 (fixture)
from tests.unit.test_memory import FULL_14B_3B, TINY_STUDENT, TINY_TEACHER, _run

VALIDATION = {"dataset": {"_component_": "torchtune.datasets.alpaca_dataset"}, "batch_size": 5}


def _compare(run) -> None:
    """Every phase, evaluation included, of the estimate within 3% of the trace."""
    from kd.memory.plan import inputs_from_run
    from kd.memory.trace import trace_run

    traced = trace_run(run).phase_peaks
    inputs = inputs_from_run(run)
    assert inputs.knobs.eval_batch == 5 != inputs.knobs.batch_size
    est = estimate(inputs.student, inputs.teacher, replace(inputs.knobs, select_labelled=False))
    assert est.phase_names == (*PHASES, EVAL_PHASE)
    for phase in est.phase_names:
        assert est.allocated(phase) == pytest.approx(traced[phase], rel=0.03), phase


@pytest.mark.parametrize(
    "lora,divergence,temperature", [(False, "forward_kl", 1.0), (True, "jsd", 2.0)]
)
def test_torchtune_evaluation_trace_matches_estimate(lora, divergence, temperature):
    student = dict(TINY_STUDENT)
    if lora:
        student["_component_"] = "torchtune.models.qwen2.lora_qwen2"
        student.update(
            lora_attn_modules=["q_proj", "v_proj"],
            apply_lora_to_mlp=True,
            lora_rank=8,
            lora_alpha=16,
        )
    cfg = OmegaConf.create(
        {
            "model": student,
            "teacher_model": TINY_TEACHER,
            "kd_ratio": 0.5,
            "tokenizer": {"max_seq_len": 128},
            "batch_size": 2,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
            "loss_chunk_size": 64,
            "kd_loss": {"divergence": divergence},
            "temperature": temperature,
            "validation": VALIDATION,
        }
    )
    _compare(_run(cfg))


@pytest.mark.parametrize("lora", [False, True])
def test_hf_evaluation_trace_matches_estimate(tiny_dirs, lora):  # noqa: F811
    from kd.config.run import run_config

    over: dict = {"validation": VALIDATION}
    if lora:
        over["model"] = dict(LORA, path=str(tiny_dirs["qwen3"]))
    _compare(run_config(_hf_cfg(tiny_dirs["qwen3"], tiny_dirs["llama"], **over)))


def test_no_validation_no_evaluation_phase():
    from kd.memory import plan_from_config

    plan = plan_from_config(load_config(FULL_14B_3B, []), budget_gib=80)
    assert plan.estimate.phase_names == PHASES
    assert "evaluation" not in plan.table() and "evaluation" not in plan.to_json()["phases"]


def test_large_validation_batch_is_refused_before_loading():
    """A plan that fits for training but not for its validation batch: kd run refuses it with the
    same message, naming the evaluation phase; the table shows the evaluation column."""
    from kd.config.run import run_config
    from kd.memory import check_memory, plan_from_config

    over = [
        "memory.budget_gib=80",
        "validation.dataset._component_=torchtune.datasets.alpaca_dataset",
    ]
    fits = plan_from_config(load_config(FULL_14B_3B, [*over, "validation.batch_size=2"]))
    assert fits.fits and fits.inputs.knobs.eval_batch == 2
    assert fits.estimate.phases[EVAL_PHASE]["gradients"] == 0
    assert "evaluation" in fits.table() and EVAL_PHASE in fits.to_json()["phases"]
    run = run_config(load_config(FULL_14B_3B, [*over, "validation.batch_size=256"]))
    with pytest.raises(KDUserError) as e:
        check_memory(run, world_size=1, budget_gib=80)
    first = str(e.value).splitlines()[0]
    assert first.startswith("memory: the plan needs") and "in evaluation" in first
    assert "memory.budget_gib" in first
    # the fit search offers a validation batch that fits, and the plan with it fits
    sizes = [o for o in str(e.value).split() if o.startswith("validation.batch_size=")]
    assert sizes
    again = plan_from_config(load_config(FULL_14B_3B, [*over, sizes[0]]))
    assert again.fits
