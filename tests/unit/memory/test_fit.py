"""``kd plan --fit`` (and the over-budget error): only settings the recipe accepts for the device and
the world size, each planned again from its overrides and fitting the budget and the data."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from kd.cli import plan as plan_cli
from kd.config import load_config
from kd.config.run import run_config
from kd.errors import KDUserError
from kd.memory import check_memory, plan_from_config
from kd.memory.estimate import GIB
from kd.memory.fit import INT8_BYTES_PER_PARAM, MIN_SAVING_BYTES, UNKNOWN_DATA_EXAMPLES
from kd.memory.plan import MemoryPlan, attach_fit
from kd.testing import write_jsonl

FULL_14B_3B = "qwen2_5/14B_to_3B_full_single_device"
FULL_14B_3B_TEACHER = "torchtune.models.qwen2_5.qwen2_5_14b_instruct"
DISTRIBUTED_8B = "llama3_1/8B_to_8B_full_distributed"


def _fit(config: str, over: list[str], *, world_size: int, budget: float) -> MemoryPlan:
    cfg = load_config(config, over)
    plan = plan_from_config(cfg, world_size=world_size, budget_gib=budget)
    assert not plan.fits
    attach_fit(plan, run_config(cfg))
    return plan


def _replans(config: str, over: list[str], plan: MemoryPlan, *, world_size: int) -> None:
    """Every option with overrides, applied to the config, is planned again at the same peak and
    fits (quantized-teacher suggestions have no config key: their settings alone must not fit)."""
    for opt in plan.fit:
        if opt.extra.get("teacher_quantization"):
            if opt.overrides:
                again = plan_from_config(
                    load_config(config, [*over, *opt.overrides]),
                    world_size=world_size,
                    budget_gib=plan.budget_gib,
                )
                assert not again.fits, opt.overrides
            continue
        again = plan_from_config(
            load_config(config, [*over, *opt.overrides]),
            world_size=world_size,
            budget_gib=plan.budget_gib,
        )
        assert again.fits, opt.overrides
        assert again.peak_bytes == opt.peak_bytes, opt.overrides


def test_two_ranks_offer_fsdp_offload_never_optimizer_in_cpu():
    """The recipe refuses optimizer_in_cpu with several ranks; fsdp.cpu_offload is what fits."""
    plan = _fit(DISTRIBUTED_8B, ["device=cuda"], world_size=2, budget=30)
    overrides = [o for opt in plan.fit for o in opt.overrides]
    assert "optimizer_in_cpu=true" not in overrides
    knobs = [opt for opt in plan.fit if not opt.suggestion]
    assert knobs and all("fsdp.cpu_offload=true" in opt.overrides for opt in knobs)
    _replans(DISTRIBUTED_8B, ["device=cuda"], plan, world_size=2)


def test_one_device_offers_the_offload_its_device_accepts():
    """One CUDA device: optimizer_in_cpu, never fsdp.cpu_offload; on the CPU no offload at all."""
    cuda = _fit(FULL_14B_3B, ["device=cuda"], world_size=1, budget=50)
    overrides = [o for opt in cuda.fit for o in opt.overrides]
    assert "optimizer_in_cpu=true" in overrides
    assert "fsdp.cpu_offload=true" not in overrides
    _replans(FULL_14B_3B, ["device=cuda"], cuda, world_size=1)
    cpu = _fit(FULL_14B_3B, ["device=cpu"], world_size=1, budget=45)
    overrides = [o for opt in cpu.fit for o in opt.overrides]
    assert not {"optimizer_in_cpu=true", "fsdp.cpu_offload=true"} & set(overrides)


def _local_data(tmp_path: Path, rows: int) -> list[str]:
    data = write_jsonl(
        tmp_path / "data.jsonl",
        ({"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(rows)),
    )
    return [
        "dataset._component_=torchtune.datasets.instruct_dataset",
        "dataset.source=json",
        f"dataset.data_files={data}",
        "dataset.split=train",
    ]


def test_options_fit_a_small_dataset(tmp_path):
    """A 64-example dataset: no micro-batch x accumulation beyond 64 examples per rank (the recipe
    needs one optimizer step per rank), whatever batch_size the config asked for."""
    over = [*_local_data(tmp_path, 64), "batch_size=100000", "device=cuda"]
    plan = _fit(FULL_14B_3B, over, world_size=1, budget=80)
    knobs = [opt for opt in plan.fit if opt.overrides]
    assert knobs
    for opt in knobs:
        values = dict(o.split("=", 1) for o in opt.overrides if "=" in o and "~" not in o)
        batch = int(values.get("batch_size", 100000))
        accumulation = int(values.get("gradient_accumulation_steps", 1))
        assert batch * accumulation <= 64, opt.overrides
    _replans(FULL_14B_3B, over, plan, world_size=1)
    two = _fit(FULL_14B_3B, over, world_size=2, budget=80)
    for opt in (o for o in two.fit if not o.suggestion):
        values = dict(o.split("=", 1) for o in opt.overrides if "=" in o and "~" not in o)
        assert int(values["batch_size"]) * int(values["gradient_accumulation_steps"]) <= 32


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    plan_cli.add_parser(sub)
    code = plan_cli.run(parser.parse_args(["plan", *argv]))
    return code, capsys.readouterr().out


def test_cli_fit_bounds_batch_by_the_data(tmp_path, capsys):
    """kd plan --fit prints no batch_size the dataset cannot fill; with a dataset whose size is
    unknown at plan time it bounds the options and says so."""
    data = _local_data(tmp_path, 64)
    code, out = _run_cli(
        ["--config", FULL_14B_3B, *data, "batch_size=100000", "--budget-gib", "80", "--fit"],
        capsys,
    )
    assert code == 1
    printed = [int(b) for b in re.findall(r"\bbatch_size=(\d+)", out)]
    assert printed and max(printed) <= 64
    assert "not known" not in out
    code, out = _run_cli(
        ["--config", FULL_14B_3B, "batch_size=100000", "--budget-gib", "80", "--fit"], capsys
    )
    assert code == 1 and f"at most {UNKNOWN_DATA_EXAMPLES} examples per rank" in out
    assert max(int(b) for b in re.findall(r"\bbatch_size=(\d+)", out)) <= UNKNOWN_DATA_EXAMPLES


def test_lora_suggestion_is_planned_again_and_fits():
    """The LoRA student is suggested with the knobs that make it fit, never over the budget."""
    plan = _fit(FULL_14B_3B, ["device=cuda"], world_size=1, budget=44)
    lora = [o for o in plan.fit if o.suggestion and "LoRA" in o.description]
    assert lora and lora[0].peak_bytes <= 44 * GIB
    assert "loss_chunk_size=512" in lora[0].overrides  # the current knobs alone do not fit
    _replans(FULL_14B_3B, ["device=cuda"], plan, world_size=1)
    # at 36 GiB (the teacher alone is 27.5, and a parked one leaves 0.3 of it in the allocator's
    # cache, kd.memory.runtime) only settings with the teacher streamed from host memory fit,
    # LoRA or not (beside a quantized teacher's suggestion); at 8 GiB nothing does, and nothing
    # is suggested
    streamed = _fit(FULL_14B_3B, ["device=cuda"], world_size=1, budget=36)
    knobs = [o for o in streamed.fit if not o.extra.get("teacher_quantization")]
    assert knobs and all("teacher_offload=stream" in o.overrides for o in knobs)
    nothing = _fit(FULL_14B_3B, ["device=cuda"], world_size=1, budget=8)
    assert nothing.fit == []


def test_hf_lora_suggestion_uses_the_transformers_builder(tmp_path):
    """For a transformers student the LoRA suggestion names kd.hf.lora_causal_lm and plans again
    to the same peak from the folder's config.json."""
    from kd.memory.hf_accuracy import write_config_folder

    student = write_config_folder(tmp_path, "Qwen3-1.7B")
    teacher = write_config_folder(tmp_path, "Qwen3-8B")
    over = [
        "model=null",
        "teacher_model=null",
        "model._component_=kd.hf.causal_lm",
        f"model.path={student}",
        "teacher_model._component_=kd.hf.causal_lm",
        f"teacher_model.path={teacher}",
        "device=cuda",
    ]
    plan = _fit(FULL_14B_3B, over, world_size=1, budget=34)
    lora = [o for o in plan.fit if o.suggestion and "LoRA" in o.description]
    assert lora and "model._component_=kd.hf.lora_causal_lm" in lora[0].overrides
    _replans(FULL_14B_3B, over, plan, world_size=1)


