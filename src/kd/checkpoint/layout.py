"""What a checkpoint folder holds: file names, step folder names, readers of the small files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kd import folders

MARKER_FILE = "kd_checkpoint.json"
RECIPE_STATE_FILE = "recipe_state.pt"
CONFIG_SNAPSHOT_FILE = "config.yaml"
MODEL_FILE = "model.safetensors"
MODEL_INDEX_FILE = folders.SAFETENSORS_INDEX_JSON
HF_CONFIG_FILE = folders.CONFIG_JSON
# A LoRA student's PEFT adapter lives in a subfolder: with adapter_config.json at the top,
# transformers' from_pretrained would load the base model + adapter instead of the merged weights.
ADAPTER_DIR = "adapter"
ADAPTER_MODEL_FILE = f"{ADAPTER_DIR}/adapter_model.safetensors"
ADAPTER_CONFIG_FILE = f"{ADAPTER_DIR}/adapter_config.json"
FINAL_DIRNAME = "final"
# The student of the best validation metric (``keep_best``): weights only, like final/.
BEST_DIRNAME = "best"


def step_dirname(step: int) -> str:
    """``step_000010`` for step 10."""
    return f"step_{step:06d}"


def read_checkpoint_marker(ckpt: Path) -> dict[str, Any]:
    """The parsed ``kd_checkpoint.json`` of a complete checkpoint folder."""
    return json.loads((Path(ckpt) / MARKER_FILE).read_text())


def load_checkpoint_config(ckpt: Path) -> str:
    """The resolved config snapshot (``config.yaml``) of a checkpoint folder."""
    return (Path(ckpt) / CONFIG_SNAPSHOT_FILE).read_text()
