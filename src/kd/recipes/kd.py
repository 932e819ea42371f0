"""Knowledge distillation: a frozen teacher teaches a trainable student (full or LoRA), 1 to N ranks.

Run it:

    kd run kd --config qwen2_5/14B_to_3B_full_single_device
    kd run kd --config my.yaml batch_size=2 gradient_accumulation_steps=16
    kd run --nproc_per_node 8 kd --config llama3_1/8B_to_8B_full_distributed

``kd_single_device`` and ``kd_distributed`` (torchtune's names) run it too; torchrun: FSDP2.

Features (each knob is a config key declared in kd/config/run.py; ``kd run --help`` lists them
with their doc pages): the memory plan before any weight loads (``kd validate`` runs exactly
:meth:`KDRecipe.preload`); the loss ``(1 - kd_ratio) * CE + kd_ratio * KD`` fused over labelled
tokens; any teacher kind (:mod:`kd.config.teacher_kinds`, ``docs/teachers.md``), asked for a
signal per micro-batch, told of each optimizer step (its state kept in step checkpoints) and never
asked which kind it is; exact gradient accumulation over micro-batches and ranks, LoRA, FSDP2; step
checkpoints and exact resume, SIGTERM/SIGINT saving and exiting 0, one run per ``output_dir``;
metrics (``metrics.jsonl``, ``metric_logger``); validation, ``best/`` and early stopping;
on-policy distillation (``on_policy``) and the final lm-eval evaluation (``eval``).
"""

from __future__ import annotations

import itertools
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from kd import checkpoint, data
from kd.checkpoint import outputs, resume_point
from kd.config.run import VALIDATION_DATASET, RunConfig, run_config
from kd.errors import brief
from kd.memory.plan import MemoryPlan
from kd.memory.run_check import check_run_memory
from kd.metrics import PhaseTimer, progress_bar
from kd.rollouts import prompts
from kd.rollouts.base import RolloutStopped
from kd.runtime import distributed
from kd.runtime.checkpoints import Progress, check_loaded_weights_finite
from kd.runtime.distributed import WorldInfo
from kd.runtime.interrupts import GracefulStop, stopped_message
from kd.runtime.run_checkpointer import RunCheckpointer
from kd.runtime.run_context import RunContext
from kd.teachers import Teacher, TeacherInput, TeacherStopped
from kd.teachers.build import teacher_source
from kd.training import evaluate, on_policy, train
from kd.training.run_log import RunLog

log = logging.getLogger("kd")


