"""Ctrl-C stops the run: launching torchrun in-process leaves no handler that swallows it.

torchrun's agent replaces the SIGINT, SIGTERM, SIGHUP and SIGQUIT handlers with ones that raise
``SignalException`` and never restores them; after one in-process ``kd run --nproc_per_node 2``
(as a test session does), Ctrl-C raised an ordinary exception that pytest reported as one failed
test before going on with the next. Here the real agent handler is installed by a stand-in for
torchrun and the signal is really delivered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kd import cli
from tests.unit.test_config import tiny_config, write

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _torchrun_interrupted(args) -> None:
    """What torchrun does when Ctrl-C arrives mid-run: its agent's handlers, then the signal."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    for sig in SIGNALS:
        signal.signal(sig, _terminate_process_handler)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # the handler raises before this ends
    raise AssertionError("SIGINT was not delivered")


def _torchrun_finished(args) -> None:
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    for sig in SIGNALS:
        signal.signal(sig, _terminate_process_handler)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("outcome", ["interrupted", "finished"])
def test_in_process_torchrun_gives_ctrl_c_back(tmp_path, monkeypatch, outcome):
    import torch.distributed.run

    fake = _torchrun_interrupted if outcome == "interrupted" else _torchrun_finished
    monkeypatch.setattr(torch.distributed.run, "run", fake)
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    path = write(tmp_path / "ok.yaml", tiny_config(tmp_path))
    argv = ["run", "--nproc_per_node", "2", "--standalone", "kd_distributed", "--config", path]
    status = cli.main(argv)
    # Ctrl-C is a KeyboardInterrupt (kd's exit status 130), not a torchrun failure (1) or a
    # traceback; afterwards every handler is the one before the launch.
    assert status == (130 if outcome == "interrupted" else 0)
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before
    handler, blocked = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:
        pass
    else:  # name what swallowed it (an earlier test's handler, a blocked signal)
        pytest.fail(f"Ctrl-C did nothing: SIGINT handler {handler!r}, blocked {sorted(blocked)}")


_LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
)
print(worker.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX sessions")
def test_run_launch_kills_workers_in_their_own_sessions(tmp_path):
    """Like torchrun's workers, a process in a session of its own survives its launcher being
    killed; run_launch kills it too when the caller stops (timeout here, Ctrl-C alike)."""
    import psutil

    from kd.testing import run_launch

    pid_file = tmp_path / "worker.pid"
    code = _LAUNCHER.replace(
        "print(worker.pid, flush=True)", f"open({str(pid_file)!r}, 'w').write(str(worker.pid))"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_launch([sys.executable, "-c", code], env=os.environ, timeout=5)
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(worker) and time.monotonic() < deadline:
        if psutil.Process(worker).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
