"""A list of datasets under ``dataset:`` (torchtune's concatenation), through the CLI.

Each entry is built with the tokenizer and the entries are joined by torchtune's ConcatDataset, as
torchtune's recipes do; the data checks and the steps per epoch see the concatenation.
"""

from __future__ import annotations

import pytest
import yaml
from omegaconf import ListConfig

from kd import cli, data
from kd._torchtune import ConcatDataset
from kd.config import load_config, validate_config
from kd.config.instantiate import build_component
from kd.config.run import run_config
from kd.testing import write_jsonl
from tests.conftest import make_config, read_metrics, write_config

# One intra-op thread (tests/conftest.py): the same float reductions in every run.
pytestmark = pytest.mark.usefixtures("one_thread")

RUN = ["run", "kd_single_device"]


def two_datasets(assets, tmp_path, **top):
    """A config over two JSON files: 3 rows (fewer than one batch of 4) and 5 rows."""
    three = write_jsonl(tmp_path / "three.jsonl", [{"input": "1+1", "output": "2"}] * 3)
    five = write_jsonl(tmp_path / "five.jsonl", [{"input": "20+22", "output": "42"}] * 5)
    cfg = make_config(assets, tmp_path / "run", **top)
    one = cfg["dataset"]
    cfg["dataset"] = [dict(one, data_files=str(three)), dict(one, data_files=str(five))]
    return write_config(tmp_path / "cfg.yaml", cfg)


def test_two_json_files_train_as_one_dataset(assets, tmp_path, capsys):
    # 3 + 5 rows = 8 = one step of batch 4 x accumulation 2; either file alone has no step.
    config = two_datasets(assets, tmp_path, max_steps_per_epoch=None)
    assert cli.main(["validate", "--config", str(config)]) == 0, capsys.readouterr().err
    assert "config OK" in capsys.readouterr().out
    assert cli.main([*RUN, "--config", str(config)]) == 0, capsys.readouterr().err
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1]
    assert (tmp_path / "run" / "final").is_dir()
    # The same files one at a time: neither fills an optimizer step.
    both = yaml.safe_load(config.read_text())
    for index, needle in ((0, "3 examples is fewer than one batch"), (1, "an epoch has only 1")):
        alone = {**both, "dataset": both["dataset"][index], "output_dir": str(tmp_path / "alone")}
        single = write_config(tmp_path / "single.yaml", alone)
        code = cli.main(["validate", "--config", str(single)])
        err = capsys.readouterr().err
        assert code == 2 and needle in err, err


def test_run_config_carries_the_list_and_the_recipe_concatenates(assets, tmp_path):
    cfg = load_config(str(two_datasets(assets, tmp_path)), [])
    validate_config(cfg)
    run = run_config(cfg)
    node = run.components["dataset"]
    assert isinstance(node, ListConfig) and len(node) == 2
    tokenizer = build_component(
        "tokenizer", run.components["tokenizer"], trust=False, fix="check the tokenizer"
    )
    dataset = data.build_dataset(node, tokenizer, trust=False)
    assert isinstance(dataset, ConcatDataset) and len(dataset) == 8
    first, last = dataset[0]["tokens"], dataset[7]["tokens"]
    assert (
        first
        == build_component("dataset[0]", node[0], tokenizer, trust=False, fix="x")[0]["tokens"]
    )
    assert (
        last == build_component("dataset[1]", node[1], tokenizer, trust=False, fix="x")[4]["tokens"]
    )
    assert first != last
    # One node (not a list) builds that dataset alone.
    assert len(data.build_dataset(node[1], tokenizer, trust=False)) == 5


def test_an_error_names_the_entry(assets, tmp_path, capsys):
    config = two_datasets(assets, tmp_path)
    bad = write_jsonl(tmp_path / "columns.jsonl", [{"question": "1+1", "answer": "2"}] * 4)
    code = cli.main(["validate", "--config", str(config), f"dataset.1.data_files={bad}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    # The data check reads the concatenation: the 4th example is the first of dataset[1].
    (error,) = [line for line in err.splitlines() if line.startswith("kd: error:")]
    assert error.startswith("kd: error: dataset: example 3 cannot be read (KeyError: 'input')")
    code = cli.main(["validate", "--config", str(config), "dataset.0.column_map={a: b}"])
    err = capsys.readouterr().err
    assert code == 2 and "kd: error: dataset[0]: torchtune.datasets.instruct_dataset failed" in err
