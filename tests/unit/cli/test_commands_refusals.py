"""``kd plan`` refuses what ``kd run`` and ``kd validate`` refuse of a teacher kind before any
weight loads (``kd.config.teacher_kinds.refuse``): a plan of a run that cannot start (an int8
teacher beside stored logits or several teachers) was printed as fitting, exit 0."""

from __future__ import annotations

import pytest

from kd import cli
from tests.conftest import make_config, write_config


def _lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("kd: error:")]


def _several(assets, out):
    cfg = make_config(assets, out, teacher_quantization="int8")
    member = {k: cfg.pop(k) for k in ("teacher_model", "teacher_checkpointer")}
    cfg["teachers"] = {"combine": "weights", "members": [{"name": "a", **member}]}
    return cfg


def _stored(assets, out):
    store = out.parent / "store"
    store.mkdir(parents=True, exist_ok=True)
    cfg = make_config(assets, out, teacher_quantization="int8", teacher_model=None)
    cfg.pop("teacher_checkpointer")
    cfg["teacher_logits"] = {"path": str(store), "k": 8}
    return cfg


def _no_teacher(assets, out):
    return make_config(
        assets,
        out,
        teacher_quantization="int8",
        teacher_model=None,
        teacher_checkpointer=None,
        kd_ratio=0.0,
    )


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (_several, "the members of teachers: are not quantized"),
        (_stored, "this run reads stored teacher logits (teacher_logits)"),
        (_no_teacher, "this run has no teacher_model"),
    ],
)
def test_plan_refuses_what_the_run_refuses(assets, tmp_path, capsys, make, expected):
    path = write_config(tmp_path / "c.yaml", make(assets, tmp_path / "run"))
    lines = {}
    for command in ("plan", "validate"):
        assert cli.main([command, "--config", str(path)]) == 2, command
        lines[command] = _lines(capsys)
    (line,) = lines["plan"]
    assert line.startswith("kd: error: teacher_quantization: int8 quantizes a local teacher_model")
    assert expected in line, line
    assert lines["validate"] == [line]
