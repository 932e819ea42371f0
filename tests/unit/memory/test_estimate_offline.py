"""Memory planner without a teacher model: the chunked CE of plain fine-tuning and training from
stored teacher logits (``teacher_logits:``), each against the real step traced under
FakeTensorMode, and ``kd plan --compare-stored-logits``."""

from __future__ import annotations

from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from kd.config import load_config
from kd.memory import estimate
from kd.memory.compare import compare, stored_label
from kd.memory.estimate import GIB, PHASES
from kd.memory.loss_head import STORED_TOPK_BYTES
from kd.memory.plan import inputs_from_run, make_plan
from tests.unit.memory.test_hf_terms import LORA, _hf_cfg, tiny_dirs  # noqa: F401 (fixture)
from tests.unit.test_memory import FULL_14B_3B, TINY_STUDENT, TINY_TEACHER, _run, _run_cli

K = 16
STORE = {"path": "/nonexistent/store", "k": K}


def _compare_with_trace(run, *, stored: bool) -> None:
    """Every phase of the estimate within 3% of the trace (the fake-tensor path on both sides)."""
    from kd.memory.trace import trace_run

    inputs = inputs_from_run(run)
    assert inputs.teacher is None
    assert inputs.knobs.stored_topk == (K if stored else None)
    traced = trace_run(run).phase_peaks
    est = estimate(inputs.student, None, replace(inputs.knobs, select_labelled=False))
    for phase in PHASES:
        assert est.allocated(phase) == pytest.approx(traced[phase], rel=0.03), phase
    io = est.phases["forward"]["stored_logits"]
    assert io == (STORED_TOPK_BYTES * K * inputs.knobs.tokens if stored else 0)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("stored", [False, True])
def test_torchtune_trace_matches_estimate(lora, stored):
    student = dict(TINY_STUDENT)
    if lora:
        student["_component_"] = "torchtune.models.qwen2.lora_qwen2"
        student.update(
            lora_attn_modules=["q_proj", "v_proj"],
            apply_lora_to_mlp=True,
            lora_rank=8,
            lora_alpha=16,
        )
    cfg = {
        "model": student,
        # with a store the teacher_model node only names the teacher: none is built or traced
        "teacher_model": TINY_TEACHER if stored else None,
        "teacher_logits": STORE if stored else None,
        "kd_ratio": 0.5 if stored else 0.0,
        "tokenizer": {"max_seq_len": 128},
        "batch_size": 2,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
        "fused_loss": True,
        "loss_chunk_size": 64,
    }
    _compare_with_trace(_run(OmegaConf.create(cfg)), stored=stored)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("stored", [False, True])
def test_hf_trace_matches_estimate(tiny_dirs, lora, stored):  # noqa: F811
    from kd.config.run import run_config

    over: dict = {"teacher_logits": STORE if stored else None}
    if not stored:
        over.update(teacher_model=None, kd_ratio=0.0)
    if lora:
        over["model"] = dict(LORA, path=str(tiny_dirs["qwen3"]))
    cfg = _hf_cfg(tiny_dirs["qwen3"], tiny_dirs["llama"], **over)
    _compare_with_trace(run_config(cfg), stored=stored)


def _topk_cfg(kind: str, tail: str) -> dict:
    cfg = {
        "model": TINY_STUDENT,
        "kd_ratio": 0.5,
        "tokenizer": {"max_seq_len": 128},
        "batch_size": 2,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
        "loss_chunk_size": 64,
    }
    if kind == "stored":
        cfg.update(teacher_model=TINY_TEACHER, teacher_logits=dict(STORE, tail=tail))
    else:
        server = {"url": "http://127.0.0.1:9", "model": "m", "top_k": K, "tail": tail}
        cfg.update(teacher_model=None, teacher_server=server)
    return cfg


