"""Decode steps replayed from graphs (``on_policy.cuda_graphs``, :mod:`kd.rollouts.graphs`), on
the CPU: :func:`kd.testing_graphs.tape_capture` replays a recorded step as a CUDA graph does (the
recorded operations on the recorded tensors, every Python value frozen), and
:func:`kd.testing_graphs.capture_hazards` lists what a real capture would refuse."""

from __future__ import annotations

import pytest
import torch

from kd.backends import backend_of
from kd.rollouts.decode import fast_rollout, next_logits
from kd.rollouts.graphs import DecodeGraphs
from kd.rollouts.sampling import row_generators
from kd.testing_graphs import capture_hazards, tape_capture
from tests.conftest import tiny_hidden_decoder
from tests.unit.rollouts.test_decode import hf_model, prompts, stops_of
from tests.unit.rollouts.test_decode_compiled import run as rollout

BACKENDS = ["torchtune", "transformers"]


def model_of(backend: str, tmp_path) -> torch.nn.Module:
    torch.manual_seed(0)
    if backend == "torchtune":
        return tiny_hidden_decoder(vocab=64, dim=32).eval()
    return hf_model(tmp_path).eval()


def decode_logits(model, p, feed: torch.Tensor, how: str) -> torch.Tensor:
    """The logits of the prefill and of every token of ``feed`` ``[b, n]`` after it: ``eager``
    (the backend's ``forward``), ``graph`` (its ``decode`` replayed from tapes), ``stale`` (a step
    that reads the position as a Python int, replayed from tapes)."""
    b, width = p.tokens.shape
    n = feed.shape[1]
    mask = torch.cat([p.mask, torch.ones(b, n, dtype=torch.bool)], dim=1)
    backend = backend_of(model)
    kw = {"static": True} if backend.name == "transformers" else {}
    with (
        torch.no_grad(),
        backend.kv_cache_steps(model, mask, width=width, total=width + n, **kw) as fwd,
    ):
        steps = fwd.__self__
        out = [next_logits(model, fwd, p.tokens, 0)]
        graph = DecodeGraphs(
            (lambda x, pos: next_logits(model, steps.decode, x, pos))
            if how == "graph"
            else (lambda x, pos: next_logits(model, fwd, x, int(pos))),
            tape_capture,
        )
        for t in range(n - 1):
            token = feed[:, t]
            if how == "eager":
                out.append(next_logits(model, fwd, token[:, None], width + t))
            else:
                out.append(graph(token, width + t).clone())
    return torch.stack(out, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replayed_decode_steps_equal_eager_steps(tmp_path, backend):
    """Every replay equals the eager step at its position, bit for bit, on the left-padded
    prompts; a step that reads its position as a Python int replays the captured one (the tape
    sees it, as a GPU would)."""
    model = model_of(backend, tmp_path)
    p = prompts(60, [5, 3, 7])
    feed = torch.randint(1, 60, (3, 6), generator=torch.Generator().manual_seed(1))
    eager = decode_logits(model, p, feed, "eager")
    assert torch.equal(decode_logits(model, p, feed, "graph"), eager)
    stale = decode_logits(model, p, feed, "stale")
    assert torch.equal(stale[:, :2], eager[:, :2])  # the prefill and the captured step
    assert not torch.allclose(stale[:, 2:], eager[:, 2:])


def eager_and_graphed(model, p, capture, *, temperature: float, stop_ids, device="cpu"):
    """``fast_rollout`` of ``p`` without graphs and with ``capture`` (each row's own generator
    when sampling), and the batch size of each capture."""
    sizes: list[int] = []

    def counted(fn):
        logits, replay = capture(fn)
        sizes.append(logits.shape[0])
        return logits, replay

    def run(graphs):
        return rollout(
            model,
            p,
            compile=False,
            temperature=temperature,
            stop_ids=stop_ids,
            device=device,
            graphs=graphs,
        )

    return run(None), run(counted), sizes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_fast_rollout_with_graphs_samples_the_same_tokens(tmp_path, backend, temperature):
    """The rollout with replayed steps samples what the eager one samples (each row's own
    generator, outside the graph), rows ending at different steps."""
    model = model_of(backend, tmp_path).train()
    p = prompts(60, [5, 3, 7, 2, 6, 4])
    stop_ids = stops_of(model, p) + (list(range(1, 9)) if temperature else [])
    eager, graphed, sizes = eager_and_graphed(
        model, p, tape_capture, temperature=temperature, stop_ids=stop_ids
    )
    assert len(set(eager.lengths.tolist())) > 1
    assert torch.equal(graphed.lengths, eager.lengths)
    assert torch.equal(graphed.tokens, eager.tokens)
    assert sizes == [6]  # 16 rows or fewer: never compacted, one capture
    assert model.training


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_large_batch_compacts_and_captures_each_size_once(tmp_path, backend):
    """More than COMPACT_ABOVE rows: compacted once half have finished, each batch size
    captured once at its first step, down to COMPACT_ABOVE rows at most; the same tokens."""
    from kd.rollouts.graphs import COMPACT_ABOVE

    model = model_of(backend, tmp_path)
    lengths = [5, 3, 7, 2, 6, 4, 8, 3] * 5  # 40 rows
    p = prompts(60, lengths, seed=2)
    stop_ids = list(range(1, 20))  # near-uniform tiny model: rows end anywhere
    eager, graphed, sizes = eager_and_graphed(
        model, p, tape_capture, temperature=1.0, stop_ids=stop_ids
    )
    assert torch.equal(graphed.tokens, eager.tokens)
    assert sizes[0] == 40 and len(sizes) >= 2
    assert sizes == sorted(set(sizes), reverse=True)
    assert all(s > COMPACT_ABOVE for s in sizes[:-1])


def test_compile_and_graphs_are_one_choice(tmp_path):
    model = model_of("torchtune", tmp_path)
    with pytest.raises(ValueError, match="pick one"):
        fast_rollout(
            model,
            prompts(60, [3, 2]),
            max_new_tokens=2,
            temperature=0.0,
            top_p=1.0,
            stop_ids=[],
            pad_id=0,
            vocab_limit=None,
            generators=None,
            compile=True,
            graphs=tape_capture,
        )


def test_a_reset_graph_captures_again():
    seen: list[torch.Tensor] = []

    def step(x, pos):
        seen.append(pos)
        return x.float() + pos

    graph = DecodeGraphs(step, tape_capture)
    token = torch.tensor([1, 2])
    assert graph(token, 5).tolist() == [[6.0], [7.0]]
    assert graph(token, 9).tolist() == [[10.0], [11.0]]  # replayed: step() not called again
    assert len(seen) == 1 and graph.captures == 1
    graph.reset()
    assert graph(token[:1], 3).tolist() == [[4.0]]
    assert graph.captures == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_steps_hold_nothing_a_capture_refuses(tmp_path, backend):
    """On the fake accelerator (device tensors, as on CUDA): a decode step reads nothing back to
    the host and copies nothing from it; the stand-in check itself sees both."""
    from kd.memory import fake_device
    from tests.conftest import FAKE_ACCELERATOR

    if FAKE_ACCELERATOR.args[0]:
        pytest.skip(FAKE_ACCELERATOR.kwargs["reason"])
    device = fake_device.register()
    cpu_model = model_of(backend, tmp_path)
    p = prompts(60, [5, 3, 7])
    b, width = p.tokens.shape
    with fake_device.FakeAccelerator():
        model = cpu_model.to(device)
        mask = torch.cat([p.mask, torch.ones(b, 4, dtype=torch.bool)], dim=1).to(device)
        kw = {"static": True} if backend == "transformers" else {}
        steps_of = backend_of(model).kv_cache_steps
        with torch.no_grad(), steps_of(model, mask, width=width, total=width + 4, **kw) as fwd:
            next_logits(model, fwd, p.tokens.to(device), 0)
            x = torch.ones(b, 1, dtype=torch.long, device=device)
            pos = torch.full((1,), width, dtype=torch.long, device=device)
            hazards = capture_hazards(lambda: next_logits(model, fwd.__self__.decode, x, pos))
            assert hazards == []
            assert capture_hazards(lambda: torch.tensor([width]).to(device) + pos) == [
                "_to_copy from the host"
            ]
            assert capture_hazards(lambda: bool(pos.sum())) != []


def test_cuda_capture_returns_the_warm_up_step_and_replays_into_the_captured_output(monkeypatch):
    """torch.cuda's graph API stood in for (a capture records and runs nothing): the step's own
    result is the eager warm-up run, never the captured output (unwritten until a replay); a
    replay writes that output from the buffers' values of now."""
    import contextlib

    from kd.rollouts import graphs

    x = torch.tensor([1.0, 2.0])
    state = {"capturing": False, "out": None, "modes": [], "replays": 0}

    def step() -> torch.Tensor:
        if state["capturing"]:  # recorded, not run: the output's memory holds nothing yet
            state["out"] = torch.full_like(x, float("nan"))
            return state["out"]
        return x * 2

    class Graph:
        def replay(self) -> None:
            state["replays"] += 1
            state["out"].copy_(x * 2)

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode="global"):  # noqa: ANN001, ANN202
        state["modes"].append((pool, capture_error_mode))
        state["capturing"] = True
        yield
        state["capturing"] = False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    first, replay = graphs.cuda_capture("pool")(step)
    assert first.tolist() == [2.0, 4.0] and state["replays"] == 0
    x.copy_(torch.tensor([5.0, 6.0]))
    again = replay()
    assert again is state["out"] and again.tolist() == [10.0, 12.0]
    assert state["modes"] == [("pool", "thread_local")]


