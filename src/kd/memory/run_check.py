"""The recipe's memory check: the plan against the device's budget, before anything is built.

``kd run`` calls :func:`check_run_memory` first in ``preload()``; ``kd plan`` and ``kd validate``
print the same plan through :mod:`kd.cli.plan`. No torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kd.config.run import RunConfig
from kd.memory.plan import MemoryPlan, check_memory
from kd.runtime.device import resolve_budget

if TYPE_CHECKING:
    from kd.runtime.distributed import WorldInfo

log = logging.getLogger("kd")

__all__ = ["check_run_memory"]


def check_run_memory(
    run: RunConfig, world: WorldInfo, *, config_name: str = ""
) -> MemoryPlan | None:
    """The memory plan of ``run`` against its budget (arithmetic on shapes, before anything is
    built), said on the ``kd`` logger on rank 0.

    Args:
        run: the typed config (``memory.budget_gib``, ``memory.check``, ``device``).
        world: this process's place in the job (its world size is planned).
        config_name: the config's name, for the ``--fit`` command a refusal suggests.

    Returns:
        The plan, or None with ``memory.check: off``.

    Raises:
        KDUserError: over budget with ``memory.check: error``: the table and the knob settings
            that fit (:func:`kd.memory.plan.check_memory`).
    """
    budget = resolve_budget(budget_gib=run.memory.budget_gib, device=run.device)
    plan = check_memory(
        run, world_size=world.world_size, budget_gib=budget.gib, config_name=config_name
    )
    if plan is not None and world.is_rank_zero:
        log.info(
            "memory plan: peak %.2f GiB (%s) of %s",
            plan.peak_gib,
            plan.phase,
            "an unknown budget" if budget.gib is None else f"{budget.gib:.2f} GiB",
        )
    return plan
