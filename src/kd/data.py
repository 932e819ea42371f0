"""Data loading: the sampler, collate and a resumable position shared by all recipes.

The sampler is torch's ``DistributedSampler`` at every world size (world size 1 on one device), so
with ``shuffle: false`` the samples of one global batch (per-rank batch x ranks x accumulation) are the
same set whatever the number of ranks.
"""

from __future__ import annotations

import functools
import glob
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from kd import _torchtune as tt
from kd.errors import KDUserError, brief, one_line
from kd.hf.tokenization import ChatRoleError


class SkipSampler(Sampler[int]):
    """Wraps a sampler and drops its first ``skip`` indices (resume mid-epoch)."""

    def __init__(self, base: DistributedSampler, skip: int = 0):
        self.base = base
        self.skip = skip

    def set_epoch(self, epoch: int) -> None:
        self.base.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        for i, idx in enumerate(self.base):
            if i >= self.skip:
                yield idx

    def __len__(self) -> int:
        return max(0, len(self.base) - self.skip)


class NamedRows(Dataset):
    """A dataset whose chat-role errors name their row: the tokenizer refuses a message's role
    (:class:`kd.hf.tokenization.ChatRoleError`) without knowing which row it reads; this adds the
    row (``index + 1``, the line of a JSON-lines file)."""

    def __init__(self, dataset: Dataset, key: str = "dataset"):
        self.dataset = dataset
        self.key = key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except ChatRoleError as e:
            raise e.at_row(index + 1, key=self.key) from None


class WithRows(Dataset):
    """A dataset whose examples also carry their index (``"row"``), for stored teacher logits."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[index], "row": index}


def collate_with_rows(
    examples: list[dict[str, Any]], *, padding_idx: int, ignore_idx: int
) -> dict[str, Any]:
    """torchtune's padded collate, plus ``"rows"``: the examples' dataset indices ``[b]``."""
    import torch

    rows = torch.tensor([int(ex["row"]) for ex in examples], dtype=torch.int64)
    batch = collate_with_route(
        [{k: v for k, v in ex.items() if k != "row"} for ex in examples],
        padding_idx=padding_idx,
        ignore_idx=ignore_idx,
    )
    return {**batch, "rows": rows}


def collate_with_route(
    examples: list[dict[str, Any]], *, padding_idx: int, ignore_idx: int
) -> dict[str, Any]:
    """torchtune's padded collate, plus ``"route"`` (a list) when the examples carry one
    (:class:`WithRoute`)."""
    batch = tt.padded_collate_sft(
        [{k: v for k, v in ex.items() if k != "route"} for ex in examples],
        padding_idx=padding_idx,
        ignore_idx=ignore_idx,
    )
    if examples and "route" in examples[0]:
        batch["route"] = [ex["route"] for ex in examples]
    return batch


def raw_row(dataset: Any, index: int) -> Any:
    """Row ``index`` of the raw data behind ``dataset`` (a mapping of its fields; None when kd
    cannot see one): through kd's wrappers, a concatenation of datasets, torchtune's SFT datasets
    (their Hugging Face rows) and kd's pre-tokenized rows."""
    rows = getattr(dataset, "_data", None)  # torchtune's SFTDataset: the loaded rows
    if rows is None and isinstance(getattr(dataset, "rows", None), list):
        rows = dataset.rows  # PretokenizedDataset
    if rows is not None:
        return rows[index]
    inner = getattr(dataset, "dataset", None)
    if inner is not None:  # NamedRows, WithRows, EvalShard-like wrappers with the same index
        return raw_row(inner, index)
    parts = getattr(dataset, "datasets", None)
    if parts is not None:  # torch / torchtune ConcatDataset
        for part in parts:
            if index < len(part):
                return raw_row(part, index)
            index -= len(part)
    return None


def row_field(dataset: Any, index: int, name: str) -> Any:
    """Field ``name`` of row ``index`` of the raw data behind ``dataset`` (:func:`raw_row`; None
    when the row has none)."""
    row = raw_row(dataset, index)
    return row.get(name) if isinstance(row, dict) else None


