"""Metric sinks and memory readings.

Every recipe writes ``output_dir/metrics.jsonl`` (one JSON object per logged step) through
:class:`JsonlWriter`; the config's ``metric_logger`` adds one more sink with torchtune's logger
interface (``log_dict(payload, step)``, ``close()``): :class:`StdoutLogger` (default),
:class:`WandBLogger`, or torchtune's own loggers, called through :class:`GuardedLogger`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kd.errors import KDUserError, brief

GIB = 1024**3

logger = logging.getLogger("kd")


class JsonlWriter:
    """Appends one JSON object per line, each row in one unbuffered write.

    A killed run keeps every row written before; a row the disk had no room for is cut off again,
    so the file only ever holds whole rows (the next run's rows start on a line of their own).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row``.

        Raises:
            OSError: the write failed (disk full, quota); the file is as it was before the call.
        """
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        data = memoryview((json.dumps(row, sort_keys=True) + "\n").encode("utf-8"))
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise

    def close(self) -> None:
        """Close the file (every row is already written; closing twice is fine)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _step_of(line: bytes) -> int | str:
    """The ``step`` of a metrics row, or why the line is damaged."""
    try:
        row = json.loads(line.decode("utf-8"))
    except ValueError:  # also UnicodeDecodeError
        return "not JSON"
    if not isinstance(row, dict):
        return "not a JSON object"
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return "no integer step"
    return step


def trim_jsonl(path: Path, step: int) -> None:
    """Keep the rows of steps up to ``step`` in a metrics file (the resumed run logs later steps again).

    Damaged lines (a row cut by ``kill -9`` or a full disk, text that is not a JSON object with an
    integer ``step``) are dropped with a warning on the ``kd`` logger naming their line numbers.

    Raises:
        OSError: the file cannot be read or rewritten; it is then left as it was.
    """
    path = Path(path)
    if not path.exists():
        return
    kept: list[bytes] = []
    damaged: dict[str, list[int]] = {}
    for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        found = _step_of(line)
        if isinstance(found, str):
            damaged.setdefault(found, []).append(number)
        elif found <= step:
            kept.append(line + b"\n")
    if damaged:
        logger.warning(
            "%s: dropped %d damaged line(s) while resuming at step %d (%s)",
            path,
            sum(len(v) for v in damaged.values()),
            step,
            "; ".join(f"{why}: {_numbers(lines)}" for why, lines in damaged.items()),
        )
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(b"".join(kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _numbers(lines: list[int], shown: int = 5) -> str:
    text = ", ".join(str(n) for n in lines[:shown])
    more = f" and {len(lines) - shown} more" if len(lines) > shown else ""
    return ("lines " if len(lines) > 1 else "line ") + text + more


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


def build_quietly(build: Callable[[], Any]) -> Any:
    """``build()``; when it fails, the half-built object is released here, silently.

    A logger whose ``__init__`` raised still gets its ``__del__`` called when the error's
    traceback lets it go; torchtune's ``DiskLogger.__del__`` then closes a file it never opened
    and Python prints "Exception ignored in ... AttributeError" after kd's one error line. Its
    frames are cleared here, under a hook that drops such noise, so it is collected now.

    Raises:
        KDUserError: whatever ``build`` raised.
    """
    try:
        return build()
    except KDUserError as e:
        hook = sys.unraisablehook
        sys.unraisablehook = lambda unraisable: None
        try:
            cause = e.__cause__
            while cause is not None:
                with contextlib.suppress(RuntimeError):  # a frame still running stays
                    traceback.clear_frames(cause.__traceback__)
                cause = cause.__cause__ if cause.__cause__ is not cause else None
            gc.collect()
        finally:
            sys.unraisablehook = hook
        raise


class GuardedLogger:
    """The config's ``metric_logger``, each call guarded: whatever the logger raises becomes one
    :class:`KDUserError` line naming the key and the fix.

    Args:
        logger: the built logger, or None (no ``metric_logger``: every call does nothing).
        target: its ``_component_``, named in errors.

    Attributes:
        outputs_kept: set once the run has written ``metrics.jsonl``: a failure then says that it
            and the checkpoints saved so far are kept.

    Raises:
        KDUserError: ``logger`` has no ``log_dict(payload, step)`` method.
    """

    def __init__(self, logger: Any, *, target: str | None):
        self.logger = logger
        self.target = target
        self.outputs_kept = False
        if logger is not None and not callable(getattr(logger, "log_dict", None)):
            raise KDUserError(
                f"metric_logger: {target} has no log_dict(payload, step) method; set "
                "metric_logger._component_ to kd.metrics.StdoutLogger, kd.metrics.WandBLogger "
                "or a torchtune metric logger"
            )

    def failed(self, method: str, e: BaseException) -> str:
        """The one line saying that ``<target>.<method>()`` raised ``e``."""
        kept = " (metrics.jsonl and the checkpoints saved so far are kept)"
        return (
            f"metric_logger: {self.target}.{method}() failed ({brief(e)}); fix the logger's "
            "settings or set metric_logger._component_ to kd.metrics.StdoutLogger"
            + (kept if self.outputs_kept else "")
        )

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        call = getattr(self.logger, method, None)
        if not callable(call):
            return
        try:
            call(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a logger raises whatever its backend raises
            raise KDUserError(self.failed(method, e)) from e

    def log_config(self, config: Any) -> None:
        """``logger.log_config(config)`` if the logger has it (torchtune's loggers do)."""
        self._call("log_config", config)

    def log_dict(self, payload: dict[str, Any], step: int) -> None:
        """``logger.log_dict(payload, step=step)``."""
        self._call("log_dict", payload, step=step)

    def close(self) -> None:
        """``logger.close()`` if the logger has it."""
        self._call("close")


def _netrc_has_wandb() -> bool:
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in path.read_text()
    except OSError:
        return False


def peak_memory_gib(device: torch.device) -> dict[str, float]:
    """Peak memory so far: CUDA allocated/reserved on GPU; process peak RSS on CPU.

    On CUDA ``device_used_gib`` is the device's used memory now (``cudaMemGetInfo``: total -
    free), which counts what the caching allocator never sees: the CUDA context, cuBLAS
    handles, NCCL buffers, and any other process on the device.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
            "device_used_gib": (total - free) / GIB,
        }
    # ru_maxrss is in KiB on Linux.
    return {"peak_memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}


class PhaseTimer:
    """Wall seconds per named phase of a step (``generate``, ``teacher``...), summed over calls.

    On CUDA each phase synchronises the device at its start and end, so the seconds are the
    phase's own kernels and not the queue ahead of it.
    """

    def __init__(self, device: torch.device):
        self.seconds: dict[str, float] = {}
        self._cuda = device.type == "cuda"

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent inside the block to ``seconds[name]``."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def progress_bar(total: int, initial: int, *, shown: bool) -> Any:
    """The training loop's tqdm bar of optimizer steps (rank 0 ``shown``). On rank 0 it is off
    when stderr is not a terminal (a log file would get one line of every redraw); the metric
    rows still say each step."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        disable=None if shown else True,
        desc="kd",
        dynamic_ncols=True,
    )
