"""A run's metric sinks as one component: ``output_dir/metrics.jsonl`` and the config's
``metric_logger`` (stdout, wandb...), opened together on rank 0, written row by row, closed once."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from kd.checkpoint import outputs
from kd.errors import KDUserError, redact
from kd.metrics import GuardedLogger, build_quietly, peak_memory_gib
from kd.runtime.run_context import RunContext
from kd.training.train import StepStats, step_metrics

__all__ = ["RunLog"]

log = logging.getLogger("kd")


class RunLog:
    """Opens the run's metric sinks: the logger first (a logger that cannot start leaves
    output_dir as it was), then ``config.yaml`` and ``metrics.jsonl``. Rank 0 only.

    Args:
        ctx: the run (its ``metric_logger`` component).
        config_yaml: the resolved config (its seed drawn), saved as ``config.yaml``.
        output_dir: the run's folder.
        resume_step: the step a resumed run continues from (rows past it are dropped), or None.
    """

    def __init__(
        self, ctx: RunContext, output_dir: Path, *, config_yaml: str, resume_step: int | None
    ):
        self.ctx = ctx
        self.output_dir = output_dir
        self.logger = GuardedLogger(
            build_quietly(lambda: ctx.build("metric_logger", fix="fix the logger's arguments")),
            target=ctx.node("metric_logger").get("_component_"),
        )
        # The metric sink (wandb...) gets the config without a URL's password.
        self.logger.log_config(OmegaConf.create(redact(config_yaml)))
        try:
            self.metrics = outputs.open_metrics(
                output_dir, config_yaml=config_yaml, resume_step=resume_step
            )
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to report
                self.logger.close()
            raise
        self.logger.outputs_kept = True

    def write(self, row: dict[str, Any]) -> None:
        """One row (``step`` and its values) to ``metrics.jsonl`` and the logger."""
        outputs.write_metrics_row(self.metrics, row, output_dir=self.output_dir)
        self.logger.log_dict({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def write_step(
        self,
        stats: StepStats,
        *,
        step: int,
        epoch: int,
        lr: float,
        planned_peak_gib: float | None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """The row of optimizer step ``step``: its learning rate and metrics
        (:func:`kd.training.train.step_metrics`), ``extra`` (the on-policy sampler's wait and
        weight version lag, when it reports them), with ``log_peak_memory_stats`` the device's
        peaks and the memory plan's (``planned_peak_gib``, None without a plan)."""
        run = self.ctx.run
        row: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            "lr": lr,
            **step_metrics(stats, on_policy=run.on_policy is not None),
            **(extra or {}),
        }
        if run.log_peak_memory_stats:
            row.update(peak_memory_gib(self.ctx.device))
            if planned_peak_gib is not None:
                row["planned_peak_gib"] = planned_peak_gib
        self.write(row)

    def close(self, *, failing: bool = False) -> None:
        """Close both sinks, raising the logger's failure as one line; while an error is on its
        way out (``failing``) that failure is only logged, so the first error is the one
        reported."""
        self.metrics.close()
        try:
            self.logger.close()
        except KDUserError as e:
            if not failing:
                raise
            log.warning("%s", e)