def filled_fields(row: Any) -> list[str]:
    """The fields of a raw row that hold a value, sorted. A Hugging Face dataset fills a field
    that some rows lack with null in the others, so a row's keys are not the fields it has."""
    if not hasattr(row, "items"):
        return []
    return sorted(str(k) for k, v in row.items() if v is not None)


class WithRoute(Dataset):
    """A dataset whose examples also carry their row's field ``field`` (``"route"``: the teacher
    the row names, ``teachers.route_field``; None without one)."""

    def __init__(self, dataset: Dataset, field: str):
        self.dataset = dataset
        self.field = field

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        value = row_field(self.dataset, index, self.field)
        return {**self.dataset[index], "route": None if value in (None, "") else str(value)}


def build_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    pad_id: int,
    ignore_index: int = -100,
    world_size: int = 1,
    rank: int = 0,
    with_rows: bool = False,
    route_field: str | None = None,
) -> tuple[DataLoader, SkipSampler]:
    """A dataloader of padded ``{"tokens", "labels"}`` batches ``[b, s]`` (last partial batch dropped).

    With ``with_rows`` each batch also holds ``"rows"`` ``[b]``, the dataset index of each
    example (to fetch its stored teacher logits); the sampler, and so the order and an exact
    resume, are the same. With ``route_field`` each batch also holds ``"route"``: each example's
    value of that data field (the teacher it names; None without one).
    """
    if len(dataset) == 0:
        raise KDUserError("dataset: it has no examples; point dataset at a non-empty data file")
    if len(dataset) < batch_size * world_size:
        raise KDUserError(
            f"dataset: {len(dataset)} examples is fewer than one batch ({batch_size} x {world_size} "
            f"ranks); lower batch_size or add data"
        )
    base = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
    )
    sampler = SkipSampler(base)
    collate = collate_with_rows if with_rows else collate_with_route
    named: Dataset = NamedRows(dataset)
    if route_field is not None:
        named = WithRoute(named, route_field)
    loader = DataLoader(
        WithRows(named) if with_rows else named,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=functools.partial(collate, padding_idx=pad_id, ignore_idx=ignore_index),
    )
    return loader, sampler


def build_dataset(node: Any, tokenizer: Any, *, trust: bool, key: str = "dataset") -> Dataset:
    """The dataset a config's ``dataset`` names: one builder, or a list of them concatenated.

    A list is torchtune's form of several datasets (each built with the tokenizer, then joined by
    ``torchtune.datasets.ConcatDataset``, as torchtune's recipes do); errors name ``dataset[i]``.

    Args:
        node: ``run.components["dataset"]``: a node with ``_component_``, or a list of them.
        tokenizer: the built tokenizer (the builders' first argument).
        trust: the config's ``trust_remote_components``.
        key: the config key of ``node`` (``validation.dataset`` for the held-out data): what it
            may build and what errors name.

    Raises:
        KDUserError: a builder fails (names the key), or packed and unpacked datasets are mixed.
    """
    from omegaconf import ListConfig

    from kd.config.instantiate import build_component

    def one(dotted: str, sub: Any) -> Dataset:
        empty = _empty_data_file(sub)
        if empty is not None:
            raise KDUserError(
                f"{dotted}: {one_line(empty)} has no examples (it is empty); point "
                f"{dotted}.data_files at a file with examples"
            )
        check_line_lengths(sub, key=dotted)
        fix = f"check {dotted}.source, {dotted}.data_files and its rows"
        return build_component(dotted, sub, tokenizer, trust=trust, fix=fix)

    if not isinstance(node, ListConfig | list):
        return one(key, node)
    parts = [one(f"{key}[{i}]", sub) for i, sub in enumerate(node)]
    try:
        return tt.ConcatDataset(parts)
    except ValueError as e:  # packed and unpacked datasets mixed
        raise KDUserError(f"{key}: {e}; set packed alike in every entry") from e


# Data files up to this size are read to see whether they hold only blank lines.
_BLANK_CHECK_BYTES = 1 << 16


