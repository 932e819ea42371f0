"""kd.data: padding collate, the (distributed) sampler with seeded shuffling, epochs and the resume
skip, the dataset checks and the pad id."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from kd import data
from kd.errors import KDUserError
from tests.conftest import MAX_SEQ_LEN, write_tokenizer


class Rows(Dataset):
    """Example ``i`` has tokens ``[i, i, ...]`` of length ``1 + i % 5``; the first label is masked."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        length = 1 + i % 5
        return {"tokens": [i] * length, "labels": [-100] + [i] * (length - 1)}


def order(loader) -> list[int]:
    """Example indices in the order the loader yields them (each row's first token)."""
    return [int(row[0]) for batch in loader for row in batch["tokens"]]


def loader_of(n: int = 20, **kw):
    args = dict(batch_size=2, shuffle=True, seed=0, pad_id=0)
    args.update(kw)
    return data.build_dataloader(Rows(n), **args)


# --- collate ----------------------------------------------------------------------------------


def test_collate_pads_tokens_with_pad_id_and_labels_with_ignore_index():
    loader, _ = loader_of(n=4, batch_size=4, shuffle=False, pad_id=7)
    (batch,) = list(loader)
    assert set(batch) == {"tokens", "labels"}
    assert batch["tokens"].dtype == torch.long and batch["labels"].dtype == torch.long
    assert batch["tokens"].tolist() == [
        [0, 7, 7, 7],
        [1, 1, 7, 7],
        [2, 2, 2, 7],
        [3, 3, 3, 3],
    ]
    assert batch["labels"].tolist() == [
        [-100, -100, -100, -100],
        [-100, 1, -100, -100],
        [-100, 2, 2, -100],
        [-100, 3, 3, 3],
    ]


def test_collate_custom_ignore_index():
    loader, _ = loader_of(n=2, batch_size=2, shuffle=False, pad_id=5, ignore_index=-1)
    (batch,) = list(loader)
    assert batch["tokens"].tolist() == [[0, 5], [1, 1]]
    # Only padding uses ignore_index; the dataset's own -100 masks are kept as they are.
    assert batch["labels"].tolist() == [[-100, -1], [-100, 1]]


# --- sampler: order, epochs, ranks, skip ------------------------------------------------------


def test_unshuffled_order_and_last_partial_batch_dropped():
    loader, sampler = loader_of(n=7, batch_size=2, shuffle=False)
    assert order(loader) == [0, 1, 2, 3, 4, 5]  # 7 // 2 full batches; the 7th example is dropped
    assert len(loader) == 3
    assert len(sampler) == 7


def test_shuffle_deterministic_for_a_seed():
    a, _ = loader_of(seed=123)
    b, _ = loader_of(seed=123)
    c, _ = loader_of(seed=124)
    first = order(a)
    assert first == order(b)
    assert first == order(a)  # iterating again (same epoch) gives the same order
    assert sorted(first) == list(range(20))
    assert first != list(range(20))
    assert order(c) != first


