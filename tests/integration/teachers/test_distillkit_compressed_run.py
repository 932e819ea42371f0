"""DistillKit's compressed rows (issue 23 item 6, kd.teachers.distillkit_compressed): rows written
by an encoder of DistillKit's format (test-only, below) decode to the ids exactly and the
log-probs to the format's precision, and ``kd run kd`` with ``teacher_logits.format: distillkit``
trains from a compressed file as from the same file's raw rows; a missing or other config is
refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from kd import cli
from kd.errors import KDUserError
from kd.teachers import distillkit_compressed as dc
from tests.conftest import STUDENT, make_config, write_config
from tests.integration.teachers.test_foreign_store_run import (  # noqa: F401
    K,
    _assert_same_losses,
    _train,
    foreign,
)

_NP = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


# ------------------------------------------------ DistillKit's encoder, from its format (test-only)
def _to_bytes(values: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``[m, n]`` floats as little-endian ``dtype`` bytes ``[m, n * width]``, and the stored values."""
    values = np.ascontiguousarray(values)
    if dtype == "bfloat16":  # round to nearest even on the high half of float32
        bits = values.astype("<f4").view("<u4").astype(np.uint64)
        high = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
        stored = (high.astype(np.uint32) << 16).view("<f4").astype(np.float64)
        return high.view(np.uint8).reshape(len(values), -1), stored
    cast = values.astype(np.dtype(_NP[dtype]).newbyteorder("<"))
    return cast.view(np.uint8).reshape(len(values), -1), cast.astype(np.float64)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """``[m, n]`` unsigned integers as an MSB-first bit stream padded to whole bytes."""
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint64)
    stream = ((q.astype(np.uint64)[..., None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(stream.reshape(len(q), -1), axis=-1)


def _design(cfg: dict, n: int) -> np.ndarray:
    work = np.float64 if cfg.get("term_dtype") == "float64" else np.float32
    t = np.linspace(0, 1, n, dtype=work) if cfg.get("normalize_t") else np.arange(n, dtype=work)
    cols = [getattr(np, x)(t) if isinstance(x, str) else t**x for x in cfg["polynomial_terms"]]
    return np.stack(cols, axis=-1).astype(np.float64)


def encode(
    ids: np.ndarray, logprobs: np.ndarray, cfg: dict
) -> tuple[list, list, np.ndarray, np.ndarray]:
    """DistillKit's ``compress_from_sparse`` of one sequence (``[m, k]`` ids and log-probs):
    ``compressed_logprobs`` and ``bytepacked_indices`` byte lists, the log-probs those bytes
    hold (``[m, k]``, sorted), which a correct decoder returns, and the format's precision there
    (the most they can differ from the sorted log-probs; inf past the residual bins)."""
    k, exact_k = cfg["k"], cfg["exact_k"]
    order = np.argsort(-logprobs, axis=-1, kind="stable")
    values = np.take_along_axis(logprobs, order, -1).astype(np.float64)
    ids = np.take_along_axis(ids, order, -1)
    delta = cfg.get("delta_encoding", True)
    if delta:
        values = np.concatenate([values[:, :1], np.diff(values, axis=-1)], axis=-1)
    chunks, held = [], []
    exact_bytes, exact = _to_bytes(values[:, :exact_k], cfg.get("exact_dtype", "float32"))
    chunks.append(exact_bytes)
    held.append(exact)
    error = [np.abs(values[:, :exact_k] - exact)]
    tail = values[:, exact_k:k]
    fit = np.zeros_like(tail)
    if cfg.get("polynomial_terms"):
        x = _design(cfg, k - exact_k)
        coeffs = np.linalg.lstsq(x, tail.T, rcond=None)[0].T
        coeff_bytes, coeffs = _to_bytes(coeffs, cfg.get("term_dtype", "float32"))
        chunks.append(coeff_bytes)
        fit = coeffs @ x.T
    residual, start = tail - fit, 0
    recon = fit.copy()
    error.append(np.full_like(tail, np.inf))
    for b in cfg.get("residual_bins") or []:
        bits, n = b["element_bits"], b["num_elements"]
        part = residual[:, start : start + n]
        top = 1.0 if bits == 1 else 2.0 ** (bits - 1)
        low, high = (0, 1) if bits == 1 else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        peak = np.abs(part).max(axis=-1, keepdims=True)
        scale_bytes, scale = _to_bytes(np.where(peak == 0, 1.0, peak / top), b["scale_dtype"])
        q = np.clip(np.round(part / scale), low, high) - low
        chunks += [scale_bytes, _pack(q, bits)]
        recon[:, start : start + n] += ((q * 2 - 1) if bits == 1 else (q + low)) * scale
        error[1][:, start : start + n] = scale / 2 if bits > 1 else 2 * scale
        start += n
    held.append(recon)
    stored, precision = np.concatenate(held, axis=-1), np.concatenate(error, axis=-1)
    if delta:  # the errors of the differences add up
        stored, precision = np.cumsum(stored, axis=-1), np.cumsum(precision, axis=-1)
    bits = max(1, (cfg["d"] - 1).bit_length())
    return np.concatenate(chunks, axis=-1).tolist(), _pack(ids, bits).tolist(), stored, precision


# ------------------------------------------------------------------------ decoding
RECOMMENDED = {  # DistillKit's README: used at Arcee for new captures
    "d": 1000,
    "k": 24,
    "exact_k": 4,
    "exact_dtype": "bfloat16",
    "polynomial_terms": [0, 1, 2, 3, 4, "sqrt"],
    "term_dtype": "float32",
    "residual_bins": [],
    "delta_encoding": False,
    "error_diffusion": False,
}
BINNED = {  # DistillKit's defaults: delta encoding, float32 exact values; bins of 8 and 3 bits
    "d": 131073,
    "k": 20,
    "exact_k": 2,
    "polynomial_terms": [0, 1, "sqrt"],
    "residual_bins": [
        {"scale_dtype": "float16", "element_bits": 8, "num_elements": 10},
        {"scale_dtype": "bfloat16", "element_bits": 3, "num_elements": 7},
    ],
    "normalize_t": True,
}


def _sparse(rng: np.random.Generator, m: int, k: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.stack([rng.choice(d, size=k, replace=False) for _ in range(m)])
    logits = rng.normal(size=(m, k)) * 3
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True) + 50.0)  # mass outside the top-k
    return ids, lp


@pytest.mark.parametrize("cfg", [RECOMMENDED, BINNED], ids=["recommended", "binned"])
def test_decoder_recovers_ids_exactly_and_logprobs_to_the_formats_precision(cfg):
    rng = np.random.default_rng(0)
    ids, lp = _sparse(rng, 9, cfg["k"], cfg["d"])
    lp_bytes, id_bytes, held, precision = encode(ids, lp, cfg)
    config = dc._parse(cfg)
    assert len(lp_bytes[0]) == config.logprob_bytes() and len(id_bytes[0]) == config.index_bytes()
    got_ids, got_lp = dc.decode_rows(lp_bytes, id_bytes, config, "here")
    order = np.argsort(-lp, axis=-1, kind="stable")
    assert got_ids == np.take_along_axis(ids, order, -1).tolist()
    got = np.asarray(got_lp)
    np.testing.assert_allclose(got, held, rtol=0, atol=1e-4)  # what the bytes hold
    # ... which is the log-probs to the format's precision: the exact dtype's rounding, half a
    # quantisation step of each residual (summed under delta encoding)
    error = np.abs(got - np.take_along_axis(lp, order, -1))
    covered = np.isfinite(precision)
    assert covered[:, : cfg["exact_k"]].all()
    assert covered.sum() == 9 * (
        cfg["exact_k"] + sum(b["num_elements"] for b in cfg["residual_bins"])
    )
    assert (error[covered] <= precision[covered] + 1e-5).all()


def test_exactly_polynomial_tail_is_recovered_to_float32():
    cfg = dict(RECOMMENDED, exact_dtype="float32", d=2**17)
    t = np.arange(cfg["k"] - cfg["exact_k"], dtype=np.float64)
    tail = -3.0 - 0.25 * t - 0.5 * np.sqrt(t)
    lp = np.concatenate([[-0.5, -1.0, -1.5, -2.0], tail])[None]
    ids = np.arange(cfg["k"])[None] * 5000 + 3
    lp_bytes, id_bytes, _, _ = encode(ids, lp, cfg)
    got_ids, got_lp = dc.decode_rows(lp_bytes, id_bytes, dc._parse(cfg), "here")
    assert got_ids == ids.tolist()
    np.testing.assert_allclose(got_lp, lp, rtol=0, atol=2e-4)


def test_bytes_of_another_config_are_refused():
    ids, lp = _sparse(np.random.default_rng(1), 3, RECOMMENDED["k"], RECOMMENDED["d"])
    lp_bytes, id_bytes, _, _ = encode(ids, lp, RECOMMENDED)
    other = dc._parse(dict(RECOMMENDED, exact_k=6))
    with pytest.raises(KDUserError, match="use the config the rows were captured with"):
        dc.decode_rows(lp_bytes, id_bytes, other, "here")


# ------------------------------------------------------------------------ end to end
# The fixture's raw rows hold K = 8 entries per position of the 288-entry vocabulary.
E2E = {
    "d": STUDENT["vocab"],
    "k": K,
    "exact_k": 2,
    "exact_dtype": "float32",
    "polynomial_terms": [0, 1, "sqrt"],
    "residual_bins": [{"scale_dtype": "float32", "element_bits": 8, "num_elements": K - 2}],
    "delta_encoding": False,
}


def _compressed(raw: Path, folder: Path, with_config: bool = True) -> Path:
    """The raw DistillKit rows at ``raw`` compressed as distillkit.sample_logits_vllm writes
    them: Parquet rows of input_ids (+ labels) and the two byte columns, and its
    compression_config.yaml in the same folder."""
    folder.mkdir()
    rows = []
    for line in raw.read_text().splitlines():
        row = json.loads(line)
        lp_bytes, id_bytes, _, _ = encode(
            np.asarray(row["token_ids"]), np.asarray(row["top_values"]), E2E
        )
        rows.append(
            {
                "input_ids": row["input_ids"],
                "labels": row["labels"],
                "compressed_logprobs": lp_bytes,
                "bytepacked_indices": id_bytes,
            }
        )
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.uint64())),
            ("labels", pa.list_(pa.int64())),
            ("compressed_logprobs", pa.list_(pa.list_(pa.uint8()))),
            ("bytepacked_indices", pa.list_(pa.list_(pa.uint8()))),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / "data-00000.parquet")
    if with_config:
        (folder / dc.CONFIG_FILE).write_text(yaml.safe_dump(E2E))
    return folder


