"""The compiled decode step (``compile: true`` with ``on_policy.batch_rollouts``,
:func:`kd.rollouts.decode.compiled_step`): the same tokens as the eager step on both backends,
and one dynamic-shape graph for every later batch, so rows leaving the batch, narrower groups and
other prompt widths do not recompile it. (Compiled here with dynamo's ``aot_eager`` backend, the
same graph capture without inductor's code generation; ``tests/integration/rollouts/
test_local_compiled.py`` runs inductor through ``kd run``.)"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from kd.rollouts.decode import _kept_rows, fast_rollout
from kd.rollouts.sampling import row_generators
from tests.conftest import tiny_hidden_decoder
from tests.unit.rollouts.test_decode import hf_model, prompts, stops_of


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    """A fresh compile cache and counters, aot_eager for this file's compiled steps."""
    import kd.rollouts.decode as decode

    torch._dynamo.reset()
    counters.clear()
    original = decode.compiled_step
    monkeypatch.setattr(decode, "compiled_step", lambda: original("aot_eager"))
    yield
    torch._dynamo.reset()


def run(model, p, *, compile, temperature, stop_ids, group_size=None, device="cpu", **extra):
    """``fast_rollout`` of ``p`` (each row's own generator when sampling; ``extra``: more of its
    keywords, ``graphs``)."""
    rows = list(range(p.tokens.shape[0]))
    gens = row_generators(7, 0, rows, device=torch.device(device)) if temperature else None
    return fast_rollout(
        model,
        p,
        max_new_tokens=10,
        temperature=temperature,
        top_p=0.9,
        stop_ids=stop_ids,
        pad_id=0,
        vocab_limit=60,
        generators=gens,
        group_size=group_size,
        compile=compile,
        **extra,
    )


@pytest.mark.parametrize("backend", ["torchtune", "transformers"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_compiled_step_samples_what_the_eager_step_samples(tmp_path, backend, temperature):
    torch.manual_seed(0)
    model = tiny_hidden_decoder(vocab=64, dim=32) if backend == "torchtune" else hf_model(tmp_path)
    p = prompts(60, [5, 3, 7, 2, 6, 4, 4, 5])
    stop_ids = stops_of(model, p) + (list(range(1, 9)) if temperature else [])
    eager = run(model, p, compile=False, temperature=temperature, stop_ids=stop_ids)
    assert len(set(eager.lengths.tolist())) > 1  # rows ended at different steps: rows left
    compiled = run(model, p, compile=True, temperature=temperature, stop_ids=stop_ids)
    assert torch.equal(compiled.tokens, eager.tokens)
    assert torch.equal(compiled.lengths, eager.lengths)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2  # the first batch, then one graph for every smaller one
    # Other groups (other widths, other batches) reuse the dynamic graph.
    grouped = run(model, p, compile=True, temperature=temperature, stop_ids=stop_ids, group_size=3)
    assert torch.equal(grouped.tokens, eager.tokens)
    assert counters["stats"]["unique_graphs"] == graphs
    assert model.training


def test_a_compiled_step_keeps_two_rows():
    """A batch of one would be one more compile: a finished row stays as padding instead."""
    done = torch.tensor([True, True, False, True])
    assert _kept_rows(done, at_least=1).tolist() == [2]
    assert _kept_rows(done, at_least=2).tolist() == [0, 2]
    assert _kept_rows(torch.tensor([False, True, False]), at_least=2).tolist() == [0, 2]
