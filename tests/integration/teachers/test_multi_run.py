"""Several teachers (``teachers:``) through ``kd run`` and ``kd validate``: one member is exactly
the one-teacher run, weights / mix / route train and log each teacher's loss, and bad input gets
one line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kd import cli
from kd.testing import checkpointer_node, write_jsonl
from tests.conftest import (
    TEACHER,
    builder,
    make_config,
    read_metrics,
    run_kd,
    write_config,
    write_hf_qwen2,
)


@pytest.fixture(scope="module")
def second_teacher(tmp_path_factory) -> Path:
    return write_hf_qwen2(tmp_path_factory.mktemp("t2") / "teacher2", TEACHER, seed=7)


@pytest.fixture(scope="module")
def routed_data(tmp_path_factory) -> Path:
    """64 additions; rows name teacher a, teacher b or none (field ``domain``)."""
    rng = random.Random(5)
    rows = []
    for i in range(64):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        row = {"input": f"{a}+{b}", "output": str(a + b)}
        if i % 3 != 2:
            row["domain"] = "a" if i % 3 == 0 else "b"
        rows.append(row)
    return write_jsonl(tmp_path_factory.mktemp("routed") / "train.jsonl", rows)


def _member(name: str, folder: Path, out: Path, weight: float = 1.0) -> dict:
    return {
        "name": name,
        "weight": weight,
        "teacher_model": builder(TEACHER),
        "teacher_checkpointer": checkpointer_node(folder, out / f"tt_{name}"),
    }


def _multi(assets: dict, out: Path, teachers: dict, **top) -> dict:
    cfg = make_config(assets, out, teachers=teachers, **top)
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    return cfg


def _steps(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if "loss" in r and "step" in r]


def test_one_member_is_exactly_the_one_teacher_run(assets, tmp_path):
    one = tmp_path / "one"
    assert run_kd(make_config(assets, one), tmp_path / "one.yaml") == 0
    multi = tmp_path / "multi"
    cfg = _multi(assets, multi, {"members": [_member("t", assets["teacher"], multi, weight=3.0)]})
    assert run_kd(cfg, tmp_path / "multi.yaml") == 0
    a, b = _steps(one), _steps(multi)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce_loss", "kd_loss", "grad_norm"):
            assert ra[key] == rb[key], key
        assert rb["kd_loss/t"] == rb["kd_loss"]


@pytest.mark.parametrize("combine", ["weights", "mix"])
def test_two_teachers_log_and_validate_each_teacher(combine, assets, second_teacher, tmp_path):
    out = tmp_path / "run"
    members = [
        _member("a", assets["teacher"], out, weight=1.0),
        _member("b", second_teacher, out, weight=3.0),
    ]
    val = {
        "dataset": make_config(assets, out)["dataset"],
        "every_n_steps": 2,
        "max_batches": 2,
    }
    cfg = _multi(
        assets,
        out,
        {"combine": combine, "members": members},
        validation=val,
        max_steps_per_epoch=2,
    )
    assert run_kd(cfg, tmp_path / "cfg.yaml") == 0
    rows = _steps(out)
    for r in rows:
        assert r["kd_loss/a"] > 0 and r["kd_loss/b"] > 0
        if combine == "weights":
            assert r["kd_loss"] == pytest.approx(0.25 * r["kd_loss/a"] + 0.75 * r["kd_loss/b"])
        else:  # the divergence to a mixture is below the mixed divergences (convexity of KL)
            assert r["kd_loss"] <= 0.25 * r["kd_loss/a"] + 0.75 * r["kd_loss/b"] + 1e-6
    val_rows = [r for r in read_metrics(out) if "val_loss" in r]
    assert val_rows and {"val_kd_loss/a", "val_kd_loss/b"} <= set(val_rows[-1])
    v = val_rows[-1]
    if combine == "weights":
        assert v["val_kd_loss"] == pytest.approx(
            0.25 * v["val_kd_loss/a"] + 0.75 * v["val_kd_loss/b"], rel=1e-5
        )


def test_route_by_a_data_field(assets, second_teacher, routed_data, tmp_path):
    out = tmp_path / "run"
    dataset = dict(make_config(assets, out)["dataset"], data_files=str(routed_data))
    members = [_member("a", assets["teacher"], out), _member("b", second_teacher, out)]
    val = {"dataset": dataset, "max_batches": 3}
    cfg = _multi(
        assets,
        out,
        {"combine": "route", "route_field": "domain", "members": members},
        dataset=dataset,
        validation=val,
    )
    assert run_kd(cfg, tmp_path / "cfg.yaml") == 0
    for r in _steps(out):
        # in training rows the per-teacher terms are shares of kd_loss
        assert r["kd_loss"] == pytest.approx(r["kd_loss/a"] + r["kd_loss/b"], rel=1e-5)
        assert r["kd_loss/a"] > 0 and r["kd_loss/b"] > 0
    v = [r for r in read_metrics(out) if "val_loss" in r][-1]
    assert v["val_kd_loss/a"] > 0 and v["val_kd_loss/b"] > 0


def test_a_row_naming_no_teacher_is_one_line(assets, tmp_path, capsys):
    data = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"input": "1+1", "output": "2", "domain": "a"}] * 7
        + [{"input": "1+2", "output": "3", "domain": "maths"}],
    )
    out = tmp_path / "run"
    dataset = dict(make_config(assets, out)["dataset"], data_files=str(data))
    cfg = _multi(
        assets,
        out,
        {
            "combine": "route",
            "route_field": "domain",
            "members": [_member("a", assets["teacher"], out)],
        },
        dataset=dataset,
    )
    path = write_config(tmp_path / "cfg.yaml", cfg)
    assert cli.main(["validate", "--config", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1
    assert "row 8 has domain='maths', which names no teacher" in err[0]


@pytest.mark.parametrize(
    ("teachers", "expected"),
    [
        ({"members": []}, "teachers.members: needs at least one"),
        ({"members": "WEIGHTS0"}, "teachers.members[0].weight"),
        ({"combine": "route", "members": "ONE"}, "teachers.route_field: is required"),
        ({"members": "DUP"}, "teachers.members[1].name: a names two teachers"),
        ({"members": "ZERO"}, "teachers.members: the weights sum to 0"),
    ],
)
def test_bad_teachers_one_line(assets, tmp_path, capsys, teachers, expected):
    out = tmp_path / "run"
    one = _member("a", assets["teacher"], out)
    members = {
        "WEIGHTS0": [dict(one, weight="x")],
        "ONE": [one],
        "DUP": [one, dict(one)],
        "ZERO": [dict(one, weight=0), dict(one, name="b", weight=0.0)],
    }
    if isinstance(teachers["members"], str):
        teachers = dict(teachers, members=members[teachers["members"]])
    cfg = _multi(assets, out, teachers)
    path = write_config(tmp_path / "cfg.yaml", cfg)
    assert cli.main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "Traceback" not in err


def _one_error(cfg: dict, path: Path, capsys) -> str:
    """``kd validate``'s one error line for ``cfg`` (exit status 2, no traceback)."""
    capsys.readouterr()
    assert cli.main(["validate", "--config", str(write_config(path, cfg))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("weight", "expected"),
    [
        (float("nan"), "nan is not a finite number"),
        (float("inf"), "inf is not a finite number"),
        (1e308, "1e+308 is outside [0, 1e+06]"),
        (-1.0, "-1 is outside [0, 1e+06]"),
        (None, "null is not allowed"),
        (True, "True is not a number"),
    ],
)
def test_a_weight_that_is_no_usable_share_is_one_line(assets, tmp_path, capsys, weight, expected):
    out = tmp_path / "run"
    members = [_member("a", assets["teacher"], out, weight=weight)]
    line = _one_error(_multi(assets, out, {"members": members}), tmp_path / "c.yaml", capsys)
    assert f"teachers.members[0].weight: {expected}" in line, line
    assert "set teachers.members[0].weight to a" in line, line


def test_weights_under_route_are_refused(assets, tmp_path, capsys, routed_data):
    out = tmp_path / "run"
    dataset = dict(make_config(assets, out)["dataset"], data_files=str(routed_data))
    members = [
        _member("a", assets["teacher"], out, weight=0.7),
        _member("b", assets["teacher"], out),
    ]
    teachers = {"combine": "route", "route_field": "domain", "members": members}
    line = _one_error(_multi(assets, out, teachers, dataset=dataset), tmp_path / "c.yaml", capsys)
    assert "teachers.members[0].weight: 0.7 is not used by combine: route" in line, line
    assert "use combine: weights" in line


def test_a_misspelt_member_key_is_one_line_with_the_key_meant(assets, tmp_path, capsys):
    out = tmp_path / "run"
    member = _member("a", assets["teacher"], out)
    member["teacher_modle"] = member.pop("teacher_model")
    line = _one_error(_multi(assets, out, {"members": [member]}), tmp_path / "c.yaml", capsys)
    assert "teachers.members[0].teacher_modle: unknown key; did you mean teacher_model?" in line
    # a run-wide key put in a member says where it goes
    member = dict(_member("a", assets["teacher"], out), kd_ratio=0.3)
    line = _one_error(_multi(assets, out, {"members": [member]}), tmp_path / "d.yaml", capsys)
    assert "teachers.members[0].kd_ratio: unknown key" in line and "top level" in line, line


def test_a_validation_row_naming_no_teacher_is_one_line(assets, tmp_path, capsys, routed_data):
    """The held-out rows are routed too: a row naming no member is refused before any weight
    is loaded (it used to end in a ValueError at the first validation)."""
    out = tmp_path / "run"
    dataset = dict(make_config(assets, out)["dataset"], data_files=str(routed_data))
    rows = [{"input": "1+1", "output": "2", "domain": "a"}] * 3
    held_out = write_jsonl(
        tmp_path / "val.jsonl", [*rows, {"input": "1", "output": "1", "domain": "z"}]
    )
    teachers = {
        "combine": "route",
        "route_field": "domain",
        "members": [_member("a", assets["teacher"], out), _member("b", assets["teacher"], out)],
    }
    val = {"dataset": dict(dataset, data_files=str(held_out)), "max_batches": 1}
    cfg = _multi(assets, out, teachers, dataset=dataset, validation=val)
    capsys.readouterr()
    assert run_kd(cfg, tmp_path / "c.yaml") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("kd: error:")]
    assert lines == [
        "kd: error: validation.dataset: row 4 has domain='z', which names no teacher of "
        "teachers.members (a, b); fix the row or add a member of that name (rows without the field "
        "learn from CE only)"
    ], err
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("field", ["domian", "meta.domain"])
def test_a_route_field_no_row_fills_is_one_line(assets, tmp_path, capsys, field):
    """A misspelt or nested route field would train every row on CE alone: refused."""
    rows = [{"input": "1+1", "output": "2", "domain": "a", "meta": {"domain": "a"}}] * 8
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "run"
    dataset = dict(make_config(assets, out)["dataset"], data_files=str(data))
    teachers = {
        "combine": "route",
        "route_field": field,
        "members": [_member("a", assets["teacher"], out)],
    }
    line = _one_error(_multi(assets, out, teachers, dataset=dataset), tmp_path / "c.yaml", capsys)
    assert f"teachers.route_field: no row of dataset has a value in field '{field}'" in line
    assert "(row 1 has: domain, input, meta, output)" in line, line
    assert ("not a nested one" in line) == ("." in field), line


