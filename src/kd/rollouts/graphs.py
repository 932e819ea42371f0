"""The local sampler's decode step replayed from CUDA graphs (``on_policy.cuda_graphs: true``).

On a GPU, one decoded token of a small model is paced by kernel launches, not arithmetic: the
H100 run of 2026-11-27 (``docs/gpu.md``) decoded Qwen2.5-0.5B at 4 rows in about 35 ms a token,
about a thousand launches (``scripts/decode_ops.py``), for well under a millisecond of work.
A CUDA graph records those launches once and replays them with one call, as vLLM and SGLang do
for their decode batches (their ``cudagraph_capture_sizes`` / ``--cuda-graph-max-bs``) and as
transformers does under ``torch.compile(mode="reduce-overhead")``. kd uses torch's own
``torch.cuda.CUDAGraph``, without compiling: a capture costs about one eager step more, not a
compile's minutes.

How :class:`DecodeGraphs` keeps a replay equal to the eager step:

- The step reads its inputs from **static buffers**: the sampled tokens ``[b, 1]`` and the
  position ``[1]`` (a device tensor, never a Python int: a graph replays the values it was
  captured with), through each backend's ``kv_cache_steps(...).decode(x, pos)``: torchtune's
  padding mask and RoPE positions gathered at ``pos``, transformers' ``StaticCache`` written at
  ``cache_position=pos``. The KV cache is preallocated for the whole rollout, so its tensors keep
  their addresses from step to step; its write position is a device tensor too.
- A batch size is **captured at its first step**: that step runs eagerly once (it is this
  step: its cache writes and its logits are used), then the same call is recorded.
  Each later step copies the new token and position into the buffers and replays.
- **Finished rows leaving the batch** make new cache tensors (``select``): the graph is dropped
  and the next step captures the smaller batch. With graphs a batch of more than
  :data:`COMPACT_ABOVE` rows is compacted once half of them have finished (:data:`SHRINK_AT`),
  and a smaller one never (its finished rows decode padding), so a rollout of 64 rows captures at
  most 3 sizes and one of 16 rows one.
- The sampling stays eager, outside the graph: each row draws from its own generator exactly as
  without graphs, so the tokens are the same.
- Every graph of a rollout draws its temporaries from one memory pool, freed when the rollout
  ends; the pool holds one decode step's temporaries for the rest of the rollout, which the plan
  adds (:func:`kd.memory.generation.rollout_candidates`).

A model whose cache keeps Python state that reaches the step (transformers' sliding-window
layers: a Python count of their length) is not captured: its steps run eagerly, said once
(:func:`capturable`).

What a graph cannot hold (a device-to-host read, a tensor made from a Python value of the
position) is kept out of both backends' ``decode``; ``tests/unit/rollouts/test_graphs.py`` checks
that on the CPU, where :func:`kd.testing_graphs.tape_capture` replays a recorded step the way a
graph does (the recorded operations on the recorded tensors, every Python value frozen).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["COMPACT_ABOVE", "SHRINK_AT", "Capture", "DecodeGraphs", "capturable", "cuda_capture"]

log = logging.getLogger("kd")

# With graphs, the batch is compacted once this share of its rows has finished (each new batch
# size is one more capture)...
SHRINK_AT = 0.5
# ...and only while it has more rows than this: a GPU decodes a small batch at about the cost of
# one row (launch-bound: the H100's 4 rows of Qwen2.5-0.5B), so below it a capture, about one
# eager step more, costs more than the smaller batch saves. Not yet measured on a GPU.
COMPACT_ABOVE = 16

# capture(fn) -> (fn's result now, a replay returning fn's result over the buffers' new values)
Capture = Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], torch.Tensor]]]


def cuda_capture(pool: Any = None) -> Capture:
    """A :data:`Capture` on the current CUDA device: the call runs once eagerly (the warm-up
    before a capture, which is the step itself: its cache writes and logits are used), then is
    recorded into a ``torch.cuda.CUDAGraph`` drawing on ``pool``
    (``torch.cuda.graph_pool_handle()``). The warm-up runs on the current stream, as vLLM's
    does (torch's side-stream warm-up is for DDP's collectives, which a decode step has none of):
    what it frees stays reusable by the rest of the step, where a side stream's cache would hold
    another step's temporaries for the rollout. ``capture_error_mode="thread_local"``: the
    process's other threads (a served teacher's request threads, a metric logger's) are not
    stopped by a capture in this one. Captures run in the training thread (``async_steps: 1`` is
    refused with graphs: its training thread synchronizes the device, which a capture in flight
    does not survive). ``torch.cuda.graph`` synchronizes and empties the caching allocator's
    unused blocks before each capture (torch 2.13): the training step after a rollout allocates
    them again, a few ``cudaMalloc`` calls per optimizer step."""

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        first = fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return first, replay

    return capture


_SAID: set[str] = set()


def capturable(steps: Any) -> bool:
    """Whether the backend's cached steps may be replayed from graphs (their ``capturable()``);
    when not, says once per process why this model decodes eagerly."""
    if steps.capturable():
        return True
    name = type(getattr(steps, "model", steps)).__name__
    if name not in _SAID:
        _SAID.add(name)
        log.warning(
            "on_policy.cuda_graphs: %s has sliding-window attention layers, whose cache keeps "
            "a Python count a graph cannot replay; its decode steps run eagerly (the same "
            "tokens, without the graphs' speed)",
            name,
        )
    return False


class DecodeGraphs:
    """One rollout group's decode steps, replayed from a graph per batch size.

    Args:
        step: the one-token step ``step(x [b, 1], pos [1]) -> logits [b, V]`` (the backend's
            ``decode`` and the last position's logits), reading only tensors.
        capture: how a step is recorded (:func:`cuda_capture`; a test's stand-in on the CPU).
    """

    def __init__(
        self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], capture: Capture
    ):
        self.step = step
        self.capture = capture
        self._replay: Callable[[], torch.Tensor] | None = None
        self._x: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self.captures = 0

    @staticmethod
    def compacts(rows: int) -> bool:
        """Whether a batch of ``rows`` rows is compacted when half of them have finished."""
        return rows > COMPACT_ABOVE

    def reset(self) -> None:
        """The batch's tensors changed (rows left): the next step captures again."""
        self._replay = self._x = self._pos = None

    def __call__(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """The logits after ``token`` ``[b]`` at ``position``."""
        if self._replay is None:  # a new batch: new buffers, captured at this step
            x = self._x = token[:, None].clone()
            pos = self._pos = torch.full((1,), position, dtype=torch.long, device=token.device)
            logits, self._replay = self.capture(lambda: self.step(x, pos))
            self.captures += 1
            return logits
        assert self._x is not None and self._pos is not None  # set with the replay
        self._x.copy_(token[:, None])
        self._pos.fill_(position)
        return self._replay()
