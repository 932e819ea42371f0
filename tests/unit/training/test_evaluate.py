"""kd.training.evaluate: token-weighted held-out metrics against a hand computation with kd.losses on full
logits, for any batch size; the training loss's definitions; the rank shards; the best tracker."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kd import _torchtune as tt
from kd import data, losses, models
from kd.config.run import LossSettings
from kd.training import evaluate, train
from tests.conftest import tiny_hidden_decoder

VOCAB_S, VOCAB_T = 64, 80  # the teacher's padded vocab is larger, as Qwen2.5-14B vs 3B


@pytest.fixture(scope="module")
def student() -> torch.nn.Module:
    return tiny_hidden_decoder(VOCAB_S, 32, seed=0)


@pytest.fixture(scope="module")
def teacher() -> torch.nn.Module:
    return models.freeze(tiny_hidden_decoder(VOCAB_T, 48, seed=5))


@pytest.fixture(scope="module")
def close_teacher(student) -> torch.nn.Module:
    """The student with noise on its weights: it agrees with the student on many positions, not
    all, so the agreement is neither 0 nor 1."""
    t = copy.deepcopy(student)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in t.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
    return models.freeze(t)


def _examples(n: int = 11, seed: int = 1) -> list[dict[str, list[int]]]:
    """Examples of different lengths with masked prompts; one has no labelled token at all."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(5, 15, (1,), generator=g))
        tokens = torch.randint(1, 60, (length,), generator=g).tolist()
        prompt = int(torch.randint(1, 4, (1,), generator=g))
        labels = [-100] * prompt + tokens[prompt:]
        if i == 4:
            labels = [-100] * length
        rows.append({"tokens": tokens, "labels": labels})
    return rows


def _reference(student, teacher, rows, settings: LossSettings) -> dict[str, float]:
    """The metrics from full logits of each example on its own, with kd.losses over all labelled
    positions of the set at once."""
    s_all, t_all, y_all = [], [], []
    with torch.no_grad():
        for row in rows:
            tokens = torch.tensor([row["tokens"]])
            s_all.append(models.logits_from_hidden(student, student(tokens))[0])
            t_all.append(models.logits_from_hidden(teacher, teacher(tokens))[0])
            y_all.append(train.shift_labels(torch.tensor([row["labels"]]))[0])
    s, t, y = torch.cat(s_all), torch.cat(t_all), torch.cat(y_all)
    ce = float(losses.ce_loss(s, y))
    kd = float(
        losses.kd_loss(
            s,
            t,
            y,
            divergence=settings.divergence,
            temperature=settings.temperature,
            beta=settings.beta,
            skew_alpha=settings.skew_alpha,
        )
    )
    mask = y != -100
    vocab = min(s.size(-1), t.size(-1))
    agree = s[:, :vocab].argmax(-1) == t[:, :vocab].argmax(-1)
    return {
        "val_loss": (1 - settings.kd_ratio) * ce + settings.kd_ratio * kd,
        "val_ce_loss": ce,
        "val_kd_loss": kd,
        "val_top1_agreement": int(agree[mask].sum()) / int(mask.sum()),
        "val_num_tokens": int(mask.sum()),
    }


def _evaluate(student, teacher, rows, settings, *, batch_size, max_batches=None):
    loader = data.build_eval_loader(rows, batch_size=batch_size, max_batches=max_batches, pad_id=0)
    return evaluate.evaluate(
        student, teacher, loader, settings=settings, device=torch.device("cpu")
    ).metrics()


def _assert_metrics(got: dict, want: dict, rel: float = 1e-6) -> None:
    assert got["val_num_tokens"] == want["val_num_tokens"]
    for name in ("val_loss", "val_ce_loss", "val_kd_loss", "val_top1_agreement"):
        assert got[name] == pytest.approx(want[name], rel=rel, abs=1e-9), name


