"""DistillKit's compressed top-k rows, decoded with numpy (DistillKit is not needed).

``distillkit.sample_logits_vllm`` writes per sequence ``compressed_logprobs`` and
``bytepacked_indices`` (list<list<uint8>>, one byte list per position) and, in the same output
folder, the ``compression_config.yaml`` it compressed with (DistillKit's
``DistributionQuantizationConfig``; the rows do not carry it). Per position:

* ``bytepacked_indices``: the ``k`` token ids, sorted by log-prob (largest first), each in
  ``ceil(log2(d))`` bits, most significant bit first, one bit stream zero-padded to whole bytes.
* ``compressed_logprobs``, in this order: the first ``exact_k`` values in ``exact_dtype``;
  one coefficient per ``polynomial_terms`` entry in ``term_dtype`` (a least-squares fit of the
  remaining ``k - exact_k`` values over ``t = 0..k-exact_k-1``, or ``linspace(0, 1)`` under
  ``normalize_t``; a term is ``t**i`` or ``sqrt(t)`` / ``exp(t)``); then per ``residual_bins``
  entry a scale in ``scale_dtype`` and ``num_elements`` residuals of ``element_bits`` bits
  (offset by ``2**(bits-1)``, times the scale; a 1-bit residual is ``(2q - 1) * scale``), each
  bin padded to whole bytes. Residuals past the bins are zero. Floats are little-endian.
  Under ``delta_encoding`` (DistillKit's default) the values are the first log-prob and then
  successive differences, summed back here.

:func:`decode_rows` turns a sequence's byte lists into the ids and log-probs
``decompress_to_sparse`` returns, which :class:`kd.teachers.foreign_store.ForeignStoreReader`
then reads as it reads DistillKit's raw ``token_ids`` / ``top_values`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kd.errors import KDUserError, brief

__all__ = ["CONFIG_FILE", "CompressionConfig", "decode_rows", "find_config", "load_config"]

CONFIG_FILE = "compression_config.yaml"
_DTYPES = {"float16": "<f2", "bfloat16": "bf16", "float32": "<f4", "float64": "<f8"}
_SPECIAL = ("sqrt", "exp")


@dataclass(frozen=True)
class ResidualBin:
    """One quantised residual bin: ``num_elements`` values of ``element_bits`` bits."""

    scale_dtype: str
    element_bits: int
    num_elements: int

    def nbytes(self) -> int:
        """Bytes of the bin (scale and packed elements, padded to a whole byte)."""
        return _width(self.scale_dtype) + (self.element_bits * self.num_elements + 7) // 8


@dataclass(frozen=True)
class CompressionConfig:
    """DistillKit's ``DistributionQuantizationConfig`` fields a reader needs."""

    d: int
    k: int
    exact_k: int
    exact_dtype: str = "float32"
    polynomial_terms: tuple[int | str, ...] = ()
    term_dtype: str = "float32"
    residual_bins: tuple[ResidualBin, ...] = ()
    delta_encoding: bool = True
    normalize_t: bool = False

    @property
    def index_bits(self) -> int:
        """Bits per token id: ``ceil(log2(d))``."""
        return max(1, (self.d - 1).bit_length())

    def logprob_bytes(self) -> int:
        """Bytes of ``compressed_logprobs`` per position."""
        return (
            self.exact_k * _width(self.exact_dtype)
            + len(self.polynomial_terms) * _width(self.term_dtype)
            + sum(b.nbytes() for b in self.residual_bins)
        )

    def index_bytes(self) -> int:
        """Bytes of ``bytepacked_indices`` per position."""
        return (self.k * self.index_bits + 7) // 8


