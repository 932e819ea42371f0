"""Metric sinks: jsonl rows, stdout lines, and a real wandb run in offline mode (no network)."""

from __future__ import annotations

import json

import torch

from kd import metrics


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
