"""What ``kd validate`` and ``kd plan`` share: the same flags, and one way from flags to a run.

Both commands take ``--config``, overrides, ``--budget-gib`` and ``--world-size`` (alias
``--nproc_per_node``, torchrun's spelling, which ``kd run`` takes), and resolve them exactly as
``kd run`` resolves its config: load, validate, :func:`kd.config.run.run_config`, then
:func:`kd.runtime.device.resolve_world_size`. ``--budget-gib X`` is applied as ``memory.budget_gib=X``, so
the budget is resolved in one place (:func:`kd.runtime.device.resolve_budget`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kd.config.run import RunConfig


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, overrides, ``--budget-gib`` and ``--world-size`` (same on every command)."""
    parser.add_argument("--config", required=True, help="built-in config name or YAML path")
    parser.add_argument("overrides", nargs="*", help="key=value or ~key overrides")
    parser.add_argument(
        "--budget-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="per-device budget, same as memory.budget_gib=GIB (default: memory.budget_gib, "
        "else the device's memory)",
    )
    parser.add_argument(
        "--world-size",
        "--nproc_per_node",
        "--nproc-per-node",
        dest="world_size",
        type=int,
        default=None,
        metavar="N",
        help="ranks to plan for (FSDP2 under torchrun; per-rank numbers; default 1)",
    )


def budget_flag(value: float) -> float:
    """``--budget-gib``, checked against the range of ``memory.budget_gib`` (the flag sets it).

    Raises:
        KDUserError: zero, negative, NaN or infinite; names the flag.
    """
    from kd.config.schema import MEMORY
    from kd.config.validate import check_value
    from kd.errors import KDUserError

    problem = check_value("--budget-gib", value, MEMORY["budget_gib"])
    if problem is not None:
        raise KDUserError(f"--budget-gib: {problem}")
    return value


@dataclass(frozen=True)
class Target:
    """A config resolved as ``kd run`` resolves it.

    Attributes:
        name: the config as given on the command line.
        cfg: the loaded, validated config.
        run: its typed run configuration.
        world_size: ranks.
    """

    name: str
    cfg: DictConfig
    run: RunConfig
    world_size: int


def resolve_target(args: argparse.Namespace, *, for_plan: bool = False) -> Target:
    """Load and validate ``args.config`` with the overrides, the budget flag and the world size.

    Args:
        args: parsed flags of :func:`add_target_arguments`.
        for_plan: ``kd plan`` needs no file but the models' ``config.json``: input files and
            ``output_dir`` are not checked (plan before the weights finish downloading), and
            the ``_component_`` targets are not imported (the plan needs no torch).

    Raises:
        KDUserError: any config mistake (all of them), or a bad flag.
    """
    from kd.config import load_config, teacher_kinds, validate_config
    from kd.config.run import run_config
    from kd.runtime.device import resolve_world_size

    world_size = resolve_world_size(args.world_size)
    overrides = list(args.overrides)
    if args.budget_gib is not None:
        overrides.append(f"memory.budget_gib={budget_flag(args.budget_gib)!r}")
    cfg = load_config(args.config, overrides)
    validate_config(cfg, check_paths=not for_plan, check_components=not for_plan)
    run = run_config(cfg)
    teacher_kinds.refuse(run)  # what kd run refuses before building the teacher (no weights)
    return Target(args.config, cfg, run, world_size)
