"""A teacher with another tokenizer as a member of ``teachers:`` (issue 26) through ``kd run`` and
``kd validate``: with ``combine: weights`` the loss is the weighted sum of the two one-teacher
runs' losses, with ``combine: route`` each row gets exactly its teacher's loss, a member from a
cross-tokenizer store trains as the live one, the planner counts the member's weights, and
``combine: mix`` or validation with such a member is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kd import cli
from kd.testing import write_jsonl
from tests.conftest import make_config, read_metrics, write_config
from tests.integration.teachers.test_cross_chat_run import _cfg as _chat_cfg
from tests.integration.teachers.test_cross_chat_run import folders  # noqa: F401 - fixture
from tests.integration.teachers.test_cross_run import letter_data, other_tok_teacher  # noqa: F401
from tests.integration.teachers.test_multi_run import _member

# One step per row, the weights never move (lr 0): every step's loss is its row's loss under
# the same student, in every run below.
ONE_ROW = {"batch_size": 1, "gradient_accumulation_steps": 1, "max_steps_per_epoch": 6}
FROZEN = {"_component_": "torch.optim.AdamW", "lr": 0.0}


def _hf(teacher: Path) -> dict:
    return {"_component_": "kd.hf.causal_lm", "path": str(teacher)}


def _cross_member(name: str, teacher: Path, weight: float = 1.0) -> dict:
    return {"name": name, "weight": weight, "teacher_model": _hf(teacher), "cross_tokenizer": {}}


def _data(assets, out: Path, data: Path) -> dict:
    return dict(make_config(assets, out)["dataset"], data_files=str(data))


def _plain(assets, out: Path, data: Path, **top) -> dict:
    return make_config(assets, out, dataset=_data(assets, out, data), **top)


def _cross(assets, out: Path, teacher: Path, data: Path, **top) -> dict:
    cfg = _plain(assets, out, data, teacher_model=_hf(teacher), cross_tokenizer={}, **top)
    del cfg["teacher_checkpointer"]
    return cfg


def _multi(assets, out: Path, data: Path, teachers: dict, **top) -> dict:
    cfg = _plain(assets, out, data, teachers=teachers, **top)
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    return cfg


def _main(*argv: str, cfg: dict, path: Path) -> int:
    return cli.main([*argv, "--config", str(write_config(path, cfg))])


def _steps(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if "loss" in r and "step" in r]


@pytest.fixture(scope="module")
def routed_letters(letter_data) -> Path:  # noqa: F811
    """The letter rows, each naming teacher p (plain), x (cross-tokenizer) or none."""
    rows = [json.loads(line) for line in letter_data.read_text().splitlines()]
    for i, row in enumerate(rows):
        if i % 3 != 2:
            row["domain"] = "p" if i % 3 == 0 else "x"
    return write_jsonl(letter_data.parent / "routed.jsonl", rows)


def test_weights_is_the_weighted_sum_of_the_two_one_teacher_runs(
    assets,
    other_tok_teacher,  # noqa: F811
    letter_data,  # noqa: F811
    tmp_path,
):
    plain, cross, multi = tmp_path / "plain", tmp_path / "cross", tmp_path / "multi"
    assert _main("run", "kd", cfg=_plain(assets, plain, letter_data), path=tmp_path / "p.yaml") == 0
    cfg = _cross(assets, cross, other_tok_teacher, letter_data)
    assert _main("run", "kd", cfg=cfg, path=tmp_path / "x.yaml") == 0
    members = [
        _member("p", assets["teacher"], multi, weight=1.0),
        _cross_member("x", other_tok_teacher, weight=3.0),
    ]
    cfg = _multi(assets, multi, letter_data, {"combine": "weights", "members": members})
    assert _main("run", "kd", cfg=cfg, path=tmp_path / "m.yaml") == 0
    p, x, m = _steps(plain)[0], _steps(cross)[0], _steps(multi)[0]
    assert m["loss"] == pytest.approx(0.25 * p["loss"] + 0.75 * x["loss"], abs=1e-5)
    assert m["kd_loss"] == pytest.approx(0.25 * p["kd_loss"] + 0.75 * x["kd_loss"], abs=1e-5)
    assert m["kd_loss/p"] == pytest.approx(p["kd_loss"], abs=1e-5)
    assert m["kd_loss/x"] == pytest.approx(x["kd_loss"], abs=1e-5)
    # the cross member's own terms, under its name
    assert m["kd_loss/x/matched"] == pytest.approx(x["kd_loss/matched"], abs=1e-5)
    assert m["kd_loss/x/unmatched"] == pytest.approx(x["kd_loss/unmatched"], abs=1e-5)
    assert m["kd_loss/x/matched"] > 0 and m["kd_loss/x/unmatched"] > 0
    assert len(_steps(multi)) == 3


def test_route_gives_each_row_exactly_its_teachers_loss(
    assets,
    other_tok_teacher,  # noqa: F811
    routed_letters,
    tmp_path,
):
    top = dict(ONE_ROW, optimizer=FROZEN)
    runs = {
        "p": _plain(assets, tmp_path / "p", routed_letters, **top),
        "x": _cross(assets, tmp_path / "x", other_tok_teacher, routed_letters, **top),
        "none": _plain(assets, tmp_path / "none", routed_letters, kd_ratio=0.0, **top),
    }
    members = [
        _member("p", assets["teacher"], tmp_path / "m"),
        _cross_member("x", other_tok_teacher),
    ]
    teachers = {"combine": "route", "route_field": "domain", "members": members}
    runs["route"] = _multi(assets, tmp_path / "route", routed_letters, teachers, **top)
    for name, cfg in runs.items():
        assert _main("run", "kd", cfg=cfg, path=tmp_path / f"{name}.yaml") == 0, name
    steps = {name: _steps(Path(cfg["output_dir"])) for name, cfg in runs.items()}
    assert len(steps["route"]) == 6
    for i, r in enumerate(steps["route"]):
        teacher = ("p", "x", "none")[i % 3]  # the rows' domain field, in order (no shuffle)
        assert r["loss"] == pytest.approx(steps[teacher][i]["loss"], abs=1e-5), (i, teacher)
        assert r["ce_loss"] == pytest.approx(steps[teacher][i]["ce_loss"], abs=1e-5)
        if teacher == "x":
            assert r["kd_loss/x"] == pytest.approx(steps["x"][i]["kd_loss"], abs=1e-5)
            assert r["kd_loss/x/matched"] == pytest.approx(steps["x"][i]["kd_loss/matched"])
            assert r["kd_loss/p"] == 0
        if teacher == "none":
            assert r["kd_loss"] == 0


def test_one_chat_member_with_its_own_template_is_exactly_the_one_teacher_run(
    assets,
    folders,  # noqa: F811
    letter_data,  # noqa: F811
    tmp_path,
):
    """The member learns in its check that chat rows need their row indices (its own template)."""
    cfg = _chat_cfg(assets, tmp_path / "one", folders["student"], folders["teacher"], letter_data)
    one = dict(cfg, cross_tokenizer={})
    assert _main("run", "kd", cfg=one, path=tmp_path / "one.yaml") == 0
    member = _cross_member("x", folders["teacher"], weight=2.0)
    multi = dict(cfg, output_dir=str(tmp_path / "multi"), teachers={"members": [member]})
    del multi["teacher_model"]
    assert _main("run", "kd", cfg=multi, path=tmp_path / "multi.yaml") == 0
    a, b = _steps(tmp_path / "one"), _steps(tmp_path / "multi")
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce_loss", "kd_loss", "grad_norm"):
            assert rb[key] == ra[key], key
        assert rb["kd_loss/x"] == ra["kd_loss"]
        assert rb["kd_loss/x/matched"] == ra["kd_loss/matched"]
        assert rb["kd_loss/x/unmatched"] == ra["kd_loss/unmatched"]


def test_a_member_from_a_cross_tokenizer_store_trains_as_the_live_member(
    assets,
    other_tok_teacher,  # noqa: F811
    letter_data,  # noqa: F811
    tmp_path,
):
    store = tmp_path / "store"
    pre = _cross(assets, tmp_path / "pre", other_tok_teacher, letter_data)
    pre["teacher_logits"] = {"path": str(store), "k": 378}  # the teacher's whole vocabulary
    assert _main("run", "teacher_logits", cfg=pre, path=tmp_path / "pre.yaml") == 0
    outs = {}
    for name, member in (
        ("live", _cross_member("x", other_tok_teacher, weight=3.0)),
        ("stored", {**_cross_member("x", other_tok_teacher, weight=3.0), "teacher_model": None}),
    ):
        if name == "stored":
            member["teacher_logits"] = {"path": str(store), "k": 378}
        out = tmp_path / name
        members = [_member("p", assets["teacher"], out), member]
        cfg = _multi(assets, out, letter_data, {"members": members})
        assert _main("run", "kd", cfg=cfg, path=tmp_path / f"{name}.yaml") == 0
        outs[name] = _steps(out)
    for a, b in zip(outs["live"], outs["stored"], strict=True):
        for key in ("loss", "kd_loss", "kd_loss/x", "kd_loss/x/matched", "kd_loss/x/unmatched"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_plan_counts_the_cross_tokenizer_members_weights(
    assets,
    other_tok_teacher,  # noqa: F811
    letter_data,  # noqa: F811
    tmp_path,
    capsys,
):
    def plan(cfg: dict, name: str) -> dict:
        capsys.readouterr()
        assert _main("plan", "--json", cfg=cfg, path=tmp_path / f"{name}.yaml") == 0
        return json.loads(capsys.readouterr().out)

    plain = plan(_plain(assets, tmp_path / "p", letter_data), "plain")
    cross = plan(_cross(assets, tmp_path / "x", other_tok_teacher, letter_data), "cross")
    assert cross["teacher"]["params"] != plain["teacher"]["params"]  # 384 vocabulary rows
    members = [_member("p", assets["teacher"], tmp_path), _cross_member("x", other_tok_teacher)]
    two = plan(_multi(assets, tmp_path / "m", letter_data, {"members": members}), "two")
    assert two["teacher"]["params"] == plain["teacher"]["params"] + cross["teacher"]["params"]
    # the smaller teacher's fp32 weights are resident on top of the larger one's peak
    small = min(plain["teacher"]["params"], cross["teacher"]["params"])
    assert two["peak_gib"] >= plain["peak_gib"] + 4 * small / 2**30 - 2e-4


def _refused(cfg: dict, tmp_path: Path, capsys) -> str:
    assert _main("validate", cfg=cfg, path=tmp_path / "cfg.yaml") == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, lines
    return lines[0]


def test_mix_with_a_cross_tokenizer_member_is_one_line(
    assets,
    other_tok_teacher,  # noqa: F811
    letter_data,  # noqa: F811
    tmp_path,
    capsys,
):
    members = [_member("p", assets["teacher"], tmp_path), _cross_member("x", other_tok_teacher)]
    cfg = _multi(assets, tmp_path / "m", letter_data, {"combine": "mix", "members": members})
    err = _refused(cfg, tmp_path, capsys)
    assert "teachers.members[1].cross_tokenizer: cannot be mixed by combine: mix" in err
    assert "use combine: weights" in err


@pytest.mark.parametrize(
    ("top", "expected"),
    [
        (
            {"validation": {"max_batches": 1}},
            "validation: teachers.members[1] (x): cannot be used with cross_tokenizer",
        ),
        (
            {"hidden_states": {"layer_map": [[1, 1]]}},
            "hidden_states: is not supported with teachers: (it matches one teacher's layers",
        ),
        (
            {"on_policy": {"max_new_tokens": 16}},
            "on_policy: teachers.members[1] (x): cannot be used with cross_tokenizer",
        ),
        ({"cross_tokenizer": {}}, "cross_tokenizer: is set beside teachers; move it into"),
    ],
)
def test_what_a_cross_tokenizer_member_refuses_is_one_line(
    top,
    expected,
    assets,
    other_tok_teacher,  # noqa: F811
    letter_data,  # noqa: F811
    tmp_path,
    capsys,
):
    members = [_member("p", assets["teacher"], tmp_path), _cross_member("x", other_tok_teacher)]
    cfg = _multi(assets, tmp_path / "m", letter_data, {"members": members}, **top)
    if "validation" in top:
        cfg["validation"]["dataset"] = cfg["dataset"]
    err = _refused(cfg, tmp_path, capsys)
    assert expected in err, err


def test_a_served_cross_tokenizer_member_is_one_line(assets, letter_data, tmp_path, capsys):  # noqa: F811
    served = {"name": "x", "cross_tokenizer": {}}
    served["teacher_server"] = {"url": "http://127.0.0.1:9", "model": "t"}
    cfg = _multi(
        assets,
        tmp_path / "m",
        letter_data,
        {"members": [_member("p", assets["teacher"], tmp_path), served]},
    )
    err = _refused(cfg, tmp_path, capsys)
    assert "teachers.members[1].teacher_server: cannot be used with cross_tokenizer" in err


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (
            {"cross_tokenizer": {"matched_weight": 2}},
            "teachers.members[1].cross_tokenizer.matched_weight:",
        ),
        (
            {"cross_tokenizer": {"matched": 0.5}},
            "teachers.members[1].cross_tokenizer.matched: unknown key",
        ),
        (
            {"teacher_model": None, "teacher_logits": {"path": "x", "format": "axolotl"}},
            "teachers.members[1].teacher_logits.format: axolotl files hold no teacher token ids",
        ),
    ],
)
def test_a_cross_tokenizer_members_own_keys_are_checked_in_one_line(
    keys,
    expected,
    assets,
    other_tok_teacher,  # noqa: F811
    letter_data,  # noqa: F811
    tmp_path,
    capsys,
):
    member = {**_cross_member("x", other_tok_teacher), **keys}
    members = [_member("p", assets["teacher"], tmp_path), member]
    cfg = _multi(assets, tmp_path / "m", letter_data, {"members": members})
    assert expected in _refused(cfg, tmp_path, capsys)
