"""Memory planner: the generation phase (``on_policy``: a model samples completions with a KV
cache at the start of a step) against the traced ``kd.rollouts.sampling.rollout``, its place in the plan,
the refusal before loading when only it does not fit, and the fit search."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from kd.config import load_config
from kd.config.on_policy_settings import OnPolicySettings
from kd.errors import KDUserError
from kd.memory import estimate
from kd.memory.estimate import GEN_PHASE, GIB, PHASES
from tests.unit.memory.test_hf_terms import LORA, _hf_cfg, tiny_dirs  # noqa: F401 (fixture)
from tests.unit.test_memory import FULL_14B_3B, TINY_STUDENT, TINY_TEACHER, _run

TT_LORA = {
    "_component_": "torchtune.models.qwen2.lora_qwen2",
    "lora_attn_modules": ["q_proj", "v_proj"],
    "apply_lora_to_mlp": True,
    "lora_rank": 8,
    "lora_alpha": 16,
}


def _compare(run) -> dict[str, int]:
    """The generation phase within 0.2% of the trace, for the plan's larger sampler and for each
    sampling model alone (the trace's per-model peaks); the training phases within 3%.

    Returns:
        Component -> bytes of the estimated generation phase.
    """
    from kd.memory.plan import inputs_from_run
    from kd.memory.trace import trace_run

    traced = trace_run(run)
    inputs = inputs_from_run(run)
    knobs = replace(inputs.knobs, select_labelled=False)
    g = knobs.generation
    assert g is not None
    est = estimate(inputs.student, inputs.teacher, knobs)
    assert est.phase_names == (GEN_PHASE, *PHASES)
    assert est.allocated(GEN_PHASE) == pytest.approx(traced.phase_peaks[GEN_PHASE], rel=0.002)
    for model in g.models:
        alone = replace(knobs, generation=replace(g, models=(model,)))
        assert estimate(inputs.student, inputs.teacher, alone).allocated(
            GEN_PHASE
        ) == pytest.approx(traced.subphases[f"{model}_generation"], rel=0.002), model
    for phase in PHASES:
        assert est.allocated(phase) == pytest.approx(traced.phase_peaks[phase], rel=0.03), phase
    assert est.phases[GEN_PHASE]["gradients"] == 0 and est.phases[GEN_PHASE]["kv_cache"] > 0
    return est.phases[GEN_PHASE]


def _tt_cfg(student: dict, on_policy: dict, **top) -> OmegaConf:
    return OmegaConf.create(
        {
            "model": student,
            "teacher_model": TINY_TEACHER,
            "kd_ratio": 0.5,
            "tokenizer": {"max_seq_len": 96},
            "batch_size": 2,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
            "loss_chunk_size": 64,
            "on_policy": on_policy,
            **top,
        }
    )


@pytest.mark.parametrize(
    "lora,lmbda,seq_kd",
    [(False, 0.5, False), (True, 0.5, True), (False, 0.0, True)],
    ids=["student", "lora-student-and-teacher", "teacher"],
)
def test_torchtune_generation_trace_matches_estimate(lora, lmbda, seq_kd):
    student = dict(TINY_STUDENT, **TT_LORA) if lora else TINY_STUDENT
    on_policy = {"lmbda": lmbda, "seq_kd": seq_kd, "max_new_tokens": 16, "top_p": 0.9}
    comps = _compare(_run(_tt_cfg(student, on_policy)))
    assert comps["activations"] > comps["sampling"]  # the prefill's MLP is the peak here


@pytest.mark.parametrize(
    "on_policy,peak",
    [
        # a large vocabulary: the top-p sampler's [b, V] buffers
        ({"max_new_tokens": 24, "top_p": 0.9}, "sampling"),
        # greedy: the next logits computed while the last ones are referenced
        ({"max_new_tokens": 24, "temperature": 0.0}, "sampling"),
        # a one-token prompt: the first decoding step (k and v of the whole cache per head)
        ({"max_new_tokens": 31, "temperature": 0.0}, "activations"),
    ],
    ids=["top-p", "greedy", "decoding"],
)
def test_torchtune_sampling_and_decoding_peaks(on_policy, peak):
    big_vocab = dict(TINY_STUDENT, vocab_size=16384)
    teacher = dict(TINY_TEACHER, vocab_size=16384)
    student = big_vocab if peak == "sampling" else dict(TINY_STUDENT, num_heads=8, embed_dim=256)
    cfg = _tt_cfg(student, on_policy, batch_size=4, tokenizer={"max_seq_len": 32})
    if peak == "sampling":
        cfg.teacher_model = teacher
    comps = _compare(_run(cfg))
    other = "activations" if peak == "sampling" else "sampling"
    assert comps[peak] > comps[other]


@pytest.mark.parametrize(
    "arch,lora,on_policy",
    [
        ("qwen3", False, {"max_new_tokens": 8}),
        ("qwen3", True, {"max_new_tokens": 8, "seq_kd": True, "top_p": 0.9}),
        ("llama", False, {"max_new_tokens": 8, "lmbda": 0.0, "seq_kd": True}),
        # Gemma 3's sliding layers keep their window (16) of the 48 positions
        ("gemma3", False, {"max_new_tokens": 24, "temperature": 0.0}),
        # a two-token prompt: the last decoding step, the caches at their longest
        ("qwen3", False, {"max_new_tokens": 22}),
    ],
    ids=["student", "lora-student-and-teacher", "teacher", "gemma3-sliding", "decoding"],
)
def test_hf_generation_trace_matches_estimate(tiny_dirs, arch, lora, on_policy):  # noqa: F811
    from kd.config.run import run_config

    over: dict = {"on_policy": on_policy}
    if on_policy["max_new_tokens"] == 22:
        over["tokenizer"] = {"max_seq_len": 24}
    if lora:
        over["model"] = dict(LORA, path=str(tiny_dirs[arch]))
    _compare(run_config(_hf_cfg(tiny_dirs[arch], tiny_dirs["llama"], **over)))


def test_fsdp_trace_has_the_generation_per_rank():
    """`kd plan --world-size 2 --trace` traces rank 0's rollouts over a fake process group; the
    per-rank closed form (not calibrated, like the other FSDP2 terms) stays within 10%."""
    from kd.memory.plan import inputs_from_run
    from kd.memory.trace import trace_run

    on_policy = {"max_new_tokens": 8, "seq_kd": True}
    run = _run(_tt_cfg(TINY_STUDENT, on_policy))
    traced = trace_run(run, world_size=2)
    assert {"student_generation", "teacher_generation"} <= set(traced.subphases)
    inputs = inputs_from_run(run, world_size=2)
    est = estimate(inputs.student, inputs.teacher, replace(inputs.knobs, select_labelled=False))
    assert est.allocated(GEN_PHASE) == pytest.approx(traced.phase_peaks[GEN_PHASE], rel=0.1)


def test_served_teacher_generation_trace_matches_estimate():
    """A served teacher with on-policy sampling: the student samples before any micro-step asks
    the server, so no top-k tensors are on the device during the rollout (trace and estimate)."""
    server = {"url": "http://127.0.0.1:9", "model": "m", "top_k": 16}
    on_policy = {"lmbda": 0.5, "max_new_tokens": 16, "top_p": 0.9}
    cfg = _tt_cfg(TINY_STUDENT, on_policy, teacher_server=server)
    cfg.teacher_model = None
    _compare(_run(cfg))


def _compare_fsdp(run, world: int, *, alone: bool) -> None:
    """The per-rank generation phase within 3% of rank 0's trace over a fake process group of
    ``world`` ranks (``kd plan --world-size N --trace``), and (``alone``) each sampling model's."""
    from kd.memory.plan import inputs_from_run
    from kd.memory.trace import trace_run

    traced = trace_run(run, world_size=world)
    inputs = inputs_from_run(run, world_size=world)
    knobs = replace(inputs.knobs, select_labelled=False)
    g = knobs.generation
    assert g is not None
    est = estimate(inputs.student, inputs.teacher, knobs)
    assert est.allocated(GEN_PHASE) == pytest.approx(traced.phase_peaks[GEN_PHASE], rel=0.03)
    assert est.phases[GEN_PHASE]["fsdp_in_flight"] > 0
    for model in g.models if alone else ():
        one = replace(knobs, generation=replace(g, models=(model,)))
        assert estimate(inputs.student, inputs.teacher, one).allocated(GEN_PHASE) == pytest.approx(
            traced.subphases[f"{model}_generation"], rel=0.03
        ), model


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_torchtune_generation_trace_matches_estimate(world):
    """FSDP2 per rank, torchtune: a LoRA student (tied: its embedding in the root unit) and an
    untied teacher (its embedding a unit of its own) both sample; the prefill's first layer is
    gathered while the root's all-gather output is still referenced, a later layer while the
    last one's is."""
    student = dict(TINY_STUDENT, **TT_LORA)
    on_policy = {"lmbda": 0.5, "seq_kd": True, "max_new_tokens": 16, "top_p": 0.9}
    _compare_fsdp(_run(_tt_cfg(student, on_policy)), world, alone=True)


def test_fsdp_teacher_samples_beside_the_students_gathered_root():
    """With several micro-batches an earlier one may have been the student's: its root stays
    gathered while the teacher samples (the trace's student samples first)."""
    on_policy = {"lmbda": 0.5, "seq_kd": True, "max_new_tokens": 16}
    run = _run(_tt_cfg(TINY_STUDENT, on_policy, gradient_accumulation_steps=2))
    _compare_fsdp(run, 2, alone=False)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_hf_generation_trace_matches_estimate(tiny_dirs, world):  # noqa: F811
    """FSDP2 per rank, transformers: a LoRA Qwen3 student and a Llama teacher both sample."""
    from kd.config.run import run_config

    over = {
        "on_policy": {"max_new_tokens": 8, "seq_kd": True, "top_p": 0.9},
        "model": dict(LORA, path=str(tiny_dirs["qwen3"])),
    }
    _compare_fsdp(
        run_config(_hf_cfg(tiny_dirs["qwen3"], tiny_dirs["llama"], **over)), world, alone=True
    )


SEQ_KD_ONLY = {"lmbda": 0.0, "seq_kd": True, "max_new_tokens": 16, "top_p": 0.9}


def test_seq_kd_with_kd_ratio_0_trace_matches_estimate():
    """seq-KD with kd_ratio 0: the teacher samples, then runs no forward on the training batch
    (the trace runs the recipe's step, which asks it nothing); the plan counts the same."""
    comps = _compare(_run(_tt_cfg(TINY_STUDENT, SEQ_KD_ONLY, kd_ratio=0.0)))
    assert comps["teacher_weights"] > 0 and comps["kv_cache"] > 0


def test_seq_kd_with_kd_ratio_0_plans_no_teacher_forward():
    """kd_ratio 0 takes the teacher's forward and the KD head out of the training and validation
    phases: what is left is plain fine-tuning's plan plus the teacher's resident weights, and the
    same generation phase (the teacher still samples); kd_ratio 0.5 plans both."""
    from kd.memory.plan import inputs_from_run

    def plan(on_policy=SEQ_KD_ONLY, **top):
        inputs = inputs_from_run(_run(_tt_cfg(TINY_STUDENT, on_policy, **top)))
        return estimate(inputs.student, inputs.teacher, inputs.knobs)

    val = {"validation": {"dataset": {"_component_": "x"}, "batch_size": 2}}
    kd, ce = plan(kd_ratio=0.5, **val), plan(kd_ratio=0.0, **val)
    plain = plan(None, kd_ratio=0.0, teacher_model=None, **val)

    def tensors(est, phase, drop=()):  # the phase's tensors (the runtime reserve follows the peak)
        skip = {"allocator_slack", "cuda_runtime", *drop}
        return {c: b for c, b in est.phases[phase].items() if c not in skip}

    assert tensors(ce, GEN_PHASE) == tensors(kd, GEN_PHASE)
    for phase in (*PHASES, "evaluation"):
        assert ce.allocated(phase) <= kd.allocated(phase), phase
        assert ce.phases[phase]["teacher_forward"] == 0, phase
        # the teacher is loaded (it samples): its weights and buffers (RoPE caches) stay
        for resident in ("teacher_weights", "buffers"):
            assert ce.phases[phase][resident] == kd.phases[phase][resident] > 0
        drop = ("teacher_weights", "buffers")
        assert tensors(ce, phase, drop) == tensors(plain, phase, drop), phase
    for phase in ("forward", "evaluation"):  # where the teacher's forward and logits were
        assert kd.phases[phase]["teacher_forward"] > 0, phase
        assert ce.allocated(phase) < kd.allocated(phase), phase
    # the forward's loss head: the student's CE chunks, not both models' logits
    assert ce.phases["forward"]["logits_loss"] < kd.phases["forward"]["logits_loss"]


def test_who_samples():
    from kd.memory.plan import generation_knobs

    def models(**kw) -> tuple[str, ...] | None:
        g = generation_knobs(OnPolicySettings(**kw), teacher=True)
        return None if g is None else g.models

    assert models(lmbda=0.5) == ("student",)
    assert models(lmbda=0.5, seq_kd=True) == ("student", "teacher")
    assert models(lmbda=1.0, seq_kd=True) == ("student",)  # the coin always comes out true
    assert models(lmbda=0.0, seq_kd=True) == ("teacher",)
    assert models(lmbda=0.0) is None
    assert generation_knobs(None, teacher=True) is None


def test_generation_in_table_and_json():
    from kd.memory import plan_from_config

    plain = plan_from_config(load_config(FULL_14B_3B, []), budget_gib=80)
    assert GEN_PHASE not in plain.estimate.phase_names and "generation" not in plain.table()
    over = ["on_policy.max_new_tokens=256", "on_policy.seq_kd=true"]
    plan = plan_from_config(load_config(FULL_14B_3B, over), budget_gib=80)
    data = plan.to_json()
    assert data["generation"] == {
        "models": ["student", "teacher"],
        "max_new_tokens": 256,
        "prompt_len": plan.inputs.knobs.seq_len - 256,
    }
    assert data["phases"][GEN_PHASE] > 0 and data["phase_components"][GEN_PHASE]["kv_cache"] > 0
    table = plan.table()
    assert "generation: student and teacher sample up to 256 tokens" in table
    header = next(line.split() for line in table.splitlines() if line.startswith("  component"))
    assert header[1] == "generation"  # the first phase column
    assert any(line.split()[0] == "kv_cache" for line in table.splitlines() if line.strip())


# A deep teacher without grouped-query attention: its KV cache outgrows the training step.
DEEP_TEACHER = dict(TINY_TEACHER, num_layers=8, num_kv_heads=4, max_seq_len=512)


def _deep_overrides(*extra: str) -> list[str]:
    def node(d: dict) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"

    return [
        f"model={node(dict(TINY_STUDENT, max_seq_len=512))}",
        f"teacher_model={node(DEEP_TEACHER)}",
        "tokenizer.max_seq_len=512",
        "batch_size=16",
        "enable_activation_checkpointing=true",
        "memory.reserve_gib=0",
        "on_policy.max_new_tokens=64",
        "on_policy.seq_kd=true",
        *extra,
    ]


BUDGET_GIB = 0.08


def test_generation_over_budget_is_refused_before_loading(capsys):
    """A plan whose training step fits but whose teacher sampling does not: the recipe's check
    (kd run, kd validate) refuses it naming the generation phase; `kd plan` says it does not fit;
    every offered knob setting fits when planned again, and so does sampling with the student
    alone."""
    from kd.cli import plan as plan_cli
    from kd.config.run import run_config
    from kd.memory import check_memory, plan_from_config

    over = _deep_overrides()
    plan = plan_from_config(load_config(FULL_14B_3B, over), budget_gib=BUDGET_GIB)
    assert plan.phase == GEN_PHASE and not plan.fits
    assert all(plan.estimate.total(p) <= BUDGET_GIB * GIB for p in PHASES)
    with pytest.raises(KDUserError) as e:
        check_memory(
            run_config(load_config(FULL_14B_3B, over)), world_size=1, budget_gib=BUDGET_GIB
        )
    first = str(e.value).splitlines()[0]
    assert first.startswith("memory: the plan needs") and "in generation" in first
    assert "nothing was loaded" in first and "kv_cache" in str(e.value)
    knobs = [line.split("#")[0].split() for line in str(e.value).splitlines() if "# " in line]
    assert knobs and any("batch_size=8" in k for k in knobs)
    assert any(k == ["on_policy.seq_kd=false"] for k in knobs)
    for extra in knobs:
        again = plan_from_config(load_config(FULL_14B_3B, [*over, *extra]), budget_gib=BUDGET_GIB)
        assert again.fits, extra
    # kd plan: the table and the verdict, exit status 1
    parser = argparse.ArgumentParser()
    plan_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--config", FULL_14B_3B, *over, "--budget-gib", "0.08"])
    assert plan_cli.run(args) == 1
    out = capsys.readouterr().out
    assert "in generation" in out and "DOES NOT FIT" in out


def test_validate_plans_the_generation(assets, tmp_path, capsys):
    """`kd validate` (kd run's pre-load phase) plans the generation of an on-policy config."""
    from kd.cli import main
    from tests.conftest import make_config, write_config

    cfg = make_config(assets, tmp_path / "out", on_policy={"max_new_tokens": 16})
    path = str(write_config(tmp_path / "c.yaml", cfg))
    assert main(["validate", "--config", path]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "generation: student samples up to 16 tokens" in out and "kv_cache" in out
    assert main(["validate", "--config", path, "--budget-gib", "0.000001"]) == 2
    assert capsys.readouterr().err.startswith("kd: error: memory:")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "backend,lora,extra",
    [
        ("torchtune", False, {"sampling_dtype": "bf16"}),
        ("torchtune", True, {"sampling_dtype": "bf16", "async_steps": 1}),
        ("torchtune", False, {"async_steps": 1}),
        ("transformers", False, {"sampling_dtype": "bf16"}),
        ("transformers", True, {"sampling_dtype": "bf16"}),
    ],
    ids=["tt-bf16", "tt-lora-bf16-async", "tt-async", "hf-bf16", "hf-lora-bf16"],
)
def test_sampling_copy_trace_matches_estimate(tiny_dirs, backend, lora, extra):  # noqa: F811
    """An fp32 student sampling through the local sampler's copy (``on_policy.sampling_dtype:
    bf16``: the copy's parameters at 2 bytes, its KV cache, activations and logits in bf16; the
    frozen copy of ``async_steps: 1`` at 4 bytes): the trace makes the copy as the run does,
    before the first step, and samples with it. The generation phase is within 0.2% of the
    trace, and in every phase the plan adds what the trace adds over the same run without the
    copy (within 0.2% of the phase)."""
    from kd.config.run import run_config
    from kd.memory.plan import inputs_from_run
    from kd.memory.trace import trace_run

    on_policy = {"max_new_tokens": 16, "top_p": 0.9}
    if backend == "torchtune":
        student = dict(TINY_STUDENT, **TT_LORA) if lora else TINY_STUDENT
        runs = [_run(_tt_cfg(student, {**on_policy, **e}, dtype="fp32")) for e in (extra, {})]
    else:
        over: dict = {"dtype": "fp32"}
        if lora:
            over["model"] = dict(LORA, path=str(tiny_dirs["qwen3"]))
        runs = [
            run_config(
                _hf_cfg(
                    tiny_dirs["qwen3"], tiny_dirs["llama"], on_policy={**on_policy, **e}, **over
                )
            )
            for e in (extra, {})
        ]
    planned, traced = [], []
    for run in runs:
        inputs = inputs_from_run(run)
        knobs = replace(inputs.knobs, select_labelled=False)
        planned.append(estimate(inputs.student, inputs.teacher, knobs))
        traced.append(trace_run(run).phase_peaks)
    g = inputs_from_run(runs[0]).knobs.generation
    assert g is not None and g.student_copy
    assert g.copy_dtype_bytes == (2 if "sampling_dtype" in extra else None)
    (est, plain), (trace, base) = planned, traced
    assert est.allocated(GEN_PHASE) == pytest.approx(trace[GEN_PHASE], rel=0.002)
    for phase in (GEN_PHASE, *PHASES):
        added = est.allocated(phase) - plain.allocated(phase)
        assert added > 0, phase
        assert added == pytest.approx(trace[phase] - base[phase], abs=0.002 * trace[phase]), phase
    if "sampling_dtype" in extra:  # the copy's keys and values in bf16 (int64 positions beside)
        kv = est.phases[GEN_PHASE]["kv_cache"], plain.phases[GEN_PHASE]["kv_cache"]
        assert kv[0] < 0.55 * kv[1]


@pytest.mark.parametrize(
    ("over", "said"),
    [
        (["on_policy.async_steps=1"], True),
        (["on_policy.async_steps=0"], False),
        (["on_policy.async_steps=1", "on_policy.lmbda=0"], False),  # nothing is sampled
    ],
)
def test_the_plan_says_an_async_rollout_is_not_beside_the_training_phases(over, said):
    """async_steps: 1 samples the next step during this one; the plan counts the frozen copy in
    every phase but not that rollout's cache and temporaries, and says so."""
    from kd.memory.plan import inputs_from_run

    base = ["on_policy.lmbda=1", "on_policy.batch_rollouts=true", "device=cuda"]
    run = _run(load_config(FULL_14B_3B, [*base, *over]))
    notes = inputs_from_run(run, world_size=1, config_name="c").notes
    assert any(
        n.startswith("on_policy.async_steps: 1: the next step's rollout") for n in notes
    ) == (said)
