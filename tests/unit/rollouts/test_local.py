"""The rollout interface's pieces that need no run: what each sampler costs in the plan (through
``kd plan``'s own path), the local sampler's refusals and its frozen copy."""

from __future__ import annotations

import pytest
import torch

from kd.config import load_config
from kd.errors import KDUserError
from kd.memory import plan_from_config
from kd.memory.estimate import GEN_PHASE
from kd.rollouts.base import Sampler
from kd.rollouts.local import LocalSampler, frozen_copy
from kd.runtime.distributed import WorldInfo
from tests.unit.test_memory import FULL_14B_3B


def components(*overrides: str) -> dict[str, dict[str, float]]:
    plan = plan_from_config(load_config(FULL_14B_3B, list(overrides)), budget_gib=80)
    return plan.to_json()["phase_components"]


def test_plan_counts_what_the_sampler_holds():
    """batch_rollouts samples the step's rows together (a larger KV cache, capped by
    rollout_batch_size); async_steps: 1 adds the frozen copy of the student's weights to every
    phase; a served sampler puts no student rollout on the training device."""
    base = ["on_policy.lmbda=1", "gradient_accumulation_steps=4", "batch_size=2"]
    one = components(*base)
    step = components(*base, "on_policy.batch_rollouts=true")
    capped = components(*base, "on_policy.batch_rollouts=true", "on_policy.rollout_batch_size=4")
    # (GiB, rounded in the JSON)
    assert step[GEN_PHASE]["kv_cache"] == pytest.approx(4 * one[GEN_PHASE]["kv_cache"], rel=0.01)
    assert capped[GEN_PHASE]["kv_cache"] == pytest.approx(2 * one[GEN_PHASE]["kv_cache"], rel=0.01)
    copy = components(*base, "on_policy.async_steps=1")
    for phase, comps in copy.items():
        assert comps["student_weights"] > one[phase]["student_weights"], phase
    served = components(*base, "on_policy.sampler=served")
    assert GEN_PHASE not in served


def test_plan_counts_the_sampling_copy():
    """sampling_dtype: bf16 on an fp32 student adds a bf16 copy of its weights to every phase (half
    of what the fp32 async copy adds) and plans the rollout's KV cache in bf16; on a bf16 student
    it is a no-op, and with async_steps: 1 the one copy is the bf16 one."""
    base = ["on_policy.lmbda=1", "dtype=fp32"]
    fp32 = components(*base)
    bf16 = components(*base, "on_policy.sampling_dtype=bf16")
    frozen = components(*base, "on_policy.async_steps=1")
    both = components(*base, "on_policy.sampling_dtype=bf16", "on_policy.async_steps=1")
    for phase, comps in bf16.items():
        added = comps["student_weights"] - fp32[phase]["student_weights"]
        assert added == pytest.approx(
            (frozen[phase]["student_weights"] - fp32[phase]["student_weights"]) / 2, rel=0.01
        ), phase
        assert both[phase]["student_weights"] == comps["student_weights"], phase
    assert bf16[GEN_PHASE]["kv_cache"] == pytest.approx(fp32[GEN_PHASE]["kv_cache"] / 2, rel=0.01)
    assert components("on_policy.lmbda=1", "dtype=bf16", "on_policy.sampling_dtype=bf16") == (
        components("on_policy.lmbda=1", "dtype=bf16")
    )


def test_sampling_copy_casts_parameters_shares_buffers_and_drops_hooks():
    """The copy's parameters are bf16 casts (tied ones stay tied), its buffers are the model's
    own, the model's forward hooks do not fire on it, and update_copy casts the trainable
    weights in."""
    from kd.rollouts.local import sampling_copy, update_copy

    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight  # tied
    model.register_buffer("table", torch.arange(3.0))
    fired: list[int] = []
    model[1].register_forward_hook(lambda *_: fired.append(1))
    copy = sampling_copy(model, torch.bfloat16)
    assert copy[0].weight is copy[1].weight and copy[0].weight.dtype == torch.bfloat16
    assert torch.equal(copy[0].weight, model[0].weight.detach().to(torch.bfloat16))
    assert copy.table is model.table
    copy(torch.tensor([1, 2]))
    assert fired == []
    with torch.no_grad():
        model[0].weight.add_(1.0)
    update_copy(copy, model)
    assert torch.equal(copy[0].weight, model[0].weight.detach().to(torch.bfloat16))
    assert not any(p.requires_grad for p in copy.parameters())


