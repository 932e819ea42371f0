"""`kd demo` end to end through the CLI: the quick run (seconds) and the full run (slow, the KD claim)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from kd.cli import main

RESULT_RE = re.compile(
    r"^RESULT kd_student_heldout_loss=(\S+) ce_student_heldout_loss=(\S+) teacher_heldout_loss=(\S+)$"
)


def _result_line(out: str) -> tuple[float, float, float]:
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-2000:]
    assert lines[0] == out.strip().splitlines()[-1], "RESULT must be the last line"
    match = RESULT_RE.match(lines[0])
    assert match, lines[0]
    kd, ce, teacher = (float(x) for x in match.groups())
    return kd, ce, teacher


def test_quick_demo_runs_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "demo"
    assert main(["demo", "--quick", "--output-dir", str(out_dir), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    kd, ce, teacher = _result_line(out)
    # The evaluation (the demo's longest part) says which run it is on.
    for i, name in enumerate(("teacher", "kd_student", "ce_student"), start=1):
        line = rf"      {name} \({i}/3\): its final model, then its initial weights and \d+ step"
        assert re.search(line, out), name
    assert all(math.isfinite(x) and x > 0 for x in (kd, ce, teacher))

    png = out_dir / "kd_demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out_dir / "results.json").read_text())
    assert results["models"]["kd_student"]["loss"] == pytest.approx(kd, abs=1e-4)
    # Held-out curves: initial weights plus every step checkpoint of each run.
    assert [s for s, _ in results["models"]["ce_student"]["heldout_curve"]] == [0, 4, 8]
    for name in ("teacher", "kd_student", "ce_student"):
        assert (out_dir / "configs" / f"{name}.yaml").is_file()
        assert (out_dir / "runs" / name / "metrics.jsonl").is_file()
    # The teacher's padded vocab is larger than the student's; both are HF folders.
    vocab = {
        name: json.loads((out_dir / "runs" / name / "final" / "config.json").read_text())[
            "vocab_size"
        ]
        for name in ("teacher", "kd_student")
    }
    assert vocab == {"teacher": 320, "kd_student": 288}
    kd_rows = [json.loads(line) for line in (out_dir / "runs/kd_student/metrics.jsonl").open()]
    ce_rows = [json.loads(line) for line in (out_dir / "runs/ce_student/metrics.jsonl").open()]
    # the CE student has no KD term: no kd_loss in its rows (not 0)
    assert all(r["kd_loss"] > 0 for r in kd_rows) and all("kd_loss" not in r for r in ce_rows)


def test_demo_refuses_a_folder_it_did_not_make(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["demo", "--quick", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not empty and was not made by kd demo" in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_full_demo_kd_closes_half_the_gap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--output-dir", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    kd, ce, teacher = _result_line(out)
    # The evaluation (the demo's longest part) says which run it is on.
    for i, name in enumerate(("teacher", "kd_student", "ce_student"), start=1):
        line = rf"      {name} \({i}/3\): its final model, then its initial weights and \d+ step"
        assert re.search(line, out), name
    assert teacher < kd < ce
    assert ce - kd >= 0.5 * (ce - teacher)


def test_demo_models_load_in_transformers(tmp_path: Path) -> None:
    """The demo's HF folders are real Qwen2 checkpoints: transformers gives the same logits."""
    transformers = pytest.importorskip("transformers")
    import torch

    from kd.demo import STUDENT, TEACHER
    from kd.testing import TOKENIZER_VOCAB_SIZE, load_tiny_model, write_tiny_model, write_tokenizer

    tok = write_tokenizer(tmp_path / "tok")
    tokens = torch.randint(0, TOKENIZER_VOCAB_SIZE, (2, 12))
    for shape, seed in ((STUDENT, 1), (TEACHER, 2)):
        folder = write_tiny_model(tmp_path / f"m{seed}", shape, seed=seed, tokenizer_dir=tok)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ours = load_tiny_model(folder, shape, tmp_path / "scratch")
        with torch.no_grad():
            expected = hf(tokens).logits
            torch.testing.assert_close(ours(tokens), expected, rtol=1e-4, atol=1e-4)
        assert expected.std() > 0.05  # logits far from 0, so a wrong weight mapping shows
        assert hf.config.vocab_size == shape.vocab_size