def test_quantized_teacher_is_suggested_only_when_it_saves_and_fits():
    """Never 'would save 0.0 GiB': a suggested teacher quantization saves at least 0.1 GiB and
    makes a setting fit that does not fit without it."""
    from kd.memory.fit import suggestions

    plan = _fit(FULL_14B_3B, ["device=cuda"], world_size=1, budget=40)
    quantized = [o for o in plan.fit if o.extra.get("teacher_quantization")]
    assert quantized
    for opt in quantized:
        saved = float(re.search(r"save (\d+\.\d) GiB", opt.description).group(1))
        assert saved >= 0.1 and opt.peak_bytes <= 40 * GIB
    _replans(FULL_14B_3B, ["device=cuda"], plan, world_size=1)
    # a tiny teacher saves nothing worth saying
    inp = plan.inputs
    tiny_teacher = replace(inp.teacher, vocab_size=64, num_layers=1, embed_dim=64)
    saving = INT8_BYTES_PER_PARAM * tiny_teacher.total_params()
    assert saving < MIN_SAVING_BYTES
    out = suggestions(inp.student, tiny_teacher, inp.knobs, budget_bytes=40 * GIB)
    assert not any(o.extra.get("teacher_quantization") for o in out)


def test_over_budget_error_lists_only_fitting_settings(tmp_path):
    """The recipe's check (memory.check: error) carries the same fit search, with the data bound."""
    over = [*_local_data(tmp_path, 64), "batch_size=100000", "device=cuda"]
    run = run_config(load_config(FULL_14B_3B, over))
    with pytest.raises(KDUserError) as e:
        check_memory(run, world_size=2, budget_gib=80)
    text = str(e.value)
    assert "optimizer_in_cpu=true" not in text
    printed = [int(b) for b in re.findall(r"\bbatch_size=(\d+)", text)]
    assert printed and max(printed) <= 32


