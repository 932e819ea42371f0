"""The opt-in int8 weight-only teacher (``teacher_quantization: int8``, torchao): never on by
default, loaded quantized by ``kd run``, counted by the planner, suggested by ``kd plan --fit`` only
with ``--consider-teacher-quantization``, refused where there is no local teacher, and its cost to
the signal reported by ``scripts/int8_teacher_report.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kd import cli
from kd.config import load_config, validate_config
from kd.config.run import run_config
from kd.memory.plan import GIB, plan_from_config
from kd.memory.shapes import int8_teacher_bytes_per_param
from kd.recipes.kd import KDRecipe
from kd.runtime.distributed import WorldInfo
from tests.conftest import make_config, read_metrics, write_config

REPO = Path(__file__).resolve().parents[3]
FULL_14B_3B = "qwen2_5/14B_to_3B_full_single_device"


def _config(assets: dict[str, Path], tmp_path: Path, name: str, **top: object) -> Path:
    cfg = make_config(assets, tmp_path / name, **top)
    return write_config(tmp_path / f"{name}.yaml", cfg)


def test_off_by_default(assets, tmp_path):
    """No config quantizes the teacher unless it says so."""
    run = run_config(load_config(str(_config(assets, tmp_path, "plain")), []))
    assert run.teacher_quantization == "none"


def test_run_trains_against_int8_teacher(assets, tmp_path):
    """``kd run`` with teacher_quantization=int8: the teacher's decoder-layer linears hold torchao
    int8 weights (the output head and embeddings do not), the run trains, and the KD term differs
    slightly from the unquantized teacher's on the same first batch."""
    plain = _config(assets, tmp_path, "plain")
    int8 = _config(assets, tmp_path, "int8", teacher_quantization="int8")
    assert cli.main(["run", "kd", "--config", str(plain)]) == 0
    assert cli.main(["run", "kd", "--config", str(int8)]) == 0
    ref, got = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "int8")
    assert len(got) == len(ref) == 3
    assert got[0]["kd_loss"] != ref[0]["kd_loss"]
    assert got[0]["kd_loss"] == pytest.approx(ref[0]["kd_loss"], rel=0.05)
    assert got[0]["ce_loss"] == ref[0]["ce_loss"]  # the student is the same

    cfg = load_config(str(int8), ["output_dir=" + str(tmp_path / "inproc")])
    validate_config(cfg)
    recipe = KDRecipe(run_config(cfg), world=WorldInfo(world_size=1, rank=0, local_rank=0))
    recipe.preload()
    recipe.load()
    teacher = recipe.teacher.model
    kinds = {
        type(m.weight).__name__
        for n, m in teacher.named_modules()
        if n.startswith("layers.") and hasattr(m, "weight") and m.weight.ndim == 2
    }
    assert kinds == {"Int8Tensor"}
    assert type(teacher.output.weight).__name__ != "Int8Tensor"
    recipe.cleanup()


def test_plan_counts_int8_teacher(assets, tmp_path, capsys):
    """``kd plan --json``: the int8 teacher's weights are its layer linears at ~1 byte per
    parameter and the rest in the run's dtype."""
    path = str(_config(assets, tmp_path, "plan"))
    out = {}
    for q in ("none", "int8"):
        assert cli.main(["plan", "--config", path, "--json", f"teacher_quantization={q}"]) == 0
        out[q] = json.loads(capsys.readouterr().out)
    plan = plan_from_config(load_config(path, []), world_size=1)
    teacher = plan.inputs.teacher
    expected = int8_teacher_bytes_per_param(teacher, 4) * teacher.total_params() / GIB
    assert out["int8"]["components"]["teacher_weights"] == pytest.approx(expected, abs=1e-4)
    assert (
        out["int8"]["components"]["teacher_weights"] < out["none"]["components"]["teacher_weights"]
    )


def test_fit_suggests_int8_teacher_only_when_asked(capsys):
    """Over budget, ``kd plan --fit`` names teacher_quantization=int8 only with
    --consider-teacher-quantization; the recipe's over-budget error never does."""
    base = ["plan", "--config", FULL_14B_3B, "device=cuda", "--budget-gib", "40", "--fit"]
    assert cli.main(base) == 1
    assert "teacher_quantization" not in capsys.readouterr().out
    assert cli.main([*base, "--consider-teacher-quantization"]) == 1
    text = capsys.readouterr().out
    assert "int8 weight-only teacher (teacher_quantization=int8;" in text


@pytest.mark.parametrize(
    "top, says",
    [
        (
            {"teacher_model": None, "teacher_checkpointer": None, "kd_ratio": 0.0},
            "has no teacher_model",
        ),
        (
            {
                "teacher_server": {"url": "http://127.0.0.1:9", "model": "m"},
                "teacher_model": None,
                "teacher_checkpointer": None,
            },
            "served",
        ),
    ],
)
def test_refused_without_a_local_teacher(assets, tmp_path, capsys, top, says):
    """teacher_quantization=int8 beside no teacher or a served teacher: one line, exit 2."""
    path = _config(assets, tmp_path, "bad", teacher_quantization="int8", **top)
    assert cli.main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "teacher_quantization: int8 quantizes a local teacher_model" in err and says in err
    assert "Traceback" not in err


def test_report_script_on_the_users_rows(assets, tmp_path):
    """scripts/int8_teacher_report.py: KL > 0 but small, top-1 agreement high, over the labelled
    positions of the config's rows; no run written."""
    path = _config(assets, tmp_path, "report")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/int8_teacher_report.py"), "--config", str(path)]
        + ["--rows", "8", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["rows"] == 8 and report["positions"] > 0
    assert 0 < report["mean_kl"] < 0.05
    assert 0.8 <= report["top1_agreement"] <= 1.0
    assert not (tmp_path / "report" / "metrics.jsonl").exists()
    bad = subprocess.run(
        [sys.executable, str(REPO / "scripts/int8_teacher_report.py"), "--config", str(path)]
        + ["--rows", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "--rows" in bad.stderr
