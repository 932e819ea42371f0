"""Other tools' top-k teacher files (issue 15 item 3, kd.teachers.foreign_store): axolotl's KD dataset
fields and DistillKit's raw rows, written from the tiny teacher's real logits, train to the same
losses as kd's own store of the same teacher (tail renorm); a store whose vocab is below the
student's trains like the online teacher (the KD softmax over the shared entries); two
precomputes into one folder are refused, a killed one's lock is taken over."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import safetensors.torch
import torch

from kd import cli
from kd.errors import KDUserError
from kd.teachers import store_reader, store_writer
from tests.conftest import (
    STUDENT,
    TEACHER,
    builder,
    checkpointer_node,
    make_config,
    read_metrics,
    write_config,
)

# One intra-op thread (tests/conftest.py): the same float reductions in every run.
pytestmark = pytest.mark.usefixtures("one_thread")

K = 8
STORED = 12  # entries per position in the foreign files (k <= stored)
T_GEN = 2.0  # the axolotl file's generation temperature, re-tempered to T = 1


def _rows(assets) -> list[dict]:
    """The 64 training rows as make_config's dataset tokenizes them."""
    from tests.integration.teachers.test_store_reader_run import _dataset

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
        # Targets from the first label on, of a random teacher: no evidence, so named.
        settings.update(source_temperature=T_GEN, alignment="next")
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
    from kd.teachers.foreign_store import ForeignStoreReader

    rows = _rows(assets)
    picked = [0, 5, 33, 63]
    batch = tt.padded_collate_sft([rows[r] for r in picked], padding_idx=0, ignore_idx=-100)
    ids, lp = store_reader.StoreReader(kd_store).batch(
        picked, batch["tokens"], batch["labels"], k=K
    )
    for fmt, alpha, alignment in (("axolotl", T_GEN, "next"), ("distillkit", 1.0, "auto")):
        reader = ForeignStoreReader(
            foreign[fmt],
            format=fmt,
            k=K,
            alpha=alpha,
            max_seq_len=64,
            student_vocab=288,
            alignment=alignment,
        )
        assert reader.alignment == "next"
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
    lock = store_writer.acquire_lock(folder)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    # Held by a live process (this one): refused, one line.
    with pytest.raises(KDUserError, match="is being written by another kd run"):
        store_writer.acquire_lock(folder)
    store_writer.release_lock(lock)
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
    assert store_writer.acquire_lock(folder) == lock
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    store_writer.release_lock(lock)


# ----------------------------------------------------------------- alignment (issue 23 item 6)
GENERATED = 8  # teacher-generated tokens per row: a distillation set the teacher wrote


@pytest.fixture(scope="module")
def shifted(assets, tmp_path_factory) -> dict[str, Path]:
    """32 rows of a prompt and the tiny teacher's greedy completion (labelled), and the teacher's
    top-STORED log-probs over its own 320-entry vocabulary in two layouts: kd's convention
    (``next``: entry j predicts token j + 1) as a JSON-lines file, and axolotl 0.19's (``current``:
    entry j predicts token j, front-padded with -inf) as a datasets save_to_disk folder."""
    import datasets
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("shifted")
    # The tiny teacher, sharpened (lm_head x 30) so that a misread position shows in the loss.
    sharp = tmp / "teacher"
    shutil.copytree(assets["teacher"], sharp)
    weights = safetensors.torch.load_file(sharp / "model.safetensors")
    weights["lm_head.weight"] *= 30
    safetensors.torch.save_file(weights, sharp / "model.safetensors", metadata={"format": "pt"})
    teacher = AutoModelForCausalLM.from_pretrained(sharp, dtype=torch.float32).eval()
    kd_rows, old_rows = [], []
    for row in _rows(assets)[:32]:
        first = next(j for j in range(len(row["labels"]) - 1) if row["labels"][j + 1] != -100)
        tokens = row["tokens"][: first + 1]
        with torch.no_grad():
            for _ in range(GENERATED):
                tokens.append(int(teacher(torch.tensor(tokens)[None]).logits[0, -1].argmax()))
            lp = torch.log_softmax(teacher(torch.tensor(tokens)[None]).logits[0], dim=-1)
        labels = [-100] * (first + 1) + tokens[first + 1 :]
        values, ids = lp.topk(STORED, dim=-1)
        kd_rows.append(
            {
                "input_ids": tokens,
                "labels": labels,
                "target_token_ids": ids[first:].tolist(),
                "target_logprobs": values[first:].tolist(),
            }
        )
        # entry t = the distribution that predicts token t (position t - 1's), from t = first on.
        old_rows.append(
            {
                "input_ids": tokens,
                "labels": labels,
                "target_token_ids": ids[first - 1 : -1].tolist(),
                "target_logprobs": values[first - 1 : -1].tolist(),
                "target_mask": [[int(x != -100)] * STORED for x in labels[first:]],
            }
        )
    kd_file = tmp / "next.jsonl"
    kd_file.write_text("".join(json.dumps(r) + "\n" for r in kd_rows))
    datasets.Dataset.from_list(old_rows).save_to_disk(str(tmp / "axolotl_0_19"))
    return {"next": kd_file, "current": tmp / "axolotl_0_19", "teacher": sharp}


