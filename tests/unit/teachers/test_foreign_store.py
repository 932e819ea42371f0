"""kd.teachers.foreign_store.detect_alignment on synthetic rows: each signal alone decides, and a file
that gives no evidence stays undecided (issue 23 item 6)."""

from __future__ import annotations

import random

import pytest

from kd.teachers.foreign_store import detect_alignment

V = 50


def _dist(prefix: list[int]) -> tuple[list[int], list[float]]:
    """A teacher that is a fixed function of the tokens it has seen (untrained: its top-1 is
    unrelated to the text)."""
    rng = random.Random(hash(tuple(prefix)))
    ids = rng.sample(range(V), 4)
    return ids, sorted((-rng.uniform(0.1, 5.0) for _ in ids), reverse=True)


def _rows(alignment: str, *, front_pad: int = 0, n_rows: int = 40, seed: int = 0):
    """Rows sharing prefixes (a template then a few tokens), entries in ``alignment``."""
    rng = random.Random(seed)
    tokens, ids, values = [], [], []
    for _ in range(n_rows):
        row = [1, 2, 3] + [rng.randrange(4, 8) for _ in range(6)]
        entries = [_dist(row[: j + 1] if alignment == "next" else row[:j]) for j in range(len(row))]
        entries = entries[front_pad:]
        tokens.append(row)
        ids.append([e[0] for e in entries])
        values.append([e[1] for e in entries])
    return tokens, ids, values


@pytest.mark.parametrize("alignment", ["next", "current"])
@pytest.mark.parametrize("front_pad", [0, 2])
def test_shared_prefixes_decide_for_any_teacher(alignment, front_pad):
    tokens, ids, values = _rows(alignment, front_pad=front_pad)
    found = detect_alignment(tokens, ids, values, front_padded=front_pad > 0)
    assert found.alignment == alignment, found.describe()
    assert found.pairs >= 4


@pytest.mark.parametrize("alignment", ["next", "current"])
def test_a_teachers_top1_decides_without_shared_prefixes(alignment):
    """Rows with nothing in common, a teacher whose top-1 is the token the entry predicts."""
    rng = random.Random(1)
    tokens, ids, values = [], [], []
    for r in range(20):
        row = [100 + r] + [rng.randrange(V) for _ in range(8)]
        target = row[1:] + [0] if alignment == "next" else row
        tokens.append(row)
        ids.append([[t, (t + 1) % V] for t in target])
        values.append([[-0.1, -2.5] for _ in target])
    found = detect_alignment(tokens, ids, values, front_padded=False)
    assert found.alignment == alignment, found.describe()


def test_no_evidence_is_undecided():
    """Distinct rows, a teacher that never agrees with the text: nothing to go by."""
    tokens, ids, values = _rows("next", n_rows=1)
    found = detect_alignment(tokens, ids, values, front_padded=False)
    assert found.alignment is None and found.pairs == 0
    assert "of 8 entries" in found.describe()  # the last token has no next one
