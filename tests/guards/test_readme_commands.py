"""The README's commands that need no model weights run as written, and what it shows of their
output is what they print (issue 42: docs that run as written)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from kd.cli import main

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _tour() -> list[list[str]]:
    """The Tour's ``kd ls`` / ``kd cp`` / ``kd plan`` lines (validate and run need weights)."""
    block = README.split("## Tour", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("  #")[0].strip() for line in block.splitlines()]
    return [shlex.split(c)[1:] for c in commands if re.match(r"kd (ls|cp|plan)\b", c)]


def test_the_tour_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    commands = _tour()
    assert [c[0] for c in commands] == ["ls", "cp", "plan", "plan"]
    for argv in commands:
        # `kd plan --fit` exits 1 when the config does not fit the budget (it lists what would).
        assert main(argv) in ((0, 1) if "--fit" in argv else (0,)), argv
        assert "kd: error" not in capsys.readouterr().err
    assert (tmp_path / "my_kd.yaml").is_file()


def test_the_plan_shown_is_what_kd_plan_prints(capsys):
    shown = README.split("```\n$ kd plan ", 1)[1].split("```", 1)[0].splitlines()
    argv = ["plan", *shlex.split(shown[0])]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    for line in shown[1:]:
        if line.strip() == "...":
            continue
        if line.endswith("; ..."):  # cut short in the README
            assert any(p.startswith(line[: -len(" ...")]) for p in printed), line
        else:
            assert line in printed, line
