"""``kd run teacher_logits`` says how far it is without a terminal: its tqdm bar is off when
stderr is a log file (a batch job), and the precompute of a large dataset was silent until its
last line."""

from __future__ import annotations

import re

from kd import cli
from tests.conftest import make_config, write_config


def test_each_shard_written_is_a_progress_line_without_a_terminal(assets, tmp_path, capsys):
    cfg = make_config(
        assets,
        tmp_path / "run",
        teacher_logits={"path": str(tmp_path / "logits"), "k": 8, "rows_per_shard": 16},
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    assert cli.main(["run", "teacher_logits", "--config", str(config)]) == 0
    err = capsys.readouterr().err  # not a terminal: no bar
    lines = re.findall(r"kd: teacher_logits: wrote (\S+), (\d+) of (\d+) rows \((\d+)%\)", err)
    assert [(name, int(done), int(total), int(pct)) for name, done, total, pct in lines] == [
        (f"rank00000-0000{n}.parquet", 16 * (n + 1), 64, 25 * (n + 1)) for n in range(4)
    ]
