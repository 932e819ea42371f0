"""kd.runtime.distributed helpers at world size 1 (the N-rank paths run in tests/integration)."""

from __future__ import annotations

import random

import torch

from kd.runtime import distributed
from kd.runtime.distributed import WorldInfo

ONE = WorldInfo(world_size=1, rank=0, local_rank=0)


def test_seed_all_ranks_seeds_torch_and_random():
    assert distributed.seed_all_ranks(1234, world=ONE) == 1234
    first = (torch.rand(3), random.random())
    distributed.seed_all_ranks(1234, world=ONE)
    again = (torch.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and first[1] == again[1]


def test_seed_all_ranks_draws_a_seed_when_none():
    drawn = distributed.seed_all_ranks(None, world=ONE)
    assert isinstance(drawn, int) and 0 <= drawn < 2**31
    after_draw = (torch.rand(2), random.random())
    torch.manual_seed(drawn)
    random.seed(drawn)
    assert torch.equal(torch.rand(2), after_draw[0]) and random.random() == after_draw[1]
