"""Data files that are not files of rows, through ``kd validate`` / ``kd run``: a folder, a named
pipe, a device, a pattern matching only folders, a line too long to be a row. Each is one line
naming the key and the fix (exit 2), before the datasets library is asked to read anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kd import cli
from kd.data import MAX_LINE_BYTES, check_line_lengths
from kd.errors import KDUserError
from tests.conftest import make_config, write_config


def _one_error(cfg: dict, tmp_path: Path, capsys) -> str:
    capsys.readouterr()
    assert cli.main(["validate", "--config", str(write_config(tmp_path / "c.yaml", cfg))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("kd: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _with_files(assets: dict, tmp_path: Path, files: str, **dataset) -> dict:
    cfg = make_config(assets, tmp_path / "out")
    cfg["dataset"] = {**cfg["dataset"], "data_files": files, **dataset}
    return cfg


def test_a_folder_as_data_files(assets, tmp_path, capsys):
    folder = tmp_path / "rows"
    folder.mkdir()
    (folder / "train.jsonl").write_text(Path(assets["data"]).read_text())
    line = _one_error(_with_files(assets, tmp_path, str(folder)), tmp_path, capsys)
    assert line == (
        f"kd: error: dataset.data_files: {folder} is a folder, not a data file; set "
        f"dataset.data_files to the files in it (e.g. {folder}/*.jsonl), or dataset.source to "
        "the folder"
    )
    # The pattern the line suggests is the fix.
    cfg = _with_files(assets, tmp_path, f"{folder}/*.jsonl")
    assert cli.main(["validate", "--config", str(write_config(tmp_path / "d.yaml", cfg))]) == 0


def test_a_pattern_matching_only_folders(assets, tmp_path, capsys):
    (tmp_path / "rows_a").mkdir()
    line = _one_error(_with_files(assets, tmp_path, str(tmp_path / "rows_*")), tmp_path, capsys)
    assert line.startswith(
        f"kd: error: dataset.data_files: {tmp_path / 'rows_*'} matches only folders"
    ), line


def test_a_device_as_data_files(assets, tmp_path, capsys):
    line = _one_error(_with_files(assets, tmp_path, "/dev/zero"), tmp_path, capsys)
    assert line == (
        "kd: error: dataset.data_files: /dev/zero is a device, not a data file; save the rows to "
        "a regular file and set dataset.data_files to it"
    )


def test_a_device_as_dataset_source(assets, tmp_path, capsys):
    cfg = make_config(assets, tmp_path / "out")
    cfg["dataset"] = {**cfg["dataset"], "source": "/dev/zero"}
    line = _one_error(cfg, tmp_path, capsys)
    assert line.startswith("kd: error: dataset.source: /dev/zero is a device, not a data folder")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_named_pipe_as_data_files_does_not_hang(assets, tmp_path):
    """A subprocess with a deadline: reading a pipe no one writes would wait forever."""
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    config = write_config(tmp_path / "c.yaml", _with_files(assets, tmp_path, str(fifo)))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "kd.cli", "validate", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("kd: error:")]
    assert lines == [
        f"kd: error: dataset.data_files: {fifo} is a named pipe (FIFO), not a data file; save "
        "the rows to a regular file and set dataset.data_files to it"
    ], proc.stderr


def test_a_line_too_long_to_be_a_row(assets, tmp_path, capsys):
    """A 9 MiB line (a file whose line breaks were lost, a row with a huge field) is refused
    with its file and line before the datasets library reads it."""
    data = tmp_path / "long.jsonl"
    rows = [{"input": "1+1", "output": "2"}] * 2 + [{"input": "x" * (9 << 20), "output": "2"}]
    with data.open("w") as f:
        for row in [*rows, *rows[:2] * 4]:
            f.write(json.dumps(row) + "\n")
    line = _one_error(_with_files(assets, tmp_path, str(data)), tmp_path, capsys)
    assert line == (
        f"kd: error: dataset.data_files: line 3 of {data} is longer than 8 MiB (a training row "
        "is at most tokenizer.max_seq_len tokens of text); split that row, drop it, or fix the "
        "file's line breaks (one JSON object per line)"
    )


def test_line_lengths_are_read_per_line_and_skip_json_arrays(tmp_path):
    """Lines just under the limit pass across read boundaries; one just over is found; a JSON
    file holding one array (read whole by the builder) is not a file of lines."""
    node = {"source": "json", "data_files": str(tmp_path / "a.jsonl")}
    near = b"x" * (MAX_LINE_BYTES - 1)
    (tmp_path / "a.jsonl").write_bytes(b"{}\n" + near + b"\n" + near + b"\n")
    check_line_lengths(node, key="dataset")
    (tmp_path / "a.jsonl").write_bytes(b"{}\n" + near + b"xy\n{}\n")
    with pytest.raises(KDUserError, match="line 2 of"):
        check_line_lengths(node, key="dataset")
    (tmp_path / "a.jsonl").write_bytes(b"[" + near + b"xy]")
    check_line_lengths(node, key="dataset")
    # A pattern: each file it matches.
    (tmp_path / "b.jsonl").write_bytes(b"{}\n" + near + b"xy\n")
    with pytest.raises(KDUserError, match="line 2 of .*b.jsonl"):
        check_line_lengths(dict(node, data_files=str(tmp_path / "*.jsonl")), key="dataset")
