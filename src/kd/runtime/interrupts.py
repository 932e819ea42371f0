"""Graceful stop on SIGTERM / SIGINT: finish the current step (or the final save), save, exit 0.

Shared GPUs pre-empt jobs with SIGTERM (Slurm, Kubernetes, torchrun forwarding it to every rank) and
users press Ctrl-C. Both only set a flag here; the training loop polls ``stop.requested`` after each
optimizer step, saves a step checkpoint and returns. A signal during the final save waits for the
save to complete. A second Ctrl-C means "stop now": the default handler comes back and
``KeyboardInterrupt`` is raised at once.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kd.runtime.distributed import WorldInfo

logger = logging.getLogger("kd")

_HANDLED = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """Context manager that turns SIGTERM / SIGINT into a stop request.

    Attributes:
        requested: True once a handled signal arrived.
        signal_name: name of the first signal received (``"SIGTERM"``), or None.
        active: whether handlers were installed (False outside the main thread, where Python
            cannot install signal handlers; the manager is then a no-op).
        action: what a signal waits for, as the warning on receiving it says (``"finishing the
            current step, then saving a checkpoint"``); the caller may change it as it goes.

    Example::

        with GracefulStop() as stop:
            for batch in loader:
                step(batch)
                if stop.requested:
                    save(...)
                    break
    """

    def __init__(self, action: str = "finishing the current step, then saving a checkpoint"):
        self.requested: bool = False
        self.signal_name: str | None = None
        self.active: bool = False
        self.action = action
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in _HANDLED:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        self.active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            # getsignal() returns None for handlers installed from C; SIG_DFL is the closest.
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        self.active = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            # Second Ctrl-C: the user does not want to wait for the save.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        if not self.requested:
            self.signal_name = name
        self.requested = True
        logger.warning(
            "received %s: %s (press Ctrl-C again to stop without saving)", name, self.action
        )


def resume_hint(command: list[str], checkpoint: Path) -> str:
    """The message printed after a stop: where the checkpoint is and how to continue.

    Args:
        command: the command line that started the run (``["kd", "run", recipe, "--config", ...]``);
            any ``resume_from_checkpoint=...`` override in it is replaced.
        checkpoint: the step checkpoint just written.

    Returns:
        One line: the command that resumes from the checkpoint (whose save the checkpointer has
        already reported: ``saved checkpoint ...``).
    """
    kept = [a for a in command if not a.lstrip("~").startswith("resume_from_checkpoint")]
    return f"to resume from {checkpoint}, run: {shlex.join([*kept, 'resume_from_checkpoint=True'])}"


def launch_command(argv: list[str], *, world_size: int) -> list[str]:
    """The ``kd run ...`` command that started this process (for the resume hint).

    Args:
        argv: ``sys.argv`` of this process.
        world_size: ranks of the run; under torchrun the launcher flags are rebuilt from the
            environment (``LOCAL_WORLD_SIZE``).
    """
    if argv[1:2] == ["run"]:  # kd run ... / python -m kd.cli run ...
        return ["kd", *argv[1:]]
    # Launched as a recipe file (torchrun kd_distributed.py --config ...).
    recipe = Path(argv[0]).stem if argv and argv[0].endswith(".py") else "kd_single_device"
    launcher: list[str] = []
    if world_size > 1:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        launcher = [f"--nproc_per_node={local}"]
        if world_size > local:
            launcher.append(f"--nnodes={world_size // local}")
    return ["kd", "run", *launcher, recipe, *argv[1:]]


def stopped_message(signal_name: str | None, step: int, path: Path, *, world: WorldInfo) -> str:
    """What rank 0 prints after a stop by ``signal_name``: the step it stopped after, then where
    the checkpoint ``path`` is and the command that resumes it (:func:`resume_hint`)."""
    return f"kd: received {signal_name}; stopped after step {step}\n" + resume_hint(
        launch_command(sys.argv, world_size=world.world_size), path
    )


# The stop signals the launcher passes on to its workers (their GracefulStop saves, then exits 0).
FORWARDED = ("SIGTERM", "SIGINT")


class WorkerForwarder:
    """The ``kd run --nproc_per_node N`` launcher's handler for SIGTERM and SIGINT: the signal
    goes on to the workers (this process's children), and torchrun's agent keeps waiting for them.

    torchrun's own handler stopped its agent at once, sent the signal on and killed the workers
    (SIGKILL) 30 s later, whatever they were doing: a save longer than that was lost, and the
    launcher ended with a traceback and exit status 1 though the workers had saved and exited 0.
    Forwarded, the workers' :class:`GracefulStop` finishes the step and saves as on one device, the
    launcher exits with their status (0) and prints nothing of its own.

    A signal before any worker exists, and a second Ctrl-C (stop without saving), are torchrun's
    as before: ``raise_now(signum)`` raises its ``SignalException`` (the agent signals the
    workers, then kills them after its shutdown timeout). ``workers`` lists their pids (default:
    this process's children).
    """

    def __init__(
        self, raise_now: Callable[[int], None], workers: Callable[[], list[int]] | None = None
    ):
        self.raise_now = raise_now
        self.workers = workers or _children
        self.forwarded = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        workers = self.workers()
        if not workers or (self.forwarded and signum == signal.SIGINT):
            self.raise_now(signum)
            return
        self.forwarded = True
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # it has just ended
                pass


def _children() -> list[int]:
    """The pids of this process's children: torchrun's workers, in the launcher."""
    import psutil

    return [p.pid for p in psutil.Process().children()]
