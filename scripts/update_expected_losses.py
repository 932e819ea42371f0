"""Regenerate tests/assets/expected_losses.json, the golden losses of the tiny fixed runs.

The file is the reference every change to the training path must reproduce
(tests/integration/test_losses_golden.py). Regenerate it only for a change that is meant to alter
the numbers, and say why in the commit message:

    OMP_NUM_THREADS=1 python scripts/update_expected_losses.py

It runs that test module with pytest in update mode, so the runs (fixtures, config builder, CLI)
are exactly those the test compares, then prints how far each metric moved.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST = ROOT / "tests" / "integration" / "test_golden_losses.py"
GOLDEN = ROOT / "tests" / "assets" / "expected_losses.json"


def _changes(old: dict, new: dict) -> list[str]:
    lines = []
    for run, entry in new.get("runs", {}).items():
        before = old.get("runs", {}).get(run)
        if before is None:
            lines.append(f"{run}: new")
            continue
        for key in ("loss", "ce_loss", "kd_loss", "grad_norm", "lr", "num_tokens"):
            worst = max(
                abs(float(a[key]) - float(b[key])) / max(abs(float(b[key])), 1e-30)
                for a, b in zip(entry["rows"], before["rows"], strict=True)
            )
            lines.append(f"{run} {key}: max rel change {worst:.2e}")
    return lines


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["KD_UPDATE_EXPECTED_LOSSES"] = "1"
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    code = pytest.main([str(TEST), "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT)])
    if code != 0:
        print(
            f"update failed (pytest exit {code}); {GOLDEN} may be partly written", file=sys.stderr
        )
        return int(code)
    new = json.loads(GOLDEN.read_text())
    print(f"wrote {GOLDEN.relative_to(ROOT)}")
    for line in _changes(old, new):
        print(f"  {line}")
    print("Say in the commit message why these numbers changed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
