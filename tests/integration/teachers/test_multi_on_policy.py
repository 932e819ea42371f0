"""``teachers: {combine: route}`` with ``on_policy:`` through ``kd run``: a sampled completion
keeps the route of the row whose prompt it completes, so the teacher the row names scores the
student's own tokens (and, with ``seq_kd``, samples them); rows naming no teacher learn from CE on
their own data, as off-policy routing does.

With ``lr: 0`` the student never changes, so step ``k`` of a run depends only on row ``k``
(``batch_size: 1``): each step of the routed run is compared with the same step of a one-teacher
run of the teacher that row names (the same coin, the same row generator, the same samples)."""

from __future__ import annotations

from pathlib import Path

import pytest

import kd.rollouts.sampling
from kd import cli
from kd.testing import checkpointer_node, write_jsonl
from tests.conftest import TEACHER, builder, make_config, read_metrics, write_config, write_hf_qwen2

# One intra-op thread (tests/conftest.py): the same float reductions in every run.
pytestmark = pytest.mark.usefixtures("one_thread")

ROUTES = ["a", "b", None, "a", "b", None, "b", "a"]


@pytest.fixture(scope="module")
def second_teacher(tmp_path_factory) -> Path:
    return write_hf_qwen2(tmp_path_factory.mktemp("t2") / "teacher2", TEACHER, seed=7)


@pytest.fixture(scope="module")
def routed_data(tmp_path_factory) -> Path:
    rows = []
    for i, route in enumerate(ROUTES):
        row = {"input": f"{i}+{2 * i}", "output": str(3 * i)}
        if route is not None:
            row["domain"] = route
        rows.append(row)
    return write_jsonl(tmp_path_factory.mktemp("routed") / "train.jsonl", rows)