def _empty_data_file(node: Any) -> str | None:
    """The first local ``data_files`` entry of a dataset node that holds nothing but
    whitespace (Hugging Face's json and csv builders raise StopIteration or "corresponds to no
    data" on it), else None."""
    from omegaconf import DictConfig, ListConfig

    files = node.get("data_files") if isinstance(node, DictConfig | dict) else None
    if isinstance(files, str):
        files = [files]
    if not isinstance(files, ListConfig | list):
        return None
    for name in files:
        path = Path(str(name)).expanduser()
        try:
            size = path.stat().st_size if path.is_file() else None
            if size == 0 or (
                size is not None and size <= _BLANK_CHECK_BYTES and not path.read_bytes().strip()
            ):
                return str(path)
        except OSError:
            continue  # the builder reports an unreadable file
    return None


# The longest line of a JSON Lines or text data file kd hands to the datasets library: a row is
# at most tokenizer.max_seq_len tokens of text (a few MB for the longest contexts), and the json
# builder re-parses a line longer than its 10 MB blocks with ever larger blocks, for minutes.
MAX_LINE_BYTES = 8 << 20
_LINE_SOURCES = ("json", "text")
_SCAN_BYTES = 1 << 20


def check_line_lengths(node: Any, *, key: str) -> None:
    """Refuse a local JSON Lines or text data file with a line over :data:`MAX_LINE_BYTES`,
    before the datasets library reads it (one pass in 1 MiB reads, nothing parsed).

    A JSON file that is one array or object (its first byte ``[``, or ``field`` set) is read
    whole by the builder, not line by line, and is not checked.

    Raises:
        KDUserError: the first such line: its file and number, the limit and the fix.
    """
    from omegaconf import DictConfig, ListConfig

    if not isinstance(node, DictConfig | dict) or node.get("source") not in _LINE_SOURCES:
        return
    if node.get("field") is not None:
        return
    files = node.get("data_files")
    if isinstance(files, DictConfig | dict):
        files = [
            f for split in files.values() for f in ([split] if isinstance(split, str) else split)
        ]
    elif isinstance(files, str):
        files = [files]
    if not isinstance(files, ListConfig | list):
        return
    paths = []
    for name in files:
        path = Path(str(name)).expanduser()
        wild = any(c in str(name) for c in "*?[")
        paths += sorted(Path(p) for p in glob.glob(str(path))) if wild else [path]
    for path in paths:
        found = _long_line(path, json=node.get("source") == "json")
        if found is not None:
            raise KDUserError(
                f"{key}.data_files: line {found} of {one_line(str(path))} is longer than "
                f"{MAX_LINE_BYTES >> 20} MiB (a training row is at most tokenizer.max_seq_len "
                "tokens of text); split that row, drop it, or fix the file's line breaks (one "
                "JSON object per line)"
            )


def _long_line(path: Path, *, json: bool) -> int | None:
    """The 1-based number of the first line of ``path`` longer than :data:`MAX_LINE_BYTES`, or
    None (also for what is not a regular file, or a JSON file whose first byte is ``[``)."""
    try:
        if not path.is_file():
            return None
        with path.open("rb") as f:
            line, since, first = 1, 0, True
            while chunk := f.read(_SCAN_BYTES):
                if first:
                    first = False
                    if json and chunk.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
                        return None  # one JSON array: read whole by the builder
                at = chunk.find(b"\n")
                if at < 0:
                    since += len(chunk)
                else:
                    if since + at > MAX_LINE_BYTES:
                        return line
                    line += chunk.count(b"\n")
                    since = len(chunk) - chunk.rfind(b"\n") - 1
                if since > MAX_LINE_BYTES:
                    return line
    except OSError:
        return None  # unreadable: the builder says so
    return None