def _width(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else int(_DTYPES[dtype][-1])


def _dtype(raw: Any, what: str) -> str:
    if raw not in _DTYPES:
        raise ValueError(f"{what} is {raw!r}, not one of {', '.join(_DTYPES)}")
    return str(raw)


def _int(raw: Any, what: str, low: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < low:
        raise ValueError(f"{what} is {raw!r}, not an integer >= {low}")
    return raw


def _parse(raw: Any) -> CompressionConfig:
    """The config from the YAML mapping (the ``logprob_compressor`` section or its contents)."""
    if isinstance(raw, dict) and isinstance(raw.get("logprob_compressor"), dict):
        raw = raw["logprob_compressor"]
    if not isinstance(raw, dict):
        raise ValueError("it is not a mapping of DistributionQuantizationConfig fields")
    terms = tuple(raw.get("polynomial_terms") or ())
    for t in terms:
        if t not in _SPECIAL and (isinstance(t, bool) or not isinstance(t, int)):
            raise ValueError(f"polynomial term {t!r} is neither an integer power nor sqrt/exp")
    bins = tuple(
        ResidualBin(
            _dtype(b.get("scale_dtype"), "scale_dtype"),
            _int(b.get("element_bits"), "element_bits", 1),
            _int(b.get("num_elements"), "num_elements", 1),
        )
        for b in raw.get("residual_bins") or ()
    )
    cfg = CompressionConfig(
        d=_int(raw.get("d"), "d", 2),
        k=_int(raw.get("k"), "k", 1),
        exact_k=_int(raw.get("exact_k"), "exact_k", 0),
        exact_dtype=_dtype(raw.get("exact_dtype", "float32"), "exact_dtype"),
        polynomial_terms=terms,
        term_dtype=_dtype(raw.get("term_dtype", "float32"), "term_dtype"),
        residual_bins=bins,
        delta_encoding=bool(raw.get("delta_encoding", True)),
        normalize_t=bool(raw.get("normalize_t", False)),
    )
    if cfg.exact_k > cfg.k or sum(b.num_elements for b in bins) > cfg.k - cfg.exact_k:
        raise ValueError("exact_k plus the residual bins' elements exceed k")
    if any(b.element_bits > 63 for b in bins):
        raise ValueError("a residual bin of more than 63 bits per element")
    return cfg


def find_config(path: Path) -> Path | None:
    """The ``compression_config.yaml`` DistillKit wrote beside the rows: in ``path`` (a folder)
    or beside it (a file); None when there is none."""
    folder = path if path.is_dir() else path.parent
    found = folder / CONFIG_FILE
    return found if found.is_file() else None


def load_config(path: Path, key: str) -> CompressionConfig:
    """Read and check the compression config of the rows at ``path`` (see :func:`find_config`).

    Raises:
        KDUserError: no config file beside the rows, or one that is not DistillKit's config.
    """
    import yaml

    found = find_config(path)
    if found is None:
        raise KDUserError(
            f"{key}: {path} holds DistillKit's compressed rows (compressed_logprobs / "
            f"bytepacked_indices) but no {CONFIG_FILE} beside them; copy the "
            f"{CONFIG_FILE} distillkit.sample_logits_vllm wrote with them (or the teacher's "
            f"logprob_compressor section) to {path if path.is_dir() else path.parent}"
        )
    try:
        return _parse(yaml.safe_load(found.read_text()))
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError) as e:
        raise KDUserError(
            f"{key}: {found} is not DistillKit's compression config ({brief(e)}); write the "
            "logprob_compressor (DistributionQuantizationConfig) the rows were captured with"
        ) from e


def _floats(raw: np.ndarray, dtype: str, count: int) -> np.ndarray:
    """``count`` floats per position from ``raw`` ``[m, bytes]`` uint8, as float64 ``[m, count]``."""
    raw = np.ascontiguousarray(raw)
    if dtype == "bfloat16":  # the high half of a float32
        half = raw.view("<u2").astype(np.uint32) << 16
        return half.view("<f4").astype(np.float64).reshape(raw.shape[0], count)
    return raw.view(_DTYPES[dtype]).astype(np.float64).reshape(raw.shape[0], count)


def _unpack(raw: np.ndarray, bits: int, count: int) -> np.ndarray:
    """``count`` unsigned ``bits``-bit integers per position, most significant bit first."""
    stream = np.unpackbits(np.ascontiguousarray(raw), axis=-1)[:, : count * bits]
    stream = stream.reshape(raw.shape[0], count, bits).astype(np.uint64)
    powers = np.left_shift(np.uint64(1), np.arange(bits - 1, -1, -1, dtype=np.uint64))
    return (stream * powers).sum(axis=-1, dtype=np.uint64)


def _terms(cfg: CompressionConfig, n: int) -> np.ndarray:
    """The polynomial's design matrix ``[n, terms]`` in ``term_dtype`` (as DistillKit builds it)."""
    work = np.float64 if cfg.term_dtype == "float64" else np.float32
    t = np.linspace(0, 1, n, dtype=work) if cfg.normalize_t else np.arange(n, dtype=work)
    cols = [
        getattr(np, term)(t) if isinstance(term, str) else t**term for term in cfg.polynomial_terms
    ]
    return np.stack(cols, axis=-1).astype(np.float64)


def _logprobs(raw: np.ndarray, cfg: CompressionConfig) -> np.ndarray:
    """Decode ``compressed_logprobs`` ``[m, bytes]`` into ``[m, k]`` float64 log-probs."""
    m = raw.shape[0]
    exact_end = cfg.exact_k * _width(cfg.exact_dtype)
    exact = _floats(raw[:, :exact_end], cfg.exact_dtype, cfg.exact_k)
    at = exact_end
    approx_n = cfg.k - cfg.exact_k
    approx = np.zeros((m, approx_n))
    residual = []
    n_terms = len(cfg.polynomial_terms)
    coeff_end = at + n_terms * _width(cfg.term_dtype)
    coeffs = _floats(raw[:, at:coeff_end], cfg.term_dtype, n_terms)
    at = coeff_end
    for b in cfg.residual_bins:
        scale = _floats(raw[:, at : at + _width(b.scale_dtype)], b.scale_dtype, 1)
        at += _width(b.scale_dtype)
        packed = (b.element_bits * b.num_elements + 7) // 8
        q = _unpack(raw[:, at : at + packed], b.element_bits, b.num_elements).astype(np.float64)
        at += packed
        offset = q * 2.0 - 1.0 if b.element_bits == 1 else q - 2.0 ** (b.element_bits - 1)
        residual.append(offset * scale)
    if residual:
        joined = np.concatenate(residual, axis=-1)
        approx[:, : joined.shape[1]] = joined
    if n_terms:
        approx += coeffs @ _terms(cfg, approx_n).T
    values = np.concatenate([exact, approx], axis=-1)
    return np.cumsum(values, axis=-1) if cfg.delta_encoding else values


def decode_rows(
    logprob_bytes: Any, index_bytes: Any, cfg: CompressionConfig, where: str
) -> tuple[list[list[int]], list[list[float]]]:
    """One sequence's compressed positions as DistillKit's raw ``token_ids`` / ``top_values``.

    Args:
        logprob_bytes: the row's ``compressed_logprobs`` (one byte list per position).
        index_bytes: the row's ``bytepacked_indices`` (as many byte lists).
        cfg: the config the rows were written with.
        where: ``"KEY: row i of FILE"``, for errors.

    Returns:
        Per position the ``k`` ids and log-probs, largest first.

    Raises:
        KDUserError: positions of another byte length than the config gives (another config),
            or unequal position counts.
    """
    lp_rows, id_rows = list(logprob_bytes or []), list(index_bytes or [])
    if len(lp_rows) != len(id_rows):
        raise KDUserError(
            f"{where} has {len(lp_rows)} positions of compressed_logprobs and {len(id_rows)} of "
            "bytepacked_indices; the two must have one byte list per position"
        )
    if not lp_rows:
        return [], []
    want = (cfg.logprob_bytes(), cfg.index_bytes())
    try:
        lp = np.asarray(lp_rows, dtype=np.uint8)
        ids = np.asarray(id_rows, dtype=np.uint8)
    except (ValueError, TypeError, OverflowError) as e:
        raise KDUserError(
            f"{where} holds compressed rows that are not byte lists of one length per "
            f"position ({brief(e)}); {CONFIG_FILE} gives {want[0]} and {want[1]} bytes"
        ) from e
    got = (lp.shape[-1] if lp.ndim == 2 else -1, ids.shape[-1] if ids.ndim == 2 else -1)
    if got != want:
        raise KDUserError(
            f"{where} has {got[0]} bytes of compressed_logprobs and {got[1]} of "
            f"bytepacked_indices per position, but {CONFIG_FILE} (d={cfg.d}, k={cfg.k}, "
            f"exact_k={cfg.exact_k}) gives {want[0]} and {want[1]}; use the config the rows "
            "were captured with"
        )
    values = _logprobs(lp, cfg)
    token_ids = _unpack(ids, cfg.index_bits, cfg.k).astype(np.int64)
    return token_ids.tolist(), values.tolist()
