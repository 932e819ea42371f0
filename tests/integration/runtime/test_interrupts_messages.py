"""What a run says on stderr (issue 42): what it loads, no progress bar when stderr is not a
terminal, and on Ctrl-C the checkpoint saved and reported once (it was printed twice), then how
to resume."""

from __future__ import annotations

import os
import signal

from kd import checkpoint, cli
from tests.conftest import make_config, write_config


def test_ctrl_c_reports_the_checkpoint_once(assets, tmp_path, monkeypatch, capfd):
    from kd.training.run_log import RunLog

    original = RunLog.write_step

    def log_then_ctrl_c(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if kwargs["step"] == 1:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, handled by GracefulStop

    monkeypatch.setattr(RunLog, "write_step", log_then_ctrl_c)
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", make_config(assets, out))
    argv = ["run", "kd_single_device", "--config", str(config)]
    monkeypatch.setattr("sys.argv", ["kd", *argv])  # the command the resume line repeats
    assert cli.main(argv) == 0
    latest = checkpoint.find_latest_checkpoint(out)
    assert latest is not None and latest.name == "step_000001"
    captured = capfd.readouterr()
    said = captured.err  # what the user sees: kd's log lines and its prints
    assert "received SIGINT" in said and "stopped after step 1" in said
    assert said.count(f"saved checkpoint {latest}") == 1, said
    # A log file gets no progress bar (one line of every redraw), but says what loads.
    assert "%|" not in said and "it/s" not in said
    assert f"kd: loading model weights from {assets['student']}" in said
    assert f"kd: loading teacher_model weights from {assets['teacher']}" in said
    assert (
        f"to resume from {latest}, run: kd run kd_single_device --config {config} "
        "resume_from_checkpoint=True"
    ) in said
