"""Validation during training through `kd run`: metric rows, keep_best's best/ folder (loaded by
transformers), early stopping, resume of the best value and the patience count, and 2 ranks
against one device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kd import cli
from kd.checkpoint import read_checkpoint_marker
from tests.conftest import make_config, read_metrics, run_kd, write_config, write_data

VAL_KEYS = {"val_loss", "val_ce_loss", "val_kd_loss", "val_top1_agreement", "val_num_tokens"}
# AdamW at this lr: the validation loss falls, then rises (the best step is neither the first nor
# the last), on the tiny assets with shuffle off.
BUMPY = {"optimizer": {"_component_": "torch.optim.AdamW", "lr": 0.03}}


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> Path:
    """13 held-out examples (an odd number: no batch size or rank count divides it)."""
    return write_data(tmp_path_factory.mktemp("heldout") / "heldout.jsonl", 13, seed=11)


def _validation(data: Path, **kw) -> dict:
    node = {
        "_component_": "torchtune.datasets.instruct_dataset",
        "source": "json",
        "data_files": str(data),
        "split": "train",
    }
    return {"dataset": node, "every_n_steps": 1, **kw}


def _val_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if "val_loss" in r]


def test_keep_best_writes_best_at_the_best_step_loadable_by_transformers(assets, heldout, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    cfg = make_config(
        assets,
        out,
        validation=_validation(heldout, batch_size=5),
        keep_best={"metric": "val_loss", "mode": "min"},
        max_steps_per_epoch=6,
        save_every_n_steps=1,
        keep_last_n=10,
        **BUMPY,
    )
    assert run_kd(cfg, tmp_path / "cfg.yaml", recipe="kd_single_device") == 0
    rows = _val_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # no second evaluation at the end
    assert all(VAL_KEYS <= set(r) and "loss" not in r for r in rows)
    assert len({r["val_num_tokens"] for r in rows}) == 1
    best = min(rows, key=lambda r: r["val_loss"])
    assert 1 < best["step"] < 6, [r["val_loss"] for r in rows]

    marker = read_checkpoint_marker(out / "best")
    assert marker["step"] == best["step"]
    assert marker["best"] == {"metric": "val_loss", "value": best["val_loss"], "mode": "min"}
    saved = load_file(out / "best" / "model.safetensors")
    step = load_file(out / f"step_{best['step']:06d}" / "model.safetensors")
    assert sorted(saved) == sorted(step)
    for key in saved:
        assert torch.equal(saved[key], step[key]), key
    final = load_file(out / "final" / "model.safetensors")
    assert not torch.equal(final["model.norm.weight"], saved["model.norm.weight"])

    hf = AutoModelForCausalLM.from_pretrained(out / "best", dtype=torch.float32)
    hf_state = hf.state_dict()
    for key, value in saved.items():
        torch.testing.assert_close(hf_state[key], value, atol=0, rtol=0)


def test_validation_only_at_the_end_and_batch_size_does_not_change_it(assets, heldout, tmp_path):
    rows = {}
    for batch in (1, 13):
        out = tmp_path / f"b{batch}"
        val = _validation(heldout, every_n_steps=None, batch_size=batch)
        cfg = make_config(assets, out, validation=val, max_steps_per_epoch=2)
        assert run_kd(cfg, tmp_path / f"b{batch}.yaml", recipe="kd_single_device") == 0
        rows[batch] = _val_rows(out)
        assert [r["step"] for r in rows[batch]] == [2]
        assert not (out / "best").exists()
    for key in VAL_KEYS:
        assert rows[1][0][key] == pytest.approx(rows[13][0][key], rel=1e-6), key


def test_early_stopping_after_patience_evaluations_without_improvement(
    assets, heldout, tmp_path, capsys
):
    """lr 0: the student never changes, so every evaluation after the first is no improvement."""
    out = tmp_path / "run"
    cfg = make_config(
        assets,
        out,
        validation=_validation(heldout),
        early_stopping={"patience": 2},
        optimizer={"_component_": "torch.optim.SGD", "lr": 0.0},
        max_steps_per_epoch=6,
    )
    assert run_kd(cfg, tmp_path / "cfg.yaml", recipe="kd_single_device") == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "early stopping" in line]
    assert lines == [
        f"kd: early stopping after step 3 of 6: val_loss did not improve (min) for 2 evaluations "
        f"(early_stopping.patience=2); the best was {_val_rows(out)[0]['val_loss']:.6g} at step 1; "
        f"saved {out / 'final'}"
    ], err[-2000:]
    assert max(r["step"] for r in read_metrics(out)) == 3
    assert [r["step"] for r in _val_rows(out)] == [1, 2, 3]
    assert (out / "final" / "model.safetensors").exists()


def test_resume_restores_the_best_value_and_the_patience_count(assets, heldout, tmp_path, capsys):
    """Stopped at step 2 and resumed, the run stops early where an uninterrupted one does (lr 0:
    every evaluation after the first is no improvement), and best/ keeps step 1. A resumed run
    that started the count over would evaluate steps 3-6 as 1 best and 3 misses and end without
    stopping early, and would write best/ at step 3."""

    def config(out: Path, steps: int) -> dict:
        return make_config(
            assets,
            out,
            validation=_validation(heldout, batch_size=5),
            keep_best={"metric": "val_loss"},
            early_stopping={"patience": 3},
            optimizer={"_component_": "torch.optim.AdamW", "lr": 0.0},
            max_steps_per_epoch=steps,
            save_every_n_steps=2,
        )

    whole = tmp_path / "whole"
    assert run_kd(config(whole, 6), tmp_path / "whole.yaml", recipe="kd_single_device") == 0
    stopped_whole = [line for line in capsys.readouterr().err.splitlines() if "early" in line]
    assert len(stopped_whole) == 1 and "after step 4 of 6" in stopped_whole[0]
    assert read_checkpoint_marker(whole / "best")["step"] == 1

    parts = tmp_path / "parts"
    assert (
        run_kd(config(parts, 2), tmp_path / "parts.yaml", recipe="kd_single_device") == 0
    )  # ends at step 2 (a step save)
    capsys.readouterr()
    state = torch.load(parts / "step_000002" / "recipe_state.pt", weights_only=True)
    assert state["validation"]["best_step"] == 1 and state["validation"]["bad_evals"] == 1
    resumed = config(parts, 6)
    assert (
        run_kd(
            resumed,
            tmp_path / "resumed.yaml",
            "resume_from_checkpoint=true",
            recipe="kd_single_device",
        )
        == 0
    )
    stopped = [line for line in capsys.readouterr().err.splitlines() if "early" in line]
    assert stopped == [stopped_whole[0].replace(str(whole), str(parts))]
    assert read_checkpoint_marker(parts / "best")["step"] == 1
    assert [r["step"] for r in _val_rows(parts)] == [1, 2, 3, 4]
    assert [r["val_loss"] for r in _val_rows(parts)] == [r["val_loss"] for r in _val_rows(whole)]


@pytest.mark.slow
def test_two_ranks_give_the_validation_metrics_of_one_device(assets, heldout, tmp_path):
    from tests.integration.runtime.test_distributed_run import _launch

    rows = {}
    for world, batch, val_batch in ((1, 8, 5), (2, 4, 3)):
        out = tmp_path / f"w{world}"
        cfg = make_config(
            assets,
            out,
            batch_size=batch,
            validation=_validation(heldout, every_n_steps=2, batch_size=val_batch),
            keep_best={"metric": "val_top1_agreement"},
        )
        path = write_config(tmp_path / f"w{world}.yaml", cfg)
        if world == 1:
            assert cli.main(["run", "kd_single_device", "--config", str(path)]) == 0
        else:
            _launch(path)
        rows[world] = _val_rows(out)
    assert [r["step"] for r in rows[1]] == [r["step"] for r in rows[2]] == [2, 3]
    for one, two in zip(rows[1], rows[2], strict=True):
        assert one["val_num_tokens"] == two["val_num_tokens"]
        for key in VAL_KEYS:
            assert two[key] == pytest.approx(one[key], abs=1e-6, rel=0), (one["step"], key)
    marker = json.loads((tmp_path / "w2" / "best" / "kd_checkpoint.json").read_text())
    assert marker["best"]["metric"] == "val_top1_agreement"


@pytest.mark.parametrize("content", ["", "\n\n"], ids=["zero_bytes", "blank_lines"])
def test_empty_validation_file_says_so(assets, tmp_path, capsys, content):
    """An empty validation data file: one line naming the key and the file (was: Hugging Face's
    StopIteration quoted as the builder's failure), exit 2, nothing written."""
    empty = tmp_path / "heldout.jsonl"
    empty.write_text(content)
    out = tmp_path / "run"
    cfg = make_config(assets, out, validation=_validation(empty), max_steps_per_epoch=1)
    assert run_kd(cfg, tmp_path / "c.yaml", recipe="kd_single_device") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "StopIteration" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert line == (
        f"kd: error: validation.dataset: {empty} has no examples (it is empty); point "
        "validation.dataset.data_files at a file with examples"
    )
    assert not out.exists() or not any(out.iterdir())