@pytest.mark.parametrize(
    ("top", "expected"),
    [
        ({"hidden_states": {"layer_map": ["0:0", "1:1"]}}, "hidden_states: is not supported"),
        ({"self_teacher": {"context": "{input}"}}, "self_teacher: is set beside teachers"),
        (
            {"teacher_quantization": "int8"},
            "teacher_quantization: int8 quantizes a local teacher_model, and the members of "
            "teachers: are not quantized",
        ),
    ],
)
def test_a_run_wide_teacher_key_beside_teachers_is_one_line(
    assets, tmp_path, capsys, top, expected
):
    out = tmp_path / "run"
    cfg = _multi(assets, out, {"members": [_member("a", assets["teacher"], out)]}, **top)
    line = _one_error(cfg, tmp_path / "c.yaml", capsys)
    assert line.startswith(f"kd: error: {expected}"), line


def test_top_level_teacher_keys_set_to_null_beside_teachers(assets, tmp_path, capsys):
    """A ``kd cp`` template keeps its teacher keys; set to null they name no teacher, and the
    members teach: the run trains (a set one is still refused)."""
    out = tmp_path / "run"
    cfg = _multi(assets, out, {"members": [_member("a", assets["teacher"], out)]})
    cfg.update(teacher_model=None, teacher_checkpointer=None, teacher_logits=None)
    assert run_kd(cfg, tmp_path / "c.yaml", "max_steps_per_epoch=1") == 0
    assert _steps(out)[0]["kd_loss/a"] > 0
    # Resumed without those null lines: the same run, already complete (a null top-level key
    # is the key left out).
    resumed = {k: v for k, v in cfg.items() if not k.startswith("teacher_")}
    capsys.readouterr()
    assert (
        run_kd(resumed, tmp_path / "r.yaml", "max_steps_per_epoch=1", "resume_from_checkpoint=true")
        == 0
    )
    assert "already complete" in capsys.readouterr().err
    cfg["teacher_checkpointer"] = checkpointer_node(assets["teacher"], out / "tt")
    line = _one_error(cfg, tmp_path / "d.yaml", capsys)
    assert "teacher_checkpointer: is set beside teachers; move it into the entry" in line, line


