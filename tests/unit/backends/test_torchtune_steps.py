"""The torchtune backend's decoding steps (``kv_cache_steps``): the same outputs as torchtune's own
KV cache and boolean masks, bit for bit, with no wait for the device in a decode step (the H100
run of 2026-11-27: torchtune's cache update reads ``cache_pos[0]`` to the host in every layer)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kd import _torchtune as tt
from kd.backends import backend_of
from tests.conftest import tiny_hidden_decoder

WIDTH, NEW = 6, 5


class _Ops(TorchDispatchMode):
    """Counts the device operations dispatched (view operations launch nothing)."""

    VIEWS = {"view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "unsqueeze"}
    VIEWS |= {"squeeze", "as_strided", "alias", "permute", "detach", "reshape", "split"}

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in self.VIEWS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def _inputs(batch: int = 3, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths 6, 4 and 2, then ``NEW`` tokens each."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, vocab, (batch, WIDTH + NEW), generator=gen)
    mask = torch.ones(batch, WIDTH + NEW, dtype=torch.bool)
    for row, pad in enumerate((0, 2, 4)[:batch]):
        mask[row, :pad] = False
        tokens[row, :pad] = 0
    return tokens, mask


def _reference(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> list:
    """torchtune's own cache update and boolean masks (kd's steps before the change)."""
    total = tokens.shape[1]
    positions = tt.get_position_ids_from_padding_mask(mask)
    keys = torch.arange(total)
    outs = []
    with tt.local_kv_cache(
        model,
        batch_size=tokens.shape[0],
        device=tokens.device,
        dtype=torch.float32,
        decoder_max_seq_len=total,
    ):
        prefill = tt.get_causal_mask_from_padding_mask(mask[:, :WIDTH], target_seq_len=total)
        outs.append(model(tokens[:, :WIDTH], input_pos=positions[:, :WIDTH], mask=prefill))
        for start in range(WIDTH, total):
            attn = (mask & (keys <= start))[:, None, :]
            x = tokens[:, start : start + 1]
            outs.append(model(x, input_pos=positions[:, start : start + 1], mask=attn))
    return outs


def _kd_steps(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor, spy=None) -> list:
    total = tokens.shape[1]
    steps = backend_of(model).kv_cache_steps(model, mask, width=WIDTH, total=total)
    outs = []
    with torch.no_grad(), steps as forward:
        outs.append(forward(tokens[:, :WIDTH], 0))
        for start in range(WIDTH, total):
            x = tokens[:, start : start + 1]
            if spy is None:
                outs.append(forward(x, start))
            else:
                with spy:
                    outs.append(forward(x, start))
    return outs


def test_decode_steps_equal_torchtunes_own_cache_bit_for_bit():
    model = tiny_hidden_decoder().eval()
    tokens, mask = _inputs()
    with torch.no_grad():
        want = _reference(model, tokens, mask)
    got = _kd_steps(model, tokens, mask)
    assert len(got) == len(want) == 1 + NEW
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g[mask[:, : g.shape[1]].any(-1)], w[mask[:, : w.shape[1]].any(-1)])
        assert torch.equal(g, w)


def test_decode_steps_never_wait_for_the_device_and_launch_fewer_operations():
    """No ``_local_scalar_dense`` (a device-to-host read: on a GPU the host waits for every
    kernel queued) in a decode step, and no boolean-mask conversion in each layer's attention
    (``where`` over two ``scalar_tensor``s): torchtune's own update and masks did both, once per
    layer per token."""
    model = tiny_hidden_decoder().eval()
    tokens, mask = _inputs()
    spy = _Ops()
    _kd_steps(model, tokens, mask, spy=spy)
    layers = len(backend_of(model).decoder_layers(model))
    assert "_local_scalar_dense" not in spy.names
    per_token = len(spy.names) / NEW
    assert spy.names.count("where") == 0
    assert spy.names.count("index_copy_") == 2 * layers * NEW  # one write of k and of v
    # torchtune's own steps: six more operations a layer (the mask, made outside its count here)
    ref = _Ops()
    total = tokens.shape[1]
    positions = tt.get_position_ids_from_padding_mask(mask)
    keys = torch.arange(total)
    with (
        torch.no_grad(),
        tt.local_kv_cache(
            model,
            batch_size=3,
            device=tokens.device,
            dtype=torch.float32,
            decoder_max_seq_len=total,
        ),
    ):
        prefill = tt.get_causal_mask_from_padding_mask(mask[:, :WIDTH], target_seq_len=total)
        model(tokens[:, :WIDTH], input_pos=positions[:, :WIDTH], mask=prefill)
        for start in range(WIDTH, total):
            attn = (mask & (keys <= start))[:, None, :]
            with ref:
                model(
                    tokens[:, start : start + 1],
                    input_pos=positions[:, start : start + 1],
                    mask=attn,
                )
    assert ref.names.count("_local_scalar_dense") == layers * NEW
    assert per_token <= len(ref.names) / NEW - 5 * layers


@pytest.mark.parametrize("keep", [[0, 2], [1]])
def test_rows_leaving_keep_the_additive_mask_in_step(keep):
    """Finished rows leave (``select``): the kept rows' outputs are those of the whole batch."""
    model = tiny_hidden_decoder().eval()
    tokens, mask = _inputs()
    total = tokens.shape[1]
    whole = _kd_steps(model, tokens, mask)
    steps = backend_of(model).kv_cache_steps(model, mask, width=WIDTH, total=total)
    index = torch.tensor(keep)
    with torch.no_grad(), steps as forward:
        forward(tokens[:, :WIDTH], 0)
        forward(tokens[:, WIDTH : WIDTH + 1], WIDTH)
        steps.select(index)
        for start in range(WIDTH + 1, total):
            out = forward(tokens[index, start : start + 1], start)
            assert torch.allclose(out, whole[1 + start - WIDTH][index], atol=1e-6, rtol=0)
