"""The fast local decoding loop (``on_policy.batch_rollouts``, :mod:`kd.rollouts.decode`) samples
what today's :func:`kd.rollouts.sampling.rollout` samples: the same greedy tokens and, with each
row's own generator, the same sampled tokens, while prompts run in length groups, the KV cache is
preallocated (transformers' StaticCache) and finished rows leave the batch."""

from __future__ import annotations

import pytest
import torch

from kd import models
from kd.rollouts.base import Prompts
from kd.rollouts.decode import fast_rollout, length_groups
from kd.rollouts.sampling import rollout, row_generators
from tests.conftest import STUDENT, tiny_hidden_decoder, write_hf_qwen2


def hf_model(tmp_path) -> torch.nn.Module:
    """A tiny transformers Qwen2 in kd's hidden-output mode, its weights loaded."""
    from transformers import AutoModelForCausalLM

    folder = write_hf_qwen2(tmp_path / "hf", STUDENT, seed=3)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    models.set_hidden_output(model)
    return model.train()


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> Prompts:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        tokens[i, width - n :] = torch.randint(1, vocab, (n,), generator=gen)
        mask[i, width - n :] = True
    return Prompts(tokens, mask, torch.tensor(lengths))


def both(model, p: Prompts, *, temperature: float, stop_ids, group_size=None):
    common = dict(
        max_new_tokens=10,
        temperature=temperature,
        top_p=0.9,
        stop_ids=stop_ids,
        pad_id=0,
        vocab_limit=60,
    )
    rows = list(range(p.tokens.shape[0]))

    def gens():
        return row_generators(7, 0, rows, device=torch.device("cpu")) if temperature else None

    slow = rollout(model, p, generators=gens(), **common)
    fast = fast_rollout(model, p, generators=gens(), group_size=group_size, **common)
    return slow, fast


def stops_of(model, p: Prompts) -> list[int]:
    """Stop ids that end rows at different steps: tokens the model samples greedily early on."""
    slow = rollout(
        model,
        p,
        max_new_tokens=4,
        temperature=0.0,
        top_p=1.0,
        stop_ids=[],
        pad_id=0,
        vocab_limit=60,
        generators=None,
    )
    return sorted({int(slow.tokens[0, 1]), int(slow.tokens[2, 3])})


@pytest.mark.parametrize("backend", ["torchtune", "transformers"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("group_size", [None, 2], ids=["one_group", "groups_of_2"])
def test_fast_rollout_samples_what_rollout_samples(tmp_path, backend, temperature, group_size):
    torch.manual_seed(0)
    model = tiny_hidden_decoder(vocab=64, dim=32) if backend == "torchtune" else hf_model(tmp_path)
    p = prompts(60, [5, 3, 7, 2, 6])
    # Sampling from a near-uniform tiny model: more stop ids, so rows end early there too.
    stop_ids = stops_of(model, p) + (list(range(1, 9)) if temperature else [])
    slow, fast = both(model, p, temperature=temperature, stop_ids=stop_ids, group_size=group_size)
    # Rows ended at different steps (so rows left the batch), and some ran to the end.
    assert len(set(slow.lengths.tolist())) > 1
    assert torch.equal(fast.lengths, slow.lengths)
    assert torch.equal(fast.tokens, slow.tokens)
    assert fast.steps <= slow.steps
    assert model.training  # put back in training mode


def test_finished_rows_leave_the_batch(tmp_path):
    """The decode steps after a quarter of the rows stopped run on fewer rows."""
    torch.manual_seed(0)
    model = tiny_hidden_decoder(vocab=64, dim=32)
    p = prompts(60, [5, 3, 7, 2, 6, 4, 4, 5])
    stop_ids = stops_of(model, p)
    widths: list[int] = []
    model.layers[0].register_forward_hook(lambda m, args, out: widths.append(out.shape[0]))
    _, fast = both(model, p, temperature=0.0, stop_ids=stop_ids)
    assert widths[0] == 8 and min(widths) < 8
    assert widths == sorted(widths, reverse=True)


def test_length_groups_sort_by_length():
    assert length_groups([5, 3, 7, 2, 6], 2) == [[3, 1], [0, 4], [2]]
    assert length_groups([5, 3, 7], None) == [[1, 0, 2]]