def _plan(cfg: dict, path: Path, capsys) -> dict:
    import json

    capsys.readouterr()
    assert cli.main(["plan", "--config", str(write_config(path, cfg)), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_counts_every_local_teacher(assets, second_teacher, tmp_path, capsys):
    out = tmp_path / "run"
    one = _plan(make_config(assets, out), tmp_path / "one.yaml", capsys)
    members = [_member("a", assets["teacher"], out), _member("b", second_teacher, out)]
    two = _plan(_multi(assets, out, {"members": members}), tmp_path / "two.yaml", capsys)
    assert two["teacher"]["params"] == 2 * one["teacher"]["params"]
    # the second teacher's fp32 weights are resident on top of the one-teacher peak
    extra = 4 * one["teacher"]["params"] / 2**30
    assert two["peak_gib"] == pytest.approx(one["peak_gib"] + extra, abs=2e-4)


def test_plan_fit_suggests_stored_logits_for_the_other_teachers(
    assets, second_teacher, tmp_path, capsys
):
    out = tmp_path / "run"
    members = [_member("a", assets["teacher"], out), _member("b", second_teacher, out)]
    cfg = _multi(assets, out, {"members": members})
    one = _plan(make_config(assets, out), tmp_path / "one.yaml", capsys)
    two = _plan(cfg, tmp_path / "two.yaml", capsys)
    budget = (one["peak_gib"] + two["peak_gib"]) / 2  # fits only without the second's weights
    path = write_config(tmp_path / "two.yaml", cfg)
    capsys.readouterr()
    code = cli.main(["plan", "--config", str(path), "--budget-gib", f"{budget:.6f}", "--fit"])
    text = capsys.readouterr().out
    assert code == 1, text  # over the budget as it is
    assert "the smaller local teachers of teachers.members from stored logits" in text, text


def test_a_stored_member_beside_a_model_member(assets, second_teacher, tmp_path):
    """Member ``s`` is the assets' teacher as stored top-k log-probs (kd run teacher_logits);
    member ``m`` a local model; under weights each trains and logs its own loss."""
    store = tmp_path / "store"
    pre = make_config(assets, tmp_path / "pre", teacher_logits={"path": str(store), "k": 8})
    assert (
        cli.main(["run", "teacher_logits", "--config", str(write_config(tmp_path / "p.yaml", pre))])
        == 0
    )
    out = tmp_path / "run"
    stored = {
        "name": "s",
        "weight": 1.0,
        "teacher_model": builder(TEACHER),  # identifies the store's teacher
        "teacher_checkpointer": checkpointer_node(assets["teacher"], out / "tt_s"),
        "teacher_logits": {"path": str(store), "k": 8},
    }
    cfg = _multi(assets, out, {"members": [stored, _member("m", second_teacher, out)]})
    assert run_kd(cfg, tmp_path / "cfg.yaml") == 0
    rows = _steps(out)
    assert len(rows) == 3
    for r in rows:
        assert r["kd_loss/s"] > 0 and r["kd_loss/m"] > 0
        assert r["kd_loss"] == pytest.approx(0.5 * r["kd_loss/s"] + 0.5 * r["kd_loss/m"])


def test_a_members_component_is_allow_listed(assets, tmp_path, capsys):
    out = tmp_path / "run"
    bad = dict(_member("a", assets["teacher"], out), teacher_model={"_component_": "os.system"})
    path = write_config(tmp_path / "cfg.yaml", _multi(assets, out, {"members": [bad]}))
    assert cli.main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "teachers.members[0].teacher_model._component_" in err, err
    assert "Traceback" not in err


@pytest.mark.slow
def test_route_on_two_ranks_where_each_rank_sees_one_teacher(
    assets, second_teacher, tmp_path, tmp_path_factory
):
    """Under torchrun (2 gloo ranks, FSDP2) rank 0's rows all name teacher a and rank 1's all
    name b: every rank still runs every member for each micro-batch (the sharded forwards are
    collectives), so the run ends and each teacher teaches its own rows."""
    from tests.integration.runtime.test_distributed_run import TOL
    from tests.integration.teachers.test_store_reader_distributed import _launch

    rows = [
        {"input": f"{i}+{i}", "output": str(2 * i), "domain": "a" if i % 2 == 0 else "b"}
        for i in range(64)
    ]
    data = write_jsonl(tmp_path_factory.mktemp("split") / "train.jsonl", rows)
    out = tmp_path / "pair"
    dataset = dict(make_config(assets, out)["dataset"], data_files=str(data))
    members = [_member("a", assets["teacher"], out), _member("b", second_teacher, out)]
    cfg = _multi(
        assets,
        out,
        {"combine": "route", "route_field": "domain", "members": members},
        dataset=dataset,
        batch_size=4,
    )
    _launch("kd", write_config(tmp_path / "pair.yaml", cfg))
    # The same global batches on one device (8 rows a micro-batch): the same losses per teacher.
    one = tmp_path / "one"
    single = _multi(
        assets,
        one,
        {"combine": "route", "route_field": "domain", "members": members},
        dataset=dataset,
        batch_size=8,
    )
    assert run_kd(single, tmp_path / "one.yaml") == 0
    steps, reference = _steps(out), _steps(one)
    assert [r["step"] for r in steps] == [r["step"] for r in reference] == [1, 2, 3]
    for r, ref in zip(steps, reference, strict=True):
        assert r["kd_loss/a"] > 0 and r["kd_loss/b"] > 0
        for key in ("loss", "ce_loss", "kd_loss", "kd_loss/a", "kd_loss/b"):
            assert r[key] == pytest.approx(ref[key], abs=TOL, rel=0), (r["step"], key)
