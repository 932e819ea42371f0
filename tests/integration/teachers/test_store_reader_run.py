"""Stored teacher logits (issue 15): `kd run teacher_logits` writes the teacher's top-k log-probs
(kd.teachers.store_writer), resumes byte for byte after a failure, refuses another config's store; the
reader returns them aligned with the shifted labels and refuses damaged or foreign stores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from kd import _torchtune as tt
from kd import cli
from kd.errors import KDUserError
from kd.teachers import store_format, store_reader, store_writer
from kd.training.train import shift_labels
from tests.conftest import MAX_SEQ_LEN, STUDENT, make_config, read_metrics, write_config

K = 8
ROWS_PER_SHARD = 16  # 64 rows: 4 shards


class Killed(Exception):
    """The injected failure of a precompute (as if killed mid-shard)."""


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def precompute_config(assets, tmp: Path, store: Path, **top) -> Path:
    cfg = make_config(
        assets,
        tmp / "run",
        teacher_logits={"path": str(store), "k": K, "rows_per_shard": ROWS_PER_SHARD},
        **top,
    )
    return write_config(tmp / "cfg.yaml", cfg)


@pytest.fixture(scope="module")
def store(assets, tmp_path_factory) -> Path:
    """A complete store of the tiny teacher over the 64 rows (k=8, 4 shards)."""
    tmp = tmp_path_factory.mktemp("store")
    config = precompute_config(assets, tmp, tmp / "logits")
    assert cli.main(["run", "teacher_logits", "--config", str(config)]) == 0
    return tmp / "logits"


def _dataset(assets):
    from kd.config.instantiate import instantiate
    from kd.testing import tokenizer_node

    tokenizer = instantiate(tokenizer_node(assets["tokenizer"], MAX_SEQ_LEN), key="tokenizer")
    from torchtune.datasets import instruct_dataset

    return instruct_dataset(tokenizer, source="json", data_files=str(assets["data"]), split="train")


def test_store_holds_the_teachers_top_k(assets, store):
    from transformers import AutoModelForCausalLM

    manifest = json.loads((store / store_format.MANIFEST_FILE).read_text())
    assert manifest["complete"] and manifest["num_rows"] == 64 and manifest["k"] == K
    assert manifest["vocab"] == STUDENT["vocab"] and manifest["teacher_vocab"] == 320
    assert [s["name"] for s in manifest["shards"]] == [
        store_format.shard_name(0, n) for n in range(4)
    ]
    table = pq.read_table(store / store_format.shard_name(0, 1))
    assert table.column("row").to_pylist() == list(range(16, 32))
    assert str(table.schema.field("logprobs").type) == "list<element: halffloat>"

    dataset = _dataset(assets)
    teacher = AutoModelForCausalLM.from_pretrained(assets["teacher"], dtype=torch.float32).eval()
    reader = store_reader.StoreReader(store)
    rows = [0, 17, 63]
    batch = tt.padded_collate_sft([dataset[r] for r in rows], padding_idx=0, ignore_idx=-100)
    ids, logprobs = reader.batch(rows, batch["tokens"], batch["labels"], k=K)
    assert ids.shape == (3, batch["tokens"].shape[1], K) and ids.dtype == torch.int64
    shifted = shift_labels(batch["labels"])
    for b, r in enumerate(rows):
        tokens = torch.tensor(dataset[r]["tokens"])[None]
        with torch.no_grad():
            logits = teacher(tokens).logits[0]  # [n, 320]
        expected = torch.log_softmax(logits[:, : STUDENT["vocab"]].float(), dim=-1)
        values, top = expected.topk(K, dim=-1)
        labelled = shifted[b, : tokens.shape[1]] != -100
        assert labelled.any()
        torch.testing.assert_close(ids[b, : tokens.shape[1]][labelled], top[labelled])
        torch.testing.assert_close(
            logprobs[b, : tokens.shape[1]][labelled].float(), values[labelled], atol=1e-2, rtol=1e-3
        )
        # Unlabelled positions (the prompt, the padding) hold zeros.
        assert (ids[b][shifted[b] == -100] == 0).all()
    # A smaller k is the first entries of the stored top-k.
    ids4, _ = reader.batch(rows, batch["tokens"], batch["labels"], k=4)
    assert torch.equal(ids4, ids[..., :4])


def test_killed_precompute_resumes_byte_identical(assets, store, tmp_path, monkeypatch):
    config = precompute_config(assets, tmp_path, tmp_path / "logits")
    original, written = store_writer.write_shard, []

    def dies_on_the_third(path, **kwargs):
        if len(written) == 2:  # killed while writing shard 3: half a temporary file left
            (path.parent / f".tmp_{path.name}_99999").write_bytes(b"PAR1 half")
            raise Killed
        written.append(path.name)
        return original(path, **kwargs)

    monkeypatch.setattr(store_writer, "write_shard", dies_on_the_third)
    with pytest.raises(Killed):
        cli.main(["run", "teacher_logits", "--config", str(config)])
    monkeypatch.undo()
    partial = json.loads((tmp_path / "logits" / "manifest.json").read_text())
    assert not partial["complete"] and len(written) == 2
    # The reader refuses the unfinished store.
    with pytest.raises(KDUserError, match="is incomplete"):
        store_reader.StoreReader(tmp_path / "logits")

    calls = []
    monkeypatch.setattr(
        store_writer,
        "write_shard",
        lambda path, **kw: (calls.append(path.name), original(path, **kw)),
    )
    assert cli.main(["run", "teacher_logits", "--config", str(config)]) == 0
    assert calls == [store_format.shard_name(0, 2), store_format.shard_name(0, 3)]
    assert snapshot(tmp_path / "logits") == snapshot(store)
    # A rerun of a complete store writes nothing and changes nothing.
    calls.clear()
    assert cli.main(["run", "teacher_logits", "--config", str(config)]) == 0
    assert calls == [] and snapshot(tmp_path / "logits") == snapshot(store)


def test_precompute_refuses_the_store_of_another_config(assets, store, tmp_path, capsys):
    shutil.copytree(store, tmp_path / "logits")
    config = precompute_config(assets, tmp_path, tmp_path / "logits", temperature=2.0)
    assert cli.main(["run", "teacher_logits", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert "already holds the teacher logits of another config" in line
    assert "config_sha256, temperature differ" in line
    assert snapshot(tmp_path / "logits") == snapshot(store)


def test_reader_refuses_damaged_shards_and_changed_rows(assets, store, tmp_path):
    dataset = _dataset(assets)
    rows = [0, 1]
    batch = tt.padded_collate_sft([dataset[r] for r in rows], padding_idx=0, ignore_idx=-100)
    # A row of other tokens than the stored row.
    reader = store_reader.StoreReader(store)
    with pytest.raises(KDUserError, match="dataset row 2 differs from the row"):
        reader.batch([0, 2], batch["tokens"], batch["labels"], k=K)
    # Same size, flipped bytes inside the data pages: the page checksums catch it on read.
    damaged = tmp_path / "logits"
    shutil.copytree(store, damaged)
    shard = damaged / store_format.shard_name(0, 0)
    raw = bytearray(shard.read_bytes())
    for i in range(200, 260):
        raw[i] ^= 0xFF
    shard.write_bytes(bytes(raw))
    reader = store_reader.StoreReader(damaged)
    with pytest.raises(KDUserError, match=r"teacher_logits.path: shard .* is damaged"):
        reader.batch(rows, batch["tokens"], batch["labels"], k=K)
    # A rerun of the precompute rewrites exactly the damaged shard.
    config = precompute_config(assets, tmp_path, damaged)
    assert cli.main(["run", "teacher_logits", "--config", str(config)]) == 0
    assert snapshot(damaged) == snapshot(store)


# ---------------------------------------------------------------------------------------------
# Training from the store: `kd run kd --config X teacher_logits.path=DIR`
# ---------------------------------------------------------------------------------------------
FULL_K = STUDENT["vocab"]  # every entry of the shared vocabulary: the tail bucket is empty


@pytest.fixture(scope="module")
def full_store(assets, tmp_path_factory) -> Path:
    """A store of the teacher's full distribution over the shared vocabulary (k = 288)."""
    tmp = tmp_path_factory.mktemp("full_store")
    cfg = make_config(
        assets, tmp / "run", teacher_logits={"path": str(tmp / "logits"), "k": FULL_K}
    )
    assert (
        cli.main(["run", "teacher_logits", "--config", str(write_config(tmp / "c.yaml", cfg))]) == 0
    )
    return tmp / "logits"


