"""Hidden-state distillation on 2 CPU ranks (gloo, FSDP2) against one device with the same global
batch: the width projections are replicated on every rank and their gradients averaged through
:mod:`kd.runtime.distributed` (:func:`kd.training.train.optimizer_step`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from kd import cli
from kd.checkpoint.recipe_state import load_recipe_state
from tests.conftest import make_config, read_metrics, write_config
from tests.integration.runtime.test_distributed_run import (
    COMPARED,
    TOL,
    _assert_same_tensors,
    _launch,
)
from tests.integration.teachers.test_hidden_states_run import HIDDEN

PAIRS = ("0_to_0", "1_to_1", "embed_to_embed", "norm_to_norm")


def _config(assets, out: Path, batch: int) -> dict:
    return make_config(
        assets,
        out,
        batch_size=batch,
        gradient_accumulation_steps=2,
        hidden_states={**HIDDEN, "loss": "mse"},  # mse: its gradient grows with the error
        clip_grad_norm=None,
        save_every_n_steps=1,
        keep_last_n=3,
        optimizer={"_component_": "torch.optim.AdamW", "lr": 1e-2},
    )


@pytest.mark.slow
def test_projections_on_two_ranks_equal_one_device(assets, tmp_path):
    """8 x 2 micro-batches on one device vs 4 x 2 ranks x 2, student width 32 -> teacher 48 (every
    pair projected), 3 steps: the same loss, CE, KD, hidden loss and gradient norm per step
    (``TOL`` = 1e-5 absolute), the same student weights in ``final/`` and the same projection
    weights in every step checkpoint (1e-5 absolute).

    What it catches: each rank's projections see only its own rows, and the recipe's backward
    scales by the world size (FSDP averages the student's gradients), so without the averaging in
    ``optimizer_step`` each rank steps its projections on its own gradient, twice its share.
    Checked by disabling ``_average_replicated_grads``: step 1's grad_norm is off by 8e-5, step 2's
    hidden loss by 3e-4, and rank 0's projections in ``step_000001`` by 2e-2, all over ``TOL``."""
    one, two = tmp_path / "one", tmp_path / "two"
    single = write_config(tmp_path / "one.yaml", _config(assets, one, batch=8))
    assert cli.main(["run", "kd_single_device", "--config", str(single)]) == 0
    _launch(write_config(tmp_path / "two.yaml", _config(assets, two, batch=4)))

    ra, rb = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [1, 2, 3]
    for x, y in zip(ra, rb, strict=True):
        for key in (*COMPARED, "hidden_loss"):
            assert y[key] == pytest.approx(x[key], abs=TOL, rel=0), (x["step"], key)
    assert ra[-1]["hidden_loss"] < ra[0]["hidden_loss"]  # the projections do train
    # Every weight but the key biases: attention's softmax is invariant to a key bias (it adds
    # q . b_k to every score of a query alike), so their gradient is rounding noise, which AdamW
    # (lr 1e-2) turns into steps that differ between one device and two ranks (1.1e-5 seen).
    fa, fb = (load_file(d / "final" / "model.safetensors") for d in (one, two))
    assert sorted(fa) == sorted(fb)
    keep = [k for k in fa if not k.endswith("k_proj.bias")]
    assert len(keep) < len(fa)
    _assert_same_tensors({k: fa[k] for k in keep}, {k: fb[k] for k in keep})
    for step in (1, 2, 3):
        name = f"step_{step:06d}"
        a, b = load_recipe_state(one / name)["extra"], load_recipe_state(two / name)["extra"]
        assert sorted(a) == [f"{p}.weight" for p in PAIRS]
        assert a["0_to_0.weight"].shape == (48, 32)
        _assert_same_tensors(a, b)
    # final/ holds the student's weights only, on either world size.
    assert sorted(load_file(two / "final" / "model.safetensors")) == sorted(
        load_file(assets["student"] / "model.safetensors")
    )
