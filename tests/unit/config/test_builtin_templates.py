"""The built-in templates: complete, valid, and each fits the GPU its header names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import kd
from kd.config import load_config, schema
from kd.memory import plan_from_config

CONFIG_ROOT = Path(kd.__file__).parent / "configs"
TEMPLATES = sorted(
    str(p.relative_to(CONFIG_ROOT).with_suffix("")) for p in CONFIG_ROOT.rglob("*.yaml")
)
EXPECTED = {
    "qwen2_5/14B_to_3B_full_single_device",
    "qwen2_5/14B_to_3B_lora_single_device",
    "llama3_1/8B_to_8B_lora_single_device",
    "llama3_1/8B_to_8B_full_distributed",
    "llama3_2/8B_to_1B_full_single_device",
}


def _header(name: str) -> str:
    text = (CONFIG_ROOT / f"{name}.yaml").read_text()
    return "\n".join(line for line in text.splitlines() if line.startswith("#"))


def _world_size(name: str) -> int:
    m = re.search(r"Target: (\d+) x ", _header(name))
    return int(m.group(1)) if m else 1


def test_all_expected_templates_exist():
    assert EXPECTED <= set(TEMPLATES)


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_sets_every_schema_key(name):
    raw = yaml.safe_load((CONFIG_ROOT / f"{name}.yaml").read_text())
    missing = [k for k in schema.TOP_LEVEL if k not in raw]
    assert not missing, f"{name} leaves out {missing}"
    for section, keys in schema.SECTIONS.items():
        if raw[section] is None and schema.TOP_LEVEL[section].nullable:
            continue  # an optional section left off (validation: null)
        missing = [k for k in keys if k not in raw[section]]
        assert not missing, f"{name}: {section} leaves out {missing}"


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_fits_its_target_and_header_states_the_plan(name):
    cfg = load_config(name, [])
    world = _world_size(name)
    plan = plan_from_config(cfg, world_size=world)
    assert plan.budget_gib is not None
    assert plan.fits, plan.table()
    m = re.search(r"`kd plan` peak: ([\d.]+) GiB", _header(name))
    assert m, f"{name}: header must state the planned peak"
    assert abs(float(m.group(1)) - plan.peak_gib) < 0.06, (name, m.group(1), plan.peak_gib)
    header = _header(name)
    assert "Target:" in header and "huggingface-cli download" in header


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_download_paths_match_checkpointers(name):
    cfg = load_config(name, [])
    header = _header(name)
    for key in ("checkpointer", "teacher_checkpointer"):
        folder = str(cfg[key].checkpoint_dir).rstrip("/")
        assert f"--local-dir {folder}" in header, (name, key, folder)