def _on_policy(seq_kd: bool) -> dict:
    return {"lmbda": 0.5, "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "seq_kd": seq_kd}


def _config(assets: dict, out: Path, data: Path, teacher: Path | None, **top) -> dict:
    """One row a step, a student that never changes (lr 0)."""
    cfg = make_config(
        assets,
        out,
        batch_size=1,
        gradient_accumulation_steps=1,
        max_steps_per_epoch=len(ROUTES),
        optimizer={"_component_": "torch.optim.AdamW", "lr": 0.0},
        **top,
    )
    cfg["dataset"]["data_files"] = str(data)
    if teacher is None:  # teachers: a (the assets' teacher) and b, routed by the row's domain
        del cfg["teacher_model"], cfg["teacher_checkpointer"]
    else:
        cfg["teacher_checkpointer"] = checkpointer_node(teacher, out / "tt_t")
    return cfg


def _routed(assets: dict, second: Path, out: Path) -> dict:
    return {
        "combine": "route",
        "route_field": "domain",
        "members": [
            {
                "name": name,
                "teacher_model": builder(TEACHER),
                "teacher_checkpointer": checkpointer_node(folder, out / f"tt_{name}"),
            }
            for name, folder in (("a", assets["teacher"]), ("b", second))
        ],
    }


def _steps(cfg: dict, path: Path) -> list[dict]:
    assert cli.main(["run", "kd", "--config", str(write_config(path, cfg))]) == 0
    rows = [r for r in read_metrics(Path(cfg["output_dir"])) if "loss" in r and "step" in r]
    assert [r["step"] for r in rows] == list(range(1, len(ROUTES) + 1))
    return rows


@pytest.mark.parametrize("seq_kd", [False, True], ids=["student", "seq_kd"])
def test_each_row_is_scored_by_the_teacher_it_names(
    assets, second_teacher, routed_data, tmp_path, seq_kd
):
    op = _on_policy(seq_kd)
    routed = _config(assets, tmp_path / "routed", routed_data, None, on_policy=op)
    routed["teachers"] = _routed(assets, second_teacher, tmp_path / "routed")
    steps = _steps(routed, tmp_path / "routed.yaml")
    alone = {
        "a": _steps(
            _config(assets, tmp_path / "a", routed_data, assets["teacher"], on_policy=op),
            tmp_path / "a.yaml",
        ),
        "b": _steps(
            _config(assets, tmp_path / "b", routed_data, second_teacher, on_policy=op),
            tmp_path / "b.yaml",
        ),
    }
    off = _config(assets, tmp_path / "off", routed_data, None)
    off["teachers"] = _routed(assets, second_teacher, tmp_path / "off")
    off_steps = _steps(off, tmp_path / "off.yaml")
    sampled = [r["sampled_batches_student"] for r in steps]
    assert 0 < sum(sampled) < len(ROUTES)  # both sides of the coin occur
    for k, (route, r) in enumerate(zip(ROUTES, steps, strict=True)):
        if route is None:  # CE on the row's own data, exactly as the off-policy routed run
            assert r["kd_loss"] == 0 and r["loss"] == pytest.approx(r["ce_loss"], rel=1e-6)
            assert r["ce_loss"] == pytest.approx(off_steps[k]["ce_loss"], rel=1e-5)
            assert r["sampled_tokens_student"] == r["sampled_tokens_teacher"] == 0
            continue
        ref = alone[route][k]  # the same sampled tokens, scored by the row's teacher alone
        assert r["num_tokens"] == ref["num_tokens"], k
        for key in ("sampled_tokens_student", "sampled_tokens_teacher"):
            assert r[key] == ref[key], (k, key)
        for key in ("loss", "ce_loss", "kd_loss"):
            assert r[key] == pytest.approx(ref[key], rel=1e-5), (k, key)
        assert r[f"kd_loss/{route}"] == pytest.approx(r["kd_loss"], rel=1e-6)
        other = "b" if route == "a" else "a"
        assert r[f"kd_loss/{other}"] == 0
    if seq_kd:  # tails sample the row's own teacher
        assert sum(r["sampled_batches_teacher"] for r in steps) > 0


def test_a_batch_samples_each_rows_teacher(
    assets, second_teacher, routed_data, tmp_path, monkeypatch
):
    """Four rows a micro-batch (a, b, none, a; then b, none, b, a): with seq_kd each teacher
    samples its own rows only, and the row naming none is not sampled."""
    seen: list[tuple[int, int]] = []
    original = kd.rollouts.sampling.rollout

    def spy(model, prompts, **kwargs):
        seen.append((id(model), int(prompts.tokens.shape[0])))
        return original(model, prompts, **kwargs)

    monkeypatch.setattr(kd.rollouts.sampling, "rollout", spy)
    op = dict(_on_policy(True), lmbda=0.0)
    cfg = _config(assets, tmp_path / "run", routed_data, None, on_policy=op)
    cfg.update(batch_size=4, max_steps_per_epoch=1, gradient_accumulation_steps=2)
    cfg["teachers"] = _routed(assets, second_teacher, tmp_path / "run")
    assert cli.main(["run", "kd", "--config", str(write_config(tmp_path / "c.yaml", cfg))]) == 0
    # micro-batch 1: a samples 2 rows, b 1; micro-batch 2: a 1, b 2 (sorted by name)
    assert [n for _, n in seen] == [2, 1, 1, 2]
    assert seen[0][0] == seen[2][0] != seen[1][0] == seen[3][0]
    (row,) = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert row["sampled_batches_teacher"] == 2 and row["sampled_tokens_student"] == 0
    assert row["kd_loss"] == pytest.approx(row["kd_loss/a"] + row["kd_loss/b"], rel=1e-5)
    assert row["kd_loss/a"] > 0 and row["kd_loss/b"] > 0
    # the row naming none kept its data: more tokens than the teachers' completions alone
    assert row["num_tokens"] > row["sampled_tokens_teacher"]


def test_routed_seq_kd_with_kd_ratio_0_asks_no_member_for_logits(
    assets, second_teacher, routed_data, tmp_path, monkeypatch
):
    """Routed seq-KD with kd_ratio 0: each row's teacher samples its answer, then no member is
    asked to score anything: no kd_loss nor kd_loss/<name> in the row."""
    import kd.teachers.multi

    asked = []
    monkeypatch.setattr(
        kd.teachers.multi.MultiTeacher, "signal", lambda self, batch: asked.append(1)
    )
    op = dict(_on_policy(True), lmbda=0.0)
    cfg = _config(assets, tmp_path / "run", routed_data, None, on_policy=op, kd_ratio=0.0)
    cfg.update(batch_size=4, max_steps_per_epoch=1, gradient_accumulation_steps=2)
    cfg["teachers"] = _routed(assets, second_teacher, tmp_path / "run")
    assert cli.main(["run", "kd", "--config", str(write_config(tmp_path / "c.yaml", cfg))]) == 0
    assert asked == []
    (row,) = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert row["sampled_batches_teacher"] == 2 and row["loss"] == row["ce_loss"]
    assert not [k for k in row if k.startswith("kd_loss")]


def _unknown(cfg: dict, data: Path, tmp: Path) -> str:
    bad = write_jsonl(tmp / "bad.jsonl", [{"input": "1+1", "output": "2", "domain": "c"}] * 8)
    cfg["dataset"]["data_files"] = str(bad)
    return "kd: error: dataset: row 1 has domain='c', which names no teacher"


def _stored_member(cfg: dict, data: Path, tmp: Path) -> str:
    cfg["teachers"]["members"][1]["teacher_logits"] = {"path": str(tmp / "store"), "k": 8}
    return "kd: error: teachers.members[1].teacher_logits: holds stored log-probs"


def _served_sampler(cfg: dict, data: Path, tmp: Path) -> str:
    member = cfg["teachers"]["members"][1]
    del member["teacher_model"], member["teacher_checkpointer"]
    member["teacher_server"] = {"url": "http://127.0.0.1:9", "tail": "renorm"}
    return "kd: error: teachers.members[1].teacher_server: cannot sample its rows' completions"


@pytest.mark.parametrize("mistake", [_unknown, _stored_member, _served_sampler])
def test_mistakes_one_line(assets, second_teacher, routed_data, tmp_path, capsys, mistake):
    out = tmp_path / "run"
    cfg = _config(assets, out, routed_data, None, on_policy=_on_policy(True))
    cfg["teachers"] = _routed(assets, second_teacher, out)
    start = mistake(cfg, routed_data, tmp_path)
    path = write_config(tmp_path / "cfg.yaml", cfg)
    assert cli.main(["validate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("kd: error:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith(start), errors
    assert not out.exists()


def test_routed_on_policy_validates(assets, second_teacher, routed_data, tmp_path):
    """The refusal of route with on_policy is gone: kd validate passes."""
    out = tmp_path / "run"
    cfg = _config(assets, out, routed_data, None, on_policy=_on_policy(False))
    cfg["teachers"] = _routed(assets, second_teacher, out)
    assert cli.main(["validate", "--config", str(write_config(tmp_path / "c.yaml", cfg))]) == 0


@pytest.mark.slow
def test_routed_seq_kd_on_two_ranks_where_each_rank_sees_one_teacher(
    assets, second_teacher, tmp_path
):
    """Under torchrun (2 gloo ranks, FSDP2) rank 0's rows all name teacher a and rank 1's all
    name b: with seq_kd every rank samples with both teachers (the sharded sampling runs
    collectives; the other rank's teacher on all its rows, unused), so the run ends, and each
    step equals the one-device run of the same global batches (greedy sampling)."""
    from tests.integration.runtime.test_distributed_run import TOL
    from tests.integration.teachers.test_store_reader_distributed import _launch

    rows = [
        {"input": f"{i}+{i}", "output": str(2 * i), "domain": "a" if i % 2 == 0 else "b"}
        for i in range(32)
    ]
    data = write_jsonl(tmp_path / "split.jsonl", rows)
    op = dict(_on_policy(True), temperature=0.0)

    def cfg(out: Path, batch_size: int) -> dict:
        c = make_config(assets, out, on_policy=op, batch_size=batch_size, max_steps_per_epoch=2)
        c["dataset"]["data_files"] = str(data)
        del c["teacher_model"], c["teacher_checkpointer"]
        c["teachers"] = _routed(assets, second_teacher, out)
        return c

    pair, one = tmp_path / "pair", tmp_path / "one"
    _launch("kd", write_config(tmp_path / "pair.yaml", cfg(pair, 4)))
    assert (
        cli.main(["run", "kd", "--config", str(write_config(tmp_path / "one.yaml", cfg(one, 8)))])
        == 0
    )
    steps = [r for r in read_metrics(pair) if "loss" in r]
    reference = [r for r in read_metrics(one) if "loss" in r]
    assert [r["step"] for r in steps] == [r["step"] for r in reference] == [1, 2]
    assert sum(r["sampled_batches_teacher"] for r in steps) > 0
    for r, ref in zip(steps, reference, strict=True):
        assert r["num_tokens"] == ref["num_tokens"]
        for key in ("loss", "ce_loss", "kd_loss", "kd_loss/a", "kd_loss/b"):
            assert r[key] == pytest.approx(ref[key], abs=TOL, rel=0), (r["step"], key)
