"""The ``eval:`` phase of ``kd plan``: there only with ``eval:``, its figure following
``eval.batch_size`` and the task rows' length (hand-computed terms), in the table, the JSON and
the verdict (the run's peak is the largest phase's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kd.cli import main
from kd.config import load_config
from kd.memory.estimate import FINAL_EVAL_PHASE
from kd.memory.plan import plan_from_config
from kd.testing import write_jsonl
from tests.conftest import STUDENT, make_config, write_config


def mc_task(folder: Path, *, pad: int = 0, rows: int = 20) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(
        folder / "mc.jsonl",
        [
            {"question": f"{a:02d}=" + "x" * pad, "choices": ["ab", "cd"], "answer": a % 2}
            for a in range(rows)
        ],
    )
    (folder / "mc.yaml").write_text("task: mc\ntype: multiple_choice\ndata: mc.jsonl\n")
    return folder


def plan(assets, tmp_path: Path, **top):
    cfg = make_config(assets, tmp_path / "run", **top)
    return plan_from_config(load_config(str(write_config(tmp_path / "c.yaml", cfg)), []))


def test_the_phase_is_there_only_with_eval(assets, tmp_path, capsys):
    without = plan(assets, tmp_path)
    assert FINAL_EVAL_PHASE not in without.estimate.phases
    assert without.to_json()["final_eval"] is None
    tasks = mc_task(tmp_path / "tasks")
    cfg = make_config(assets, tmp_path / "run", eval={"tasks": [str(tasks)]})
    config = write_config(tmp_path / "e.yaml", cfg)
    assert main(["plan", "--config", str(config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert FINAL_EVAL_PHASE in out["phases"]
    # "00=" + " ab" is 6 byte tokens; the input drops the last: 5
    assert out["final_eval"] == [
        {
            "task": "mc",
            "kind": "loglikelihood",
            "rows": 8,
            "tokens": 5,
            "new_tokens": 0,
            "measured": True,
        }
    ]
    assert main(["plan", "--config", str(config)]) == 0
    table = capsys.readouterr().out
    assert "evaluation (eval:): final/ scored by lm-eval" in table and "mc 8 x 5" in table
    assert "eval:" in table.splitlines()[5]  # the phase's column


@pytest.mark.parametrize("batch_size,pad", [(4, 0), (8, 0), (8, 30)])
def test_the_figure_follows_the_batch_and_the_rows(assets, tmp_path, batch_size, pad):
    """By hand: full logits and their log-softmax of the second batch beside the first's
    log-probs, 3 x [b, L, V] fp32; the student's weights (tied: the embedding once)."""
    tasks = mc_task(tmp_path / "tasks", pad=pad)
    p = plan(assets, tmp_path, eval={"tasks": [str(tasks)], "batch_size": batch_size})
    phase = p.estimate.phases[FINAL_EVAL_PHASE]
    length = 5 + pad
    assert phase["logits_loss"] == 3 * 4 * batch_size * length * STUDENT["vocab"]
    assert phase["buffers"] >= 8 * batch_size * length
    assert phase["student_weights"] == 4 * p.estimate.student_params
    assert phase["gradients"] == phase["optimizer_states"] == phase["teacher_weights"] == 0


def test_one_batch_holds_no_earlier_batch(assets, tmp_path):
    tasks = mc_task(tmp_path / "tasks", rows=2)  # 4 requests: one batch of 4
    p = plan(assets, tmp_path, eval={"tasks": [str(tasks)], "batch_size": 8})
    assert p.estimate.phases[FINAL_EVAL_PHASE]["logits_loss"] == 2 * 4 * 4 * 5 * STUDENT["vocab"]


def test_the_verdict_covers_the_eval_phase(assets, tmp_path, capsys):
    """Long rows and a large batch: the evaluation is the run's peak and the budget refuses it."""
    tasks = mc_task(tmp_path / "tasks", pad=240, rows=64)
    cfg = make_config(assets, tmp_path / "run", eval={"tasks": [str(tasks)], "batch_size": 64})
    p = plan(assets, tmp_path, eval={"tasks": [str(tasks)], "batch_size": 64})
    assert p.phase == FINAL_EVAL_PHASE
    budget = (p.peak_bytes - 1) / (1 << 30)
    cfg["memory"] = {"budget_gib": budget, "check": "error"}
    config = write_config(tmp_path / "v.yaml", cfg)
    assert main(["plan", "--config", str(config)]) == 1  # kd plan's "does not fit"
    assert "in final_eval; budget" in capsys.readouterr().out.splitlines()[-1]
    assert main(["validate", "--config", str(config)]) == 2
    assert "in final_eval but the budget" in capsys.readouterr().err


def test_a_task_by_name_is_planned_at_the_sequence_length(assets, tmp_path):
    p = plan(assets, tmp_path, eval={"tasks": ["arc_easy"], "batch_size": 2})
    (batch,) = p.inputs.knobs.final_eval.batches
    assert (batch.tokens, batch.rows, batch.measured) == (p.inputs.knobs.seq_len, 2, False)
    assert any("arc_easy" in n for n in p.inputs.notes)


def test_planning_the_eval_phase_imports_no_torch(assets, tmp_path):
    """The task rows are read and counted (tokenizers, PyYAML) without torch: kd plan stays fast."""
    import subprocess
    import sys

    tasks = mc_task(tmp_path / "tasks")
    cfg = make_config(assets, tmp_path / "run", eval={"tasks": [str(tasks)]})
    config = write_config(tmp_path / "c.yaml", cfg)
    code = (
        "import sys; from kd.cli import main; "
        f"assert main(['plan', '--config', {str(config)!r}]) == 0; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "evaluation (eval:)" in out.stdout and out.stdout.strip().endswith("False")


def test_the_trace_ratio_leaves_out_the_untraced_eval_phase(assets, tmp_path):
    """kd plan --trace traces the training step, not lm-eval: with the eval: phase the run's peak,
    estimate/trace still compares the traced phases."""
    from kd.config.run import run_config
    from kd.memory.trace import trace_run

    tasks = mc_task(tmp_path / "tasks", pad=200, rows=40)
    cfg = make_config(assets, tmp_path / "run", eval={"tasks": [str(tasks)], "batch_size": 32})
    loaded = load_config(str(write_config(tmp_path / "c.yaml", cfg)), [])
    p = plan_from_config(loaded)
    assert p.phase == FINAL_EVAL_PHASE
    p.traced = trace_run(run_config(loaded)).phase_peaks
    assert FINAL_EVAL_PHASE not in p.traced
    assert p.to_json()["trace_vs_estimate"] == pytest.approx(1.0, abs=0.03)
