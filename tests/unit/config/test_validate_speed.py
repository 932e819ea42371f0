"""A config mistake answers before torch and torchtune are imported.

The schema pass of validation (keys, values, files) reports its problems first; only a config that
passes it imports the ``_component_`` targets (and ``kd run`` the recipe). Checked by what a fresh
process has imported when ``kd.cli.main`` returns, not by timing it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kd.config import load_config, validate_config
from kd.config.validate import component_problems
from kd.errors import ConfigError
from tests.unit.test_config import problems_of, tiny_config, write

HEAVY = ("torch", "torchtune", "transformers")

_PROBE = f"""
import json, sys
from kd.cli import main
code = main(sys.argv[1:])
print(json.dumps({{"code": code, "imported": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def kd_main_subprocess(argv: list[str]) -> tuple[int, list[str], list[str]]:
    """Run ``kd.cli.main(argv)`` in a fresh interpreter.

    Returns:
        The exit status, the heavy modules imported by then, and the stderr lines.
    """
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip(), result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    return out["code"], out["imported"], result.stderr.splitlines()


@pytest.fixture
def config(tmp_path: Path) -> str:
    return write(tmp_path / "kd.yaml", tiny_config(tmp_path))


@pytest.mark.parametrize(
    ("command", "mistake", "line"),
    [
        ("run", "kd_ration=0.7", "kd: error: kd_ration: unknown key; did you mean kd_ratio?"),
        ("validate", "kd_ratio=2", "kd: error: kd_ratio: 2 is outside [0, 1]"),
        (
            "run",
            "tokenizer.path=/nonexistent/vocab.json",
            "kd: error: tokenizer.path: /nonexistent",
        ),
        # A misspelled argument of a component whose signature its source declares: read
        # with ast, not by importing torch (it took 71 s, the component pass importing every
        # target, before issue 42).
        (
            "validate",
            "optimizer.lrr=1e-4",
            "kd: error: optimizer.lrr: not an argument of torch.optim.AdamW; did you mean "
            "optimizer.lr?",
        ),
        (
            "run",
            "model.num_layrs=2",
            "kd: error: model.num_layrs: not an argument of torchtune.models.qwen2.qwen2; did "
            "you mean model.num_layers?",
        ),
    ],
)
def test_config_mistake_answers_without_importing_torch(config, command, mistake, line):
    head = ["run", "kd_single_device"] if command == "run" else [command]
    code, imported, stderr = kd_main_subprocess([*head, "--config", config, *mistake.split()])
    assert code == 2, stderr
    assert len(stderr) == 1 and stderr[0].startswith(line), stderr
    assert imported == [], f"{imported} imported before the config mistake was reported"


def test_signature_problems_follow_a_clean_schema(config):
    # Arguments a source signature declares are checked with the schema, all together.
    both = load_config(config, ["model.num_layrs=2", "kd_ration=0.7", "optimizer.lrr=1"])
    found = problems_of(both)
    assert set(found) == {"kd_ration", "model.num_layrs", "optimizer.lrr"}
    assert "did you mean model.num_layers?" in found["model.num_layrs"]
    with pytest.raises(ConfigError, match="optimizer.lrr"):
        validate_config(both, check_components=False)
    # The component pass (importing the targets) finds the same problems.
    assert {p.key for p in component_problems(OmegaConf.to_container(both, resolve=True))} >= {
        "model.num_layrs",
        "optimizer.lrr",
    }
