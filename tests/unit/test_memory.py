"""Memory planner: exact shapes, the estimate's structure, the plan, the check, the fit search, the CLI.

The fast tier traces one tiny model under FakeTensorMode and compares it with the closed form; the
real-size comparisons live in scripts/bench_memory.py (docs/memory_accuracy.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from kd import families
from kd.cli import plan as plan_cli
from kd.config import load_config
from kd.errors import KDUserError
from kd.memory import (
    MemoryPlan,
    OptimizerSpec,
    TrainKnobs,
    check_memory,
    estimate,
    fit_options,
    plan_from_config,
    shape_from_component,
    shape_from_hf_config,
)
from kd.memory.estimate import GIB
from kd.memory.shapes import BUILDERS

FULL_14B_3B = "qwen2_5/14B_to_3B_full_single_device"

TINY_STUDENT = {
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
TINY_TEACHER = {
    "_component_": "torchtune.models.qwen2.qwen2",
    "vocab_size": 2048,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 192,
    "intermediate_dim": 512,
    "max_seq_len": 256,
}


def _kwargs(node: dict) -> dict:
    return {k: v for k, v in node.items() if k != "_component_"}


# --------------------------------------------------------------------------- shapes
def _meta_params(builder, **kwargs) -> int:
    import torch

    with torch.device("meta"):
        model = builder(**kwargs)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "name", sorted(n for n in BUILDERS if not n.endswith(("405b", "72b_base", "70b")))
)
def test_builder_table_matches_torchtune_meta_builders(name):
    import importlib

    module = f"torchtune.models.{families.family_of_builder(name).name}"
    builder = getattr(importlib.import_module(module), name)
    assert shape_from_component(f"{module}.{name}", {}).total_params() == _meta_params(builder)


@pytest.mark.parametrize(
    "component,kwargs",
    [
        (
            "torchtune.models.qwen2_5.lora_qwen2_5_3b",
            {
                "lora_attn_modules": ["q_proj", "v_proj", "output_proj"],
                "apply_lora_to_mlp": True,
                "lora_rank": 64,
                "lora_alpha": 128,
            },
        ),
        (
            "torchtune.models.llama3_2.lora_llama3_2_1b",
            {
                "lora_attn_modules": ["q_proj", "k_proj"],
                "apply_lora_to_mlp": False,
                "lora_rank": 8,
                "lora_alpha": 16,
                "use_dora": True,
            },
        ),
        (
            "torchtune.models.llama3.lora_llama3",
            {
                "lora_attn_modules": ["v_proj"],
                "apply_lora_to_output": True,
                "lora_rank": 4,
                "lora_alpha": 8,
                "vocab_size": 1000,
                "num_layers": 2,
                "num_heads": 4,
                "num_kv_heads": 1,
                "embed_dim": 64,
                "max_seq_len": 128,
            },
        ),
    ],
)
def test_lora_param_counts_match_builders(component, kwargs):
    import importlib

    module, name = component.rsplit(".", 1)
    builder = getattr(importlib.import_module(module), name)
    shape = shape_from_component(component, kwargs)
    assert shape.total_params() == _meta_params(builder, **kwargs)
    assert shape.lora is not None and shape.lora_params() > 0


def test_component_builder_kwargs_and_default_mlp_size():
    shape = shape_from_component(
        "torchtune.models.llama3.llama3",
        {
            "vocab_size": 512,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "embed_dim": 96,
            "max_seq_len": 64,
        },
    )
    assert shape.intermediate_dim == 256  # torchtune's scale_hidden_dim_for_mlp(96)
    assert shape.total_params() == _meta_params(
        __import__("torchtune.models.llama3", fromlist=["llama3"]).llama3,
        vocab_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=96,
        max_seq_len=64,
    )


def test_hf_config_json(tmp_path):
    cfg = {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = shape_from_hf_config(str(tmp_path / "config.json"))
    assert shape.total_params() == shape_from_component("qwen2_5_3b", {}).total_params()
    # an unknown builder falls back to the checkpoint's config.json
    other = shape_from_component("my.pkg.my_qwen", {}, hf_config_path=str(tmp_path / "config.json"))
    assert other.total_params() == shape.total_params()


def test_unknown_builder_without_config_json_is_a_user_error():
    cfg = load_config(FULL_14B_3B, ["model._component_=torchtune.models.nope.nope_1b"])
    with pytest.raises(KDUserError, match="model: cannot plan memory"):
        plan_from_config(cfg)


# --------------------------------------------------------------------------- the estimate
def test_14b_to_3b_plan_has_exact_weights_and_fits_80():
    plan = plan_from_config(load_config(FULL_14B_3B, []), budget_gib=80)
    assert isinstance(plan, MemoryPlan)
    assert plan.fits and 50 <= plan.peak_gib <= 80
    comps = plan.estimate.phases["optimizer_step"]
    assert comps["teacher_weights"] == 2 * 14_770_033_664  # 27.51 GiB
    assert comps["student_weights"] == 2 * 3_085_938_688  # 5.75 GiB
    assert comps["gradients"] == 2 * 3_085_938_688
    assert comps["optimizer_states"] == 4 * 3_085_938_688  # AdamW m, v in bf16
    out = plan.to_json()
    assert out["components"]["teacher_weights"] == pytest.approx(27.51, abs=0.01)
    assert out["components"]["student_weights"] == pytest.approx(5.75, abs=0.01)
    assert all(isinstance(v, float) for v in out["components"].values())
    assert sum(plan.components.values()) == plan.peak_bytes


def _knobs(**kw) -> TrainKnobs:
    base = {"batch_size": 2, "seq_len": 1024, "optimizer": OptimizerSpec(fused=True)}
    base.update(kw)
    return TrainKnobs(**base)


def test_knob_effects_have_the_right_direction():
    s = shape_from_component("qwen2_5_3b", {})
    t = shape_from_component("qwen2_5_14b_instruct", {})
    base = estimate(s, t, _knobs()).peak_bytes
    assert estimate(s, t, _knobs(activation_checkpointing=True)).peak_bytes < base
    assert estimate(s, t, _knobs(batch_size=4)).peak_bytes > base
    assert estimate(s, t, _knobs(fused_loss=False)).peak_bytes > base
    small_chunk = estimate(s, t, _knobs(loss_chunk_size=256)).phases["forward"]["logits_loss"]
    assert small_chunk < estimate(s, t, _knobs()).phases["forward"]["logits_loss"]
    eight_bit = estimate(s, t, _knobs(optimizer=OptimizerSpec(kind="adamw8bit")))
    assert eight_bit.phases["optimizer_step"]["optimizer_states"] < 0.6 * 4 * s.total_params()
    offload = estimate(s, t, _knobs(optimizer=OptimizerSpec(in_cpu=True)))
    assert offload.phases["optimizer_step"]["optimizer_states"] == 0
    foreach = estimate(s, t, _knobs(optimizer=OptimizerSpec(fused=False)))
    assert foreach.phases["optimizer_step"]["optimizer_temp"] == 2 * s.total_params()


def test_gradient_accumulation_keeps_gradients_in_forward():
    s = shape_from_component("qwen2_5_3b", {})
    one = estimate(s, None, _knobs(fused_loss=False))
    many = estimate(s, None, _knobs(fused_loss=False, grad_accum=4))
    assert one.phases["forward"]["gradients"] == 0
    assert many.phases["forward"]["gradients"] == 2 * s.total_params()


def test_world_size_divides_states_and_adds_in_flight_layers():
    s = shape_from_component("llama3_1_8b", {})
    one = estimate(s, s, _knobs())
    eight = estimate(s, s, _knobs(world_size=8))
    p = s.total_params()
    ph = eight.phases["optimizer_step"]
    assert ph["student_weights"] == -(-2 * p // 8)
    assert ph["teacher_weights"] == -(-2 * p // 8)
    assert ph["gradients"] == -(-2 * p // 8)
    assert ph["optimizer_states"] == -(-4 * p // 8)
    assert eight.phases["forward"]["fsdp_in_flight"] >= 2 * 2 * s.largest_layer_params()
    assert one.phases["forward"]["fsdp_in_flight"] == 0
    assert eight.peak_bytes < one.peak_bytes


def test_activation_formula_matches_the_research_closed_form():
    # torchtune's llama layer, full FT, GQA: 28h + 8f + 4nh + 8 bytes per token per layer (llama).
    s = shape_from_component("llama3_1_8b", {})
    from kd.memory.activations import layer_saved_bytes

    per_tok = layer_saved_bytes(s, 1, 1, 2, input_grad=True)
    h, f, nh = 4096, 14336, 32
    assert per_tok == 28 * h + 8 * f + 4 * nh + 8


# --------------------------------------------------------------------------- check and fit
def test_check_memory_error_warn_off(capsys):
    from kd.config.run import run_config
    from kd.runtime.device import resolve_budget

    def check(over: list[str], **kwargs):
        run = run_config(load_config(FULL_14B_3B, over))
        return check_memory(run, world_size=1, **kwargs)

    over = ["memory.budget_gib=40"]
    with pytest.raises(KDUserError) as e:
        check(over, budget_gib=40)
    msg = str(e.value)
    assert "memory.budget_gib" in msg and "teacher_weights" in msg and "=" in msg
    plan = check([*over, "memory.check=warn"], budget_gib=40)
    assert plan is not None and not plan.fits
    assert "DOES NOT FIT" in capsys.readouterr().err
    assert check([*over, "memory.check=off"], budget_gib=40) is None
    assert check(["memory.budget_gib=null"], budget_gib=80).fits
    # one budget resolution: memory.budget_gib first, else the device's memory
    assert resolve_budget(budget_gib=40, device="cuda").gib == 40
    cpu = resolve_budget(budget_gib=None, device="cpu")
    assert cpu.gib is not None and cpu.gib > 0 and "RAM" in cpu.source
    if not __import__("torch").cuda.is_available():
        none = resolve_budget(budget_gib=None, device="cuda")
        assert none.gib is None and "--budget-gib" in none.source


def test_fit_options_are_ready_overrides_that_fit():
    budget = 52.0
    cfg = load_config(FULL_14B_3B, [f"memory.budget_gib={budget}"])
    plan = plan_from_config(cfg)
    assert not plan.fits
    inp = plan.inputs
    opts = fit_options(
        inp.student,
        inp.teacher,
        inp.knobs,
        budget_bytes=int(budget * GIB),
        optimizer_keys=inp.optimizer_keys,
    )
    knob_opts = [o for o in opts if not o.suggestion]
    assert knob_opts, "some knob setting must fit 52 GiB"
    times = [o.relative_time for o in knob_opts]
    assert times == sorted(times)
    for opt in knob_opts:
        replanned = plan_from_config(
            load_config(FULL_14B_3B, [f"memory.budget_gib={budget}", *opt.overrides])
        )
        assert replanned.fits, opt.overrides
        assert replanned.peak_bytes == opt.peak_bytes
        g = replanned.inputs.knobs
        assert g.batch_size * g.grad_accum == inp.knobs.batch_size * inp.knobs.grad_accum
    assert any(o.suggestion and "LoRA" in o.description for o in opts)


# --------------------------------------------------------------------------- CLI
def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    plan_cli.add_parser(sub)
    args = parser.parse_args(["plan", *argv])
    code = plan_cli.run(args)
    return code, capsys.readouterr().out


def test_cli_json_and_table(capsys, tmp_path):
    code, out = _run_cli(["--config", FULL_14B_3B, "--budget-gib", "80", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["fits"] is True and 50 <= data["peak_gib"] <= 80
    assert data["budget_gib"] == 80 and data["phase"] in ("forward", "backward", "optimizer_step")
    code, out = _run_cli(
        ["--config", FULL_14B_3B, "batch_size=64", "--fit", "--plot", str(tmp_path / "p.png")],
        capsys,
    )
    assert code == 1 and "DOES NOT FIT" in out and "gradient_accumulation_steps=" in out
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_plan_does_not_import_torch():
    code = (
        "import sys; from kd.config import load_config; from kd.memory import plan_from_config; "
        f"p = plan_from_config(load_config('{FULL_14B_3B}', [])); "
        "assert 'torch' not in sys.modules and 'torchtune' not in sys.modules, 'imported torch'; print(p.peak_gib)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# --------------------------------------------------------------------------- trace vs estimate
def _run(cfg):
    """The RunConfig of a partial config (schema defaults merged under it)."""
    from kd.config.parse import fill_defaults
    from kd.config.run import run_config

    cfg = OmegaConf.merge(cfg, {})
    fill_defaults(cfg)
    return run_config(cfg)


@pytest.mark.parametrize(
    "lora,ac,fused,divergence,teacher,ga",
    [
        (False, False, True, "forward_kl", True, 1),
        (True, True, True, "jsd", True, 1),
        (False, True, False, "reverse_kl", True, 2),
        (False, False, False, "forward_kl", False, 1),
    ],
)
def test_tiny_trace_matches_estimate(lora, ac, fused, divergence, teacher, ga):
    from dataclasses import replace

    from kd.memory.plan import inputs_from_run
    from kd.memory.trace import trace_run

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
            "teacher_model": TINY_TEACHER if teacher else None,
            "kd_ratio": 0.5 if teacher else 0.0,
            "tokenizer": {"max_seq_len": 128},
            "batch_size": 2,
            "gradient_accumulation_steps": ga,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
            "enable_activation_checkpointing": ac,
            "fused_loss": fused,
            "loss_chunk_size": 64,
            "kd_loss": {"divergence": divergence},
        }
    )
    traced = trace_run(_run(cfg))
    inputs = inputs_from_run(_run(cfg))
    est = estimate(inputs.student, inputs.teacher, replace(inputs.knobs, select_labelled=False))
    for phase in ("forward", "backward", "optimizer_step"):
        assert est.allocated(phase) == pytest.approx(traced.phase_peaks[phase], rel=0.03), phase


def test_trace_refuses_torchao_optimizers():
    from kd.memory.trace import trace_step

    cfg = OmegaConf.create(
        {
            "model": TINY_STUDENT,
            "teacher_model": None,
            "kd_ratio": 0.0,
            "optimizer": {"_component_": "torchao.optim.AdamW8bit"},
            "batch_size": 1,
            "tokenizer": {"max_seq_len": 8},
        }
    )
    with pytest.raises(KDUserError, match="cannot run on fake tensors"):
        trace_step(_run(cfg))


def test_fsdp_trace_through_trace_config_is_per_rank():
    """`kd plan --world-size N --trace` traces rank 0 of N FSDP2 ranks; sharding shrinks every phase,
    and the gradient norm does not gather whole gradients at the optimizer step."""
    from kd.memory.trace import trace_run

    cfg = OmegaConf.create(
        {
            "model": TINY_STUDENT,
            "teacher_model": TINY_TEACHER,
            "kd_ratio": 0.5,
            "tokenizer": {"max_seq_len": 128},
            "batch_size": 2,
            "gradient_accumulation_steps": 1,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
            "clip_grad_norm": 1.0,
            "enable_activation_checkpointing": True,
            "fused_loss": True,
            "loss_chunk_size": 64,
            "kd_loss": {"divergence": "forward_kl"},
            "fsdp": {"cpu_offload": False, "reshard_after_forward": True, "reduce_dtype": "fp32"},
        }
    )
    one = trace_run(_run(cfg), world_size=1).phase_peaks
    four = trace_run(_run(cfg), world_size=4).phase_peaks
    for phase in ("forward", "backward", "optimizer_step"):
        assert four[phase] < one[phase], phase
    with pytest.raises(KDUserError, match="CPU offload"):
        trace_run(_run(OmegaConf.merge(cfg, {"fsdp": {"cpu_offload": True}})), world_size=2)


@pytest.mark.parametrize("bad", [0, -3, 1e-300, 2.5, True, "8"])
def test_shape_sizes_must_be_whole_numbers_from_one(bad, tmp_path):
    """A size the builder would reject (or that divides by zero in the plan) is a ShapeError."""
    from kd.memory.shapes import ShapeError

    kwargs = dict(TINY_STUDENT)
    kwargs.pop("_component_")
    with pytest.raises(ShapeError, match="num_heads must be a whole number >= 1"):
        shape_from_component("torchtune.models.qwen2.qwen2", {**kwargs, "num_heads": bad})
    config = tmp_path / "config.json"
    config.write_text(
        '{"num_attention_heads": 0, "hidden_size": 64, "vocab_size": 10, '
        '"num_hidden_layers": 1, "intermediate_size": 8}'
    )
    with pytest.raises(ShapeError, match="num_attention_heads must be a whole number"):
        shape_from_component("my.pkg.model", {}, hf_config_path=str(config))