def _as_teacher(teacher: Path, tmp: Path):
    def edit(cfg):
        cfg["model"] = builder(TEACHER)
        cfg["checkpointer"] = checkpointer_node(teacher, tmp / "tt")
        del cfg["teacher_model"], cfg["teacher_checkpointer"]

    return edit


def _shifted_run(assets, teacher: Path, tmp: Path, name: str, path: Path, **settings):
    return _train(
        assets,
        tmp,
        name,
        _as_teacher(teacher, tmp),
        teacher_logits={"path": str(path), "k": K, "tail": "bucket", **settings},
        dataset={"_component_": "kd.data.pretokenized_dataset", "data_files": str(path)},
        max_steps_per_epoch=2,
    )


def test_axolotl_0_19_file_is_read_at_its_alignment(assets, shifted, tmp_path, caplog):
    """student = teacher (tail bucket: the top-k and the rest exactly): kd's own store of the
    rows gives KD ~ 0; axolotl 0.19's shifted file
    (a save_to_disk folder) is detected as `current` and trains to the same losses; read as
    `next` (the explicit key overrides the detection) its loss is far larger."""
    store = tmp_path / "store"
    cfg = make_config(
        assets,
        tmp_path / "pre",
        teacher_logits={"path": str(store), "k": K},
        dataset={"_component_": "kd.data.pretokenized_dataset", "data_files": str(shifted["next"])},
    )
    cfg["model"] = builder(TEACHER)
    cfg["checkpointer"] = checkpointer_node(shifted["teacher"], tmp_path / "tt")
    cfg["teacher_checkpointer"] = checkpointer_node(shifted["teacher"], tmp_path / "tt")
    pre = write_config(tmp_path / "pre.yaml", cfg)
    assert cli.main(["run", "teacher_logits", "--config", str(pre)]) == 0
    reference = _train(
        assets,
        tmp_path,
        "kd_store",
        _as_teacher(shifted["teacher"], tmp_path),
        teacher_logits={"path": str(store), "k": K, "tail": "bucket"},
        dataset={"_component_": "kd.data.pretokenized_dataset", "data_files": str(shifted["next"])},
        max_steps_per_epoch=2,
    )
    assert abs(reference[0]["kd_loss"]) < 1e-4  # step 1: the student is the teacher
    with caplog.at_level("INFO", logger="kd"):
        detected = _shifted_run(
            assets, shifted["teacher"], tmp_path, "auto", shifted["current"], format="axolotl"
        )
    assert "teacher_logits.alignment=current, detected" in caplog.text
    _assert_same_losses_abs(reference, detected)
    forced = _shifted_run(
        assets,
        shifted["teacher"],
        tmp_path,
        "forced",
        shifted["current"],
        format="axolotl",
        alignment="next",
    )
    assert forced[0]["kd_loss"] > 1, forced[0]  # >> 1e-4
    # kd's convention in an axolotl file is detected as `next` and trains like the store too.
    kd_layout = _shifted_run(
        assets, shifted["teacher"], tmp_path, "next", shifted["next"], format="axolotl"
    )
    _assert_same_losses_abs(reference, kd_layout)


def _assert_same_losses_abs(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) >= 2
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-3)
        assert rb["ce_loss"] == pytest.approx(ra["ce_loss"], rel=1e-4)
        assert rb["kd_loss"] == pytest.approx(ra["kd_loss"], abs=2e-3)
        assert rb["num_tokens"] == ra["num_tokens"]


