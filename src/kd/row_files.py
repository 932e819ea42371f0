"""Files of pre-tokenized rows: Parquet, Arrow IPC (``datasets.save_to_disk``) or JSON lines.

Read by :func:`kd.data.pretokenized_dataset` (a dataset of token ids) and by the foreign teacher
files of :mod:`kd.teachers.foreign_store` (axolotl's and DistillKit's rows, which carry the same
``input_ids`` / ``labels`` columns beside the teacher's top-k). No torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kd.errors import KDUserError, brief

__all__ = ["COMPRESSED", "check_token_ids", "column_names", "pretokenized_rows", "read_rows"]

# DistillKit's compressed columns (decoded by kd.teachers.distillkit_compressed).
COMPRESSED = ("compressed_logprobs", "bytepacked_indices")
# Compressed rows kd does not decode, and what they are.
_UNSUPPORTED = {
    "packed_indices": "DistillKit's legacy compressed rows (packed_indices / exact_values / coeffs)",
}
_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json")


def _saved_dataset_files(path: Path, key: str) -> list[Path] | None:
    """The Arrow files of a Hugging Face ``save_to_disk`` folder (axolotl preprocess writes one),
    in the order its ``state.json`` lists them; a ``DatasetDict`` folder gives its ``train``
    split (or its only one). None for any other folder."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        if "train" in splits or len(splits) == 1:
            return _saved_dataset_files(path / ("train" if "train" in splits else splits[0]), key)
        raise KDUserError(
            f"{key}: {path} holds the splits {', '.join(splits) or '(none)'}; point {key} at "
            "the split folder to train on"
        )
    state = path / "state.json"
    if not state.is_file():
        return None
    try:
        names = [str(f["filename"]) for f in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise KDUserError(
            f"{key}: {state} is not a datasets save_to_disk state ({brief(e)}); point {key} at "
            "the folder Dataset.save_to_disk (axolotl preprocess) wrote, or at its .arrow files"
        ) from e
    files = [path / n for n in names]
    bad = next(
        (n for n, f in zip(names, files, strict=True) if Path(n).name != n or not f.is_file()), None
    )
    if bad is not None or not files:
        raise KDUserError(
            f"{key}: {state} lists {bad!r}, which is not a file in {path}; save the dataset "
            f"again (Dataset.save_to_disk) or point {key} at its .arrow files"
        )
    return files


def _files(path: Path, key: str) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        saved = _saved_dataset_files(path, key)
        if saved is not None:
            return saved
        files = sorted(p for p in path.iterdir() if p.suffix in _SUFFIXES and p.is_file())
        if files:
            return files
        raise KDUserError(
            f"{key}: {path} holds no .parquet, .arrow or .jsonl file; point {key} at the "
            "file (or folder of files) holding the rows"
        )
    raise KDUserError(f"{key}: {path} does not exist; point {key} at the file of rows")


def _read_file(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        return pq.read_table(path)
    if path.suffix == ".arrow":
        source = pa.memory_map(str(path))
        try:
            return pa.ipc.open_stream(source).read_all()  # datasets.save_to_disk
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source).read_all()
    with open(path) as f:  # json accepts -Infinity (axolotl pads with -inf)
        rows = [json.loads(line) for line in f if line.strip()]
    return pa.Table.from_pylist(rows)


def read_rows(path: Path | str, *, columns: Sequence[str], key: str) -> dict[str, list[Any]]:
    """The named columns of every row of a file or folder of files, as Python lists.

    Args:
        path: a ``.parquet``, ``.arrow`` or ``.jsonl`` file, or a folder of them.
        columns: the columns to return (a missing one is an error; see :func:`_column`).
        key: the config key naming ``path``, for errors.

    Raises:
        KDUserError: no such file, an unreadable file, a missing column.
    """
    path = Path(path).expanduser()
    out: dict[str, list[Any]] = {c: [] for c in columns}
    for file in _files(path, key):
        try:
            table = _read_file(file)
        except Exception as e:  # noqa: BLE001 - pyarrow and json raise many kinds
            raise KDUserError(
                f"{key}: {file} cannot be read ({brief(e)}); it must be Parquet, Arrow IPC "
                "or JSON lines"
            ) from e
        for c in columns:
            if c not in table.column_names:
                raise KDUserError(
                    f"{key}: {file} has no column {c!r} (it has {', '.join(table.column_names)})"
                    f"; {_fix(c, table.column_names)}"
                )
            out[c].extend(table.column(c).to_pylist())
    return out


def _fix(column: str, present: Sequence[str]) -> str:
    if COMPRESSED[0] in present and column not in COMPRESSED:
        return "these are DistillKit's compressed rows: set teacher_logits.format to distillkit"
    for marker, what in _UNSUPPORTED.items():
        if marker in present:
            return (
                f"kd reads raw top-k rows, not {what}; decompress them with DistillKit's "
                "LogprobCompressor.decompress_to_sparse and write token_ids / top_values "
                "(docs/stored_logits.md)"
            )
    if column == "input_ids":
        return (
            "kd trains on the file's own token ids: tokenize the rows first (axolotl "
            "preprocess writes input_ids and labels)"
        )
    return "set teacher_logits.format to the tool that wrote the file"


def column_names(path: Path, key: str) -> list[str]:
    """The column names of the first file of ``path`` (a file or folder of files)."""
    files = _files(path, key)
    try:
        return list(_read_file(files[0]).column_names)
    except Exception as e:  # noqa: BLE001
        raise KDUserError(f"{key}: {files[0]} cannot be read ({brief(e)})") from e


def pretokenized_rows(
    path: Path | str, *, max_seq_len: int | None, key: str = "dataset"
) -> list[dict[str, list[int]]]:
    """``{"tokens", "labels"}`` of every row of a pre-tokenized file (``input_ids``, optional
    ``labels``; every position labelled without it), truncated to ``max_seq_len``.

    Raises:
        KDUserError: a missing ``input_ids``, labels of another length than the tokens.
    """
    path = Path(path).expanduser()
    has_labels = "labels" in column_names(path, key)
    cols = read_rows(
        path, columns=("input_ids", "labels") if has_labels else ("input_ids",), key=key
    )
    check_token_ids(cols["input_ids"], path, key)
    rows = []
    for i, tokens in enumerate(cols["input_ids"]):
        labels = cols["labels"][i] if has_labels else list(tokens)
        if tokens is None or labels is None or len(labels) != len(tokens):
            raise KDUserError(
                f"{key}: row {i} of {path} has {len(tokens or [])} input_ids and "
                f"{len(labels or [])} labels; each row needs one label per token"
            )
        n = len(tokens) if max_seq_len is None else min(len(tokens), int(max_seq_len))
        try:
            row = {"tokens": [int(t) for t in tokens[:n]], "labels": [int(x) for x in labels[:n]]}
        except (TypeError, ValueError) as e:
            raise KDUserError(
                f"{key}: row {i} of {path} holds input_ids or labels that are not integers "
                f"({brief(e)}); they must be lists of token ids"
            ) from e
        rows.append(row)
    return rows


def check_token_ids(input_ids: list[Any], path: Path, key: str) -> None:
    """Refuse a row whose ``input_ids`` hold a negative id (no token has one)."""
    for i, tokens in enumerate(input_ids):
        bad = next((t for t in tokens or [] if isinstance(t, int) and t < 0), None)
        if bad is not None:
            raise KDUserError(
                f"{key}: row {i} of {path} holds the negative token id {bad} in input_ids; "
                "token ids are >= 0: write the tokenizer's ids (padding is not stored)"
            )