def test_set_epoch_changes_order_reproducibly():
    loader, sampler = loader_of(seed=5)
    epoch0 = order(loader)
    sampler.set_epoch(1)
    epoch1 = order(loader)
    assert epoch1 != epoch0 and sorted(epoch1) == sorted(epoch0)
    sampler.set_epoch(0)
    assert order(loader) == epoch0
    other, other_sampler = loader_of(seed=5)
    other_sampler.set_epoch(1)
    assert order(other) == epoch1


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("n", [24, 25], ids=["divisible", "remainder"])
def test_distributed_ranks_disjoint_and_complete(shuffle, n):
    world = 3
    per_rank = [
        order(loader_of(n=n, batch_size=2, shuffle=shuffle, seed=9, world_size=world, rank=r)[0])
        for r in range(world)
    ]
    seen = [i for rank in per_rank for i in rank]
    assert len(seen) == len(set(seen)), "ranks overlap"
    assert all(len(rank) == n // world // 2 * 2 for rank in per_rank)
    if n % (world * 2) == 0:
        assert sorted(seen) == list(range(n))  # every example once per epoch
    else:
        assert len(seen) == n // (world * 2) * (world * 2)


def test_distributed_world_one_equals_single_device():
    single, _ = loader_of(n=12, seed=3)
    ranked, _ = loader_of(n=12, seed=3, world_size=1, rank=0)
    assert order(single) == order(ranked)


@pytest.mark.parametrize("skip", [0, 1, 4, 7])
def test_skip_resumes_exactly(skip):
    full_loader, full_sampler = loader_of(n=20, batch_size=2, seed=11)
    full_sampler.set_epoch(2)
    full = order(full_loader)
    loader, sampler = loader_of(n=20, batch_size=2, seed=11)
    sampler.set_epoch(2)
    sampler.skip = skip * 2  # `skip` batches of 2 already consumed
    rest = order(loader)
    assert rest == full[skip * 2 :]
    assert len(sampler) == 20 - skip * 2
    assert len(loader) == 10 - skip


def test_skip_per_rank():
    world = 2
    for rank in range(world):
        full = order(loader_of(n=16, seed=1, world_size=world, rank=rank)[0])
        loader, sampler = loader_of(n=16, seed=1, world_size=world, rank=rank)
        sampler.skip = 4
        assert order(loader) == full[4:]


def test_skip_beyond_epoch_is_empty():
    loader, sampler = loader_of(n=6, batch_size=2)
    sampler.skip = 10
    assert len(sampler) == 0
    assert order(loader) == []


def test_dataloader_rejects_empty_and_too_small_datasets():
    with pytest.raises(KDUserError, match="^dataset: it has no examples"):
        loader_of(n=0)
    with pytest.raises(KDUserError, match=r"^dataset: 5 examples is fewer than one batch \(3 x 2 "):
        loader_of(n=5, batch_size=3, world_size=2)
    loader_of(n=6, batch_size=3, world_size=2)  # exactly one batch per rank is fine


# --- check_dataset ----------------------------------------------------------------------------


class Examples(Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def row(length: int, labelled: bool = True) -> dict[str, list[int]]:
    labels = [-100] * length
    if labelled and length > 1:
        labels[-1] = 5
    return {"tokens": [1] * length, "labels": labels}


def test_check_dataset_counts_truncated():
    rows = [row(8), row(3), row(8), row(12), row(2)]
    assert data.check_dataset(Examples(rows), max_seq_len=8) == (3, 5)
    assert data.check_dataset(Examples(rows), max_seq_len=None) == (0, 5)
    assert data.check_dataset(Examples(rows), max_seq_len=100) == (0, 5)


def test_check_dataset_samples_spread_examples():
    rows = [row(4) for _ in range(100)]
    assert data.check_dataset(Examples(rows), max_seq_len=4, sample=10) == (10, 10)
    assert data.check_dataset(Examples(rows), max_seq_len=4, sample=1) == (1, 1)
    # Only the last example has a label: the spread sample includes the last index.
    masked = [row(4, labelled=False) for _ in range(99)] + [row(4)]
    assert data.check_dataset(Examples(masked), max_seq_len=None, sample=5) == (0, 5)


def test_check_dataset_empty():
    with pytest.raises(KDUserError, match="^dataset: it has no examples"):
        data.check_dataset(Examples([]), max_seq_len=8)


def test_check_dataset_everything_truncated_names_max_seq_len():
    rows = [row(8, labelled=False) for _ in range(4)]
    with pytest.raises(KDUserError) as err:
        data.check_dataset(Examples(rows), max_seq_len=8)
    msg = str(err.value)
    assert msg.startswith("tokenizer.max_seq_len: every example checked (4 of 4) is at least 8")
    assert "raise tokenizer.max_seq_len" in msg


def test_check_dataset_every_label_masked():
    # Only labels[0] is set, which never trains (position 0 predicts nothing before it).
    rows = [{"tokens": [1, 2, 3], "labels": [7, -100, -100]} for _ in range(3)]
    with pytest.raises(KDUserError, match="^dataset: every label is masked in the 3 examples"):
        data.check_dataset(Examples(rows), max_seq_len=64)


def test_check_dataset_unreadable_row():
    rows = [row(4), {"tokens": [1, 2]}, row(4)]
    with pytest.raises(KDUserError, match=r"^dataset: example 1 cannot be read .*column_map"):
        data.check_dataset(Examples(rows), max_seq_len=64)


def test_check_dataset_iterable_is_not_checked():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield row(4)

    assert data.check_dataset(Stream(), max_seq_len=4) == (0, 0)


# --- pad id -----------------------------------------------------------------------------------


class _Tok:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_pad_id_of(tmp_path):
    assert data.pad_id_of(_Tok(pad_id=42)) == 42
    assert data.pad_id_of(_Tok(pad_id=0)) == 0
    assert data.pad_id_of(_Tok(pad_id=None)) == 0
    assert data.pad_id_of(_Tok()) == 0
    from torchtune.models.qwen2_5 import qwen2_5_tokenizer

    tok_dir = write_tokenizer(tmp_path / "tok")
    tok = qwen2_5_tokenizer(
        path=str(tok_dir / "vocab.json"),
        merges_file=str(tok_dir / "merges.txt"),
        special_tokens_path=str(tok_dir / "tokenizer.json"),
        max_seq_len=MAX_SEQ_LEN,
    )
    assert data.pad_id_of(tok) == tok.special_tokens["<|endoftext|>"] == 256


def test_next_micro_batches_takes_one_steps_worth():
    batches = iter(range(5))
    assert data.next_micro_batches(batches, count=2, step=1) == [0, 1]
    assert data.next_micro_batches(batches, count=2, step=2) == [2, 3]

    def bad_rows():
        yield {"tokens": 1}
        raise KeyError("labels")

    with pytest.raises(KDUserError) as e:
        data.next_micro_batches(bad_rows(), count=2, step=7)
    assert str(e.value) == (
        "dataset: reading the batches of step 7 failed (KeyError: 'labels'); fix that row of the "
        "data file (the last checkpoint is kept)"
    )
