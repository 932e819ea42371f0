"""``kd demo`` orchestration: prepare the folder, write the assets, train three runs, evaluate, report."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

from kd.demo.configs import MAX_SEQ_LEN, STUDENT, TEACHER, dataset_node, write_runs
from kd.demo.evaluate import HeldOut, evaluate_runs
from kd.demo.report import DemoResult, plot_curves, print_table, say, write_results
from kd.demo.task import ANSWER_LETTERS, FULL, QUICK, DemoPlan, write_task
from kd.errors import KDUserError
from kd.testing import TinyModel, tokenizer_node, write_tokenizer

# A folder holding this file was made by `kd demo` and may be cleared by the next `kd demo`.
MARKER_FILE = "kd_demo.json"
# Sub-folders `kd demo` writes (and clears on a rerun into the same folder).
_OWNED = ("tokenizer", "data", "models", "configs", "runs", "eval", "cache")


def _quiet_step_checkpoints(record: logging.LogRecord) -> bool:
    # The demo saves a step checkpoint every few steps for its held-out curves; one line each
    # would bury the progress bar.
    return (
        not record.getMessage().startswith("saved checkpoint") or "step_" not in record.getMessage()
    )


def train(config_path: Path) -> None:
    """Run ``kd run kd_single_device --config <config_path>`` in this process.

    Raises:
        KDUserError: the run failed.
    """
    from kd.recipes.kd_single_device import recipe_main
    from kd.runtime.launch import run_recipe

    log = logging.getLogger("kd")
    log.addFilter(_quiet_step_checkpoints)
    try:
        rc = run_recipe(recipe_main, ["--config", str(config_path)])
    finally:
        log.removeFilter(_quiet_step_checkpoints)
    if rc != 0:
        raise KDUserError(f"demo: training with {config_path} failed (exit status {rc}); see above")


def _prepare_output_dir(root: Path) -> None:
    from kd.config.validate import lookup_problem

    reason = lookup_problem(str(root))
    if reason is not None:
        raise KDUserError(
            f"--output-dir: {str(root)[:120]!r} is not usable ({reason}); pass a folder"
        )
    if root.exists() and not root.is_dir():
        raise KDUserError(f"--output-dir: {root} is a file; pass a folder")
    if root.is_dir() and any(root.iterdir()):
        if not (root / MARKER_FILE).exists():
            raise KDUserError(
                f"--output-dir: {root} is not empty and was not made by kd demo; "
                "pass a new or empty folder"
            )
        for name in _OWNED:
            shutil.rmtree(root / name, ignore_errors=True)
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / MARKER_FILE).write_text(json.dumps({"made_by": "kd demo"}) + "\n")
    except OSError as e:
        raise KDUserError(
            f"--output-dir: cannot create {root} ({e.strerror or e}); pass a folder you can "
            "write to"
        ) from e


def run_demo(output_dir: Path, *, quick: bool = False, seed: int = 0) -> DemoResult:
    """Build the tiny task, train teacher and both students through the recipe, evaluate, plot.

    Args:
        output_dir: folder for everything (created; a previous demo folder is cleared first).
        quick: a short smoke run (the numbers then do not show KD's advantage).
        seed: seeds the task, the data, the initial weights and the training runs.

    Returns:
        The evaluation of the three models and where the plot is.

    Raises:
        KDUserError: the folder is not usable, or a training run failed.
    """
    import torch

    root = Path(output_dir).resolve()
    _prepare_output_dir(root)
    plan = QUICK if quick else FULL
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        # Tiny models: one intra-op thread is as fast as two on an idle 2-core machine and ~20x
        # faster when the cores are busy (the threads spin-wait for each other).
        torch.set_num_threads(1)
    try:
        return _run_demo(root, plan, seed)
    finally:
        torch.set_num_threads(threads)


def _run_demo(root: Path, plan: DemoPlan, seed: int) -> DemoResult:
    start = time.perf_counter()

    say(f"[1/4] writing tokenizer, task data, random-init models and configs under {root}")
    tokenizer_dir = write_tokenizer(root / "tokenizer")
    chain, files = write_task(root / "data", plan, seed)
    runs = write_runs(root, plan, seed, files, tokenizer_dir)

    t0 = time.perf_counter()
    say(
        f"[2/4] training the teacher ({_describe(TEACHER)}) on {plan.teacher_examples} labelled "
        f"examples, {plan.teacher_steps()} steps:\n      kd run kd_single_device --config "
        f"{runs['teacher'].config}"
    )
    train(runs["teacher"].config)
    say(f"      done in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    say(
        f"[3/4] training two students ({_describe(STUDENT)}) on the same {plan.student_examples} "
        f"labelled examples, {plan.student_steps()} steps each"
    )
    for name, what in (
        ("kd_student", "with KD from the teacher"),
        ("ce_student", "cross-entropy only"),
    ):
        say(f"      {what}: kd run kd_single_device --config {runs[name].config}")
        train(runs[name].config)
    say(f"      done in {time.perf_counter() - t0:.0f} s")

    t0 = time.perf_counter()
    say(
        f"[4/4] evaluating on {plan.heldout_examples} held-out examples (and every step checkpoint)"
    )
    heldout = HeldOut(
        files["heldout"],
        tokenizer_node(tokenizer_dir, MAX_SEQ_LEN),
        dataset_node(files["heldout"], root / "cache"),
    )
    results = evaluate_runs(runs, heldout, chain, root / "eval" / "checkpointer", say=say)
    say(f"      done in {time.perf_counter() - t0:.0f} s")
    # Per labelled token: the answer letters carry the chain's entropy, the other labelled tokens
    # (the assistant header) are predictable.
    labelled_per_row = float((heldout.labels != -100).sum()) / len(heldout.rows)
    floor = chain.entropy() * ANSWER_LETTERS / labelled_per_row
    t, k, c = (results[n]["final"] for n in ("teacher", "kd_student", "ce_student"))
    closed = (c.loss - k.loss) / (c.loss - t.loss) if c.loss > t.loss else math.nan
    plot = plot_curves(root / "kd_demo.png", results, plan, floor)
    result = DemoResult(t, k, c, floor, closed, time.perf_counter() - start, str(plot))
    write_results(root, result, results, plan, seed, runs)
    print_table(result, plan)
    say(f"plot: {plot}")
    say(f"configs: {root / 'configs'}   runs: {root / 'runs'}   numbers: {root / 'results.json'}")
    say(f"time: {result.seconds:.0f} s")
    say(result.result_line())
    return result


def _describe(shape: TinyModel) -> str:
    return f"{shape.num_layers} layers, dim {shape.embed_dim}, vocab {shape.vocab_size}"


# -------------------------------------------------------------------------------------- CLI
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``kd demo`` to the ``kd`` command's subparsers."""
    p = subparsers.add_parser(
        "demo",
        help="distil a tiny teacher into a tiny student on CPU in a few minutes",
        description="Train a tiny teacher, then two students on a few labelled examples (one with "
        "KD, one without), all through kd run; print held-out results and plot the curves.",
    )
    p.add_argument(
        "--output-dir", default="./kd_demo", help="folder for everything (default ./kd_demo)"
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run (under a minute)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task, data, weights and runs")


def run(args: argparse.Namespace) -> int:
    """``kd demo``: run the demo; returns the exit status."""
    run_demo(Path(args.output_dir), quick=bool(args.quick), seed=int(args.seed))
    return 0
