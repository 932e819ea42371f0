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

import dataclasses
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from kd import (
    checkpoint,
    data,
    distributed,
    evaluate,
    foreign_logits,
    models,
    on_policy,
    outputs,
    stored_logits,
    train,
)
from kd.checkpoint.training import (
    Progress,
    StudentSource,
    check_loaded_weights_finite,
    restore_training_checkpoint,
    save_best_checkpoint,
    save_training_checkpoint,
)
from kd.config.instantiate import build_component
from kd.config.run import VALIDATION_DATASET, RunConfig, run_config
from kd.device import check_device, resolve_budget
from kd.distributed import WorldInfo
from kd.errors import KDUserError, brief
from kd.memory.plan import MemoryPlan, check_memory
from kd.metrics import GuardedLogger, PhaseTimer, build_quietly, peak_memory_gib
from kd.prepare import ShardSpec, materialize, prepare_student, prepare_teacher, shard_spec
from kd.signals import GracefulStop, launch_command, resume_hint

log = logging.getLogger("kd")

# The checkpointer of each model key (torchtune builders only: a Hugging Face model's folder is
# its checkpoint).
CHECKPOINTER_OF = {"model": "checkpointer", "teacher_model": "teacher_checkpointer"}


class KDRecipe:
    """Distil ``teacher_model`` into ``model`` (the student). See the module docstring for knobs.

    Phases: :meth:`preload` (checks, no weight, nothing written), :meth:`load` (weights, optimizer,
    resume state, outputs), :meth:`train` (the loop; one optimizer step is :meth:`train_step`).
    """

    def __init__(self, run: RunConfig, *, world: WorldInfo, config_name: str = ""):
        self.run = run
        self.world = world
        self.config_name = config_name
        self.device = torch.device(run.device)
        if world.distributed and self.device.type == "cuda":
            self.device = torch.device("cuda", world.local_rank)
        self.dtype = models.DTYPES[run.dtype]
        self.output_dir = run.checkpoint.output_dir
        self.global_step = 0
        self.epoch = 0
        self.plan: MemoryPlan | None = None
        self.lock: outputs.OutputDirLock | None = None
        self.complete = False  # resume found the run already finished (preload)
        val = run.validation
        self.tracker = (
            evaluate.BestTracker(val.metric, val.mode, patience=val.patience)
            if val is not None
            else None
        )

    def _build(self, key: str, *args: Any, fix: str, **kwargs: Any) -> Any:
        node = self.run.components[key]
        return build_component(
            key, node, *args, trust=self.run.trust_remote_components, fix=fix, **kwargs
        )

    def _node(self, key: str) -> dict[str, Any]:
        """Component ``key``'s plain values, for kd's functions (empty when it is absent)."""
        node = self.run.components[key]
        return OmegaConf.to_container(node, resolve=True) if node is not None else {}

    # ------------------------------------------------------------ 1. before any weight
    def preload(self) -> None:
        """Every check that needs no weight, cheapest first; reads inputs, writes nothing.

        ``kd validate`` runs exactly this. Fails on: the device, the tokenizer (its files, a test
        encoding, its ids against both models' vocabularies from meta-device shapes), each
        checkpoint's config.json against its safetensors headers, the memory plan against the
        budget, output_dir (in use by another run, or holding another run's outputs without resume
        or overwrite), the resume state, and the data (readable, non-empty, labelled, long enough
        for one optimizer step per rank; the validation data readable, non-empty and labelled).
        """
        run = self.run
        check_device(run.device)
        if run.optimizer.in_cpu and (self.device.type != "cuda" or self.world.distributed):
            raise KDUserError(
                "optimizer_in_cpu: offloads optimizer states from one GPU (device=cuda, one rank); "
                "with several ranks use fsdp.cpu_offload=true, on CPU set optimizer_in_cpu=false"
            )
        self._check_memory()  # arithmetic on shapes: before anything is built
        self.tokenizer = models.checked_tokenizer(
            lambda: self._build("tokenizer", fix="check the tokenizer files and arguments"),
            models.tokenizer_files(self._node("tokenizer")),
        )
        with torch.device("meta"):
            student = self._build("model", fix="fix the builder's arguments")
            config_teacher = self._build("teacher_model", fix="fix the builder's arguments")
        # With stored teacher logits no teacher runs; its node (if any) only identifies them.
        teacher = config_teacher if run.has_teacher else None
        built = {"model": student, "teacher_model": teacher}
        models.check_decoders({k: (self._node(k).get("_component_"), m) for k, m in built.items()})
        self.lora = models.is_lora(student)
        problems = models.check_vocab(
            tokenizer_max=models.tokenizer_max_id(self.tokenizer),
            student_vocab=models.vocab_size(student),
            teacher_vocab=models.vocab_size(teacher) if teacher is not None else None,
        )
        problems += models.max_seq_len_problems(built, max_seq_len=run.max_seq_len)
        self.sources: dict[str, models.WeightsSource] = {}
        for key, model in built.items():
            if model is not None:
                src = self.sources[key] = self._weights_source(key, model)
                problems += checkpoint.checkpoint_config_problems(
                    str(src.folder),
                    src.files,
                    key=src.key,
                    heads=models.attention_shape(model),
                    folder_arg=src.field,
                )
        if problems:
            raise KDUserError("\n".join(problems))
        if teacher is not None:
            models.check_teacher_tokenizer(
                self.sources.get("teacher_model"),
                self._node("tokenizer"),
                teacher_vocab=models.vocab_size(teacher),
                student_vocab=models.vocab_size(student),
            )
        self.student_vocab = models.vocab_size(student)
        # On-policy sampling draws only ids every model and the tokenizer know.
        self.sample_vocab = min(
            models.tokenizer_max_id(self.tokenizer) + 1,
            self.student_vocab,
            *([models.vocab_size(teacher)] if teacher is not None else []),
        )
        self.teacher_identity = (
            stored_logits.teacher_identity(
                str(self._node("teacher_model").get("_component_")),
                (src := self._weights_source("teacher_model", config_teacher)).folder,
                src.files,
            )
            if config_teacher is not None and run.teacher_logits is not None
            else None
        )
        del student, teacher, config_teacher, built
        outputs.check_not_in_use(self.output_dir)
        ckpt = run.checkpoint
        if ckpt.resume and outputs.completed_run(self.output_dir, config_yaml=run.yaml):
            self.complete = True  # said on the kd logger; load() and train() do nothing
            return
        found = outputs.find_resume(self.output_dir, resume=ckpt.resume, overwrite=ckpt.overwrite)
        self.resume_from = found.checkpoint if found is not None else None
        if found is not None:
            if run.seed is None and found.seed is not None:
                # seed: null draws a fresh seed per process; the run being resumed drew its own.
                self.run = run = run.with_seed(found.seed)
            checkpoint.check_resume_compatible(
                found.config_yaml, run.yaml, checkpoint=found.checkpoint
            )
        self.dataset = self._dataset(run.components["dataset"], key="dataset")
        if run.on_policy is not None:
            on_policy.check_prompts(self.dataset, key="dataset")
        self.store = self._open_store() if run.teacher_logits is not None else None
        if run.validation is not None:
            self.val_dataset = self._dataset(run.validation.dataset, key=VALIDATION_DATASET)
        self.steps_per_epoch = self._steps_per_epoch(run.max_steps_per_epoch)
        self.total_steps = self.steps_per_epoch * run.epochs
        if found is not None:
            checkpoint.check_schedule_change(
                found.config_yaml,
                run.yaml,
                checkpoint=found.checkpoint,
                total_steps=lambda epochs, max_steps: epochs * self._steps_per_epoch(max_steps),
                make_scheduler=self._make_scheduler,
            )
            checkpoint.check_resume_position(self.resume_from, steps_per_epoch=self.steps_per_epoch)

    def _steps_per_epoch(self, max_steps: int | None) -> int:
        run = self.run
        return data.steps_per_epoch(
            len(self.dataset),
            batch_size=run.batch_size,
            world_size=self.world.world_size,
            grad_accum=run.optimizer.grad_accum,
            max_steps=max_steps,
        )

    def _make_scheduler(self, optimizer: Any, num_training_steps: int) -> Any:
        return self._build(
            "lr_scheduler",
            optimizer,
            fix="fix the scheduler's arguments",
            num_training_steps=num_training_steps,
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

    def _open_store(self) -> stored_logits.TeacherLogitsReader | foreign_logits.ForeignLogitsReader:
        """The stored teacher logits, checked against this run: the teacher (when the config
        names one), tokenizer files, max_seq_len, every row of the data, temperature, k. For
        another tool's file (``teacher_logits.format``), its rows against the data."""
        settings = self.run.teacher_logits
        assert settings is not None
        rows = (self.dataset[i] for i in range(len(self.dataset)))
        fingerprint = stored_logits.dataset_fingerprint(
            stored_logits.row_hash(ex["tokens"], ex["labels"]) for ex in rows
        )
        if settings.format != "kd":
            source_t = settings.source_temperature
            temperature = self.run.loss.temperature
            reader = foreign_logits.ForeignLogitsReader(
                settings.path,
                format=settings.format,
                k=settings.k,
                alpha=1.0 if source_t is None else source_t / temperature,
                max_seq_len=self.run.max_seq_len,
                student_vocab=self.student_vocab,
                alignment=settings.alignment,
            )
            if reader.fingerprint != fingerprint:
                raise KDUserError(
                    f"dataset: its {len(self.dataset)} rows are not the {reader.num_rows} rows "
                    f"of {settings.path} (teacher_logits.path, by hash); set dataset to "
                    f"{{_component_: kd.data.pretokenized_dataset, data_files: {settings.path}}}"
                )
            return reader
        store = stored_logits.TeacherLogitsReader(settings.path)
        stored_logits.check_store_matches(
            store.manifest,
            settings.path,
            tokenizer_sha256=stored_logits.files_sha256(
                models.tokenizer_files(self._node("tokenizer"))
            ),
            max_seq_len=self.run.max_seq_len,
            dataset_fingerprint=fingerprint,
            temperature=self.run.loss.temperature,
            k=settings.k,
            student_vocab=self.student_vocab,
            teacher=self.teacher_identity,
        )
        # The student's KD softmax runs over the shared vocabulary, as with the online teacher.
        loss = dataclasses.replace(self.run.loss, topk_vocab=int(store.manifest["vocab"]))
        self.run = dataclasses.replace(self.run, loss=loss)
        return store

    def _weights_source(self, key: str, model: torch.nn.Module) -> models.WeightsSource:
        ckpt_key = CHECKPOINTER_OF[key]
        return models.weights_source(
            model,
            model_key=key,
            model_node=self._node(key),
            ckpt_key=ckpt_key,
            ckpt_node=self._node(ckpt_key),
        )

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
        """output_dir (rank 0 takes it), seed, data order, teacher (frozen) then student,
        optimizer, schedule, resume, outputs."""
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
        self.pad_id = data.pad_id_of(self.tokenizer)
        self.stop_ids = on_policy.stop_token_ids(self.tokenizer)
        self.header = on_policy.assistant_header(self.tokenizer) if run.on_policy else []
        self.loader, self.sampler = data.build_dataloader(
            self.dataset,
            batch_size=run.batch_size,
            shuffle=run.shuffle,
            seed=run.seed,
            pad_id=data.pad_id_of(self.tokenizer),
            world_size=self.world.world_size,
            rank=self.world.rank,
            with_rows=self.store is not None or run.on_policy is not None,
        )
        if run.validation is not None:
            self.val_loader = data.build_eval_loader(
                self.val_dataset,
                batch_size=run.validation.batch_size,
                max_batches=run.validation.max_batches,
                pad_id=data.pad_id_of(self.tokenizer),
                world_size=self.world.world_size,
                rank=self.world.rank,
            )
        self.teacher = self._load_model("teacher_model") if run.has_teacher else None
        self.student = self._load_model("model")
        trainable = [p for p in self.student.parameters() if p.requires_grad]
        self.optimizer = (
            train.cpu_offload_optimizer(
                trainable,
                component=run.optimizer.component,
                kwargs=run.optimizer.kwargs(),
                trust=run.trust_remote_components,
            )
            if run.optimizer.in_cpu
            else self._build("optimizer", trainable, fix="fix the optimizer's arguments")
        )
        self.lr_scheduler = self._build(
            "lr_scheduler",
            self.optimizer,
            fix="fix the scheduler's arguments",
            num_training_steps=self.total_steps,
        )
        if self.resume_from is not None:
            progress = restore_training_checkpoint(
                self.resume_from,
                student=self.student,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                source=self._source(),
                world=self.world,
            )
            self.global_step, self.epoch = progress.global_step, progress.epoch
            self.run = self.run.with_seed(progress.seed)
            tracker = self.tracker
            if tracker is not None and not tracker.load_state_dict(progress.validation):
                if self.world.is_rank_zero:
                    log.info(
                        "%s holds no best %s: it starts over", self.resume_from, tracker.metric
                    )
        if self.world.is_rank_zero:
            self._open_outputs()

    def _load_model(self, key: str) -> torch.nn.Module:
        """The model of ``key`` with its weights (its folder's, or its checkpointer's), prepared
        (and sharded when distributed: rank 0 alone reads the files,
        :func:`kd.prepare.materialize`)."""
        ckpt_key = CHECKPOINTER_OF[key]

        def build(device: torch.device) -> torch.nn.Module:
            with models.default_dtype(self.dtype), device:
                return self._build(key, fix="fix the builder's arguments")

        def load(model: torch.nn.Module) -> None:
            outputs.make_checkpointer_output_dir(
                self._node(ckpt_key).get("output_dir"), key=ckpt_key, run_dir=self.output_dir
            )
            models.load_model_weights(
                model,
                self.sources[key],
                lambda: self._build(
                    ckpt_key, fix="check the checkpoint files", should_load_recipe_state=False
                ),
            )

        def prepare(model: torch.nn.Module, shard: ShardSpec | None) -> torch.nn.Module:
            if key == "teacher_model":
                return prepare_teacher(model, shard=shard)
            ac = self.run.activation_checkpointing
            return prepare_student(model, lora=self.lora, activation_checkpointing=ac, shard=shard)

        shard = (
            shard_spec(self.run.fsdp, device_type=self.device.type, param_dtype=self.dtype)
            if self.world.distributed
            else None
        )
        model = materialize(build, load, prepare, device=self.device, shard=shard, world=self.world)
        if self.run.compile:
            models.compile_layers(model)
        return model

    def _open_outputs(self) -> None:
        # The logger first: a logger that cannot start leaves output_dir as it was.
        self.metric_logger = GuardedLogger(
            build_quietly(lambda: self._build("metric_logger", fix="fix the logger's arguments")),
            target=self._node("metric_logger").get("_component_"),
        )
        self.metric_logger.log_config(OmegaConf.create(self.run.yaml))
        self.metrics = outputs.open_metrics(
            self.output_dir,
            config_yaml=self.run.yaml,
            resume_step=self.global_step if self.resume_from is not None else None,
        )
        self.metric_logger.outputs_kept = True

    def _weights_origins(self) -> dict[str, tuple[torch.nn.Module | None, Path]]:
        """Each loaded model and the folder its weights came from."""
        student = self.resume_from or self.sources["model"].folder
        teacher = self.sources["teacher_model"].folder if self.teacher is not None else Path()
        return {"model": (self.student, student), "teacher_model": (self.teacher, teacher)}

    # ------------------------------------------------------------ 3. training
    def train(self) -> None:
        """The loop: step, log, validate, checkpoint, final save; stop cleanly on SIGTERM/SIGINT
        (a signal after the last step waits for the final save) or when early stopping says so."""
        grad_accum, start_epoch = self.run.optimizer.grad_accum, self.epoch
        done_in_epoch = self.global_step - start_epoch * self.steps_per_epoch
        bad_steps, first_step = 0, self.global_step + 1
        saved: tuple[int, Path | None] | None = None  # (step, folder) of the newest step save
        every = self.run.checkpoint.save_every_n_steps
        val = self.run.validation
        val_every = val.every_n_steps if val is not None else None
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
                for _ in range(skip, self.steps_per_epoch):
                    step = self.global_step + 1
                    stats = self.train_step(
                        data.next_micro_batches(batches, count=grad_accum, step=step)
                    )
                    if not stats.stepped or not math.isfinite(stats.loss):
                        bad_steps += 1
                        if step == first_step:  # no step applied yet: were they loaded so?
                            check_loaded_weights_finite(self._weights_origins())
                        train.skip_or_stop(
                            stats,
                            step=step,
                            bad_steps=bad_steps,
                            max_bad_steps=self.run.max_bad_steps,
                            latest_checkpoint=checkpoint.find_latest_checkpoint(self.output_dir),
                        )
                    self.global_step += 1
                    bar.update(1)
                    if (
                        self.world.is_rank_zero
                        and self.global_step % self.run.log_every_n_steps == 0
                    ):
                        self._log(stats)
                    # Before the step save: its resume state holds this evaluation.
                    evaluated = val_every is not None and self.global_step % val_every == 0
                    if evaluated:
                        self.validate()
                    if every is not None and self.global_step % every == 0:
                        saved = (self.global_step, self.save(final=False))
                    last = self.global_step == self.total_steps  # then final/ is the save
                    tracker = self.tracker
                    if evaluated and not last and tracker is not None and tracker.should_stop:
                        bar.close()
                        self._stop_early(stop)
                        return
                    if distributed.any_rank(stop.requested, device=self.device) and not last:
                        bar.close()
                        just_saved = saved[1] if saved and saved[0] == self.global_step else None
                        self._stop(stop.signal_name, just_saved)
                        return
            bar.close()
            # Inside GracefulStop: a signal now waits for final/ to be complete.
            stop.action = "finishing the final save"
            if self.tracker is not None and self.tracker.last_step != self.global_step:
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
        inputs = [
            self._inputs(b, index=i, timer=timer, sampled=sampled) for i, b in enumerate(batches)
        ]
        labels = [train.shift_labels(lab) for _, lab in inputs]
        total = distributed.all_reduce_sum(train.count_tokens(labels).to(self.device))
        sums = torch.zeros(3, device=self.device)
        for batch, (tokens, _), lab in zip(batches, inputs, labels, strict=True):
            r = train.micro_step(
                self.student,
                self.teacher,
                tokens.to(self.device),
                lab.to(self.device),
                settings=self.run.loss,
                num_tokens_total=total,
                grad_scale=float(self.world.world_size),
                teacher_topk=self._stored_topk(batch),
                timer=timer,
            )
            sums += torch.stack([r.loss, r.ce, r.kd]).float()
            # Free the teacher's gathered root (norm + output) before backward peaks.
            distributed.reshard(self.teacher)
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
        *,
        index: int,
        timer: PhaseTimer,
        sampled: dict[str, tuple[int, int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``index``'s ``(tokens, labels)`` (labels not shifted): the dataset's, or
        on-policy (``on_policy:``) a model's completions of its prompts. The coin is the same on
        every rank, so under FSDP2 all ranks sample or none do."""
        op = self.run.on_policy
        if op is None:
            return batch["tokens"], batch["labels"]
        seed, step = int(self.run.seed or 0), self.global_step + 1
        if on_policy.coin(seed, step, index, op.lmbda):
            source, model = "student", self.student
        elif op.seq_kd:
            source, model = "teacher", self.teacher
        else:
            return batch["tokens"], batch["labels"]
        assert model is not None
        rows = batch["rows"].tolist()
        limit = self.run.max_seq_len
        prompts = on_policy.prompts_of(
            batch["tokens"].to(self.device),
            batch["labels"].to(self.device),
            pad_id=self.pad_id,
            max_len=None if limit is None else limit - op.max_new_tokens,
            rows=rows,
            header=self.header,
        )
        generators = (
            on_policy.row_generators(seed, self.epoch, rows, device=self.device)
            if op.temperature > 0
            else None
        )
        world = self.world
        with timer.phase("generate"):
            done = on_policy.rollout(
                model,
                prompts,
                max_new_tokens=op.max_new_tokens,
                temperature=op.temperature,
                top_p=op.top_p,
                stop_ids=self.stop_ids,
                pad_id=self.pad_id,
                vocab_limit=self.sample_vocab,
                generators=generators,
                all_done=(
                    (lambda here: not distributed.any_rank(not here, device=self.device))
                    if world.distributed
                    else None
                ),
            )
        if source == "teacher":
            distributed.reshard(self.teacher)
        # The completion tokens of all ranks: the logged count is the same on any world size.
        count, tokens = sampled.get(source, (0, 0))
        new = int(distributed.all_reduce_sum(done.lengths.sum()))
        sampled[source] = (count + 1, tokens + new)
        return on_policy.training_batch(prompts, done, pad_id=self.pad_id)

    def _stored_topk(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The batch's stored teacher top-k ``(ids, logprobs)`` ``[b, s, k]`` on the device, or
        None with an online teacher."""
        if self.store is None:
            return None
        assert self.run.teacher_logits is not None
        ids, logprobs = self.store.batch(
            batch["rows"].tolist(), batch["tokens"], batch["labels"], k=self.run.teacher_logits.k
        )
        return ids.to(self.device), logprobs.to(self.device)

    def validate(self) -> evaluate.ValStats:
        """Evaluate on the validation set (all ranks), log the row, and keep ``best/`` when the
        followed metric improved. Collective when distributed."""
        val, tracker = self.run.validation, self.tracker
        assert val is not None and tracker is not None
        stats = evaluate.evaluate(
            self.student, self.teacher, self.val_loader, settings=self.run.loss, device=self.device
        )
        value = stats.value(tracker.metric)
        improved = tracker.update(float("nan") if value is None else value, step=self.global_step)
        if self.world.is_rank_zero:
            row = {"step": self.global_step, "epoch": self.epoch, **stats.metrics()}
            outputs.write_metrics_row(self.metrics, row, output_dir=self.output_dir)
            self.metric_logger.log_dict(
                {k: v for k, v in row.items() if k != "step"}, step=self.global_step
            )
        if improved and val.keep_best and tracker.best is not None:
            save_best_checkpoint(
                self.output_dir,
                student=self.student,
                progress=self._progress(),
                source=self._source(),
                config_yaml=self.run.yaml,
                metric=tracker.metric,
                value=tracker.best,
                mode=tracker.mode,
                world=self.world,
            )
        return stats

    def _stop_early(self, stop: GracefulStop) -> None:
        """Early stopping: save final/ and say why training stopped."""
        tracker = self.tracker
        assert tracker is not None
        stop.action = "finishing the final save"
        final = self.save(final=True)
        if self.world.is_rank_zero:
            keep = self.run.validation is not None and self.run.validation.keep_best
            if tracker.best is None:
                best = "; no evaluation gave a finite value"
            elif keep:
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
            "loss": stats.loss,
            "ce_loss": stats.ce_loss,
            "kd_loss": stats.kd_loss,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "grad_norm": stats.grad_norm,
            "num_tokens": stats.num_tokens,
            "tokens_per_second": stats.num_tokens / max(stats.seconds, 1e-9),
        }
        # The step's time by part: sampling (on-policy), the teacher's forward, the student's
        # forward + backward + optimizer step (the rest).
        generate_s = stats.phases.get("generate", 0.0)
        teacher_s = stats.phases.get("teacher", 0.0)
        if self.run.on_policy is not None:
            row["time_generate_s"] = generate_s
        row["time_teacher_s"] = teacher_s
        row["time_student_s"] = max(stats.seconds - generate_s - teacher_s, 0.0)
        if self.run.on_policy is not None:
            for source in ("student", "teacher"):
                count, tokens = stats.sampled.get(source, (0, 0))
                row[f"sampled_batches_{source}"] = count
                row[f"sampled_tokens_{source}"] = tokens
            if generate_s > 0:
                total = sum(tokens for _, tokens in stats.sampled.values())
                row["generate_tokens_per_second"] = total / generate_s
        if self.run.log_peak_memory_stats:
            row.update(peak_memory_gib(self.device))
            if self.plan is not None:
                row["planned_peak_gib"] = self.plan.peak_gib
        outputs.write_metrics_row(self.metrics, row, output_dir=self.output_dir)
        payload = {k: v for k, v in row.items() if k != "step"}
        self.metric_logger.log_dict(payload, step=self.global_step)

    # ------------------------------------------------------------ checkpoints and exit
    def save(self, *, final: bool) -> Path | None:
        """Write the student in HF format (and, for step checkpoints, the full resume state).

        Collective when distributed: every rank calls it; rank 0 writes.
        """
        return save_training_checkpoint(
            self.output_dir,
            student=self.student,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            progress=self._progress(),
            source=self._source(),
            config_yaml=self.run.yaml,
            keep_last_n=self.run.checkpoint.keep_last_n,
            final=final,
            world=self.world,
        )

    def _progress(self) -> Progress:
        return Progress(
            self.global_step,
            self.epoch,
            int(self.run.seed or 0),
            validation=self.tracker.state_dict() if self.tracker is not None else {},
        )

    def _source(self) -> StudentSource:
        src = self.sources["model"]
        return StudentSource(
            model_type=src.model_type,
            source_dir=src.folder,
            lora=self.run.lora,
            backend=src.backend,
            tokenizer_files=models.tokenizer_files_to_copy(self._node("tokenizer")),
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
    from kd.launch import run_recipe

    sys.exit(run_recipe(recipe_main))