@pytest.mark.parametrize(
    "settings",
    [
        LossSettings(kd_ratio=0.5, chunk_size=7),
        LossSettings(kd_ratio=0.8, temperature=2.0, divergence="jsd", beta=0.3, chunk_size=5),
        LossSettings(kd_ratio=0.3, temperature=0.5, divergence="reverse_kl", chunk_size=1000),
    ],
    ids=["forward_kl", "jsd_T2", "reverse_kl_T0.5"],
)
def test_token_weighted_over_the_set_for_any_batch_size(student, teacher, settings):
    rows = _examples()
    want = _reference(student, teacher, rows, settings)
    assert want["val_kd_loss"] > 0
    for batch_size in (1, 3, len(rows)):
        _assert_metrics(_evaluate(student, teacher, rows, settings, batch_size=batch_size), want)


def test_not_a_mean_of_batch_means(student, teacher):
    """Batches with very different numbers of labelled tokens: the mean of batch means differs
    from the token-weighted value, which evaluate gives."""
    settings = LossSettings(chunk_size=4)
    rows = _examples()
    got = _evaluate(student, teacher, rows, settings, batch_size=3)
    means = [
        _reference(student, teacher, rows[i : i + 3], settings)["val_ce_loss"]
        for i in range(0, len(rows), 3)
    ]
    assert abs(sum(means) / len(means) - got["val_ce_loss"]) > 1e-4
    assert got["val_ce_loss"] == pytest.approx(
        _reference(student, teacher, rows, settings)["val_ce_loss"], rel=1e-6
    )


def test_top1_agreement_is_the_direct_argmax_comparison(student, close_teacher):
    settings = LossSettings(chunk_size=6)
    rows = _examples()
    want = _reference(student, close_teacher, rows, settings)
    assert 0.2 < want["val_top1_agreement"] < 1.0  # a value that tells right from wrong
    for batch_size in (1, 4):
        got = _evaluate(student, close_teacher, rows, settings, batch_size=batch_size)
        assert got["val_top1_agreement"] == want["val_top1_agreement"]  # a count: exact


@pytest.mark.parametrize("divergence", ["forward_kl", "symmetric_kl", "tvd", "skew_reverse_kl"])
def test_equals_the_training_loss_on_the_same_batch(student, teacher, divergence):
    """val_loss, val_ce_loss and val_kd_loss of one batch are the training step's loss, ce and kd
    (the fused path, which the recipe runs)."""
    settings = LossSettings(kd_ratio=0.6, temperature=1.5, divergence=divergence, chunk_size=8)
    rows = _examples(n=4, seed=3)
    batch = tt.padded_collate_sft(rows, padding_idx=0, ignore_idx=-100)
    labels = train.shift_labels(batch["labels"])
    with torch.no_grad():
        loss, ce, kd = train.compute_loss(
            student, teacher, batch["tokens"], labels, settings=settings
        )
    got = _evaluate(student, teacher, rows, settings, batch_size=len(rows))
    assert got["val_loss"] == pytest.approx(float(loss), rel=1e-5)
    assert got["val_ce_loss"] == pytest.approx(float(ce), rel=1e-5)
    assert got["val_kd_loss"] == pytest.approx(float(kd), rel=1e-5)


def test_max_batches_evaluates_the_first_examples(student, teacher):
    settings = LossSettings(chunk_size=16)
    rows = _examples()
    want = _reference(student, teacher, rows[:6], settings)
    _assert_metrics(_evaluate(student, teacher, rows, settings, batch_size=3, max_batches=2), want)


def test_without_a_teacher_only_ce(student, teacher):
    """No KD term: val_kd_loss and val_top1_agreement are absent from the row (not 0)."""
    settings = LossSettings(kd_ratio=0.0, chunk_size=16)
    rows = _examples()
    got = _evaluate(student, None, rows, settings, batch_size=3)
    assert "val_top1_agreement" not in got and "val_kd_loss" not in got
    want = _reference(student, teacher, rows, settings)
    assert got["val_ce_loss"] == pytest.approx(want["val_ce_loss"], rel=1e-6)
    assert got["val_loss"] == got["val_ce_loss"]