class PretokenizedDataset(Dataset):
    """Rows of ``{"tokens", "labels"}`` already tokenized (:func:`pretokenized_dataset`)."""

    def __init__(self, rows: list[dict[str, list[int]]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.rows[index]


def pretokenized_dataset(
    tokenizer: Any, *, data_files: str, split: str = "train"
) -> PretokenizedDataset:
    """A dataset of a file's own token ids: ``input_ids`` and, when present, ``labels``
    (``-100`` = unlabelled; every position is labelled without them), truncated to
    ``tokenizer.max_seq_len``. The training data of an axolotl or DistillKit teacher file
    (``teacher_logits.format``, :mod:`kd.teachers.foreign_store`), or of any pre-tokenized rows.

    Args:
        tokenizer: the run's tokenizer (only its ``max_seq_len`` is read).
        data_files: a ``.parquet``, ``.arrow`` (``datasets.save_to_disk``) or ``.jsonl`` file,
            or a folder of them (read in name order).
        split: accepted for torchtune's dataset signature; a file holds one split.

    Raises:
        KDUserError: a missing file or ``input_ids`` column, labels of another length.
    """
    from kd.row_files import pretokenized_rows

    del split
    max_seq_len = getattr(tokenizer, "max_seq_len", None)
    return PretokenizedDataset(
        pretokenized_rows(data_files, max_seq_len=max_seq_len, key="dataset.data_files")
    )


def pad_id_of(tokenizer: Any) -> int:
    """The tokenizer's padding id (0 when it has none)."""
    pad = getattr(tokenizer, "pad_id", None)
    return int(pad) if pad is not None else 0


def check_dataset(
    dataset: Any, *, max_seq_len: int | None, sample: int = 32, key: str = "dataset"
) -> tuple[int, int]:
    """Fail fast when no example can teach the student anything.

    torchtune truncates every example to ``tokenizer.max_seq_len``; when the prompts are that long,
    truncation removes the whole response and every label is masked, and training would silently
    run on zero tokens. ``sample`` examples spread over the dataset are checked.

    Args:
        dataset: the built dataset.
        max_seq_len: ``tokenizer.max_seq_len`` (None: untruncated).
        sample: examples checked, spread over the dataset.
        key: its config key (``dataset`` or ``validation.dataset``), named in errors.

    Returns:
        ``(truncated, checked)``: examples that reach ``max_seq_len``, of those checked.

    Raises:
        KDUserError: no examples, an unreadable example, or no labelled token in any checked one.
    """
    try:
        n = len(dataset)
    except TypeError:
        return 0, 0  # an iterable dataset: nothing to index
    if n == 0:
        raise KDUserError(f"{key}: it has no examples; point {key} at a non-empty data file")
    k = min(n, sample)
    indices = sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})
    labelled = truncated = 0
    for i in indices:
        try:
            example = dataset[i]
            labels = list(example["labels"])
            length = len(example["tokens"])
        except ChatRoleError as e:
            raise e.at_row(i + 1, key=key) from None
        except KDUserError:
            raise  # already names its key (a chat template kd.hf.tokenizer cannot split)
        except Exception as e:  # noqa: BLE001 - a bad row raises whatever the transform raises
            raise KDUserError(
                f"{key}: example {i} cannot be read ({brief(e)}); check {key}.column_map "
                "against the columns of the data file"
            ) from e
        # Position j predicts token j+1 (train.shift_labels), so labels[0] never trains.
        labelled += any(int(x) != -100 for x in labels[1:])
        truncated += max_seq_len is not None and length >= int(max_seq_len)
    if labelled:
        return truncated, len(indices)
    if truncated == len(indices):
        raise KDUserError(
            f"tokenizer.max_seq_len: every example checked ({len(indices)} of {n}) is at least "
            f"{max_seq_len} tokens, so truncation removed every response token; raise "
            "tokenizer.max_seq_len or shorten the prompts"
        )
    raise KDUserError(
        f"{key}: every label is masked in the {len(indices)} examples checked (of {n}), so "
        f"there is nothing to {'evaluate' if key != 'dataset' else 'train on'}; check the "
        f"response column in {key}.column_map and the dataset's masking (train_on_input)"
    )