def test_dataset_examples_counts_local_files_only(tmp_path):
    """Rows of local json / jsonl / csv / text files; None for what only the loader can tell."""
    import json

    from kd.memory.data_size import dataset_examples

    (tmp_path / "a.json").write_text(json.dumps([{"text": str(i)} for i in range(7)]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": i}) + "\n\n" for i in range(5)))
    (tmp_path / "c.csv").write_text('text\n"a\nb"\nc\nd\n')
    (tmp_path / "d.txt").write_text("x\ny\nz\n")
    node = {"_component_": "torchtune.datasets.text_completion_dataset", "split": "train"}
    assert dataset_examples({**node, "source": "json", "data_files": str(tmp_path / "a.json")}) == 7
    assert (
        dataset_examples({**node, "source": "json", "data_files": str(tmp_path / "b.jsonl")}) == 5
    )
    assert dataset_examples({**node, "source": "csv", "data_files": str(tmp_path / "c.csv")}) == 3
    assert dataset_examples({**node, "source": "text", "data_files": str(tmp_path / "d.txt")}) == 3
    both = [
        {**node, "source": "json", "data_files": str(tmp_path / "*.json*")},
        {**node, "source": "text", "data_files": [str(tmp_path / "d.txt")]},
    ]
    assert dataset_examples(both) == 7 + 5 + 3
    local = {**node, "source": "json", "data_files": str(tmp_path / "a.json")}
    for unknown in (
        {**local, "split": "train[:10%]"},
        {**local, "packed": True},
        {**local, "data_files": str(tmp_path / "missing.json")},
        {**node, "source": "tatsu-lab/alpaca"},
        [local, {**node, "source": "tatsu-lab/alpaca"}],
    ):
        assert dataset_examples(unknown) is None, unknown


def _fit_json(argv: list[str], *flags: str, capsys) -> list[dict]:
    from kd import cli

    assert cli.main([*argv, "--fit", "--json", *flags]) == 1
    return json.loads(capsys.readouterr().out).get("fit", [])


def _accepted(argv: list[str], options: list[dict], capsys) -> None:
    """Every option, applied as printed (an int8 suggestion with its teacher_quantization=int8),
    passes the config's checks: exit 0 or 1 (fits or not), never 2 (refused)."""
    from kd import cli

    for opt in options:
        int8 = "teacher_quantization=int8" in opt["description"]
        extra = ["teacher_quantization=int8"] if int8 else []
        code = cli.main([*argv, *extra, *opt["overrides"], "--json"])
        assert code in (0, 1), (opt, capsys.readouterr().err)
        capsys.readouterr()


@pytest.mark.parametrize(
    "over", [["compile=true"], ["device=cuda:0", "teacher_device=cuda:0"]], ids=["compile", "dev"]
)
def test_fit_never_parks_a_teacher_the_config_refuses_to_park(over, capsys):
    """compile, or teacher_device (even the student's own): teacher_offload is refused, so no
    option offers it (--fit offered optimizer_in_cpu=true teacher_offload=stream, then refused)."""
    argv = ["plan", "--config", FULL_14B_3B, "--budget-gib", "40", *over]
    options = _fit_json(argv, capsys=capsys)
    assert not any(o.startswith("teacher_offload=") for opt in options for o in opt["overrides"])
    _accepted(argv, options, capsys)


@pytest.mark.parametrize("over", [[], ["teacher_offload=park"]], ids=["resident", "parked"])
def test_int8_teacher_suggestion_is_never_parked(over, capsys):
    """An int8 teacher is not parked (check_teacher_offload): its suggestion keeps the teacher
    resident (and unparks one the config parks); applied with teacher_quantization=int8 it is
    accepted (it said teacher_offload=stream, which the run refused)."""
    argv = ["plan", "--config", FULL_14B_3B, "--budget-gib", "36", *over]
    options = _fit_json(argv, "--consider-teacher-quantization", capsys=capsys)
    int8 = [o for o in options if "teacher_quantization=int8" in o["description"]]
    assert int8
    for opt in int8:
        assert not {"teacher_offload=park", "teacher_offload=stream"} & set(opt["overrides"])
        assert ("teacher_offload=none" in opt["overrides"]) == bool(over)
    _accepted(argv, options, capsys)


def test_fit_states_what_several_parked_teachers_move(tmp_path, capsys):
    """teachers: with two local members, an option that parks them states the bytes and seconds
    the plan of that option moves (every member, brought in in turn), not the largest's alone
    (it said 208.5 GiB, the 14B member's, where the plan moved 313.8)."""
    import yaml
    from omegaconf import OmegaConf

    from kd import cli

    cfg = OmegaConf.to_container(load_config(FULL_14B_3B, []), resolve=True)
    member = {"teacher_checkpointer": cfg.pop("teacher_checkpointer")}
    del cfg["teacher_model"]
    seven = "torchtune.models.qwen2_5.qwen2_5_7b_instruct"
    cfg["teachers"] = {
        "members": [
            {"name": "big", "teacher_model": {"_component_": FULL_14B_3B_TEACHER}, **member},
            {"name": "small", "teacher_model": {"_component_": seven}, **member},
        ]
    }
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = ["plan", "--config", str(path), "--budget-gib", "48"]
    options = _fit_json(argv, capsys=capsys)
    parked = [o for o in options if "teacher_offload=stream" in o["overrides"]]
    assert parked
    for opt in parked:
        assert cli.main([*argv, *opt["overrides"], "--json"]) == 0
        moved = json.loads(capsys.readouterr().out)["host"]["moved_gib_per_step"]
        said = (
            f"(one layer at a time, the next prefetched): {moved['parked_teacher']:.1f} GiB moved"
        )
        assert said in opt["description"], (opt["description"], moved)


def _int8_options(plan: MemoryPlan) -> list:
    return [o for o in plan.fit if o.extra.get("teacher_quantization") == "int8 weight-only"]


@pytest.mark.parametrize("over", [[], ["teacher_offload=park"]])
def test_int8_suggestion_is_a_config_kd_accepts(over):
    """The int8 suggestion's overrides with teacher_quantization=int8 validate and plan to its
    peak: kd parks no int8 teacher, so it never rides on teacher_offload (it suggested
    ``optimizer_in_cpu=true teacher_offload=stream``, which kd validate refuses), and a parked
    config is told to unpark."""
    from kd.config import validate_config

    base = ["device=cuda", *over]
    for budget in (30, 36, 40):
        plan = _fit(FULL_14B_3B, base, world_size=1, budget=budget)
        for opt in _int8_options(plan):
            assert not any(o.startswith("teacher_offload=") for o in opt.overrides) or (
                over and "teacher_offload=none" in opt.overrides
            ), opt.overrides
            cfg = load_config(FULL_14B_3B, [*base, *opt.overrides, "teacher_quantization=int8"])
            validate_config(cfg, check_paths=False, check_components=False)
            again = plan_from_config(cfg, world_size=1, budget_gib=budget)
            assert again.fits and again.peak_bytes == opt.peak_bytes, opt.overrides


def test_no_int8_suggestion_where_the_run_refuses_it():
    """Several teachers (their members are not quantized) and several ranks (an FSDP2-sharded
    teacher is not quantized): kd run refuses teacher_quantization=int8, so --fit does not
    suggest it."""
    plain = _fit(FULL_14B_3B, ["device=cuda"], world_size=1, budget=40)
    assert _int8_options(plain)
    cfg = load_config(FULL_14B_3B, ["device=cuda"])
    member = {"name": "a", "teacher_model": cfg.teacher_model}
    member["teacher_checkpointer"] = cfg.teacher_checkpointer
    several = ["teacher_model=null", "teacher_checkpointer=null"]
    cfg = load_config(FULL_14B_3B, ["device=cuda", *several])
    cfg.teachers = {"combine": "weights", "members": [member]}
    plan = plan_from_config(cfg, world_size=1, budget_gib=40)
    assert plan.peak_bytes == plain.peak_bytes
    attach_fit(plan, run_config(cfg))
    assert not _int8_options(plan)
    sharded = _fit(DISTRIBUTED_8B, ["device=cuda"], world_size=2, budget=30)
    assert not _int8_options(sharded)
