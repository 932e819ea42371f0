"""``kd plan``: the memory plan of a config, before any weight exists on disk.

    kd plan --config qwen2_5/14B_to_3B_full_single_device
    kd plan --config my.yaml batch_size=8 --budget-gib 24 --fit
    kd plan --config my.yaml --json --trace        # also run the real step under FakeTensorMode
    kd plan --config my.yaml --plot plan.png
    kd plan --config qwen2_5/14B_to_3B_full_single_device --compare-stored-logits 64

Exit status: 0 when the plan fits the budget (or no budget is known), 1 when it does not, 2 for a
config mistake.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from kd.cli.commands import add_target_arguments, resolve_target
from kd.errors import KDUserError, brief, one_line

if TYPE_CHECKING:
    from kd.config.run import RunConfig

_EPILOG = """\
The plan assumes every sequence is tokenizer.max_seq_len tokens long (memory.seq_len overrides it).
--fit searches activation checkpointing, micro-batch (accumulation raised to keep the global batch,
never beyond what the dataset holds), loss chunk size, 8-bit AdamW and the CPU offload the recipe
accepts (optimizer_in_cpu on one CUDA device, fsdp.cpu_offload over several ranks), and prints the
settings that fit, fastest first, as overrides; a LoRA student (and, with
--consider-teacher-quantization, a quantized teacher) are only suggested, with the settings that make them fit. With on_policy the generation phase (the KV-cache
rollout at the start of each step) is planned too, prompt + completion filling max_seq_len.
--trace runs the recipe's real training step for the full-size architecture on fake CPU tensors
(FakeTensorMode + MemTracker: no real memory, tens of seconds per billion parameters), and with
on_policy each sampling model's rollout (every one of max_new_tokens steps).
--compare-stored-logits K plans the run with its online teacher and trained from stored top-K
teacher logits (kd run teacher_logits, then teacher_logits.path; e.g. 64) side by side, and says for each budget (--budget-gib, default 40 and 24 GiB) which mode fits, as
configured or with the fastest --fit setting; exit status 0 (a comparison, not a check)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to ``kd``'s argparse subparsers."""
    p = subparsers.add_parser(
        "plan",
        help="memory plan of a config: peak per device, by component and phase (no weights needed)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_arguments(p)
    p.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    p.add_argument(
        "--trace",
        action="store_true",
        help="also trace the real step under FakeTensorMode and report its peaks",
    )
    p.add_argument(
        "--fit", action="store_true", help="when over budget, print the settings that fit"
    )
    p.add_argument(
        "--consider-teacher-quantization",
        action="store_true",
        help="with --fit, also suggest a quantized teacher (int8: teacher_quantization=int8; "
        "changes the teacher's outputs, so never suggested unasked)",
    )
    p.add_argument(
        "--plot", metavar="PNG", default=None, help="write a stacked bar chart of the components"
    )
    p.add_argument(
        "--compare-stored-logits",
        metavar="K",
        default=None,
        type=_topk_flag,
        help="plan the online teacher and stored top-K teacher logits side by side, with the "
        "settings that fit 40 and 24 GiB (or --budget-gib)",
    )
    return p


def _topk_flag(value: str) -> int:
    """``--compare-stored-logits K``: a whole number in ``teacher_logits.k``'s range."""
    from kd.config.schema import SECTIONS

    key = SECTIONS["teacher_logits"]["k"]
    try:
        k = int(value)
    except ValueError:
        k = -1
    if not (key.min or 1) <= k <= (key.max or k):
        raise argparse.ArgumentTypeError(
            f"K must be a whole number from {key.min} to {key.max} (teacher_logits.k), got {value!r}"
        )
    return k


# What matplotlib writes, by file suffix (a name without one gets a PNG).
PLOT_FORMATS: frozenset[str] = frozenset(
    {"png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp", "pgf"}
)


def check_plot_path(path: str) -> None:
    """Refuse a ``--plot`` destination that cannot be written, before planning anything.

    Raises:
        KDUserError: an empty or unusable path, a folder, a missing or read-only parent folder, or
            a suffix matplotlib does not write; names ``--plot`` and the fix.
    """
    from pathlib import Path

    from kd.config.validate import lookup_problem

    reason = lookup_problem(path) if path.strip() else "it is empty"
    if reason is not None:
        raise KDUserError(
            f"--plot: {path[:120]!r} is not a usable path ({reason}); pass a .png path"
        )
    dst = Path(path).expanduser()
    suffix = dst.suffix.lower().lstrip(".")
    if dst.is_dir():
        raise KDUserError(
            f"--plot: {one_line(path)} is a folder; pass a file path such as {one_line(str(dst / 'plan.png'))}"
        )
    if suffix and suffix not in PLOT_FORMATS:
        raise KDUserError(
            f"--plot: cannot write .{suffix} images; pass a path ending in .png, .svg or .pdf"
        )
    parent = dst.absolute().parent
    if parent.exists() and not parent.is_dir():
        raise KDUserError(
            f"--plot: {one_line(str(parent))} is a file, not a folder; pass a path in a folder"
        )
    if not parent.is_dir():
        raise KDUserError(
            f"--plot: the folder {one_line(str(parent))} does not exist; create it or pass a path in an existing "
            "folder"
        )
    if not os.access(parent, os.W_OK | os.X_OK) or (dst.exists() and not os.access(dst, os.W_OK)):
        raise KDUserError(
            f"--plot: {one_line(path)} is not writable; pass a path in a folder you can write to"
        )


def _sampler_torchrun_problem(run: RunConfig) -> str | None:
    """The line the run's on-policy sampler refuses its settings with under torchrun
    (:func:`kd.rollouts.plan.torchrun_problem`); None without ``on_policy``."""
    from kd.rollouts import plan as rollout_plan

    op = run.on_policy
    if op is None:
        return None
    copies = rollout_plan.copy_dtype(op, dtype=run.dtype) is not None
    return rollout_plan.torchrun_problem(op, copies=copies)


def run(args: argparse.Namespace) -> int:
    """Run ``kd plan``; returns the exit status (0 fits, 1 does not fit)."""
    from kd.config.teacher_kinds.model import torchrun_problem
    from kd.memory.estimate import estimate
    from kd.memory.fit import format_options
    from kd.memory.plan import attach_fit, inputs_from_run, make_plan
    from kd.runtime.device import optimizer_in_cpu_problem, resolve_budget

    t0 = time.perf_counter()
    if getattr(args, "compare_stored_logits", None) is not None:
        return _run_compare(args)
    if args.plot is not None:
        check_plot_path(args.plot)
    target = resolve_target(args, for_plan=True)
    run, world = target.run, target.world_size
    in_cpu = run.optimizer.in_cpu
    refused = (
        torchrun_problem(run)
        or optimizer_in_cpu_problem(in_cpu, "cuda", distributed=True)
        or _sampler_torchrun_problem(run)
        if world > 1
        else None
    )
    if refused is not None:  # as the run under torchrun, before any weight is read
        raise KDUserError(refused)
    inputs = inputs_from_run(run, world_size=world, config_name=args.config)
    budget = resolve_budget(budget_gib=run.memory.budget_gib, device=run.device)
    if budget.source != "memory.budget_gib":
        inputs.notes.append(f"budget = {budget.source}")
    if args.world_size is None and world == 1 and "distributed" in str(args.config):
        inputs.notes.append(
            "planned for 1 rank; pass --world-size N for the per-rank plan of N ranks"
        )
    plan = make_plan(inputs, budget.gib)
    if args.trace:
        from kd.memory.trace import trace_run

        if world > 1:
            inputs.notes.append(
                f"--trace: rank 0 of {world} FSDP2 ranks over a fake process group (FSDPMemTracker)"
            )
        result = trace_run(run, world_size=world)
        plan.traced = result.phase_peaks
        plan.traced_wall_s = result.wall_s
        # The trace keeps every labelled row (no gather), and what the run keeps in host memory
        # (offloaded activations, a parked teacher) on a device of its own, apart from the
        # device's memory (kd.memory.fake_step.HOST).
        traced_knobs = dataclasses.replace(inputs.knobs, select_labelled=False)
        plan.trace_estimate = estimate(inputs.student, inputs.teacher, traced_knobs)
    note = None
    if args.fit and not plan.fits:
        note = attach_fit(plan, run, quantized_teacher=args.consider_teacher_quantization)
    if args.plot:
        from kd.memory.report import plot_plan

        try:
            plot_plan(plan, args.plot)
        except (OSError, ValueError) as e:
            raise KDUserError(
                f"--plot: cannot write {one_line(args.plot)} ({brief(e)}); pass a writable .png path"
            ) from e
    if args.json:
        out = plan.to_json()
        out["plan_wall_s"] = round(time.perf_counter() - t0, 3)
        print(json.dumps(out, indent=2))
    else:
        print(plan.table())
        if args.fit and plan.fits:
            print("fit: the plan fits as it is; nothing to change")
        elif args.fit:
            print(format_options(plan.fit, note=note))
        if args.plot:
            print(f"plot written to {args.plot}")
    sys.stdout.flush()
    return 0 if plan.fits else 1


def _run_compare(args: argparse.Namespace) -> int:
    """``kd plan --compare-stored-logits K``: the online-teacher and stored-logits plans side by
    side and the budgets each fits (:mod:`kd.memory.compare`); exit status 0."""
    from kd.memory.compare import DEFAULT_BUDGETS_GIB, compare
    from kd.memory.data_size import run_dataset_size
    from kd.memory.plan import inputs_from_run

    for flag, used in (("--trace", args.trace), ("--fit", args.fit), ("--plot", args.plot)):
        if used:
            raise KDUserError(
                f"{flag}: not with --compare-stored-logits (it searches the settings that fit "
                f"itself); run kd plan {flag} without it"
            )
    target = resolve_target(args, for_plan=True)
    run = target.run
    # the online plan needs the teacher model, whether or not the config trains from a store
    online = run.with_section("teacher_logits", None)
    if not online.has_teacher:
        raise KDUserError(
            "--compare-stored-logits: the config has no teacher_model; set teacher_model (the "
            "teacher the logits come from) to compare with the online teacher"
        )
    k = int(args.compare_stored_logits)
    if target.world_size > 1:
        raise KDUserError(
            "--compare-stored-logits: compares one device; drop --world-size (or plan each mode "
            "per rank with kd plan --world-size N, with and without teacher_logits.path)"
        )
    inputs = inputs_from_run(online, world_size=1, config_name=args.config)
    budgets = (float(args.budget_gib),) if args.budget_gib is not None else DEFAULT_BUDGETS_GIB
    result = compare(inputs, k, budgets, device=run.device, dataset_size=run_dataset_size(run))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(result.table())
    sys.stdout.flush()
    return 0
