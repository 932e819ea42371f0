"""Metric sinks and memory readings.

Every recipe writes ``output_dir/metrics.jsonl`` (one JSON object per logged step) through
:class:`JsonlWriter`; the config's ``metric_logger`` adds one more sink with torchtune's logger
interface (``log_dict(payload, step)``, ``close()``): :class:`StdoutLogger` (default),
:class:`WandBLogger`, or torchtune's own loggers.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

GIB = 1024**3


class JsonlWriter:
    """Appends one JSON object per line; flushed per row so a killed run keeps its metrics."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(row, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def trim_jsonl(path: Path, step: int) -> None:
    """Drop rows after ``step`` (logged by a run that was killed later) from a metrics file.

    The resumed run logs those steps again; unreadable lines (a row cut by ``kill -9``) go too.
    """
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and int(row.get("step", 0)) <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class StdoutLogger:
    """One line per logged step on stdout (through tqdm so the progress bar stays intact)."""

    def __init__(self, **_: Any):
        pass

    def log_config(self, config: Any) -> None:
        pass

    def log_dict(self, payload: dict[str, Any], step: int) -> None:
        from tqdm import tqdm

        fields = " ".join(f"{k}={_fmt(v)}" for k, v in payload.items())
        tqdm.write(f"step {step} {fields}", file=sys.stdout)

    def close(self) -> None:
        pass


class WandBLogger:
    """Weights & Biases logger that never blocks on the network.

    Without an API key (``WANDB_API_KEY`` or a netrc entry) it runs in offline mode; sync later with
    ``wandb sync <dir>``.

    Args:
        project: wandb project.
        log_dir: where wandb writes its run folder (default: the current directory).
        mode: ``online``, ``offline`` or ``disabled``; default chooses by the presence of a key.
        **kwargs: passed to ``wandb.init`` (entity, name, group, tags...).
    """

    def __init__(
        self,
        project: str = "kd",
        log_dir: str | None = None,
        mode: str | None = None,
        **kwargs: Any,
    ):
        import wandb

        if mode is None:
            has_key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has_wandb()
            mode = "online" if has_key else "offline"
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self.run = wandb.init(
            project=project,
            dir=log_dir,
            mode=mode,
            settings=wandb.Settings(silent=True, console="off"),
            **kwargs,
        )

    def log_config(self, config: Any) -> None:
        from omegaconf import OmegaConf

        self.run.config.update(OmegaConf.to_container(config, resolve=True), allow_val_change=True)

    def log_dict(self, payload: dict[str, Any], step: int) -> None:
        self.run.log(payload, step=step)

    def close(self) -> None:
        self.run.finish()


def _netrc_has_wandb() -> bool:
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in path.read_text()
    except OSError:
        return False


def peak_memory_gib(device: torch.device) -> dict[str, float]:
    """Peak memory so far: CUDA allocated/reserved on GPU; process peak RSS on CPU."""
    if device.type == "cuda":
        return {
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
    # ru_maxrss is in KiB on Linux.
    return {"peak_memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
