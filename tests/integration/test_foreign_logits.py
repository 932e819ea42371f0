"""Other tools' top-k teacher files (issue 15 item 3, kd.foreign_logits): axolotl's KD dataset
fields and DistillKit's raw rows, written from the tiny teacher's real logits, train to the same
losses as kd's own store of the same teacher (tail renorm); a store whose vocab is below the
student's trains like the online teacher (the KD softmax over the shared entries); two
precomputes into one folder are refused, a killed one's lock is taken over."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import (
    STUDENT,
    TEACHER,
    builder,
    checkpointer_node,
    make_config,
    read_metrics,
    write_config,
)

from kd import cli, stored_logits
from kd.errors import KDUserError

K = 8
STORED = 12  # entries per position in the foreign files (k <= stored)
T_GEN = 2.0  # the axolotl file's generation temperature, re-tempered to T = 1


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rows(assets) -> list[dict]:
    """The 64 training rows as make_config's dataset tokenizes them."""
    from test_teacher_logits import _dataset

    dataset = _dataset(assets)
    return [
        {
            "tokens": [int(t) for t in dataset[i]["tokens"]],
            "labels": [int(x) for x in dataset[i]["labels"]],
        }
        for i in range(len(dataset))
    ]


@pytest.fixture(scope="module")
def foreign(assets, tmp_path_factory) -> dict[str, Path]:
    """The tiny teacher's top-STORED log-probs of the 64 rows over the student's vocabulary,
    as an axolotl Parquet file (T_GEN, front-padded targets, entries in ascending order) and a
    DistillKit JSON-lines file (T = 1, positions 0..n-2)."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("foreign")
    teacher = AutoModelForCausalLM.from_pretrained(assets["teacher"], dtype=torch.float32).eval()
    axolotl, distillkit = [], []
    for row in _rows(assets):
        tokens, labels = row["tokens"], row["labels"]
        with torch.no_grad():
            logits = teacher(torch.tensor(tokens)[None]).logits[0, :, : STUDENT["vocab"]]
        # axolotl: targets from the position before the first label on (front-padded).
        first = next(j for j in range(len(labels) - 1) if labels[j + 1] != -100)
        lp_gen = torch.log_softmax(logits / T_GEN, dim=-1)
        values, ids = lp_gen.topk(STORED, dim=-1)
        axolotl.append(
            {
                "input_ids": tokens,
                "labels": labels,
                "attention_mask": [1] * len(tokens),
                "target_token_ids": ids[first:].flip(-1).tolist(),
                "logprobs": values[first:].flip(-1).tolist(),
                "target_mask": [[int(x != -100)] * STORED for x in labels[first:]],
            }
        )
        lp = torch.log_softmax(logits, dim=-1)
        values, ids = lp.topk(K, dim=-1)
        distillkit.append(
            {
                "input_ids": tokens,
                "labels": labels,
                "token_ids": ids[:-1].tolist(),
                "top_values": values[:-1].tolist(),
            }
        )
    pq.write_table(pa.Table.from_pylist(axolotl), tmp / "axolotl.parquet")
    with open(tmp / "distillkit.jsonl", "w") as f:
        for row in distillkit:
            f.write(json.dumps(row) + "\n")
    return {"axolotl": tmp / "axolotl.parquet", "distillkit": tmp / "distillkit.jsonl"}


@pytest.fixture(scope="module")
def kd_store(assets, tmp_path_factory) -> Path:
    """kd's own store of the same teacher and rows (k = K, T = 1)."""
    tmp = tmp_path_factory.mktemp("kd_store")
    cfg = make_config(assets, tmp / "run", teacher_logits={"path": str(tmp / "logits"), "k": K})
    assert (
        cli.main(["run", "teacher_logits", "--config", str(write_config(tmp / "c.yaml", cfg))]) == 0
    )
    return tmp / "logits"


def _train(assets, tmp: Path, name: str, cfg_edit=None, **top) -> list[dict]:
    cfg = make_config(assets, tmp / name, **top)
    if cfg_edit is not None:
        cfg_edit(cfg)
    assert cli.main(["run", "kd", "--config", str(write_config(tmp / f"{name}.yaml", cfg))]) == 0
    return read_metrics(tmp / name)


def _assert_same_losses(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) >= 2
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "ce_loss", "kd_loss"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-3), (key, ra[key], rb[key])
        assert rb["num_tokens"] == ra["num_tokens"]