@pytest.mark.parametrize(
    "kind,tail", [("stored", "renorm"), ("served", "bucket"), ("served", "renorm")]
)
def test_stored_and_served_traces_run_their_signal(kind, tail):
    """`kd plan --trace` of a store or a served teacher builds no teacher: the micro-batch holds
    the top-k tensors, answered as the run's file or served teacher answers them (with its
    section's tail), and the estimate is within 3% of that trace."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kd.memory.fake_step import build_fake_step, fake_friendly
    from kd.teachers import FixedTopKTeacher

    run = _run(OmegaConf.create(_topk_cfg(kind, tail)))
    with fake_friendly(run), FakeTensorMode():
        step = build_fake_step(run)
    assert step.teacher is None and isinstance(step.signal_teacher, FixedTopKTeacher)
    assert step.signal_teacher.tail == tail
    assert step.teacher_topk is not None and step.teacher_topk[0].shape[-1] == K
    _compare_with_trace(run, stored=True)


def test_no_teacher_fused_loss_keeps_no_full_logits():
    """The 14B->3B template without its teacher: the chunked CE, not [tokens, vocab] logits."""
    plan = make_plan(inputs_from_run(_template(["teacher_model=null", "kd_ratio=0"])), 80)
    est = plan.estimate
    assert est.teacher_params == 0
    assert est.phases["forward"]["logits_loss"] < 3 * GIB  # was 9.27 GiB with full logits
    assert est.phases["backward"]["logits_loss"] < 1 * GIB  # was 13.94 GiB
    unfused = make_plan(
        inputs_from_run(_template(["teacher_model=null", "kd_ratio=0", "fused_loss=false"])), 80
    )
    assert unfused.estimate.phases["backward"]["logits_loss"] > 10 * GIB
    assert unfused.peak_bytes > plan.peak_bytes + 8 * GIB


def _template(over: list[str]):
    from kd.config.run import run_config

    return run_config(load_config(FULL_14B_3B, over))


def test_stored_logits_plan_drops_the_teacher_and_adds_the_io_buffers():
    online = make_plan(inputs_from_run(_template([])), 80)
    run = _template(["teacher_logits.path=/nonexistent/store", "teacher_logits.k=64"])
    assert not run.has_teacher
    inputs = inputs_from_run(run)
    stored = make_plan(inputs, 80)
    assert inputs.teacher is None and inputs.knobs.stored_topk == 64
    fwd = stored.estimate.phases["forward"]
    assert fwd["teacher_weights"] == fwd["teacher_forward"] == 0
    assert fwd["stored_logits"] == 10 * 64 * 4 * 2048  # int64 ids + float16 log-probs, B x S x k
    assert online.peak_bytes - stored.peak_bytes > 27 * GIB  # the 27.5 GiB teacher and its forward
    assert "stored top-64" in stored.table() and stored.to_json()["stored_topk"] == 64
    # a larger k costs more loss memory per chunk, and more I/O
    big = make_plan(
        inputs_from_run(run.with_section("teacher_logits", replace(run.teacher_logits, k=1024))), 80
    )
    assert big.estimate.phases["forward"]["logits_loss"] > fwd["logits_loss"]
    with pytest.raises(ValueError, match="no teacher"):
        estimate(inputs_from_run(_template([])).student, online.inputs.teacher, inputs.knobs)


def test_compare_says_which_mode_fits_each_budget():
    result = compare(inputs_from_run(_template([])), 64, (40.0, 24.0), device="cuda")
    by = {(v.mode, v.budget_gib): v for v in result.verdicts}
    label = stored_label(64)
    # 40 GiB: the stored mode as configured; the online teacher (27.5 GiB of weights) not
    assert by[(label, 40.0)].fits_as_is and not by[("online teacher", 40.0)].fits_as_is
    # 24 GiB: the stored mode with a knob setting that fits; every option's peak is in budget
    v24 = by[(label, 24.0)]
    assert not v24.fits_as_is and v24.option is not None and not v24.option.suggestion
    assert v24.option.peak_bytes <= 24 * GIB
    online24 = by[("online teacher", 24.0)]
    # the online teacher (27.5 GiB of weights) does not fit 24 GiB: even streamed from host
    # memory, and a quantized teacher is never streamed (an NF4 teacher with teacher_offload was
    # offered, which kd refuses of its int8 teacher)
    assert not online24.fits_as_is and online24.option is None
    table = result.table()
    assert "online teacher" in table and label in table and "budget 24 GiB:" in table


def test_cli_compare_stored_logits(capsys):
    import json

    code, out = _run_cli(["--config", FULL_14B_3B, "--compare-stored-logits", "64"], capsys)
    assert code == 0
    assert "stored top-64" in out and "budget 40 GiB:" in out and "budget 24 GiB:" in out
    assert "teacher_weights" in out and "stored_logits" in out
    code, out = _run_cli(
        ["--config", FULL_14B_3B, "--compare-stored-logits", "32", "--budget-gib", "30", "--json"],
        capsys,
    )
    data = json.loads(out)
    assert code == 0 and data["stored_logits"]["k"] == 32
    assert [b["budget_gib"] for b in data["budgets"]] == [30.0, 30.0]
    assert data["online"]["components"]["teacher_weights"] > 27
    assert data["stored_logits"]["phase_components"]["forward"]["teacher_weights"] == 0


def test_cli_compare_needs_a_teacher_and_a_valid_k(capsys):
    from kd.errors import KDUserError

    with pytest.raises(KDUserError, match="no teacher_model"):
        _run_cli(
            [
                "--config",
                FULL_14B_3B,
                "--compare-stored-logits",
                "64",
                "teacher_model=null",
                "kd_ratio=0",
            ],
            capsys,
        )
    with pytest.raises(SystemExit):
        _run_cli(["--config", FULL_14B_3B, "--compare-stored-logits=0"], capsys)
    with pytest.raises(KDUserError, match="--trace"):
        _run_cli(["--config", FULL_14B_3B, "--compare-stored-logits", "8", "--trace"], capsys)