def sampler(world_size: int = 1, **kw) -> LocalSampler:
    overrides = [f"on_policy.{k}={v}" for k, v in {"lmbda": 1, **kw}.items()]
    run = load_config(FULL_14B_3B, overrides)
    from kd.config.run import run_config

    settings = run_config(run).on_policy
    assert settings is not None

    class Tok:
        pad_id, eos_id, stop_tokens = 0, 2, [2]

    return LocalSampler(
        settings,
        tokenizer=Tok(),
        seed=0,
        vocab_limit=10,
        world=WorldInfo(world_size, 0, 0),
        device=torch.device("cpu"),
    )


def test_local_sampler_is_a_sampler_and_refuses_async_under_torchrun():
    assert isinstance(sampler(), Sampler)
    sampler(async_steps=1).check()
    with pytest.raises(KDUserError, match=r"^on_policy.async_steps: 1 samples from a background"):
        sampler(2, async_steps=1).check()


def test_local_sampler_refuses_cuda_graphs_without_one_cuda_device():
    """cuda_graphs replays the one-device fast decode on CUDA: refused on this CPU and under
    torchrun (whose sharded student does not run that decode)."""
    graphs = {"batch_rollouts": "true", "cuda_graphs": "true"}
    with pytest.raises(KDUserError, match=r"^on_policy.cuda_graphs needs a CUDA device, and"):
        sampler(**graphs).check()
    with pytest.raises(KDUserError, match=r"^on_policy.cuda_graphs replays the one-device"):
        sampler(2, **graphs).check()


@pytest.mark.parametrize("compiled", [False, True])
def test_frozen_copy_keeps_its_own_weights(compiled):
    """The async sampler's copy computes with its weights, not the student's (compiled in place
    as compile: true does, too), and trains nothing."""
    student = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    if compiled:
        for layer in student:
            layer.compile(backend="eager")
    copy = frozen_copy(student)
    x = torch.ones(1, 3)
    before = copy(x).detach().clone()
    with torch.no_grad():
        for p in student.parameters():
            p.add_(1.0)
    assert torch.equal(copy(x), before)
    assert not torch.equal(student(x), before)
    assert not any(p.requires_grad for p in copy.parameters())


def test_plan_counts_the_decode_graphs_pool():
    """cuda_graphs: the generation phase also holds a decode step's temporaries (the graphs'
    pool): more than without, by less than the KV cache of the rows sampled together; the other
    phases are unchanged."""
    base = ["on_policy.lmbda=1", "gradient_accumulation_steps=4", "batch_size=2"]
    base += ["on_policy.batch_rollouts=true"]
    eager = components(*base)
    graphed = components(*base, "on_policy.cuda_graphs=true")
    extra = sum(graphed[GEN_PHASE].values()) - sum(eager[GEN_PHASE].values())
    assert 0 < extra < graphed[GEN_PHASE]["kv_cache"]
    assert graphed[GEN_PHASE]["sampling"] > eager[GEN_PHASE]["sampling"]
    for phase in eager:
        if phase != GEN_PHASE:
            assert graphed[phase] == eager[phase], phase


def test_cuda_graphs_reach_the_fast_decode_through_the_sampler(monkeypatch):
    """on_policy.cuda_graphs: the local sampler hands its capture to the fast decode (stood in
    for on the CPU by the tape replay) and samples the tokens it samples without graphs."""
    from kd.testing_graphs import tape_capture
    from tests.conftest import tiny_hidden_decoder
    from tests.unit.rollouts.test_decode import prompts

    captured: list[int] = []

    def capture(self):  # noqa: ANN001, ANN202
        def counted(fn):  # noqa: ANN001, ANN202
            captured.append(1)
            return tape_capture(fn)

        return counted

    monkeypatch.setattr(LocalSampler, "capture", capture)
    model = tiny_hidden_decoder(vocab=64, dim=32)
    p = prompts(10, [5, 3, 7, 2])
    done = {}
    for graphs in ("false", "true"):
        s = sampler(batch_rollouts="true", cuda_graphs=graphs, temperature=1.0)
        done[graphs] = s.sample(p, rows=[0, 1, 2, 3], epoch=0, step=0, student=model)
    assert captured  # the graphed run captured (the other did not ask)
    assert torch.equal(done["true"].tokens, done["false"].tokens)
    assert torch.equal(done["true"].lengths, done["false"].lengths)