def tiny_hf(arch: str, **extra) -> torch.nn.Module:
    """A tiny random transformers ``{arch}ForCausalLM`` in kd's hidden-output mode."""
    import transformers

    from kd import models

    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        **extra,
    )
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    models.set_hidden_output(model, True)
    return model


def _sliding_model(window: int) -> torch.nn.Module:
    """A tiny transformers Qwen2 whose every layer attends over a sliding window."""
    return tiny_hf("Qwen2", use_sliding_window=True, sliding_window=window, max_window_layers=0)


def test_a_sliding_window_model_decodes_eagerly(caplog):
    """transformers' sliding-window static layers keep a Python count of their length that
    reaches the step's tensors: a graph captured at one step replays it stale (the tape shows
    the replays diverging, even with a window longer than the rollout), so such a model's
    rollout decodes eagerly, says so once, and samples what it samples without graphs."""
    p = prompts(60, [5, 3, 7])
    feed = torch.randint(1, 60, (3, 8), generator=torch.Generator().manual_seed(1))
    steps = backend_of(_sliding_model(window=6)).kv_cache_steps
    mask = torch.ones(3, 7 + 8, dtype=torch.bool)
    for window in (6, 32):
        model = _sliding_model(window)
        eager = decode_logits(model, p, feed, "eager")
        assert not torch.equal(decode_logits(model, p, feed, "graph"), eager)
        assert not steps(model, mask, width=7, total=15, static=True).capturable()
    short = _sliding_model(window=6)

    captures: list[int] = []

    def counted(fn):
        captures.append(1)
        return tape_capture(fn)

    def run(graphs):
        return fast_rollout(
            short,
            p,
            max_new_tokens=8,
            temperature=1.0,
            top_p=1.0,
            stop_ids=[],
            pad_id=0,
            vocab_limit=60,
            generators=row_generators(7, 0, range(3), device=torch.device("cpu")),
            graphs=graphs,
        )

    with caplog.at_level("WARNING", logger="kd"):
        graphed = run(counted)
        run(counted)
    assert captures == []
    assert torch.equal(graphed.tokens, run(None).tokens)
    said = [r.getMessage() for r in caplog.records if "sliding-window" in r.getMessage()]
    assert len(said) <= 1 and all("decode steps run eagerly" in s for s in said)


@pytest.mark.parametrize(
    "arch,extra",
    [
        (
            "Llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
        ),
        ("Qwen3", {"head_dim": 8}),
        ("Mistral", {"sliding_window": None}),
        ("Gemma2", {"head_dim": 8}),  # sliding-window layers
    ],
)
def test_cached_steps_say_capturable_exactly_when_replays_equal_eager_steps(arch, extra):
    """Across transformers architectures: the cached steps' capturable() is True exactly where
    the tape's replays equal the eager steps (and only there does fast_rollout capture)."""
    model = tiny_hf(arch, **extra)
    p = prompts(60, [5, 3, 7])
    feed = torch.randint(1, 60, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 13, dtype=torch.bool)
    capturable = backend_of(model).kv_cache_steps(model, mask, width=7, total=13, static=True)
    same = torch.equal(
        decode_logits(model, p, feed, "graph"), decode_logits(model, p, feed, "eager")
    )
    assert capturable.capturable() == same == (arch != "Gemma2")
