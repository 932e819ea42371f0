"""``on_policy.cuda_graphs`` on a real CUDA device (marker ``gpu``; ``scripts/gpu_check.py`` runs
them): the captured and replayed decode samples the tokens the eager decode samples, with both
backends, rows leaving the batch; and a run trains with it through ``kd run``."""

from __future__ import annotations

import math

import pytest
import torch

from kd import cli
from kd.rollouts.graphs import cuda_capture
from tests.conftest import make_config, read_metrics, write_config
from tests.unit.rollouts.test_decode import prompts, stops_of
from tests.unit.rollouts.test_graphs import eager_and_graphed, model_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("backend", ["torchtune", "transformers"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_cuda_graphs_sample_what_the_eager_decode_samples(tmp_path, backend, temperature):
    model = model_of(backend, tmp_path).cuda()
    p = _on_cuda(prompts(60, [5, 3, 7, 2, 6, 4]))
    stop_ids = stops_of(model, p) + (list(range(1, 9)) if temperature else [])
    capture = cuda_capture(torch.cuda.graph_pool_handle())
    eager, graphed, sizes = eager_and_graphed(
        model, p, capture, temperature=temperature, stop_ids=stop_ids, device="cuda"
    )
    assert torch.equal(graphed.lengths, eager.lengths)
    assert torch.equal(graphed.tokens, eager.tokens)
    assert sizes and sizes == sorted(set(sizes), reverse=True)


def _on_cuda(p):
    from kd.rollouts.base import Prompts

    return Prompts(p.tokens.cuda(), p.mask.cuda(), p.lengths.cuda())


def test_a_run_samples_with_cuda_graphs(assets, tmp_path):
    """``kd run`` with on_policy.cuda_graphs: every step samples through replayed graphs and
    trains to a finite loss."""
    out = tmp_path / "graphs"
    cfg = make_config(assets, out, device="cuda", dtype="bf16", max_steps_per_epoch=2)
    cfg["on_policy"] = {
        "lmbda": 1.0,
        "max_new_tokens": 8,
        "temperature": 1.0,
        "batch_rollouts": True,
        "cuda_graphs": True,
    }
    cfg["memory"] = {"budget_gib": None, "check": "error"}
    path = write_config(tmp_path / "graphs.yaml", cfg)
    assert cli.main(["run", "kd", "--config", str(path)]) == 0
    rows = [r for r in read_metrics(out) if "loss" in r]
    assert rows and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["time_generate_s"] > 0
