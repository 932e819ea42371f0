"""Stored teacher logits on 2 CPU ranks (gloo, FSDP2), through the commands a user types:
`kd run --nproc_per_node 2 teacher_logits` (one writer per rank, only rank 0 reads weights) stores
what one process stores, and training from a store on 2 ranks equals one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kd import cli
from kd.teachers import store_reader
from kd.testing import run_launch
from tests.conftest import make_config, read_metrics, write_config
from tests.integration.runtime.test_distributed_run import (
    _RANK0_ONLY_GUARD,
    COMPARED,
    TOL,
    _assert_same_files,
)

K = 8


def _launch(recipe: str, cfg_path: Path, *, expect: int = 0) -> subprocess.CompletedProcess[str]:
    guard = cfg_path.parent / f"{cfg_path.stem}_guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(_RANK0_ONLY_GUARD)
    path = os.pathsep.join(p for p in (str(guard), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "kd.cli", "run", "--nproc_per_node", "2", recipe]
    proc = run_launch([*cmd, "--config", str(cfg_path)], env=env, timeout=300)
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _store_config(assets, root: Path, name: str) -> Path:
    cfg = make_config(
        assets,
        root / f"{name}_run",
        batch_size=4,
        teacher_logits={"path": str(root / name), "k": K, "rows_per_shard": 8},
    )
    return write_config(root / f"{name}.yaml", cfg)


@pytest.fixture(scope="module")
def stores(assets, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("stores")
    one = _store_config(assets, root, "one")
    assert cli.main(["run", "teacher_logits", "--config", str(one)]) == 0
    _launch("teacher_logits", _store_config(assets, root, "two"))
    return root / "one", root / "two"


@pytest.mark.slow
def test_two_ranks_store_what_one_process_stores(stores):
    one, two = stores
    m1 = json.loads((one / "manifest.json").read_text())
    m2 = json.loads((two / "manifest.json").read_text())
    assert m1["complete"] and m2["complete"]
    assert (m1["world_size"], m2["world_size"]) == (1, 2)
    assert {s["name"][:9] for s in m2["shards"]} == {"rank00000", "rank00001"}  # a writer per rank
    for key in ("dataset_fingerprint", "tokenizer_sha256", "num_rows", "k", "vocab", "teacher"):
        assert m1[key] == m2[key], key
    r1, r2 = store_reader.StoreReader(one), store_reader.StoreReader(two)
    for row in range(r1.num_rows):
        a, b = r1.record(row), r2.record(row)
        assert a.row_hash == b.row_hash and a.num_tokens == b.num_tokens
        assert (a.ids == b.ids).all(), row
        torch.testing.assert_close(
            torch.tensor(b.logprobs.astype("float32")),
            torch.tensor(a.logprobs.astype("float32")),
            atol=2e-3,
            rtol=0,
        )


@pytest.mark.slow
def test_training_from_a_store_on_two_ranks_equals_one_device(assets, stores, tmp_path):
    """8 x 1 on one device vs 4 x 2 ranks, from the store the 2 ranks wrote, no teacher nodes."""

    def config(name: str, batch: int) -> Path:
        cfg = make_config(
            assets,
            tmp_path / name,
            batch_size=batch,
            teacher_logits={"path": str(stores[1]), "k": K, "tail": "bucket"},
        )
        del cfg["teacher_model"], cfg["teacher_checkpointer"]
        return write_config(tmp_path / f"{name}.yaml", cfg)

    assert cli.main(["run", "kd", "--config", str(config("single", 8))]) == 0
    _launch("kd", config("pair", 4))
    a, b = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "pair")
    assert [r["step"] for r in a] == [r["step"] for r in b] and a
    for x, y in zip(a, b, strict=True):
        assert x["kd_loss"] > 0
        for key in COMPARED:
            assert y[key] == pytest.approx(x[key], abs=TOL, rel=0), (x["step"], key)
    _assert_same_files(tmp_path / "single" / "final", tmp_path / "pair" / "final")


@pytest.mark.slow
def test_a_server_failing_one_rank_stops_every_rank_with_a_save(assets, tmp_path):
    """Under torchrun the server fails for one rank's rows only: every rank stops at the same
    micro-batch, they save step 1 together, the line names the failing rank; with the server
    answering again, resume finishes the run."""
    from torchtune.datasets import instruct_dataset

    from kd.config.instantiate import instantiate
    from kd.testing import tokenizer_node
    from kd.testing_server import TeacherTestServer, model_logprobs
    from tests.conftest import MAX_SEQ_LEN, STUDENT, TEACHER, tiny_model

    tok = instantiate(tokenizer_node(assets["tokenizer"], MAX_SEQ_LEN), key="tokenizer")
    fn = model_logprobs(assets["teacher"], tiny_model(TEACHER), tmp_path, vocab=STUDENT["vocab"])
    row = instruct_dataset(tok, source="json", data_files=str(assets["data"]), split="train")[17]
    labelled = [i for i, x in enumerate(row["labels"]) if x != -100]
    # Rank 1's rows are 1, 3, 5, ... (no shuffle): row 17 is in its first micro-batch of step 2.
    with TeacherTestServer(fn, decode=lambda t: tok.decode([t])) as server:
        server.refused.add(tuple(row["tokens"][: labelled[-1] + 1]))
        section = {"url": server.url, "model": "tiny-teacher", "top_k": K, "retries": 1}
        section.update(backoff=0, prefetch=0, timeout=20)
        cfg = make_config(assets, tmp_path / "pair", batch_size=4, teacher_server=section)
        del cfg["teacher_model"], cfg["teacher_checkpointer"]
        config = write_config(tmp_path / "pair.yaml", cfg)
        proc = _launch("kd", config, expect=2)
        lines = [x for x in proc.stderr.splitlines() if x.startswith("kd: error:")]
        assert lines and "rank 1: teacher_server.url" in lines[0], proc.stderr[-3000:]
        assert "stopped after step 1; saved" in lines[0] and "step_000001" in lines[0]
        assert (tmp_path / "pair" / "step_000001").is_dir()
        server.refused.clear()
        cfg["resume_from_checkpoint"] = True
        _launch("kd", write_config(tmp_path / "pair.yaml", cfg))
    assert [r["step"] for r in read_metrics(tmp_path / "pair")] == [1, 2, 3]
    assert (tmp_path / "pair" / "final").is_dir()
