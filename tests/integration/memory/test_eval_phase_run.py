"""The ``eval:`` phase of the plan against a real tiny run: ``kd run`` with ``eval:`` scores
``final/`` with lm-eval while every tensor allocated on the CPU is counted (a dispatch mode that
adds each new storage and subtracts it when freed: torch's allocator counters for the CPU), and
the peak is the plan's ``final_eval`` phase within the 3% the training phases' traces use. Before
``final/`` loads, nothing of the training (the student's and teacher's parameters, the optimizer's
states, an async sampler's frozen copy) is still alive."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kd.harness.evaluate as harness_evaluate
from kd.cli import main
from kd.testing import write_jsonl
from tests.conftest import make_config, write_config

pytest.importorskip("lm_eval")

pytestmark = pytest.mark.usefixtures("one_thread")
RECIPE = ["run", "kd_single_device"]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive that were made under the mode (or :meth:`track`-ed), and their
    peak."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[int] = set()
        self.now = 0
        self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.keys:
            return
        n = storage.nbytes()
        self.keys.add(key)
        self.now += n
        self.peak = max(self.peak, self.now)

        def free(key: int = key, n: int = n) -> None:
            self.keys.discard(key)
            self.now -= n

        weakref.finalize(storage, free)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def live_parameters() -> int:
    gc.collect()
    return sum(isinstance(o, torch.nn.Parameter) for o in gc.get_objects())


@pytest.fixture
def measured(monkeypatch):
    """The evaluation's peak (``peak``) and the parameters alive when it starts
    (``parameters_at_start``), from the model's load on."""
    seen: dict[str, int] = {}
    counter = LiveBytes()
    load = harness_evaluate._load

    def counted_load(model, device):  # noqa: ANN001
        seen["parameters_at_start"] = live_parameters()
        loaded, tokenizer = load(model, device)
        for t in [*loaded.parameters(), *loaded.buffers()]:
            counter.track(t)
        counter.__enter__()
        return loaded, tokenizer

    run = harness_evaluate.FinalEvaluation.run

    def counted_run(self, final_dir, *, output_dir):  # noqa: ANN001
        try:
            return run(self, final_dir, output_dir=output_dir)
        finally:
            counter.__exit__(None, None, None)
            seen["peak"] = counter.peak

    monkeypatch.setattr(harness_evaluate, "_load", counted_load)
    monkeypatch.setattr(harness_evaluate.FinalEvaluation, "run", counted_run)
    return seen


def mc_task(folder: Path, rows: int = 20, pad: int = 0) -> Path:
    """A multiple-choice task whose rows all have one length (the plan's worst case is exact:
    every batch as long as the first); two-token choices (no one-token cache grouping)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(
        folder / "mc.jsonl",
        [
            {
                "question": f"{a:02d}+{a:02d}=" + "x" * pad,
                "choices": ["ab", "cd", "ef"],
                "answer": a % 3,
            }
            for a in range(rows)
        ],
    )
    (folder / "mc.yaml").write_text(
        'task: mc\ntype: multiple_choice\ndata: mc.jsonl\nprompt: "Question: {question}\\nAnswer:"\n'
    )
    return folder


def gen_task(folder: Path, rows: int = 10, new: int = 40) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(
        folder / "gen.jsonl",
        [{"question": f"{a:02d}*{a:02d}=" + "w" * 30, "answer": str(a * a)} for a in range(rows)],
    )
    (folder / "gen.yaml").write_text(
        f"task: gen\ntype: generate\ndata: gen.jsonl\nmax_new_tokens: {new}\n"
    )
    return folder


def plan_json(config: Path, capsys) -> dict:
    capsys.readouterr()
    assert main(["plan", "--config", str(config), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def planned_bytes(config: Path) -> int:
    """The plan's ``final_eval`` phase in bytes (the JSON rounds to 1e-4 GiB)."""
    from kd.config import load_config
    from kd.memory.estimate import FINAL_EVAL_PHASE
    from kd.memory.plan import plan_from_config

    return plan_from_config(load_config(str(config), [])).estimate.allocated(FINAL_EVAL_PHASE)


@pytest.mark.parametrize(
    "task,batch_size,top",
    [
        ("mc", 8, {}),
        ("gen", 4, {}),
        ("mc", 8, {"on_policy": {"lmbda": 1.0, "max_new_tokens": 4, "async_steps": 1}}),
    ],
    ids=["multiple-choice", "generate", "async-sampler-freed"],
)
def test_eval_phase_matches_the_measured_evaluation(
    assets, tmp_path, capsys, measured, task, batch_size, top
):
    tasks = (mc_task if task == "mc" else gen_task)(tmp_path / "tasks")
    out = tmp_path / "run"
    cfg = make_config(
        assets,
        out,
        max_steps_per_epoch=1,
        eval={"tasks": [str(tasks)], "batch_size": batch_size},
        **top,
    )
    config = write_config(tmp_path / "c.yaml", cfg)
    plan = plan_json(config, capsys)
    assert [b["task"] for b in plan["final_eval"]] == [task]
    before = live_parameters()
    assert main([*RECIPE, "--config", str(config)]) == 0
    assert json.loads((out / "eval.json").read_text())["results"][task]
    # Nothing of the training is alive when final/ loads: its parameters were freed.
    assert measured["parameters_at_start"] <= before
    est = planned_bytes(config)
    assert est == pytest.approx(measured["peak"], rel=0.03), (est, measured["peak"])