class KDRecipe:
    """Distil the teacher into ``model`` (the student). See the module docstring for knobs.

    Phases: :meth:`preload` (checks, no weight), :meth:`load` (weights, optimizer, resume state,
    outputs), :meth:`train` (the loop; one optimizer step is :meth:`train_step`). It holds a
    teacher, a student, a validator, an on-policy component (its sampler inside) and a
    checkpointer, and never asks which kind of teacher or sampler it holds.
    """

    def __init__(self, run: RunConfig, *, world: WorldInfo, config_name: str = ""):
        self.run = run
        self.world = world
        self.config_name = config_name
        self.ctx = RunContext(run, world)
        self.device = self.ctx.device
        self.output_dir = run.checkpoint.output_dir
        self.global_step = 0
        self.epoch = 0
        self.plan: MemoryPlan | None = None
        self.lock: outputs.OutputDirLock | None = None
        self.teacher_source = teacher_source(run)
        self.teacher: Teacher | None = None
        self.validator: evaluate.Validator | None = None
        self.on_policy: on_policy.OnPolicyBatches | None = None
        self.log: RunLog | None = None  # rank 0's metric sinks
        self.complete = False  # resume found the run already finished (preload)
        self.found: resume_point.ResumePoint | None = None
        # Trainable parameters the teacher's loss adds (Teacher.bind_student), or None.
        self.extra: torch.nn.Module | None = None
        self.final_eval: Any = None  # kd.harness.evaluate.FinalEvaluation with eval:
        self.rollout_state: dict[str, Any] = {}  # the on-policy state of the resumed checkpoint

    # ------------------------------------------------------------ 1. before any weight
    def preload(self) -> None:
        """Every check that needs no weight, cheapest first (``kd validate`` runs exactly this):
        device, memory plan, tokenizer and both models' shapes, output_dir and the resume state,
        the data, the teacher's and the sampler's own checks, the schedule. Writes nothing."""
        run, ctx = self.run, self.ctx
        ctx.check_device()
        self.plan = check_run_memory(run, ctx.world, config_name=self.config_name)
        self.tokenizer = ctx.tokenizer()
        teacher_reads = self.teacher_source.reads if self.teacher_source is not None else ()
        self.facts = ctx.inspect_models(self.tokenizer, read=("model", *teacher_reads))
        start = resume_point.resume_point(self.output_dir, run)
        if start is None:
            self.complete = True  # already finished (said on the kd logger): nothing to do
            return
        self.run, self.found = run, found = start
        self.resume_from = found.checkpoint if found is not None else None
        self.dataset = ctx.dataset(run.components["dataset"], self.tokenizer, key="dataset")
        if run.on_policy is not None:
            prompts.check_prompts(self.dataset, key="dataset")
        if self.teacher_source is not None:
            self.teacher_source.check(ctx, self.facts, self.dataset)
        if run.on_policy is not None:  # a server probed, settings the sampler cannot honour
            on_policy.run_sampler(run, ctx, self.facts, self.tokenizer, self.output_dir).check()
        if run.validation is not None:
            self.val_dataset = ctx.dataset(
                run.validation.dataset, self.tokenizer, key=VALIDATION_DATASET
            )
        if run.eval is not None:  # the task files, their data and lm-eval's names
            from kd.harness.evaluate import FinalEvaluation

            student = ctx.student_source(self.facts)
            self.final_eval = FinalEvaluation(run.eval, device=str(self.device), student=student)

        def steps(max_steps: int | None) -> int:
            return ctx.steps_per_epoch(len(self.dataset), max_steps)

        self.steps_per_epoch = steps(run.max_steps_per_epoch)
        self.total_steps = self.steps_per_epoch * run.epochs
        if found is not None:  # the schedule goes on where the checkpoint left it
            checkpoint.check_schedule_change(
                found.config_yaml,
                run.yaml,
                checkpoint=found.checkpoint,
                total_steps=lambda epochs, max_steps: epochs * steps(max_steps),
                make_scheduler=lambda opt, n: train.build_lr_scheduler(ctx, opt, n),
            )
            checkpoint.check_resume_position(found.checkpoint, steps_per_epoch=self.steps_per_epoch)

    # ------------------------------------------------------------ 2. weights and state
    def load(self) -> None:
        """output_dir (rank 0 takes it), seed, data order, teacher then student, optimizer,
        schedule, resume, the components, outputs."""
        run, ckpt = self.run, self.run.checkpoint
        # Every rank has finished its checks of output_dir before rank 0 takes it.
        distributed.barrier()
        self.lock = distributed.on_rank_zero(
            lambda: outputs.claim_output_dir(
                self.output_dir, resume=ckpt.resume, overwrite=ckpt.overwrite
            ),
            world=self.world,
        )
        self.run = run = run.with_seed(distributed.seed_all_ranks(run.seed, world=self.world))
        pad_id = data.pad_id_of(self.tokenizer)
        needs_rows = self.teacher_source is not None and self.teacher_source.needs_rows
        self.loader, self.sampler = data.build_dataloader(
            self.dataset,
            batch_size=run.batch_size,
            shuffle=run.shuffle,
            seed=run.seed,
            pad_id=pad_id,
            world_size=self.world.world_size,
            rank=self.world.rank,
            with_rows=needs_rows or run.on_policy is not None,
            route_field=self._route_field(),
        )
        if self.teacher_source is not None:
            self.teacher = self.teacher_source.load(self.ctx, self.facts, run_dir=self.output_dir)
        self.student = self.ctx.load_student(self.facts, run_dir=self.output_dir)
        if self.teacher is not None:
            self.extra = self.teacher.bind_student(self.student)
        self.optimizer, self.lr_scheduler = train.build_optimizer(
            self.ctx, self.student, num_training_steps=self.total_steps, extra=self.extra
        )
        self.checkpointer = RunCheckpointer(
            self.output_dir,
            source=self.ctx.student_source(self.facts),
            config_yaml=run.yaml,
            keep_last_n=run.checkpoint.keep_last_n,
            world=self.world,
            extra=self.extra,
        )
        if run.validation is not None:
            self.validator = evaluate.Validator.for_run(
                run,
                self.val_dataset,
                pad_id=pad_id,
                world=self.world,
                device=self.device,
                route_field=self._route_field(),
            )
        if self.resume_from is not None:
            self._restore(self.resume_from)
        if run.on_policy is not None:
            self.on_policy = on_policy.OnPolicyBatches.for_run(
                self.run,
                self.ctx,
                self.facts,
                self.tokenizer,
                self.output_dir,
                state=self.rollout_state,
            )
            self.on_policy.start(self.student, self.global_step)
        if self.world.is_rank_zero:
            resume_step = self.global_step if self.resume_from is not None else None
            self.log = RunLog(
                self.ctx, self.output_dir, config_yaml=self.run.yaml, resume_step=resume_step
            )

    def _route_field(self) -> str | None:
        """The data field batches carry for the teacher (``TeacherInput.route``), if any."""
        return self.teacher_source.route_field if self.teacher_source is not None else None

    def _restore(self, ckpt: Path) -> None:
        progress = self.checkpointer.restore(ckpt, self.student, self.optimizer, self.lr_scheduler)
        self.global_step, self.epoch = progress.global_step, progress.epoch
        self.rollout_state = progress.rollouts
        self.run = self.run.with_seed(progress.seed)
        self.checkpointer.config_yaml = self.run.yaml  # the snapshot holds the run's seed
        if self.teacher is not None:
            self.teacher.load_state_dict(progress.teacher)
        if self.validator is not None:
            self.validator.restore(progress.validation, ckpt, say=self.world.is_rank_zero)

    # ------------------------------------------------------------ 3. training
    def train(self) -> None:
        """The loop: step, log, validate, checkpoint, final save; stop cleanly on SIGTERM/SIGINT
        (a signal after the last step waits for the final save) or when early stopping says so."""
        grad_accum, start_epoch = self.run.optimizer.grad_accum, self.epoch
        done_in_epoch = self.global_step - start_epoch * self.steps_per_epoch
        bad_steps, first_step = 0, self.global_step + 1
        saved: tuple[int, Path | None] | None = None  # (step, folder) of the newest step save
        every = self.run.checkpoint.save_every_n_steps
        bar = progress_bar(self.total_steps, self.global_step, shown=self.world.is_rank_zero)
        # Closing the bar on any exit ends its line, so an error message starts a line of its own.
        with bar, GracefulStop() as stop:
            for epoch in range(start_epoch, self.run.epochs):
                self.epoch = epoch
                self.sampler.set_epoch(epoch)
                skip = done_in_epoch if epoch == start_epoch else 0
                self.sampler.skip = skip * grad_accum * self.run.batch_size
                # Exactly the micro-batches this epoch trains on (a teacher that asks ahead
                # never asks for one that max_steps_per_epoch cuts off).
                batches = itertools.islice(self.loader, (self.steps_per_epoch - skip) * grad_accum)
                batches = self._read_ahead(batches)
                for _ in range(skip, self.steps_per_epoch):
                    step = self.global_step + 1
                    try:
                        stats = self.train_step(
                            train.next_micro_batches(batches, count=grad_accum, step=step)
                        )
                    except (TeacherStopped, RolloutStopped) as e:  # save, then stop
                        bar.close()
                        just_saved = saved[1] if saved and saved[0] == self.global_step else None
                        raise self.checkpointer.save_on_stop(
                            e, step=self.global_step, just_saved=just_saved, save=self.save
                        ) from e.__cause__
                    if not stats.stepped or not math.isfinite(stats.loss):
                        bad_steps += 1
                        if step == first_step:  # no step applied yet: were they loaded so?
                            self._check_loaded_weights()
                        train.skip_or_stop(
                            stats,
                            step=step,
                            bad_steps=bad_steps,
                            max_bad_steps=self.run.max_bad_steps,
                            latest_checkpoint=checkpoint.find_latest_checkpoint(self.output_dir),
                        )
                    self.global_step += 1
                    bar.update(1)
                    stats = self._after_step(bar, stats)  # teacher, sampler: the new weights
                    if self.world.is_rank_zero and step % self.run.log_every_n_steps == 0:
                        self._log_step(stats, step)
                    # Before the step save: its resume state holds this evaluation.
                    evaluated = self.validator is not None and self.validator.due(step)
                    if evaluated:
                        self.validate()
                    if every is not None and step % every == 0:
                        saved = (step, self.save(final=False))
                    last = step == self.total_steps  # then final/ is the save
                    if evaluated and not last and self.validator.tracker.should_stop:
                        bar.close()
                        self._finish(stop, early=True)
                        return
                    if distributed.any_rank(stop.requested, device=self.device) and not last:
                        bar.close()
                        self._stop(
                            stop.signal_name, saved[1] if saved and saved[0] == step else None
                        )
                        return
            bar.close()
            self._finish(stop, early=False)

    def train_step(self, batches: list[dict[str, torch.Tensor]]) -> train.StepStats:
        """One optimizer step over ``batches`` (the micro-batches of this rank), each as the step
        trains on it (:meth:`_inputs`): :func:`kd.training.train.train_step`."""
        t0, timer = time.perf_counter(), PhaseTimer(self.device)
        sampled: dict[str, tuple[int, int]] = {}
        made = (
            self.on_policy.step_inputs(
                batches,
                step=self.global_step + 1,
                epoch=self.epoch,
                student=self.student,
                teacher=self.teacher,
                timer=timer,
                sampled=sampled,
            )
            if self.on_policy is not None
            else [None] * len(batches)
        )
        inputs = [self._inputs(b, m) for b, m in zip(batches, made, strict=True)]
        return train.train_step(
            self.student,
            self.teacher,
            inputs,
            settings=self.run.loss,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            clip_grad_norm=self.run.optimizer.clip_grad_norm,
            extra=self.extra,
            world=self.world,
            device=self.device,
            timer=timer,
            sampled=sampled,
            started=t0,
        )

    def _inputs(
        self, batch: dict[str, torch.Tensor], made: tuple[torch.Tensor, torch.Tensor] | None
    ) -> TeacherInput:
        """A micro-batch as the step trains on it: the dataset's rows, or (on-policy) the
        completions ``made`` by :meth:`kd.training.on_policy.OnPolicyBatches.step_inputs`."""
        if made is not None:
            source = batch["rows"].tolist()  # the rows whose prompts were completed
            # A completion keeps its row's route: the teacher the row names scores it.
            return TeacherInput(
                tokens=made[0], labels=made[1], source_rows=source, route=batch.get("route")
            )
        return train.batch_input(batch)

    def _read_ahead(self, batches: Any) -> Any:
        """The epoch's micro-batches, read ahead by those that ask: a slow teacher starts on the
        next batches early, and with ``on_policy.async_steps`` the next step's prompts are
        sampled while this step trains."""
        if self.teacher is not None:
            batches = self.teacher.look_ahead(batches)
        if self.on_policy is not None:
            batches = self.on_policy.look_ahead(batches, per_step=self.run.optimizer.grad_accum)
        return batches

    def _log_step(self, stats: train.StepStats, step: int) -> None:
        """Rank 0's row of optimizer step ``step`` (with the sampler's wait and lag)."""
        plan = self.plan.peak_gib if self.plan is not None else None
        extra = self.on_policy.step_metrics(step) if self.on_policy is not None else {}
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.log.write_step(
            stats, step=step, epoch=self.epoch, lr=lr, planned_peak_gib=plan, extra=extra
        )

    def _after_step(self, bar: Any, stats: train.StepStats) -> train.StepStats:
        """The teacher and sampler take the new weights (or stop the run, saved); their time added."""
        t0 = time.perf_counter()
        if self.teacher is not None:
            self.teacher.after_step(self.global_step)
        try:
            if self.on_policy is not None:
                self.on_policy.after_step(self.student, self.global_step)
        except RolloutStopped as e:
            bar.close()
            raise self.checkpointer.save_on_stop(
                e, step=self.global_step, just_saved=None, save=self.save
            ) from e.__cause__
        return train.with_after_step(stats, time.perf_counter() - t0, self.on_policy)

    def _check_loaded_weights(self) -> None:
        """A non-finite first step: blame weights that were loaded as NaN or inf on their files."""
        folder = self.resume_from or self.facts.sources["model"].folder
        check_loaded_weights_finite({"model": (self.student, folder)})
        if self.teacher is not None:
            self.teacher.check_loaded()

    def validate(self) -> evaluate.ValStats:
        """Evaluate on the validation set (all ranks), log the row, and keep ``best/`` when the
        followed metric improved (:meth:`kd.training.evaluate.Validator.run`)."""
        assert self.validator is not None
        return self.validator.run(
            self.student,
            self.teacher,
            step=self.global_step,
            epoch=self.epoch,
            write=self.log.write if self.log is not None else None,
            save_best=lambda **best: self.checkpointer.save_best(
                self.student, self._progress(), **best
            ),
        )

    def _finish(self, stop: GracefulStop, *, early: bool) -> None:
        """The end of training (inside GracefulStop: a signal now waits for final/ to be
        complete): the last validation (unless this step was just evaluated), final/, ``eval:``,
        then why training stopped (early stopping, or a signal during the final save)."""
        stop.action = "finishing the final save"
        validator = self.validator
        if not early and validator is not None and validator.tracker.last_step != self.global_step:
            self.validate()
        final = self.save(final=True)
        self._evaluate(final)
        if not self.world.is_rank_zero or not (early or stop.requested):
            return
        if early:
            assert validator is not None
            best = self.output_dir / checkpoint.BEST_DIRNAME
            why = validator.stop_message(
                step=self.global_step, total_steps=self.total_steps, best_dir=best, final=final
            )
        else:
            why = f"kd: received {stop.signal_name} at the end of training; saved {final} "
            why += "(the run is complete)"
        print(why, file=sys.stderr)

    def _evaluate(self, final: Path | None) -> None:
        """``eval:``: rank 0 scores ``final/`` (lm-eval's table, eval.json, a metrics row)."""
        if self.final_eval is None or final is None or not self.world.is_rank_zero:
            return
        # Saved: models, optimizer, sampler (an async copy) go first (kd.memory.eval_phase).
        for part in (self.teacher, self.on_policy):
            if part is not None:
                part.close()
        self.teacher = self.on_policy = self.checkpointer.extra = None
        self.student = self.optimizer = self.lr_scheduler = self.extra = None  # type: ignore[assignment]
        row = self.final_eval.run(final, output_dir=self.output_dir)
        assert self.log is not None
        self.log.write({"step": self.global_step, **row})

    # ------------------------------------------------------------ checkpoints and exit
    def save(self, *, final: bool) -> Path | None:
        """Write the student in HF format (and, for step checkpoints, the full resume state).
        Collective when distributed: every rank calls it; rank 0 writes."""
        return self.checkpointer.save(
            self.student, self.optimizer, self.lr_scheduler, self._progress(), final=final
        )

    def _progress(self) -> Progress:
        tracker = self.validator.tracker if self.validator is not None else None
        return Progress(
            self.global_step,
            self.epoch,
            int(self.run.seed or 0),
            validation=tracker.state_dict() if tracker is not None else {},
            rollouts=self.on_policy.state_dict() if self.on_policy is not None else {},
            teacher=self.teacher.state_dict() if self.teacher is not None else {},
        )

    def _stop(self, signal_name: str | None, just_saved: Path | None = None) -> None:
        """Save (unless this step was just saved), then say where and how to resume."""
        path = just_saved if just_saved is not None else self.save(final=False)
        if self.world.is_rank_zero:
            print(
                stopped_message(signal_name, self.global_step, path, world=self.world),
                file=sys.stderr,
            )

    def cleanup(self, *, failing: bool = False) -> None:
        """Close the metric sinks, the sampler and the teacher, and leave the process group;
        while an error is on its way out (``failing``) a logger's failure to close is only logged,
        so the first error is the one reported (else it raises KDUserError)."""
        try:
            if self.log is not None:
                self.log.close(failing=failing)
        finally:
            if self.on_policy is not None:
                self.on_policy.close()
            if self.teacher is not None:
                self.teacher.close()
            if self.lock is not None:
                self.lock.release()
            distributed.destroy()


def recipe_main(cfg: DictConfig) -> None:
    """Entry point of ``kd run kd`` (and of torchrun): preload, load, train."""
    run = run_config(cfg)
    recipe = KDRecipe(run, world=distributed.init_distributed(torch.device(run.device).type))
    try:
        recipe.preload()
        if not recipe.complete:
            recipe.load()
            recipe.train()
    except BaseException:
        try:
            recipe.cleanup(failing=True)
        except Exception as e:  # noqa: BLE001 - the first error is the one to report
            log.warning("cleanup after the error failed too: %s", brief(e))
        raise
    recipe.cleanup()


if __name__ == "__main__":
    from kd.runtime.launch import run_recipe

    sys.exit(run_recipe(recipe_main))
