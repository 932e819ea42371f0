"""kd.runtime.interrupts.GracefulStop: SIGTERM / SIGINT set a flag; a second Ctrl-C stops at once."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from kd.runtime.interrupts import GracefulStop, resume_hint


def _deliver(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)
    # The Python-level handler runs between bytecodes of the main thread; a sleep-free spin
    # of a few statements is enough, signal.sigwait is not needed.
    for _ in range(1000):
        pass


def test_sigterm_sets_requested_and_handlers_are_restored() -> None:
    before_term = signal.getsignal(signal.SIGTERM)
    before_int = signal.getsignal(signal.SIGINT)
    with GracefulStop() as stop:
        assert stop.active and not stop.requested
        _deliver(signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
        _deliver(signal.SIGTERM)  # a second SIGTERM keeps waiting for the save
        assert stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before_term
    assert signal.getsignal(signal.SIGINT) is before_int


def test_second_sigint_raises_keyboard_interrupt() -> None:
    before_int = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), GracefulStop() as stop:
        _deliver(signal.SIGINT)
        assert stop.requested and stop.signal_name == "SIGINT"
        _deliver(signal.SIGINT)
        pytest.fail("the second SIGINT did not interrupt")
    assert signal.getsignal(signal.SIGINT) is before_int


def test_noop_outside_main_thread() -> None:
    seen: list[bool] = []

    def run() -> None:
        with GracefulStop() as stop:
            seen.append(stop.active)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [False]


def test_resume_hint_replaces_resume_override() -> None:
    cmd = [
        "kd",
        "run",
        "kd_single_device",
        "--config",
        "my run.yaml",
        "resume_from_checkpoint=False",
    ]
    text = resume_hint(cmd, Path("/o/step_000010"))
    assert text.splitlines() == [
        "to resume from /o/step_000010, run: kd run kd_single_device --config 'my run.yaml' "
        "resume_from_checkpoint=True",
    ]


def test_the_suite_guard_names_a_test_that_leaves_a_handler_and_puts_it_back():
    """conftest's guard (every test runs inside it): a handler left behind fails the test that
    left it, and the next test starts with the handler from before."""
    from tests.conftest import signal_state_kept

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(pytest.fail.Exception, match="leaky left the signal state changed: SIGINT"):
        with signal_state_kept("leaky"):
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(pytest.fail.Exception, match="blocked signals"):
        with signal_state_kept("blocking"):
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with signal_state_kept("clean"), GracefulStop():
        pass


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_worker_forwarder_passes_a_stop_on_and_a_second_ctrl_c_stops_now():
    """The launcher's SIGTERM / SIGINT go on to its workers (children) and it keeps waiting; with
    no worker yet, or on a second Ctrl-C, torchrun's stop (``raise_now``) runs instead."""
    import subprocess

    from kd.runtime.interrupts import WorkerForwarder

    raised: list[int] = []
    pids: list[int] = []
    forward = WorkerForwarder(raised.append, workers=lambda: pids)
    forward(signal.SIGTERM, None)  # no worker yet
    assert raised == [signal.SIGTERM] and not forward.forwarded
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pids.append(worker.pid)
    try:
        forward(signal.SIGTERM, None)
        assert worker.wait(timeout=30) == -signal.SIGTERM and forward.forwarded
        assert raised == [signal.SIGTERM]
        forward(signal.SIGINT, None)  # the second signal, a Ctrl-C: stop now
        assert raised == [signal.SIGTERM, signal.SIGINT]
    finally:
        worker.kill()
        worker.wait()
