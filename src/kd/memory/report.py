"""Plots of a memory plan (matplotlib with the Agg backend: no display needed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kd.memory.estimate import COMPONENTS, GIB

if TYPE_CHECKING:
    from kd.memory.plan import MemoryPlan


def plot_plan(plan: MemoryPlan, path: str) -> None:
    """Write a stacked bar per phase (components in GiB) against the budget line to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e = plan.estimate
    phases = list(e.phase_names)
    fig, ax = plt.subplots(figsize=(8, 5))
    bottoms = [0.0] * len(phases)
    cmap = plt.get_cmap("tab20")
    for i, comp in enumerate(COMPONENTS):
        vals = [e.phases[p][comp] / GIB for p in phases]
        if not any(vals):
            continue
        ax.bar(phases, vals, bottom=bottoms, label=comp.replace("_", " "), color=cmap(i % 20))
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    if plan.traced:
        xs = [i for i, p in enumerate(phases) if p in plan.traced]
        ys = [(plan.traced[phases[i]] + plan.reserve_bytes) / GIB for i in xs]
        ax.scatter(xs, ys, marker="D", color="black", zorder=5, label="traced (+ reserve)")
    if plan.budget_gib:
        ax.axhline(
            plan.budget_gib, color="red", linestyle="--", label=f"budget {plan.budget_gib:g} GiB"
        )
    verdict = "fits" if plan.fits else "does not fit"
    ax.set_title(f"peak {plan.peak_gib:.1f} GiB in {plan.phase} ({verdict})")
    ax.set_ylabel("GiB per device")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