class EvalShard(Dataset):
    """One rank's share of an evaluation set: examples ``rank, rank + W, rank + 2W...`` of the
    first ``num_examples``, padded to the same length on every rank without counting anything
    twice.

    Every rank must run the same number of forward passes (FSDP2 gathers parameters in each), so
    a rank with one example fewer gets a filler: a real example with every label set to
    ``ignore_index``, which adds no labelled position to any sum. Examples are read (tokenized)
    once and kept: every evaluation reads the same ones.

    Args:
        dataset: the evaluation dataset (``{"tokens", "labels"}`` examples).
        num_examples: evaluate its first ``num_examples`` examples (>= 1).
        world_size: number of ranks.
        rank: this rank.
        ignore_index: label value of unlabelled positions.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        num_examples: int,
        world_size: int,
        rank: int,
        ignore_index: int = -100,
    ):
        self.dataset = dataset
        self.num_examples = num_examples
        self.ignore_index = ignore_index
        per_rank = -(-num_examples // world_size)  # ceil: the same on every rank
        self.indices = [rank + k * world_size for k in range(per_rank)]
        self._read: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i not in self._read:
            index = self.indices[i]
            example = self.dataset[index % self.num_examples]
            if index >= self.num_examples:
                example = dict(example, labels=[self.ignore_index] * len(example["labels"]))
            self._read[i] = example
        return self._read[i]


def build_eval_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    max_batches: int | None,
    pad_id: int,
    ignore_index: int = -100,
    world_size: int = 1,
    rank: int = 0,
    route_field: str | None = None,
) -> DataLoader:
    """Padded ``{"tokens", "labels"}`` batches of this rank's share of an evaluation set.

    In dataset order, the last batch kept even when partial; rank r gets examples r, r + W...
    (:class:`EvalShard`), so summing per-token quantities over all ranks counts each example of
    the set exactly once whatever the number of ranks and the batch size. Build it once and
    iterate it at every evaluation: each example is tokenized on first use only.

    Args:
        dataset: the evaluation dataset.
        batch_size: examples per batch on each rank.
        max_batches: evaluate the first ``max_batches * batch_size`` examples; None = all.
        pad_id: the tokenizer's padding id.
        ignore_index: label value of unlabelled positions.
        world_size: number of ranks.
        rank: this rank.
        route_field: also give each batch's ``"route"``: each example's value of that field.

    Raises:
        KDUserError: the dataset has no examples.
    """
    total = len(dataset)
    if total == 0:
        raise KDUserError(
            "validation.dataset: it has no examples; point it at a non-empty data file"
        )
    n = total if max_batches is None else min(total, max_batches * batch_size)
    shard = EvalShard(
        WithRoute(dataset, route_field) if route_field is not None else dataset,
        num_examples=n,
        world_size=world_size,
        rank=rank,
        ignore_index=ignore_index,
    )
    return DataLoader(
        shard,
        batch_size=batch_size,
        shuffle=False,
        drop_last=False,
        collate_fn=functools.partial(
            collate_with_route, padding_idx=pad_id, ignore_idx=ignore_index
        ),
    )


def steps_per_epoch(
    num_examples: int,
    *,
    batch_size: int,
    world_size: int,
    grad_accum: int,
    max_steps: int | None,
) -> int:
    """Optimizer steps in one epoch: the sampler drops the last partial batch on every rank.

    Raises:
        KDUserError: fewer examples than one micro-batch per rank, or than one optimizer step.
    """
    if num_examples == 0:
        raise KDUserError("dataset: it has no examples; point dataset at a non-empty data file")
    if num_examples < batch_size * world_size:
        raise KDUserError(
            f"dataset: {num_examples} examples is fewer than one batch ({batch_size} x "
            f"{world_size} ranks); lower batch_size or add data"
        )
    micro_batches = (num_examples // world_size) // batch_size
    steps = micro_batches // grad_accum
    if max_steps is not None:
        steps = min(steps, max_steps)
    if steps < 1:
        raise KDUserError(
            f"gradient_accumulation_steps: {grad_accum} micro-batches per step but an epoch has "
            f"only {micro_batches}; lower gradient_accumulation_steps or batch_size"
        )
    return steps


def next_micro_batches(batches: Iterator[Any], *, count: int, step: int) -> list[Any]:
    """The next ``count`` micro-batches of ``batches`` (the dataloader's iterator): one optimizer
    step's worth.

    Args:
        batches: the dataloader's iterator for this epoch.
        count: ``gradient_accumulation_steps``.
        step: the optimizer step they are for (1-based), named in errors.

    Raises:
        KDUserError: reading them failed (a bad row raises whatever the transform raises); the
            message names the step and the fix.
    """
    try:
        return [next(batches) for _ in range(count)]
    except Exception as e:  # noqa: BLE001 - a bad row raises whatever the transform raises
        raise KDUserError(
            f"dataset: reading the batches of step {step} failed ({brief(e)}); "
            "fix that row of the data file (the last checkpoint is kept)"
        ) from e
