"""How many examples a config's dataset has, when that is cheap to know before it is built.

The fit search (:mod:`kd.memory.fit`) must not offer a micro-batch or an accumulation the data
cannot fill (the recipe refuses fewer examples per rank than one optimizer step). The plan runs
before the tokenizer and the dataset are built, so only local files read by Hugging Face's file
loaders (``source: json | csv | text | parquet`` with ``data_files``) are counted, by rows, without
tokenizing; anything else (a hub dataset, packing, a split slice, a filter) is unknown (None).
Imports neither torch nor datasets.
"""

from __future__ import annotations

import csv
import glob
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

# Files larger than this together are not counted (reading them is not cheap).
MAX_COUNT_BYTES = 1 << 30


def _files(node: Mapping[str, Any]) -> list[str] | None:
    files = node.get("data_files")
    if isinstance(files, str):
        entries = [files]
    elif isinstance(files, Sequence) and all(isinstance(f, str) for f in files):
        entries = list(files)
    else:
        return None  # per-split mappings and the like: leave it to the loader
    out: list[str] = []
    for entry in entries:
        if "://" in entry:
            return None
        path = os.path.expanduser(entry)
        matches = sorted(glob.glob(path)) if any(c in entry for c in "*?[") else [path]
        if not matches or not all(os.path.isfile(m) for m in matches):
            return None
        out += matches
    return out


def _json_rows(path: str) -> int | None:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith(b"["):
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return len(data) if isinstance(data, list) else None
    count = 0
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                count += 1
    return count


def _csv_rows(path: str) -> int:
    with open(path, encoding="utf-8", newline="") as fh:
        return max(0, sum(1 for _ in csv.reader(fh)) - 1)  # the header row


def _text_rows(path: str) -> int:
    with open(path, "rb") as fh:
        return sum(1 for _ in fh)


def _parquet_rows(path: str) -> int | None:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        return None
    return int(pq.ParquetFile(path).metadata.num_rows)


_COUNTERS = {"json": _json_rows, "csv": _csv_rows, "text": _text_rows, "parquet": _parquet_rows}


def node_examples(node: Mapping[str, Any]) -> int | None:
    """Rows of one dataset node's local files, or None when not cheaply known.

    Args:
        node: a dataset builder's plain values (``_component_``, ``source``, ``data_files``...).
    """
    source = node.get("source")
    counter = _COUNTERS.get(source) if isinstance(source, str) else None
    if counter is None or node.get("packed") or node.get("filter_fn") is not None:
        return None
    split = node.get("split", "train")
    if split != "train" or node.get("field") is not None:
        return None
    files = _files(node)
    if not files or sum(os.path.getsize(f) for f in files) > MAX_COUNT_BYTES:
        return None
    total = 0
    try:
        for path in files:
            rows = counter(path)
            if rows is None:
                return None
            total += rows
    except (OSError, ValueError, RecursionError, csv.Error):  # unreadable: the loader will say
        return None
    return total


def dataset_examples(node: Any) -> int | None:
    """Examples of a ``dataset`` value (one node, or a list concatenated), or None when any part
    is not cheaply known.

    Args:
        node: the config's ``dataset`` as plain values (a dict, or a list of dicts).
    """
    if isinstance(node, Mapping):
        return node_examples(node)
    if isinstance(node, Sequence) and not isinstance(node, str) and node:
        counts = [dataset_examples(sub) for sub in node]
        return None if any(c is None for c in counts) else sum(c for c in counts if c)
    return None


def run_dataset_size(run: Any) -> int | None:
    """Examples of a run's dataset (its ``RunConfig``) when its local files tell cheaply (None
    otherwise)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    node = run.components["dataset"]
    if node is None:
        return None
    try:
        data = OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException:  # an interpolation the config check reports
        return None
    return dataset_examples(data)