def _train(assets, tmp: Path, name: str, *overrides: str, **top) -> Path:
    out = tmp / name
    config = write_config(tmp / f"{name}.yaml", make_config(assets, out, **top))
    assert cli.main(["run", "kd", "--config", str(config), *overrides]) == 0
    return out


def test_training_from_full_store_matches_the_online_teacher(
    assets, full_store, tmp_path, monkeypatch
):
    from kd.runtime.run_context import RunContext

    online = _train(assets, tmp_path, "online")
    built = []
    original = RunContext.load_model
    monkeypatch.setattr(
        RunContext,
        "load_model",
        lambda self, key, *a, **kw: (built.append(key), original(self, key, *a, **kw))[1],
    )
    # The teacher's nodes stay in the config, ignored but for the store's identity check.
    offline = _train(
        assets,
        tmp_path,
        "offline",
        f"teacher_logits.path={full_store}",
        f"teacher_logits.k={FULL_K}",
    )
    assert built == ["model"]  # no teacher built or loaded
    a, b = read_metrics(online), read_metrics(offline)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce_loss", "kd_loss"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-3), (key, ra[key], rb[key])
        assert rb["num_tokens"] == ra["num_tokens"]


def test_training_from_store_without_teacher_nodes_resumes_exactly(
    assets, store, tmp_path, monkeypatch
):
    from tests.integration.checkpoint.test_resume_point_run import (
        assert_bit_identical,
        sigterm_at_step,
    )

    top = dict(
        teacher_logits={"path": str(store), "k": 4, "tail": "renorm"},
        save_every_n_steps=1,
        max_steps_per_epoch=4,
        shuffle=True,
    )

    def config(name: str) -> Path:
        cfg = make_config(assets, tmp_path / name, **top)
        del cfg["teacher_model"], cfg["teacher_checkpointer"]
        return write_config(tmp_path / f"{name}.yaml", cfg)

    reference = config("reference")
    assert cli.main(["run", "kd", "--config", str(reference)]) == 0
    rows = read_metrics(tmp_path / "reference")
    assert len(rows) == 4 and all(r["kd_loss"] > 0 for r in rows)
    resumed = config("resumed")
    with monkeypatch.context() as m:
        sigterm_at_step(m, 2)
        assert cli.main(["run", "kd", "--config", str(resumed)]) == 0
    assert not (tmp_path / "resumed" / "final").exists()
    assert cli.main(["run", "kd", "--config", str(resumed), "resume_from_checkpoint=true"]) == 0
    assert_bit_identical(tmp_path / "reference", tmp_path / "resumed")
    assert [r["loss"] for r in read_metrics(tmp_path / "resumed")] == [r["loss"] for r in rows]