def test_rollout_batch_size_caps_the_rows_sampled_together_under_torchrun(monkeypatch):
    """Under torchrun (the per-rank loop, not the fast decode) batch_rollouts samples the step's
    rows in groups of at most rollout_batch_size, as the plan counts them (it sampled them all at
    once, a KV cache the plan had not counted), each row with its own generator: the tokens of
    one generation."""
    import kd.rollouts.local
    from tests.conftest import tiny_hidden_decoder
    from tests.unit.rollouts.test_decode import prompts

    widths: list[int] = []
    original = kd.rollouts.local.sampling.rollout

    def spy(model, p, **kw):  # noqa: ANN001, ANN202
        widths.append(p.tokens.shape[0])
        return original(model, p, **kw)

    monkeypatch.setattr(kd.rollouts.local.sampling, "rollout", spy)
    model = tiny_hidden_decoder(vocab=64, dim=32)
    p = prompts(10, [5, 3, 7, 2, 6, 4, 1])
    rows = [9, 3, 4, 0, 12, 7, 8]
    done = {}
    for size in ("null", "3"):
        s = sampler(2, batch_rollouts="true", rollout_batch_size=size, temperature=1.0)
        done[size] = s.sample(p, rows=rows, epoch=1, step=1, student=model)
    assert widths == [7, 3, 3, 1]
    assert torch.equal(done["3"].tokens, done["null"].tokens)
    assert torch.equal(done["3"].lengths, done["null"].lengths)


@pytest.mark.parametrize(
    "over",
    [
        {"async_steps": 1},
        {"sampling_dtype": "bf16", "dtype": "fp32"},
        {"batch_rollouts": "true", "cuda_graphs": "true", "device": "cuda"},
    ],
    ids=["async", "sampling-dtype", "cuda-graphs"],
)
def test_plan_over_ranks_refuses_what_the_sampler_refuses_under_torchrun(over, capsys):
    """``kd plan --world-size 2`` planned an on-policy sampler that the run under torchrun
    refuses before any weight is read (a background thread, a bf16 copy, CUDA graphs): it
    refuses it with the sampler's own line; one rank is planned."""
    from kd import cli
    from kd.config.run import run_config
    from kd.rollouts.build import sampler_for

    top = {k: over.pop(k) for k in ("dtype", "device") if k in over}
    over = [f"on_policy.{k}={v}" for k, v in over.items()]
    over += ["on_policy.lmbda=1", *(f"{k}={v}" for k, v in top.items())]
    run = run_config(load_config(FULL_14B_3B, over))

    class Tok:
        pad_id, eos_id, stop_tokens = 0, 2, [2]

    local = sampler_for(
        run,
        tokenizer=Tok(),
        seed=0,
        vocab_limit=10,
        world=WorldInfo(2, 0, 0),
        device=torch.device("cuda"),
        output_dir=None,  # type: ignore[arg-type]
    )
    with pytest.raises(KDUserError) as refused:
        local.check()
    argv = ["plan", "--config", FULL_14B_3B, "--budget-gib", "80", *over]
    assert cli.main([*argv, "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kd: error: {refused.value}"]
    assert cli.main(argv) in (0, 1)  # one rank: planned
    assert "kd: error" not in capsys.readouterr().err


def test_plan_over_ranks_refuses_a_served_samplers_async_steps(capsys):
    """The served sampler's refusal of async_steps: 1 under torchrun (its probe) is kd plan
    --world-size 2's too."""
    from kd import cli

    over = [
        "on_policy.lmbda=1",
        "on_policy.sampler=served",
        "on_policy.server_url=http://127.0.0.1:9",
        "on_policy.server_model=m",
        "on_policy.async_steps=1",
    ]
    argv = ["plan", "--config", FULL_14B_3B, "--budget-gib", "80", *over]
    assert cli.main([*argv, "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "kd: error: on_policy.async_steps: 1 asks the server from a background thread"
    )
    assert cli.main(argv) in (0, 1)
