"""A teacher that poisons training silently (issue 41, class 2): answers whose top-k repeats a
token id, whose probabilities add up to more than 1, that are renormalised around entries of
probability 0, that hold NaN or ids outside the vocabulary, and cross-tokenizer stores whose
spans are reversed or short or whose shard was rewritten behind its manifest, are refused with
one line naming the source, the row and the position, through ``kd run`` from every source: a
vLLM or SGLang server (the run saves and stops as when the server dies; ``kd run teacher_logits``
stores nothing of it), kd's store (read, and written), axolotl's and DistillKit's files, and a
cross-tokenizer store (kd.teachers.answer_checks)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kd import cli
from kd.errors import KDUserError
from kd.fileio import sha256_file
from kd.teachers import store_format
from kd.teachers.answer_checks import ZERO_LOGPROB
from kd.teachers.served import TeacherClient
from kd.testing_server import TeacherTestServer
from tests.conftest import STUDENT, make_config, write_config
from tests.integration.teachers.test_cross_run import letter_data, other_tok_teacher  # noqa: F401 - fixtures
from tests.integration.teachers.test_cross_stored_run import TEACHER_SIZE
from tests.integration.teachers.test_cross_stored_run import _cfg as cross_cfg
from tests.integration.teachers.test_cross_stored_run import _store as cross_store
from tests.integration.teachers.test_foreign_store_run import _bad_file, foreign  # noqa: F401 - fixture
from tests.integration.teachers.test_served_teacher import (  # noqa: F401 - fixtures
    K,
    _settings,
    assert_same_steps,
    errors,
    served_config,
    stored_run,
    teacher_fn,
    tokenizer,
)
from tests.integration.teachers.test_store_reader_run import ROWS_PER_SHARD, precompute_config
from tests.integration.teachers.test_store_reader_run import store as kd_store  # noqa: F401 - fixture

SERVED_FIX = "serve the teacher's own log-probs"
SAID = {
    "repeat": "repeats the token id",
    "mass": "adding up to",
    "renorm": "entries of probability 0",
    "nan": "holds the log-prob nan",
    "outside": "outside the vocabulary",
}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = errors(err)
    return line


# ------------------------------------------------------------------------- served teachers
class PoisoningServer(TeacherTestServer):
    """The test server whose answer at the middle position of a faulted request is poisoned as
    a broken server, or a proxy in front of one, would send it: ``repeat`` (the rank-2 entry
    repeats the rank-1 id; in vLLM's dict keyed by id a repeat can only be another spelling of
    the key, ``"05"`` beside ``"5"``), ``mass`` (every top-k entry at probability 0.3) and
    ``renorm`` (a sampler's processed log-probs: the first two entries renormalised, the rest
    cut to probability 0, which vLLM's JSON writes as -9999.0 and SGLang's base64 as -inf)."""

    POISONS = ("repeat", "mass", "renorm")

    def _positions(self, ids: list[int], k: int, fault: str | None) -> list[list[tuple]]:
        out = super()._positions(ids, k, None if fault in self.POISONS else fault)
        if fault in self.POISONS and out:
            j = len(out) // 2
            out[j] = self._poison(out[j], fault, k)
        return out

    def _poison(self, entries: list[tuple], fault: str, k: int) -> list[tuple]:
        by_rank = {rank: (t, lp) for t, lp, rank in entries}
        out = []
        for t, lp, rank in entries:
            if fault == "repeat" and rank == 2:
                first = by_rank[1][0]
                t = f"0{first}" if self.api == "vllm" else first
            elif fault == "mass" and rank <= k:
                lp = math.log(0.3)
            elif fault == "renorm":
                top = np.logaddexp(by_rank[1][1], by_rank[2][1])
                zero = ZERO_LOGPROB if self.api == "vllm" else -math.inf
                lp = lp - top if rank <= 2 else zero
            out.append((t, lp, rank))
        return out


def _poisoning(teacher_fn, tokenizer, **kwargs) -> PoisoningServer:  # noqa: F811
    return PoisoningServer(teacher_fn, decode=lambda t: tokenizer.decode([t]), **kwargs)


SHAPES = {
    "vllm": {"api": "vllm"},
    "sglang": {"api": "sglang"},
    "sglang-base64": {"api": "sglang", "sglang_base64": True},
}


@pytest.mark.parametrize("kind", PoisoningServer.POISONS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_poisoned_answer_is_refused_with_the_row_and_position(
    shape,
    kind,
    teacher_fn,  # noqa: F811
    tokenizer,  # noqa: F811
):
    ids = tokenizer.encode("12+30=42 and 7+5=12", add_bos=False, add_eos=False)
    with _poisoning(teacher_fn, tokenizer, **SHAPES[shape]) as s:
        client = TeacherClient(_settings(s.url, api=SHAPES[shape]["api"]), vocab=STUDENT["vocab"])
        assert client.topk([ids], K)[0].ids.shape == (len(ids) - 1, K)  # unpoisoned: as served
        s.faults.append(kind)
        with pytest.raises(KDUserError) as err:
            client.topk([ids], K)
    text = str(err.value)
    assert "\n" not in text and s.url in text, text
    assert f"row 0 position {(len(ids) - 1) // 2 + 1} " in text, text
    assert SAID[kind] in text and SERVED_FIX in text, text
    if kind == "renorm":
        assert "renormalised around a cut vocabulary" in text and "raw_logprobs" in text


@pytest.mark.parametrize(("shape", "kind"), [("vllm", "repeat"), ("sglang-base64", "renorm")])
def test_a_poisoned_answer_mid_run_saves_stops_and_resumes(
    shape,
    kind,
    assets,
    stored_run,  # noqa: F811
    teacher_fn,  # noqa: F811
    tokenizer,  # noqa: F811
    tmp_path,
    capsys,
):
    """A server that answers step 2 with a poisoned top-k stops the run as a dying one does:
    step 1 saved, exit 2, one line; resumed against a sound server, the run ends as the one
    that met no poison."""
    api = SHAPES[shape]["api"]
    with _poisoning(teacher_fn, tokenizer, **SHAPES[shape]) as s:
        port = s.port
        s.faults.extend([""] * (1 + 8 + 3) + [kind])  # the probe, step 1, 3 rows of step 2
        config = served_config(assets, tmp_path, "poisoned", s.url, api=api, prefetch=0)
        capsys.readouterr()
        assert cli.main(["run", "kd", "--config", str(config)]) == 2
    line = _one_line(capsys)
    assert "gave a malformed answer: row 0 position" in line and SAID[kind] in line, line
    assert SERVED_FIX in line and "stopped after step 1; saved" in line, line
    assert (tmp_path / "poisoned" / "step_000001").is_dir()
    assert not (tmp_path / "poisoned" / "final").exists()
    sound = {k: v for k, v in SHAPES[shape].items() if k != "api"}
    with _poisoning(teacher_fn, tokenizer, api=api, port=port, **sound):
        assert cli.main(["run", "kd", "--config", str(config), "resume_from_checkpoint=true"]) == 0
    assert_same_steps(stored_run, tmp_path / "poisoned")


def test_a_server_of_processed_log_probs_is_refused_before_training(
    assets,
    teacher_fn,  # noqa: F811
    tokenizer,  # noqa: F811
    tmp_path,
    capsys,
):
    """The probe before training meets the renormalised answer: exit 2, nothing trained."""
    with _poisoning(teacher_fn, tokenizer) as s:
        s.faults.append("renorm")
        config = served_config(assets, tmp_path, "probe", s.url)
        capsys.readouterr()
        assert cli.main(["run", "kd", "--config", str(config)]) == 2
        assert s.requests == 1
    line = _one_line(capsys)
    assert "renormalised around a cut vocabulary" in line and "raw_logprobs" in line, line
    assert "stopped after step" not in line
    assert not (tmp_path / "probe" / "metrics.jsonl").exists()


def test_teacher_logits_stores_nothing_of_a_poisoned_answer(
    assets,
    teacher_fn,  # noqa: F811
    tokenizer,  # noqa: F811
    tmp_path,
    capsys,
):
    store = tmp_path / "logits"
    with _poisoning(teacher_fn, tokenizer) as s:
        s.faults.extend(["", "", "mass"])  # the probe, row 0; row 1 poisoned
        cfg = make_config(
            assets,
            tmp_path / "run",
            teacher_server={"url": s.url, "model": "tiny-teacher", "top_k": K, "backoff": 0},
            teacher_logits={"path": str(store), "k": K, "rows_per_shard": ROWS_PER_SHARD},
        )
        del cfg["teacher_model"], cfg["teacher_checkpointer"]
        capsys.readouterr()
        assert (
            cli.main(
                ["run", "teacher_logits", "--config", str(write_config(tmp_path / "c.yaml", cfg))]
            )
            == 2
        )
    line = _one_line(capsys)
    assert "adding up to" in line and SERVED_FIX in line, line
    assert not list(store.glob("*.parquet"))
    assert not json.loads((store / store_format.MANIFEST_FILE).read_text())["complete"]


# ------------------------------------------------------------------------- kd's store, read
def _rewrite(store: Path, dest: Path, names: list[str], edit) -> Path:
    """A copy of ``store`` whose shards ``names`` are rewritten with ``edit(rows)`` applied (the
    manifest's sizes follow, as a store written by another tool or edited with care would)."""
    shutil.copytree(store, dest)
    manifest_path = dest / store_format.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    for name in names:
        shard = dest / name
        schema = pq.read_schema(shard)
        rows = pq.read_table(shard).to_pylist()
        rows = edit(rows)
        pq.write_table(
            pa.Table.from_pylist(rows, schema=schema),
            shard,
            row_group_size=store_format.ROWS_PER_GROUP,
            compression="zstd",
            write_page_checksum=True,
        )
        entry = next(e for e in manifest["shards"] if e["name"] == name)
        entry.update(size=shard.stat().st_size, sha256=sha256_file(shard))
    manifest_path.write_text(json.dumps(manifest))
    return dest


def _poison_row(kind: str, k: int, vocab: int):
    """An edit of a shard's rows poisoning labelled position 1 of its first row."""

    def edit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ids, lp = rows[0]["ids"], rows[0]["logprobs"]
        if kind == "repeat":
            ids[k + 1] = ids[k]
        elif kind == "mass":
            lp[k : 2 * k] = [math.log(0.3)] * k
        elif kind == "renorm":
            top = float(np.logaddexp(lp[k], lp[k + 1]))
            lp[k], lp[k + 1] = lp[k] - top, lp[k + 1] - top
            lp[k + 2 : 2 * k] = [-math.inf] * (k - 2)
        elif kind == "nan":
            lp[k + 3] = math.nan
        elif kind == "outside":
            ids[k + 2] = vocab
        return rows

    return edit


def _train_from(assets, tmp: Path, store: Path) -> int:
    cfg = make_config(assets, tmp / "run", teacher_logits={"path": str(store), "k": K})
    return cli.main(["run", "kd", "--config", str(write_config(tmp / "c.yaml", cfg))])


@pytest.mark.parametrize("kind", list(SAID))
def test_a_poisoned_store_row_saves_stops_and_names_the_shard_row_and_position(
    kind,
    assets,
    kd_store,  # noqa: F811
    tmp_path,
    capsys,
):
    """Shard 1 (rows 16..31, first read at step 3) holds a poisoned row 16: steps 1 and 2 are
    saved, then one line names the shard, the row, the position and the fix."""
    name = store_format.shard_name(0, 1)
    store = _rewrite(kd_store, tmp_path / "logits", [name], _poison_row(kind, K, STUDENT["vocab"]))
    capsys.readouterr()
    assert _train_from(assets, tmp_path, store) == 2
    line = _one_line(capsys)
    assert f"teacher_logits.path: shard {store / name}, dataset row 16, labelled position 1" in line
    assert SAID[kind] in line and f"delete {store / name} and rerun kd run teacher_logits" in line
    assert "stopped after step 2; saved" in line, line
    assert (tmp_path / "run" / "step_000002").is_dir()


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda rows: rows[:-1], "holds 15 rows where its manifest places 16"),
        (lambda rows: rows[1:] + rows[:1], "holds dataset row 1 where its manifest places row 0"),
    ],
    ids=["fewer_rows", "other_rows"],
)
def test_a_shard_rewritten_behind_its_manifest_is_named(
    edit,
    said,
    assets,
    kd_store,  # noqa: F811
    tmp_path,
    capsys,
):
    name = store_format.shard_name(0, 0)
    store = _rewrite(kd_store, tmp_path / "logits", [name], edit)
    capsys.readouterr()
    assert _train_from(assets, tmp_path, store) == 2
    line = _one_line(capsys)
    assert f"shard {store / name} {said}: it was rewritten behind manifest.json" in line, line