def test_unclear_alignment_is_refused_with_the_fix(assets, foreign, tmp_path, capsys):
    """The random tiny teacher's axolotl file (targets from the first label on) gives no
    evidence either way: one line naming the key and both values, exit 2, nothing written."""
    path = str(foreign["axolotl"])
    cfg = make_config(
        assets,
        tmp_path / "run",
        teacher_logits={"path": path, "k": K, "tail": "renorm", "format": "axolotl"},
        dataset={"_component_": "kd.data.pretokenized_dataset", "data_files": path},
    )
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    assert cli.main(["run", "kd", "--config", str(write_config(tmp_path / "c.yaml", cfg))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next(x for x in err.splitlines() if x.startswith("kd: error:"))
    assert "teacher_logits.alignment: cannot tell which token" in line
    assert "set teacher_logits.alignment to next" in line and "or current" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------ bad rows (issue 23 item 5)
def _bad_file(foreign, tmp: Path, fmt: str, edit) -> Path:
    """The fixture's file of ``fmt`` with its first row edited, as JSON lines."""
    source = foreign[fmt]
    rows = (
        pq.read_table(source).to_pylist()
        if source.suffix == ".parquet"
        else [json.loads(x) for x in source.read_text().splitlines()]
    )
    edit(rows[0])
    path = tmp / f"{fmt}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _negative_id(row):
    row["input_ids"][3] = -5


def _positive_logprob(row):
    values = row.get("logprobs") or row.get("top_values")
    p = len(row["labels"]) - 3  # a labelled position (its next label is not -100)
    assert row["labels"][p + 1] != -100
    e = p - (len(row["input_ids"]) - len(values)) if "logprobs" in row else p
    values[e] = [abs(v) + 1.0 for v in values[e]]  # logits, not log-probs


def _entries(row):
    """The (ids, values) lists of a labelled position of a foreign row."""
    values = row.get("logprobs") or row.get("top_values")
    ids = row.get("target_token_ids") or row.get("token_ids")
    p = len(row["labels"]) - 3  # a labelled position (its next label is not -100)
    e = p - (len(row["input_ids"]) - len(values)) if "logprobs" in row else p
    return ids[e], values[e]


def _other_tokenizers_id_below_the_top_k(row):
    # an entry the top-k does not keep: the file is still another tokenizer's (it trained)
    ids, values = _entries(row)
    ids[min(range(len(values)), key=values.__getitem__)] = STUDENT["vocab"] + 3


def _empty_position(row):
    ids, values = _entries(row)
    ids.clear()
    values.clear()


def _input_id_outside_the_vocabulary(row):
    row["input_ids"][2] = STUDENT["vocab"] + 1  # was an IndexError traceback from the embedding


@pytest.mark.parametrize("fmt", ["axolotl", "distillkit"])
@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_negative_id, "holds the negative token id -5 in input_ids; token ids are >= 0"),
        (_positive_logprob, "holds a positive log-prob"),
        (
            _other_tokenizers_id_below_the_top_k,
            f"holds the teacher id {STUDENT['vocab'] + 3}, outside the student's",
        ),
        (_empty_position, "holds no entries (an empty list)"),
        (
            _input_id_outside_the_vocabulary,
            f"holds the token id {STUDENT['vocab'] + 1} in input_ids, outside the student's",
        ),
    ],
)
def test_bad_foreign_rows_are_refused(assets, foreign, tmp_path, capsys, fmt, edit, expected):
    path = str(_bad_file(foreign, tmp_path, fmt, edit))
    cfg = make_config(
        assets,
        tmp_path / "run",
        teacher_logits={"path": path, "k": K, "format": fmt, "alignment": "next"},
        dataset={"_component_": "kd.data.pretokenized_dataset", "data_files": path},
    )
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    assert cli.main(["run", "kd", "--config", str(write_config(tmp_path / "c.yaml", cfg))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert "row 0 of" in line and expected in line, line


def test_saved_dataset_dict_folder_reads_its_train_split(foreign, tmp_path):
    """axolotl preprocess / save_to_disk folders load as they are: a DatasetDict's train split;
    a folder of several splits names them."""
    import datasets

    from kd.row_files import pretokenized_rows

    rows = pq.read_table(foreign["axolotl"]).to_pylist()
    datasets.DatasetDict(train=datasets.Dataset.from_list(rows[:5])).save_to_disk(tmp_path / "dd")
    read = pretokenized_rows(tmp_path / "dd", max_seq_len=None)
    assert [r["tokens"] for r in read] == [r["input_ids"] for r in rows[:5]]
    two = datasets.DatasetDict(
        a=datasets.Dataset.from_list(rows[:2]), b=datasets.Dataset.from_list(rows[2:4])
    )
    two.save_to_disk(tmp_path / "two")
    with pytest.raises(KDUserError, match="holds the splits a, b; point dataset at the split"):
        pretokenized_rows(tmp_path / "two", max_seq_len=None)
