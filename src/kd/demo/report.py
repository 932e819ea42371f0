"""What ``kd demo`` shows: the results table, the loss curves, ``results.json`` and the RESULT line."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kd.demo.configs import STUDENT, TEACHER, DemoRun
from kd.demo.evaluate import EvalResult
from kd.demo.task import DemoPlan


@dataclass
class DemoResult:
    """What ``kd demo`` measured (also written to ``<output-dir>/results.json``).

    Attributes:
        teacher, kd_student, ce_student: held-out results of the three final models.
        heldout_floor: the least held-out loss any model can reach (the chain's entropy per token).
        gap_closed: ``(ce - kd) / (ce - teacher)`` of the held-out losses.
        seconds: wall time of the whole demo.
        plot: path of the PNG.
    """

    teacher: EvalResult
    kd_student: EvalResult
    ce_student: EvalResult
    heldout_floor: float
    gap_closed: float
    seconds: float
    plot: str

    def result_line(self) -> str:
        """``RESULT kd_student_heldout_loss=<x> ce_student_heldout_loss=<y> teacher_heldout_loss=<z>``."""
        return (
            f"RESULT kd_student_heldout_loss={self.kd_student.loss:.4f} "
            f"ce_student_heldout_loss={self.ce_student.loss:.4f} "
            f"teacher_heldout_loss={self.teacher.loss:.4f}"
        )


def say(msg: str) -> None:
    """Print one line of the demo's output at once."""
    print(msg, flush=True)


def plot_curves(dest: Path, runs: dict[str, dict[str, Any]], plan: DemoPlan, floor: float) -> Path:
    """Training and held-out loss curves of the three runs, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    colors = {"teacher": "tab:green", "kd_student": "tab:blue", "ce_student": "tab:red"}
    labels = {
        "teacher": f"teacher ({plan.teacher_examples} labelled examples)",
        "kd_student": f"KD student ({plan.student_examples} labelled + teacher)",
        "ce_student": f"CE-only student ({plan.student_examples} labelled)",
    }
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = [
        (axes[0], ["teacher"], "teacher"),
        (axes[1], ["kd_student", "ce_student"], "students"),
    ]
    for ax, names, title in panels:
        for name in names:
            run = runs[name]
            steps = [row["step"] for row in run["metrics"]]
            ax.plot(
                steps,
                [row["ce_loss"] for row in run["metrics"]],
                color=colors[name],
                alpha=0.35,
                lw=1,
                label=f"{labels[name]}: training CE",
            )
            xs, ys = zip(*run["curve"], strict=True)
            ax.plot(
                xs,
                ys,
                color=colors[name],
                lw=2,
                marker="o",
                ms=3,
                label=f"{labels[name]}: held-out",
            )
        if title == "students":
            ax.axhline(
                runs["teacher"]["final"].loss,
                color=colors["teacher"],
                ls="--",
                lw=1.5,
                label="trained teacher: held-out",
            )
        ax.axhline(floor, color="gray", ls=":", lw=1, label="best possible (chain entropy)")
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss per labelled token (nats)")
        # Log scale: step 0 (random init) sits near ln(vocab), far above the rest.
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(FixedLocator([0.3, 0.4, 0.5, 0.6, 0.8, 1, 1.5, 2, 3, 4, 6]))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(
        "kd demo: knowledge distillation on 'continue the letters' (held-out = unseen prompts)"
    )
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest


def write_results(
    root: Path,
    result: DemoResult,
    results: dict[str, dict[str, Any]],
    plan: DemoPlan,
    seed: int,
    runs: dict[str, DemoRun],
) -> Path:
    """Write ``<root>/results.json``: the plan, shapes, held-out numbers and curves of every run."""
    out = {
        "seed": seed,
        "plan": asdict(plan),
        "teacher_shape": asdict(TEACHER),
        "student_shape": asdict(STUDENT),
        "heldout_floor": result.heldout_floor,
        "gap_closed": result.gap_closed,
        "seconds": result.seconds,
        "configs": {name: str(run.config) for name, run in runs.items()},
        "models": {
            name: {**asdict(r["final"]), "heldout_curve": r["curve"]} for name, r in results.items()
        },
    }
    path = root / "results.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    return path


def print_table(result: DemoResult, plan: DemoPlan) -> None:
    """Print the held-out results of the three models against the best possible."""
    rows = [
        ("teacher", f"{plan.teacher_examples}", plan.teacher_steps(), result.teacher),
        (
            "KD student",
            f"{plan.student_examples} + teacher",
            plan.student_steps(),
            result.kd_student,
        ),
        ("CE-only student", f"{plan.student_examples}", plan.student_steps(), result.ce_student),
    ]
    head = (
        f"{'model':<16} {'labelled examples':>18} {'steps':>6} {'held-out loss':>14} "
        f"{'next-letter acc':>16} {'greedy exact match':>19} {'KL to teacher':>14} "
        f"{'top-1 = teacher':>16}"
    )
    say("")
    say(head)
    say("-" * len(head))
    for name, data, steps, r in rows:
        kl = "-" if r.kd_loss is None else f"{r.kd_loss:.4f}"
        agree = "-" if r.top1_agreement is None else f"{r.top1_agreement:.3f}"
        say(
            f"{name:<16} {data:>18} {steps:>6} {r.loss:>14.4f} {r.next_letter_acc:>16.3f} "
            f"{r.exact_match:>19.3f} {kl:>14} {agree:>16}"
        )
    say(
        f"{'best possible':<16} {'':>18} {'':>6} {result.heldout_floor:>14.4f} {1.0:>16.3f} "
        f"{1.0:>19.3f}"
    )
    say(
        f"KD closed {100 * result.gap_closed:.0f}% of the held-out loss gap between the CE-only "
        "student and the teacher: (ce - kd) / (ce - teacher)"
    )
    say(
        "held-out loss, KL to teacher and top-1 = teacher are kd.training.evaluate's val_ce_loss, "
        "val_kd_loss and val_top1_agreement (what validation: logs during training)"
    )
    say("")