@pytest.mark.parametrize("fmt", ["axolotl", "distillkit"])
def test_foreign_file_trains_like_kds_store(assets, foreign, kd_store, tmp_path, fmt):
    reference = _train(
        assets,
        tmp_path,
        "kd_store",
        teacher_logits={"path": str(kd_store), "k": K, "tail": "renorm"},
        max_steps_per_epoch=2,
    )
    path = str(foreign[fmt])

    def no_teacher(cfg):
        del cfg["teacher_model"], cfg["teacher_checkpointer"]

    settings = {"path": path, "k": K, "tail": "renorm", "format": fmt}
    if fmt == "axolotl":
        settings["source_temperature"] = T_GEN
    rows = _train(
        assets,
        tmp_path,
        fmt,
        no_teacher,
        teacher_logits=settings,
        dataset={"_component_": "kd.data.pretokenized_dataset", "data_files": path},
        max_steps_per_epoch=2,
    )
    assert all(r["kd_loss"] > 0 for r in rows)
    _assert_same_losses(reference, rows)


def test_foreign_reader_aligns_with_kds_store(assets, foreign, kd_store):
    """Batch by batch: the same ids, and after renormalisation the same log-probs."""
    from kd import _torchtune as tt
    from kd.foreign_logits import ForeignLogitsReader

    rows = _rows(assets)
    picked = [0, 5, 33, 63]
    batch = tt.padded_collate_sft([rows[r] for r in picked], padding_idx=0, ignore_idx=-100)
    ids, lp = stored_logits.TeacherLogitsReader(kd_store).batch(
        picked, batch["tokens"], batch["labels"], k=K
    )
    for fmt, alpha in (("axolotl", T_GEN), ("distillkit", 1.0)):
        reader = ForeignLogitsReader(
            foreign[fmt], format=fmt, k=K, alpha=alpha, max_seq_len=64, student_vocab=288
        )
        assert reader.num_rows == 64
        fids, flp = reader.batch(picked, batch["tokens"], batch["labels"], k=K)
        assert torch.equal(fids, ids)
        renorm = lp.float() - torch.logsumexp(lp.float(), dim=-1, keepdim=True)
        frenorm = flp.float() - torch.logsumexp(flp.float(), dim=-1, keepdim=True)
        labelled = (ids != 0).any(-1)
        torch.testing.assert_close(frenorm[labelled], renorm[labelled], atol=5e-3, rtol=1e-3)
        # A row of other tokens is refused by its hash.
        with pytest.raises(KDUserError, match="dataset row 1 differs from row 1"):
            reader.batch([1], batch["tokens"][:1], batch["labels"][:1], k=K)


def test_store_with_smaller_teacher_vocab_matches_online(assets, tmp_path):
    """Vt < Vs: the stored KD term's student softmax runs over the first Vt entries, as online.
    (The tiny teacher, vocab 288, teaches the tiny 320-entry model; k = Vt: no tail.)"""
    vt = STUDENT["vocab"]

    def swapped(cfg):
        cfg["model"] = builder(TEACHER)
        cfg["checkpointer"] = checkpointer_node(assets["teacher"], tmp_path / "tt")
        cfg["teacher_model"] = builder(STUDENT)
        cfg["teacher_checkpointer"] = checkpointer_node(assets["student"], tmp_path / "tt")

    store = tmp_path / "logits"
    cfg = make_config(assets, tmp_path / "pre", teacher_logits={"path": str(store), "k": vt})
    swapped(cfg)
    assert (
        cli.main(["run", "teacher_logits", "--config", str(write_config(tmp_path / "p.yaml", cfg))])
        == 0
    )
    assert json.loads((store / "manifest.json").read_text())["vocab"] == vt
    online = _train(assets, tmp_path, "online", swapped, max_steps_per_epoch=2)
    offline = _train(
        assets,
        tmp_path,
        "offline",
        swapped,
        teacher_logits={"path": str(store), "k": vt},
        max_steps_per_epoch=2,
    )
    _assert_same_losses(online, offline)


def test_precompute_lock(tmp_path):
    folder = tmp_path / "logits"
    folder.mkdir()
    lock = stored_logits.acquire_lock(folder)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    # Held by a live process (this one): refused, one line.
    with pytest.raises(KDUserError, match="is being written by another kd run teacher_logits"):
        stored_logits.acquire_lock(folder)
    stored_logits.release_lock(lock)
    assert not lock.exists()
    # Left by a killed precompute on this host: taken over.
    import socket
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    lock.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    assert stored_logits.acquire_lock(folder) == lock
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    stored_logits.release_lock(lock)