def test_no_teacher_model_is_loaded_from_a_store(assets, full_store, tmp_path, monkeypatch):
    """With teacher_logits the run's teacher is the store: RunContext.load_model (the one way a
    model is loaded) sees the student only; with a teacher model it sees both."""
    from kd.runtime.run_context import RunContext

    loaded = []
    original = RunContext.load_model
    monkeypatch.setattr(
        RunContext,
        "load_model",
        lambda self, key, *a, **kw: (loaded.append(key), original(self, key, *a, **kw))[1],
    )
    _train(assets, tmp_path, "online2")
    assert loaded == ["teacher_model", "model"]
    loaded.clear()
    _train(
        assets,
        tmp_path,
        "offline2",
        f"teacher_logits.path={full_store}",
        f"teacher_logits.k={FULL_K}",
    )
    assert loaded == ["model"]


# ------------------------------------------------------- hand-edited manifests (issue 23 item 5)
def _edit_k(m):
    m["k"] = 4  # still an integer: the rows of 8 entries are refused when read


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda m: m.pop("k"), "manifest.json has no 'k' (edited or damaged)"),
        (lambda m: m.update(k="8"), "manifest.json has k='8', not an integer >= 1"),
        (lambda m: m.update(k=8.5), "manifest.json has k=8.5, not an integer >= 1"),
        (lambda m: m.update(world_size=0), "has world_size=0, not an integer >= 1"),
        (lambda m: m["shards"][0].update(name=7), "lists the shard 7, not a file name"),
        (
            lambda m: m["shards"][0].update(name="../rank00000-00000.parquet"),
            "lists the shard '../rank00000-00000.parquet', not a file name",
        ),
        (lambda m: m.update(world_size=2), "lists other shards than its num_rows, world_size"),
        (_edit_k, "(k) was edited: restore it"),
    ],
)
def test_hand_edited_manifest_is_refused_in_one_line(
    assets, store, tmp_path, capsys, edit, expected
):
    """kd run kd on a store whose manifest.json was edited: one line naming the file and what
    is wrong in it, exit 2, no traceback (was: KeyError, ZeroDivisionError, AssertionError)."""
    edited = tmp_path / "logits"
    shutil.copytree(store, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    edit(manifest)
    (edited / "manifest.json").write_text(json.dumps(manifest))
    config = write_config(
        tmp_path / "c.yaml",
        make_config(
            assets,
            tmp_path / "run",
            teacher_logits={"path": str(edited), "k": 4},
            max_steps_per_epoch=1,
        ),
    )
    assert cli.main(["run", "kd", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert "teacher_logits.path: " in line and expected in line, line
    assert "rerun" in line