def test_kd_ratio_0_never_runs_the_teachers_forward(student, teacher):
    """kd_ratio 0 with a teacher (one kept to sample seq_kd completions): the evaluation runs no
    teacher forward and gives the row of an evaluation without a teacher, bit for bit."""
    settings = LossSettings(kd_ratio=0.0, chunk_size=16)
    calls = []
    handle = teacher.register_forward_hook(lambda *_: calls.append(1))
    try:
        got = _evaluate(student, teacher, _examples(), settings, batch_size=3)
    finally:
        handle.remove()
    assert calls == []
    alone = _evaluate(student, None, _examples(), settings, batch_size=3)
    assert {k: v for k, v in got.items() if k != "val_seconds"} == {
        k: v for k, v in alone.items() if k != "val_seconds"
    }
    # kd_ratio above 0: the same teacher is asked, and its metrics are in the row
    handle = teacher.register_forward_hook(lambda *_: calls.append(1))
    try:
        scored = _evaluate(student, teacher, _examples(), LossSettings(chunk_size=16), batch_size=3)
    finally:
        handle.remove()
    assert calls and "val_kd_loss" in scored and "val_top1_agreement" in scored


def test_eval_mode_during_no_autograd_and_training_mode_after(student, teacher):
    modes = []
    handle = student.register_forward_hook(
        lambda m, i, o: modes.append((m.training, o.requires_grad))
    )
    student.train()
    try:
        _evaluate(student, teacher, _examples(n=3), LossSettings(), batch_size=2)
    finally:
        handle.remove()
    assert modes == [(False, False), (False, False)]
    assert student.training
    student.eval()
    _evaluate(student, teacher, _examples(n=3), LossSettings(), batch_size=2)
    assert not student.training


@pytest.mark.parametrize("n", [1, 5, 7, 12])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_shards_count_every_example_once(n, world):
    rows = [{"tokens": [i, i], "labels": [i, i]} for i in range(n)]
    shards = [data.EvalShard(rows, num_examples=n, world_size=world, rank=r) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of batches
    labelled = [s[i]["tokens"][0] for s in shards for i in range(len(s)) if s[i]["labels"][0] >= 0]
    assert sorted(labelled) == list(range(n))
    fillers = [s[i] for s in shards for i in range(len(s)) if s[i]["labels"][0] < 0]
    assert len(fillers) == len(shards[0]) * world - n
    assert all(set(f["labels"]) == {-100} for f in fillers)


def test_best_tracker_min_max_nan_patience_and_state():
    t = evaluate.BestTracker("val_loss", "min", patience=2)
    assert t.update(2.0, step=1) and t.best == 2.0
    assert not t.update(2.0, step=2)  # equal is no improvement
    assert not t.should_stop
    assert not t.update(math.nan, step=3)  # nor is NaN
    assert t.should_stop and (t.best, t.best_step, t.bad_evals) == (2.0, 1, 2)
    assert t.update(1.5, step=4) and t.bad_evals == 0 and not t.should_stop

    restored = evaluate.BestTracker("val_loss", "min", patience=2)
    assert restored.load_state_dict(t.state_dict())
    assert restored == t
    assert not evaluate.BestTracker("val_loss", "min").load_state_dict({})  # old checkpoint
    other = evaluate.BestTracker("val_top1_agreement", "max")
    assert not other.load_state_dict(t.state_dict())  # another metric starts over
    assert other.best is None

    up = evaluate.BestTracker("val_top1_agreement", "max")
    assert up.update(0.5, step=1) and not up.update(0.4, step=2) and up.update(0.6, step=3)
    assert up.patience is None and not up.should_stop


def test_transformers_models(assets):
    """The transformers backend (kd.hf.causal_lm) goes through the same kd.models functions."""
    from kd.hf.model import causal_lm

    torch.manual_seed(0)
    hf_student = causal_lm(str(assets["student"]))
    hf_teacher = models.freeze(causal_lm(str(assets["teacher"])))
    for m in (hf_student, hf_teacher):
        m.float()
        models.set_hidden_output(m)
    settings = LossSettings(kd_ratio=0.7, temperature=2.0, chunk_size=5)
    rows = _examples(n=6, seed=4)
    want = _reference(hf_student, hf_teacher, rows, settings)
    for batch_size in (1, len(rows)):
        got = _evaluate(hf_student, hf_teacher, rows, settings, batch_size=batch_size)
        _assert_metrics(got, want, rel=1e-5)  # sdpa on batches of different shapes
