"""``kd_ratio: 0`` through ``kd run`` on the tiny assets: no teacher logits are computed for a loss
nobody trains on. Sequence-level KD (``on_policy: {lmbda: 0, seq_kd: true}``) keeps the teacher
to sample its answers but never runs its forward on the rows the student trains or validates on;
a teacher nothing asks for is not loaded; ``kd_loss`` / ``val_kd_loss`` are absent from the rows.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kd.teachers.model
from kd import cli
from kd.config.run import LossSettings
from kd.teachers.build import NOT_ASKED, ModelTeacherSource
from tests.conftest import UNTIMED, make_config, read_metrics, write_config

# One intra-op thread (tests/conftest.py): the same float reductions in every run.
pytestmark = pytest.mark.usefixtures("one_thread")

KD_KEYS = {"kd_loss", "val_kd_loss", "val_top1_agreement"}
UNTIMED_ROWS = UNTIMED | {"val_seconds"}


def run(tmp_path: Path, name: str, assets: dict, **top) -> Path:
    out = tmp_path / name
    cfg = make_config(assets, out, **top)
    cfg["validation"] = {"dataset": dict(cfg["dataset"]), "every_n_steps": 1, "max_batches": 2}
    config = write_config(tmp_path / f"{name}.yaml", cfg)
    assert cli.main(["run", "kd", "--config", str(config)]) == 0
    return out


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def rows_without(out: Path, keys: set[str]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in keys} for r in read_metrics(out)]


def count_signals(monkeypatch) -> list[tuple[int, ...]]:
    """The shape of every batch the model teacher is asked to score (its forward on the rows
    a step or an evaluation trains or validates on)."""
    seen: list[tuple[int, ...]] = []
    original = kd.teachers.model.ModelTeacher.signal

    def signal(self, batch):
        seen.append(tuple(batch.tokens.shape))
        return original(self, batch)

    monkeypatch.setattr(kd.teachers.model.ModelTeacher, "signal", signal)
    return seen


def force_old_path(monkeypatch) -> None:
    """The code path before kd_ratio 0 skipped the teacher: every step and evaluation asks it
    for logits and the fused KD loss computes a KD term weighted by 0."""
    monkeypatch.setattr(LossSettings, "needs_teacher_logits", property(lambda self: True))


SEQ_KD = {"lmbda": 0.0, "seq_kd": True, "max_new_tokens": 8, "temperature": 0.0}


@pytest.mark.parametrize("temperature", [2.0, 1.0], ids=["T2", "T1"])
def test_seq_kd_with_kd_ratio_0_never_scores_with_the_teacher(
    assets, tmp_path, monkeypatch, temperature
):
    """seq-KD, kd_ratio 0: the teacher samples every micro-batch's answers and is asked for no
    logits; the student trains as it did when the teacher's KD term was computed and weighted
    by 0 (the old path, forced): the same CE step by step and the same weights."""
    top = dict(kd_ratio=0.0, temperature=temperature, max_steps_per_epoch=2, on_policy=SEQ_KD)
    seen = count_signals(monkeypatch)
    new = run(tmp_path, "new", assets, **top)
    assert seen == []
    rows = read_metrics(new)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["sampled_batches_teacher"] == 2 and r["num_tokens"] == r["sampled_tokens_teacher"]
        assert r["time_teacher_s"] == 0.0
    assert not KD_KEYS & {k for r in rows for k in r}
    assert [r["step"] for r in rows if "val_ce_loss" in r] == [1, 2]

    force_old_path(monkeypatch)
    old = run(tmp_path, "old", assets, **top)
    assert len(seen) == 2 * 2 + 2 * 2  # 2 micro-batches per step, 2 validation batches per step
    old_rows = read_metrics(old)
    assert all("kd_loss" in r for r in old_rows if "loss" in r)
    w_new, w_old = weights(new), weights(old)
    if temperature != 1.0:
        # the CE of the fused KD loss at T != 1 is the fused CE head's arithmetic: bit for bit
        assert rows_without(new, UNTIMED_ROWS | KD_KEYS) == rows_without(
            old, UNTIMED_ROWS | KD_KEYS
        )
        assert all(torch.equal(w_new[k], w_old[k]) for k in w_new)
    else:
        # At T = 1 the fused KD loss takes its CE from the log-softmax it shares with the
        # divergence, which rounds differently from the CE head kd_ratio 0 now trains with (the
        # head of teacher_model: null): the same CE to float32 rounding, and weights within
        # float32 noise after AdamW (a step of lr 1e-3 that went wrong would be 1e-3 off).
        for a, b in zip(train, [r for r in old_rows if "loss" in r], strict=True):
            assert a["ce_loss"] == pytest.approx(b["ce_loss"], rel=1e-6)
        for k in w_new:
            torch.testing.assert_close(w_new[k], w_old[k], rtol=1e-5, atol=1e-5)


def test_kd_ratio_0_without_seq_kd_loads_no_teacher(assets, tmp_path, monkeypatch, caplog):
    """kd_ratio 0 with teacher_model set and nothing sampled by the teacher: the teacher is not
    loaded (said once) and the run trains, validates and logs exactly as teacher_model: null."""
    loads = []
    monkeypatch.setattr(ModelTeacherSource, "load", lambda *a, **k: loads.append(1))
    with caplog.at_level(logging.INFO, logger="kd"):
        with_teacher = run(tmp_path, "with", assets, kd_ratio=0.0, max_steps_per_epoch=2)
    assert loads == []
    assert [r.getMessage() for r in caplog.records].count(NOT_ASKED) == 1
    plain = run(
        tmp_path,
        "plain",
        assets,
        kd_ratio=0.0,
        max_steps_per_epoch=2,
        teacher_model=None,
        teacher_checkpointer=None,
    )
    assert rows_without(with_teacher, UNTIMED_ROWS) == rows_without(plain, UNTIMED_ROWS)
    assert not KD_KEYS & {k for r in read_metrics(plain) for k in r}
    w_a, w_b = weights(with_teacher), weights(plain)
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)


def test_hidden_states_with_kd_ratio_0_run_the_teacher_for_their_term(
    assets, tmp_path, monkeypatch
):
    """kd_ratio 0 with hidden-state targets: the teacher still runs (its states train the
    student), its logits do not: the loss is CE + weight * hidden_loss, no kd_loss."""
    seen = count_signals(monkeypatch)
    hidden = {"layer_map": ["0:0", "norm:norm"], "loss": "cosine", "weight": 1.0}
    out = run(tmp_path, "hs", assets, kd_ratio=0.0, max_steps_per_epoch=2, hidden_states=hidden)
    assert len(seen) == 2 * 2 + 2 * 2  # every micro-batch and validation batch
    rows = read_metrics(out)
    assert not KD_KEYS & {k for r in rows for k in r}
    train = [r for r in rows if "loss" in r]
    assert len(train) == 2
    for r in train:
        assert r["loss"] == pytest.approx(r["ce_loss"] + r["hidden_loss"], rel=1e-6)
        assert r["hidden_loss"] > 0
    assert all("val_hidden_loss" in r for r in rows if "val_ce_loss" in r)