# ------------------------------------------------------------------------- kd's store, written
@pytest.mark.parametrize("kind", ["nan", "repeat"])
def test_teacher_logits_refuses_to_store_a_poisoned_row(
    kind,
    assets,
    kd_store,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    """A teacher whose forward gives NaN (or a top-k with a repeat) at row 17: the shards
    before it are written as they would be, its shard is not, and the store stays incomplete."""
    original = store_format.topk_logprobs
    calls = []

    def poisoned(logits, **kw):
        ids, values = original(logits, **kw)
        calls.append(1)
        if len(calls) == 18:  # row 17 (one call per row of these short rows)
            if kind == "nan":
                values[1, 3] = float("nan")
            else:
                ids[1, 1] = ids[1, 0]
        return ids, values

    monkeypatch.setattr(store_format, "topk_logprobs", poisoned)
    folder = tmp_path / "logits"
    config = precompute_config(assets, tmp_path, folder)
    capsys.readouterr()
    assert cli.main(["run", "teacher_logits", "--config", str(config)]) == 2
    line = _one_line(capsys)
    assert (
        "teacher_logits.path: the teacher's answer for dataset row 17, labelled position 1" in line
    )
    assert SAID[kind] in line and "nothing of shard rank00000-00001.parquet was written" in line
    first = store_format.shard_name(0, 0)
    assert sorted(p.name for p in folder.glob("*.parquet")) == [first]
    assert (folder / first).read_bytes() == (kd_store / first).read_bytes()
    assert not json.loads((folder / store_format.MANIFEST_FILE).read_text())["complete"]


# ------------------------------------------------------------------------- other tools' files
def _at(row: dict[str, Any]) -> tuple[list, list]:
    """The entry lists (ids, values) of a labelled position of a foreign row."""
    values = row.get("logprobs") or row.get("top_values")
    ids = row.get("target_token_ids") or row.get("token_ids")
    p = len(row["labels"]) - 3
    assert row["labels"][p + 1] != -100
    e = p - (len(row["input_ids"]) - len(values)) if "logprobs" in row else p
    return ids[e], values[e]


def _foreign_poison(kind: str):
    def edit(row: dict[str, Any]) -> None:
        ids, values = _at(row)
        m = len(values)
        if kind == "repeat":
            ids[1] = ids[0]
        elif kind == "mass":
            values[:] = [math.log(0.3)] * m
        elif kind == "renorm":  # two entries renormalised, the rest cut away
            values[:] = [-math.inf] * (m - 2) + [math.log(0.5)] * 2
        elif kind == "nan":
            values[0] = math.nan

    return edit


def _train_on_file(assets, tmp: Path, path: Path, fmt: str) -> int:
    cfg = make_config(
        assets,
        tmp / "run",
        teacher_logits={"path": str(path), "k": K, "format": fmt, "alignment": "next"},
        dataset={"_component_": "kd.data.pretokenized_dataset", "data_files": str(path)},
    )
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    return cli.main(["run", "kd", "--config", str(write_config(tmp / "c.yaml", cfg))])


@pytest.mark.parametrize("kind", ["repeat", "mass", "renorm", "nan"])
@pytest.mark.parametrize("fmt", ["axolotl", "distillkit"])
def test_a_poisoned_foreign_row_is_refused(
    fmt,
    kind,
    assets,
    foreign,  # noqa: F811
    tmp_path,
    capsys,
):
    path = _bad_file(foreign, tmp_path, fmt, _foreign_poison(kind))
    capsys.readouterr()
    assert _train_on_file(assets, tmp_path, path, fmt) == 2
    line = _one_line(capsys)
    assert f"teacher_logits.path: row 0 of {path}: position" in line and SAID[kind] in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("kind", ["repeat", "mass"])
def test_a_poisoned_distillkit_compressed_row_is_refused(
    kind,
    assets,
    foreign,  # noqa: F811
    tmp_path,
    capsys,
):
    """DistillKit's compressed rows: a repeated id, or exact values adding up to more than 1
    (its first exact_k = 2 entries, float32; the rest are a lossy fit and not summed)."""
    from tests.integration.teachers.test_distillkit_compressed_run import _compressed

    def edit(row: dict[str, Any]) -> None:
        ids, values = _at(row)
        if kind == "repeat":
            ids[1] = ids[0]
        else:
            values[:2] = [math.log(0.6)] * 2

    raw = _bad_file(foreign, tmp_path, "distillkit", edit)
    packed = _compressed(raw, tmp_path / "packed")
    capsys.readouterr()
    assert _train_on_file(assets, tmp_path, packed, "distillkit") == 2
    line = _one_line(capsys)
    assert "teacher_logits.path: row 0 of" in line and SAID[kind] in line, line


# ------------------------------------------------------------------------- cross-tokenizer store
@pytest.fixture(scope="module")
def x_store(assets, other_tok_teacher, letter_data, tmp_path_factory) -> Path:  # noqa: F811
    return cross_store(
        assets, tmp_path_factory.mktemp("xpoison"), other_tok_teacher, letter_data, 8
    )


def _cross_edit(kind: str):
    def edit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        row = rows[0]
        offsets = row["teacher_offsets"]
        if kind == "reversed":
            offsets[2], offsets[3] = offsets[3], offsets[2]
        elif kind == "short":
            del offsets[-2:]
        elif kind == "token_outside":
            row["teacher_tokens"][1] = TEACHER_SIZE
        elif kind == "topk_outside":
            row["ids"][8 + 1] = TEACHER_SIZE + 5
        elif kind == "rewritten":
            return rows[:-1]
        return rows

    return edit


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("reversed", "its teacher_offsets, holds the span ["),
        ("short", "its teacher_offsets, holds"),
        ("token_outside", "teacher token 1 (of"),
        (
            "topk_outside",
            f"holds the token id {TEACHER_SIZE + 5} (entry 1), outside the vocabulary",
        ),
        ("rewritten", "rows where its manifest places"),
    ],
)
def test_a_damaged_cross_tokenizer_store_is_one_line(
    kind,
    said,
    assets,
    x_store,
    other_tok_teacher,  # noqa: F811
    letter_data,  # noqa: F811
    tmp_path,
    capsys,
):
    name = store_format.shard_name(0, 0)
    store = _rewrite(x_store, tmp_path / "logits", [name], _cross_edit(kind))
    cfg = cross_cfg(
        assets,
        tmp_path / "run",
        other_tok_teacher,
        letter_data,
        teacher_logits={"path": str(store), "k": 8},
    )
    capsys.readouterr()
    assert cli.main(["run", "kd", "--config", str(write_config(tmp_path / "c.yaml", cfg))]) == 2
    line = _one_line(capsys)
    assert f"teacher_logits.path: shard {store / name}" in line and said in line, line
    if kind == "reversed":
        assert "which is reversed" in line
    if kind == "short":
        assert "span numbers for" in line
    if kind == "token_outside":
        assert f"actual token {TEACHER_SIZE}" in line