def _settings(path: Path) -> tuple[dict, dict]:
    return (
        {"path": str(path), "k": K, "tail": "renorm", "format": "distillkit"},
        {"_component_": "kd.data.pretokenized_dataset", "data_files": str(path)},
    )


def _no_teacher(cfg):
    del cfg["teacher_model"], cfg["teacher_checkpointer"]


def test_compressed_file_trains_like_its_raw_rows(assets, foreign, tmp_path):  # noqa: F811
    from kd.teachers.foreign_store import ForeignStoreReader

    packed = _compressed(foreign["distillkit"], tmp_path / "packed")
    readers = [
        ForeignStoreReader(
            p, format="distillkit", k=K, alpha=1.0, max_seq_len=64, student_vocab=288
        )
        for p in (foreign["distillkit"], packed)
    ]
    assert readers[1].alignment == readers[0].alignment == "next"
    assert readers[1].fingerprint == readers[0].fingerprint
    for raw, got in zip(readers[0].rows, readers[1].rows, strict=True):
        # The same k ids per position (near-ties may trade places), each with its log-prob to
        # the format's precision: float32 exact values, 8-bit residuals (and kd's fp16).
        by_id = [r.ids.sort(-1) for r in (raw, got)]
        assert by_id[0].values.equal(by_id[1].values)
        lp = [
            r.logprobs.float().gather(-1, s.indices) for r, s in zip((raw, got), by_id, strict=True)
        ]
        assert (lp[0] - lp[1]).abs().max() < 0.02
    losses = []
    for name, path in (("raw", foreign["distillkit"]), ("packed", packed)):
        settings, dataset = _settings(path)
        losses.append(
            _train(
                assets,
                tmp_path,
                name,
                _no_teacher,
                teacher_logits=settings,
                dataset=dataset,
                max_steps_per_epoch=2,
            )
        )
    assert all(r["kd_loss"] > 0 for r in losses[1])
    _assert_same_losses(*losses)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, "but no compression_config.yaml beside them; copy the compression_config.yaml"),
        (dict(E2E, k=K + 2), "use the config the rows were captured with"),
        ({"d": "many"}, "is not DistillKit's compression config (ValueError: d is 'many'"),
    ],
    ids=["missing", "other", "malformed"],
)
def test_compressed_rows_without_their_config_are_refused(
    assets,
    foreign,  # noqa: F811
    tmp_path,
    capsys,
    config,
    expected,
):
    packed = _compressed(foreign["distillkit"], tmp_path / "packed", with_config=False)
    if config is not None:
        (packed / dc.CONFIG_FILE).write_text(yaml.safe_dump(config))
    settings, dataset = _settings(packed)
    cfg = make_config(assets, tmp_path / "run", teacher_logits=settings, dataset=dataset)
    _no_teacher(cfg)
    assert cli.main(["run", "kd", "--config", str(write_config(tmp_path / "c.yaml", cfg))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("kd: error:")]
    assert "teacher_logits.path" in line and expected in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
