"""Knowledge distillation: a frozen teacher teaches a trainable student (full or LoRA), 1 to N ranks.

Run it:

    kd run kd --config qwen2_5/14B_to_3B_full_single_device
    kd run kd --config my.yaml batch_size=2 gradient_accumulation_steps=16
    kd run --nproc_per_node 8 kd --config llama3_1/8B_to_8B_full_distributed

``kd_single_device`` and ``kd_distributed`` (torchtune's names) run this recipe too. Under torchrun
both models are sharded with FSDP2 and the loss curve matches one device.

Features (each knob is a config key; defaults live in kd/config/schema.py):
    - Memory plan before any weight loads (``memory.budget_gib``, ``memory.check``): over budget exits 2
      with the table and knob settings that fit (``kd plan --fit``). ``kd validate`` runs exactly
      :meth:`KDRecipe.preload`, every check made before a weight is read.
    - Loss ``(1 - kd_ratio) * CE + kd_ratio * KD`` (``kd_ratio``, ``kd_loss.divergence``,
      ``temperature`` with T^2 scaling). The fused loss (``fused_loss``, ``loss_chunk_size``) computes
      logits chunk by chunk over labelled tokens only and never keeps full-vocab logits.
    - Teacher and student may have different padded vocabularies (Qwen2.5-14B vs 3B): the KD term uses
      the shared first min(Vs, Vt) entries; token ids are checked against both before loading.
    - Exact gradient accumulation (``gradient_accumulation_steps``): normalised by the labelled tokens of
      the whole optimizer step (all ranks), so batch b x k equals batch b*k x 1.
    - ``enable_activation_checkpointing`` (less memory, ~30% more compute), ``compile``,
      ``clip_grad_norm``, LR warmup + cosine (``lr_scheduler``), ``optimizer_in_cpu``.
    - LoRA students (torchtune ``lora_*`` builders): only adapters train; saved merged and as an adapter.
    - FSDP2 (``fsdp.*``): per-layer sharding of both models; rank 0 alone reads checkpoint files.
    - Step checkpoints (``save_every_n_steps``, ``keep_last_n``), exact resume
      (``resume_from_checkpoint``), SIGTERM/SIGINT finish the step (or the final save), save and
      exit 0.
    - One run per ``output_dir`` (an OS file lock held by rank 0); a fresh run into another run's
      outputs is refused before any weight loads, unless ``overwrite_output_dir`` moves them into
      ``output_dir/previous_<time>/``.
    - Metrics: ``output_dir/metrics.jsonl`` plus ``metric_logger`` (stdout, wandb offline/online).
    - Validation (``validation``): every ``every_n_steps`` steps and at the end, ``val_loss``,
      ``val_ce_loss``, ``val_kd_loss`` and ``val_top1_agreement`` on held-out data, token-weighted
      over the whole set (the same numbers for any batch size and number of ranks), in their own
      metric rows. ``keep_best`` keeps ``output_dir/best/`` (HF folder, like ``final/``) at the best
      step; ``early_stopping`` stops after ``patience`` evaluations without improvement, saves
      ``final/`` and says why. Resume keeps the best value and the patience count.
    - On-policy distillation (``on_policy``, GKD): with probability ``lmbda`` a micro-batch trains
      on the student's own completions of its prompts (``max_new_tokens``, ``temperature``,
      ``top_p``; KV cache), scored by the teacher; ``seq_kd`` trains the other micro-batches on the
      teacher's completions. Metrics split each step into generate / teacher / student seconds.

Cookbook (held-out data, the best student, early stopping)::

    validation:
      dataset:                      # any dataset node, or a list of them, as for `dataset`
        _component_: torchtune.datasets.instruct_dataset
        source: json
        data_files: heldout.jsonl
        split: train
      every_n_steps: 100            # null = only at the end of training
      max_batches: null             # an int evaluates the first max_batches x batch_size examples
      batch_size: null              # null = batch_size; the numbers do not depend on it
    keep_best: {metric: val_loss, mode: min}   # or val_ce_loss, val_kd_loss, val_top1_agreement
    early_stopping: {patience: 3}   # follows keep_best's metric, else val_loss (lower is better)

    kd run kd --config my.yaml validation.every_n_steps=50 early_stopping.patience=5
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from kd import checkpoint, data, distributed, evaluate, models, on_policy, outputs, train
from kd.checkpoint.run_checkpointer import RunCheckpointer
from kd.checkpoint.training import Progress, StudentSource
from kd.config.run import VALIDATION_DATASET, RunConfig, run_config
from kd.device import resolve_budget
from kd.distributed import WorldInfo
from kd.errors import KDUserError, brief
from kd.memory.plan import MemoryPlan, check_memory
from kd.metrics import GuardedLogger, PhaseTimer, peak_memory_gib
from kd.prepare import prepare_student
from kd.run_context import RunContext
from kd.signals import GracefulStop, launch_command, resume_hint
from kd.teachers import Teacher, TeacherInput
from kd.teachers.build import teacher_source
from kd.teachers.served import save_if_teacher_down

log = logging.getLogger("kd")


class KDRecipe:
    """Distil the teacher into ``model`` (the student). See the module docstring for knobs.

    Phases: :meth:`preload` (checks, no weight, nothing written), :meth:`load` (weights, optimizer,
    resume state, outputs), :meth:`train` (the loop; one optimizer step is :meth:`train_step`).
    It holds a teacher (:mod:`kd.teachers`: a model, a file of top-k log-probs...), a student, a
    validator (:class:`kd.evaluate.Validator`), an on-policy sampler
    (:class:`kd.on_policy.OnPolicyBatches`) and a checkpointer
    (:class:`kd.checkpoint.run_checkpointer.RunCheckpointer`), and never asks which kind of
    teacher it holds.
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

    # ------------------------------------------------------------ 1. before any weight
    def preload(self) -> None:
        """Every check that needs no weight, cheapest first; reads inputs, writes nothing.

        ``kd validate`` runs exactly this. Fails on: the device, the tokenizer (its files, a test
        encoding, its ids against both models' vocabularies from meta-device shapes), each
        checkpoint's config.json against its safetensors headers, the memory plan against the
        budget, output_dir (in use by another run, or holding another run's outputs without resume
        or overwrite), the resume state, the data (readable, non-empty, labelled, long enough
        for one optimizer step per rank; the validation data readable, non-empty and labelled),
        and the teacher's own checks (a store of top-k log-probs against the data).
        """
        run, ctx = self.run, self.ctx
        ctx.check_device()
        if run.optimizer.in_cpu and (self.device.type != "cuda" or self.world.distributed):
            raise KDUserError(
                "optimizer_in_cpu: offloads optimizer states from one GPU (device=cuda, one rank); "
                "with several ranks use fsdp.cpu_offload=true, on CPU set optimizer_in_cpu=false"
            )
        self._check_memory()  # arithmetic on shapes: before anything is built
        self.tokenizer = ctx.tokenizer()
        teacher_reads = self.teacher_source.reads if self.teacher_source is not None else ()
        self.facts = ctx.inspect_models(self.tokenizer, read=("model", *teacher_reads))
        self._check_resume()
        self.dataset = self._dataset(run.components["dataset"], key="dataset")
        if run.on_policy is not None:
            on_policy.check_prompts(self.dataset, key="dataset")
        if self.teacher_source is not None:
            self.teacher_source.check(ctx, self.facts, self.dataset)
        if run.validation is not None:
            self.val_dataset = self._dataset(run.validation.dataset, key=VALIDATION_DATASET)
        self.steps_per_epoch = data.steps_per_epoch(
            len(self.dataset),
            batch_size=run.batch_size,
            world_size=self.world.world_size,
            grad_accum=run.optimizer.grad_accum,
            max_steps=run.max_steps_per_epoch,
        )
        self.total_steps = self.steps_per_epoch * run.epochs
        if self.resume_from is not None:
            checkpoint.check_resume_position(self.resume_from, steps_per_epoch=self.steps_per_epoch)

    def _check_resume(self) -> None:
        """output_dir free of other runs, and the checkpoint to resume from (None: fresh)."""
        outputs.check_not_in_use(self.output_dir)
        ckpt = self.run.checkpoint
        found = outputs.find_resume(self.output_dir, resume=ckpt.resume, overwrite=ckpt.overwrite)
        self.resume_from = found.checkpoint if found is not None else None
        if found is not None:
            if self.run.seed is None and found.seed is not None:
                # seed: null draws a fresh seed per process; the run being resumed drew its own.
                self.run = self.run.with_seed(found.seed)
            checkpoint.check_resume_compatible(
                found.config_yaml, self.run.yaml, checkpoint=found.checkpoint
            )

    def _dataset(self, node: Any, *, key: str) -> Any:
        """The dataset of config key ``key``, checked (readable, non-empty, labelled)."""
        dataset = data.build_dataset(
            node, self.tokenizer, trust=self.run.trust_remote_components, key=key
        )
        truncated, checked = data.check_dataset(dataset, max_seq_len=self.run.max_seq_len, key=key)
        if truncated and self.world.is_rank_zero:
            log.warning(
                "%s: %d of %d examples checked reach tokenizer.max_seq_len and are truncated",
                key,
                truncated,
                checked,
            )
        return dataset

    def _check_memory(self) -> None:
        budget = resolve_budget(budget_gib=self.run.memory.budget_gib, device=self.run.device)
        plan = check_memory(
            self.run,
            world_size=self.world.world_size,
            budget_gib=budget.gib,
            config_name=self.config_name,
        )
        if plan is not None:
            self.plan = plan
            if self.world.is_rank_zero:
                log.info(
                    "memory plan: peak %.2f GiB (%s) of %s",
                    plan.peak_gib,
                    plan.phase,
                    "an unknown budget" if budget.gib is None else f"{budget.gib:.2f} GiB",
                )

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
        )
        if self.teacher_source is not None:
            self.teacher = self.teacher_source.load(self.ctx, self.facts, run_dir=self.output_dir)
        self.student = self._load_model("model")
        self._build_optimizer()
        self.checkpointer = RunCheckpointer(
            self.output_dir,
            source=self._student_source(),
            config_yaml=run.yaml,
            keep_last_n=run.checkpoint.keep_last_n,
            world=self.world,
        )
        if run.validation is not None:
            self.validator = evaluate.Validator(
                run.validation,
                loss=run.loss,
                batches=data.build_eval_loader(
                    self.val_dataset,
                    batch_size=run.validation.batch_size,
                    max_batches=run.validation.max_batches,
                    pad_id=pad_id,
                    world_size=self.world.world_size,
                    rank=self.world.rank,
                ),
                device=self.device,
            )
        if self.resume_from is not None:
            self._restore(self.resume_from)
        if run.on_policy is not None:
            facts = self.facts
            self.on_policy = on_policy.OnPolicyBatches(
                run.on_policy,
                tokenizer=self.tokenizer,
                seed=int(self.run.seed or 0),
                max_seq_len=run.max_seq_len,
                # On-policy sampling draws only ids every model and the tokenizer know.
                vocab_limit=min(facts.tokenizer_max + 1, facts.shared_vocab),
                world=self.world,
                device=self.device,
            )
        if self.world.is_rank_zero:
            self._open_outputs()

    def _load_model(self, key: str) -> torch.nn.Module:
        """The student with its weights, prepared (LoRA, activation checkpointing, FSDP2)."""
        ac, lora = self.run.activation_checkpointing, self.facts.lora
        return self.ctx.load_model(
            key,
            self.facts.sources[key],
            lambda m, shard: prepare_student(
                m, lora=lora, activation_checkpointing=ac, shard=shard
            ),
            run_dir=self.output_dir,
        )

    def _build_optimizer(self) -> None:
        run = self.run
        trainable = [p for p in self.student.parameters() if p.requires_grad]
        self.optimizer = (
            train.cpu_offload_optimizer(
                trainable,
                component=run.optimizer.component,
                kwargs=run.optimizer.kwargs(),
                trust=run.trust_remote_components,
            )
            if run.optimizer.in_cpu
            else self.ctx.build("optimizer", trainable, fix="fix the optimizer's arguments")
        )
        self.lr_scheduler = self.ctx.build(
            "lr_scheduler",
            self.optimizer,
            fix="fix the scheduler's arguments",
            num_training_steps=self.total_steps,
        )

    def _restore(self, ckpt: Path) -> None:
        progress = self.checkpointer.restore(ckpt, self.student, self.optimizer, self.lr_scheduler)
        self.global_step, self.epoch = progress.global_step, progress.epoch
        self.run = self.run.with_seed(progress.seed)
        validator = self.validator
        if validator is not None and not validator.tracker.load_state_dict(progress.validation):
            if self.world.is_rank_zero:
                log.info("%s holds no best %s: it starts over", ckpt, validator.tracker.metric)

    def _student_source(self) -> StudentSource:
        src = self.facts.sources["model"]
        return StudentSource(
            model_type=src.model_type,
            source_dir=src.folder,
            lora=self.run.lora,
            backend=src.backend,
            tokenizer_files=models.tokenizer_files_to_copy(self.ctx.node("tokenizer")),
        )

    def _open_outputs(self) -> None:
        # The logger first: a logger that cannot start leaves output_dir as it was.
        self.metric_logger = GuardedLogger(
            self.ctx.build("metric_logger", fix="fix the logger's arguments"),
            target=self.ctx.node("metric_logger").get("_component_"),
        )
        self.metric_logger.log_config(OmegaConf.create(self.run.yaml))
        self.metrics = outputs.open_metrics(
            self.output_dir,
            config_yaml=self.run.yaml,
            resume_step=self.global_step if self.resume_from is not None else None,
        )
        self.metric_logger.outputs_kept = True

    # ------------------------------------------------------------ 3. training
    def train(self) -> None:
        """The loop: step, log, validate, checkpoint, final save; stop cleanly on SIGTERM/SIGINT
        (a signal after the last step waits for the final save) or when early stopping says so."""
        grad_accum, start_epoch = self.run.optimizer.grad_accum, self.epoch
        done_in_epoch = self.global_step - start_epoch * self.steps_per_epoch
        bad_steps = 0
        saved: tuple[int, Path | None] | None = None  # (step, folder) of the newest step save
        every = self.run.checkpoint.save_every_n_steps
        bar = tqdm(
            total=self.total_steps,
            initial=self.global_step,
            disable=not self.world.is_rank_zero,
            desc="kd",
            dynamic_ncols=True,
        )
        # Closing the bar on any exit ends its line, so an error message starts a line of its own.
        with bar, GracefulStop() as stop:
            for epoch in range(start_epoch, self.run.epochs):
                self.epoch = epoch
                self.sampler.set_epoch(epoch)
                skip = done_in_epoch if epoch == start_epoch else 0
                self.sampler.skip = skip * grad_accum * self.run.batch_size
                batches = iter(self.loader)
                if self.teacher is not None:  # a slow teacher starts on the next batches early
                    batches = self.teacher.look_ahead(batches)
                for _ in range(skip, self.steps_per_epoch):
                    step = self.global_step + 1
                    stats = self.train_step(
                        data.next_micro_batches(batches, count=grad_accum, step=step)
                    )
                    if not stats.stepped or not math.isfinite(stats.loss):
                        bad_steps += 1
                        train.skip_or_stop(
                            stats,
                            step=step,
                            bad_steps=bad_steps,
                            max_bad_steps=self.run.max_bad_steps,
                            latest_checkpoint=checkpoint.find_latest_checkpoint(self.output_dir),
                        )
                    self.global_step += 1
                    bar.update(1)
                    if self.world.is_rank_zero and step % self.run.log_every_n_steps == 0:
                        self._log(stats)
                    # Before the step save: its resume state holds this evaluation.
                    evaluated = self.validator is not None and self.validator.due(step)
                    if evaluated:
                        self.validate()
                    if every is not None and step % every == 0:
                        saved = (step, self.save(final=False))
                    last = step == self.total_steps  # then final/ is the save
                    if evaluated and not last and self._should_stop_early():
                        bar.close()
                        self._stop_early(stop)
                        return
                    if distributed.any_rank(stop.requested, device=self.device) and not last:
                        bar.close()
                        self._stop(
                            stop.signal_name, saved[1] if saved and saved[0] == step else None
                        )
                        return
            bar.close()
            # Inside GracefulStop: a signal now waits for final/ to be complete.
            stop.action = "finishing the final save"
            if self.validator is not None and self.validator.tracker.last_step != self.global_step:
                self.validate()  # the end of training (unless this step was just evaluated)
            final = self.save(final=True)
            if stop.requested and self.world.is_rank_zero:
                print(
                    f"kd: received {stop.signal_name} at the end of training; saved {final} "
                    "(the run is complete)",
                    file=sys.stderr,
                )

    def train_step(self, batches: list[dict[str, torch.Tensor]]) -> train.StepStats:
        """One optimizer step over ``batches`` (the micro-batches of this rank).

        The labelled tokens of all micro-batches on all ranks are counted first, so each micro-batch
        contributes ``mean_loss * local / total`` and accumulation is exact.
        """
        t0 = time.perf_counter()
        timer = PhaseTimer(self.device)
        sampled: dict[str, tuple[int, int]] = {}
        inputs = [self._inputs(b, i, timer, sampled) for i, b in enumerate(batches)]
        labels = [train.shift_labels(inp.labels) for inp in inputs]
        total = distributed.all_reduce_sum(train.count_tokens(labels).to(self.device))
        sums = torch.zeros(3, device=self.device)
        for inp, lab in zip(inputs, labels, strict=True):
            r = train.micro_step(
                self.student,
                self.teacher,
                inp.tokens.to(self.device),
                lab.to(self.device),
                settings=self.run.loss,
                num_tokens_total=total,
                grad_scale=float(self.world.world_size),
                teacher_input=inp,
                timer=timer,
            )
            sums += torch.stack([r.loss, r.ce, r.kd]).float()
            if self.teacher is not None:
                self.teacher.release()  # before the backward of the next micro-batch peaks
        sums = distributed.all_reduce_sum(sums)
        # optimizer_step never applies NaN/inf gradients: the weights stay those of the last good
        # step whatever the loop decides.
        norm, stepped = train.optimizer_step(
            self.student, self.optimizer, clip_grad_norm=self.run.optimizer.clip_grad_norm
        )
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        loss, ce, kd = (float(x) for x in sums)
        return train.StepStats(
            loss=loss,
            ce_loss=ce,
            kd_loss=kd,
            grad_norm=float(norm),
            num_tokens=int(total),
            stepped=stepped,
            seconds=time.perf_counter() - t0,
            phases=dict(timer.seconds),
            sampled=sampled,
        )

    def _inputs(
        self,
        batch: dict[str, torch.Tensor],
        index: int,
        timer: PhaseTimer,
        sampled: dict[str, tuple[int, int]],
    ) -> TeacherInput:
        """Micro-batch ``index`` as the step trains on it: the dataset's rows, or (on-policy)
        completions sampled by :class:`kd.on_policy.OnPolicyBatches`."""
        if self.on_policy is not None:
            made = self.on_policy.inputs(
                batch,
                step=self.global_step + 1,
                epoch=self.epoch,
                index=index,
                student=self.student,
                teacher=self.teacher,
                timer=timer,
                sampled=sampled,
            )
            if made is not None:
                return TeacherInput(tokens=made[0], labels=made[1])
        rows = batch.get("rows")
        return TeacherInput(
            tokens=batch["tokens"],
            labels=batch["labels"],
            rows=rows.tolist() if rows is not None else None,
        )

    def validate(self) -> evaluate.ValStats:
        """Evaluate on the validation set (all ranks), log the row, and keep ``best/`` when the
        followed metric improved. Collective when distributed."""
        validator = self.validator
        assert validator is not None
        stats, best_due = validator.evaluate(self.student, self.teacher, step=self.global_step)
        if self.world.is_rank_zero:
            row = {"step": self.global_step, "epoch": self.epoch, **stats.metrics()}
            self._write_row(row)
        tracker = validator.tracker
        if best_due and tracker.best is not None:
            self.checkpointer.save_best(
                self.student,
                self._progress(),
                metric=tracker.metric,
                value=tracker.best,
                mode=tracker.mode,
            )
        return stats

    def _should_stop_early(self) -> bool:
        return self.validator is not None and self.validator.tracker.should_stop

    def _stop_early(self, stop: GracefulStop) -> None:
        """Early stopping: save final/ and say why training stopped."""
        assert self.validator is not None
        tracker = self.validator.tracker
        stop.action = "finishing the final save"
        final = self.save(final=True)
        if self.world.is_rank_zero:
            if tracker.best is None:
                best = "; no evaluation gave a finite value"
            elif self.validator.settings.keep_best:
                best = (
                    f"; the best, {tracker.best:.6g} at step {tracker.best_step}, is in "
                    f"{self.output_dir / checkpoint.BEST_DIRNAME}"
                )
            else:
                best = f"; the best was {tracker.best:.6g} at step {tracker.best_step}"
            print(
                f"kd: early stopping after step {self.global_step} of {self.total_steps}: "
                f"{tracker.metric} did not improve ({tracker.mode}) for {tracker.bad_evals} "
                f"evaluations (early_stopping.patience={tracker.patience}){best}; saved {final}",
                file=sys.stderr,
            )

    def _log(self, stats: train.StepStats) -> None:
        row: dict[str, Any] = {
            "step": self.global_step,
            "epoch": self.epoch,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            **train.step_metrics(stats, on_policy=self.on_policy is not None),
        }
        if self.run.log_peak_memory_stats:
            row.update(peak_memory_gib(self.device))
            if self.plan is not None:
                row["planned_peak_gib"] = self.plan.peak_gib
        self._write_row(row)

    def _write_row(self, row: dict[str, Any]) -> None:
        outputs.write_metrics_row(self.metrics, row, output_dir=self.output_dir)
        self.metric_logger.log_dict(
            {k: v for k, v in row.items() if k != "step"}, step=self.global_step
        )

    # ------------------------------------------------------------ checkpoints and exit
    def save(self, *, final: bool) -> Path | None:
        """Write the student in HF format (and, for step checkpoints, the full resume state).

        Collective when distributed: every rank calls it; rank 0 writes.
        """
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
        )

    def _stop(self, signal_name: str | None, just_saved: Path | None = None) -> None:
        """Save (unless this step was just saved), then say where and how to resume."""
        path = just_saved if just_saved is not None else self.save(final=False)
        if self.world.is_rank_zero:
            print(
                f"kd: received {signal_name}; stopped after step {self.global_step}",
                file=sys.stderr,
            )
            print(
                resume_hint(launch_command(sys.argv, world_size=self.world.world_size), path),
                file=sys.stderr,
            )

    def cleanup(self, *, failing: bool = False) -> None:
        """Close the metric sinks and leave the process group.

        Args:
            failing: an error is on its way out; a logger's failure to close is then only logged,
                so the first error is the one reported.

        Raises:
            KDUserError: the metric logger's ``close()`` failed (when not ``failing``).
        """
        try:
            if self.world.is_rank_zero:
                if hasattr(self, "metrics"):
                    self.metrics.close()
                if hasattr(self, "metric_logger"):
                    self.metric_logger.close()
        except KDUserError as e:
            if not failing:
                raise
            log.warning("%s", e)
        finally:
            if self.lock is not None:
                self.lock.release()
            distributed.destroy()


def recipe_main(cfg: DictConfig) -> None:
    """Entry point of ``kd run kd`` (and of torchrun): preload, load, train."""
    run = run_config(cfg)
    recipe = KDRecipe(run, world=distributed.init_distributed(torch.device(run.device).type))
    try:
        recipe.preload()
        recipe.load()
        recipe.train()
    except BaseException:
        save_if_teacher_down(recipe)  # a served teacher that stopped: save, then stop
        try:
            recipe.cleanup(failing=True)
        except Exception as e:  # noqa: BLE001 - the first error is the one to report
            log.warning("cleanup after the error failed too: %s", brief(e))
        raise
    recipe.cleanup()


if __name__ == "__main__":
    from kd.launch import run_recipe

    sys.exit(run_recipe(recipe_main))
