"""Metric sinks: jsonl rows, stdout lines, and a real wandb run in offline mode (no network)."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest
import torch

from kd import metrics
from kd.errors import KDUserError


def test_jsonl_writer_appends_rows(tmp_path):
    w = metrics.JsonlWriter(tmp_path / "m" / "metrics.jsonl")
    w.write({"step": 1, "loss": 2.5})
    w.write({"step": 2, "loss": 2.0})
    w.close()
    rows = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"loss": 2.5, "step": 1}, {"loss": 2.0, "step": 2}]


def test_stdout_logger_prints_one_line_per_step(capsys):
    logger = metrics.StdoutLogger()
    logger.log_dict({"loss": 1.23456, "lr": 0.001}, step=7)
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["step 7 loss=1.235 lr=0.001"]


def test_wandb_logger_offline_without_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    logger = metrics.WandBLogger(project="kd-test", log_dir=str(tmp_path / "wb"))
    assert logger.run.settings.mode == "offline"
    logger.log_dict({"loss": 1.0}, step=1)
    logger.close()
    assert list((tmp_path / "wb" / "wandb").glob("offline-run-*"))


def test_peak_memory_on_cpu_is_rss():
    peak = metrics.peak_memory_gib(torch.device("cpu"))
    assert set(peak) == {"peak_memory_gib"} and 0.01 < peak["peak_memory_gib"] < 64


def test_jsonl_writer_cuts_a_row_the_disk_had_no_room_for(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    w = metrics.JsonlWriter(path)
    w.write({"step": 1})
    write = os.write

    def half_then_full(fd, data):
        write(fd, bytes(data)[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        w.write({"step": 2, "loss": 1.5})
    monkeypatch.undo()
    assert path.read_text() == '{"step": 1}\n'
    w.write({"step": 2})  # room again: the row starts on a line of its own
    w.close()
    w.close()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_trim_jsonl_keeps_rows_up_to_the_step(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)))
    with caplog.at_level(logging.WARNING, logger="kd"):
        metrics.trim_jsonl(path, 2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert caplog.text == ""  # rows after the step are logged again, not damage
    metrics.trim_jsonl(tmp_path / "absent.jsonl", 2)
    assert not (tmp_path / "absent.jsonl").exists()


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b'{"step": 2, "lo', "not JSON"),
        (b"\xff\xfe garbage", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"loss": 1.0}', "no integer step"),
        (b'{"step": "2"}', "no integer step"),
        (b'{"step": null}', "no integer step"),
        (b'{"step": true}', "no integer step"),
    ],
)
def test_trim_jsonl_drops_damaged_lines_and_says_so(tmp_path, caplog, line, why):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n' + line + b'\n{"step": 2}\n\n')
    with caplog.at_level(logging.WARNING, logger="kd"):
        metrics.trim_jsonl(path, 5)
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    assert f"dropped 1 damaged line(s) while resuming at step 5 ({why}: line 2)" in caplog.text
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_trim_jsonl_failing_rewrite_leaves_the_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics.os, "replace", full_disk)
    with pytest.raises(OSError):
        metrics.trim_jsonl(path, 1)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


class _Recorder:
    def __init__(self, fail: str | None = None):
        self.calls: list[tuple] = []
        self.fail = fail

    def log_dict(self, payload, step):
        self.calls.append(("log_dict", payload, step))
        if self.fail == "log_dict":
            raise ValueError("rejected")

    def close(self):
        self.calls.append(("close",))
        if self.fail == "close":
            raise RuntimeError("flush failed")


def test_guarded_logger_passes_calls_through():
    inner = _Recorder()
    logger = metrics.GuardedLogger(inner, target="my.Logger")
    logger.log_config({"seed": 1})  # the logger has no log_config: skipped
    logger.log_dict({"loss": 1.0}, step=3)
    logger.close()
    assert inner.calls == [("log_dict", {"loss": 1.0}, 3), ("close",)]
    nothing = metrics.GuardedLogger(None, target=None)  # no metric_logger: every call is a no-op
    nothing.log_config({})
    nothing.log_dict({"loss": 1.0}, step=1)
    nothing.close()


def test_guarded_logger_refuses_a_logger_without_log_dict():
    with pytest.raises(KDUserError) as e:
        metrics.GuardedLogger(object(), target="collections.OrderedDict")
    assert str(e.value) == (
        "metric_logger: collections.OrderedDict has no log_dict(payload, step) method; set "
        "metric_logger._component_ to kd.metrics.StdoutLogger, kd.metrics.WandBLogger or a "
        "torchtune metric logger"
    )


@pytest.mark.parametrize("kept", [False, True])
def test_guarded_logger_failures_are_one_line_naming_the_key(kept):
    logger = metrics.GuardedLogger(_Recorder(fail="log_dict"), target="my.Logger")
    logger.outputs_kept = kept
    with pytest.raises(KDUserError) as e:
        logger.log_dict({"loss": 1.0}, step=1)
    suffix = " (metrics.jsonl and the checkpoints saved so far are kept)" if kept else ""
    assert str(e.value) == (
        "metric_logger: my.Logger.log_dict() failed (ValueError: rejected); fix the logger's "
        "settings or set metric_logger._component_ to kd.metrics.StdoutLogger" + suffix
    )
    closing = metrics.GuardedLogger(_Recorder(fail="close"), target="my.Logger")
    with pytest.raises(KDUserError, match=r"^metric_logger: my.Logger.close\(\) failed \(Runtime"):
        closing.close()
