"""Knowledge distillation: a frozen teacher teaches a trainable student (full or LoRA).

Run it:

    kd run kd_single_device --config qwen2_5/14B_to_3B_full_single_device
    kd run kd_single_device --config my.yaml batch_size=2 gradient_accumulation_steps=16
    kd run --nproc_per_node 8 kd_distributed --config llama3_1/8B_to_8B_full_distributed

The same recipe serves one device and N ranks under torchrun (FSDP2); ``kd_distributed`` launches it.

Features (each knob is a config key; defaults live in kd/config/schema.py):
    - Memory plan before any weight loads (``memory.budget_gib``, ``memory.check``): over budget exits 2
      with the table and knob settings that fit (``kd plan --fit``).
    - Loss ``(1 - kd_ratio) * CE + kd_ratio * KD`` (``kd_ratio``, ``kd_loss.divergence``,
      ``temperature`` with T^2 scaling). The fused loss (``fused_loss``, ``loss_chunk_size``) computes
      logits chunk by chunk over labelled tokens only and never keeps full-vocab logits.
    - Teacher and student may have different padded vocabularies (Qwen2.5-14B vs 3B): the KD term uses
      the shared first min(Vs, Vt) entries; token ids are checked against both before loading.
    - Exact gradient accumulation (``gradient_accumulation_steps``): normalised by the labelled tokens of
      the whole optimizer step, so batch b x k equals batch b*k x 1.
    - ``enable_activation_checkpointing`` (less memory, ~30% more compute), ``compile``,
      ``clip_grad_norm``, LR warmup + cosine (``lr_scheduler``).
    - LoRA students (torchtune ``lora_*`` builders): only adapters train; saved merged and as an adapter.
    - Step checkpoints (``save_every_n_steps``, ``keep_last_n``), exact resume
      (``resume_from_checkpoint``), SIGTERM/SIGINT finish the step, save and exit 0.
    - Metrics: ``output_dir/metrics.jsonl`` plus ``metric_logger`` (stdout, wandb offline/online).
"""

from __future__ import annotations

import logging
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from kd import _torchtune as tt
from kd import checkpoint, data, distributed, models, train
from kd.config import instantiate
from kd.errors import KDUserError, brief
from kd.metrics import JsonlWriter, peak_memory_gib, trim_jsonl
from kd.signals import GracefulStop, launch_command, resume_hint

log = logging.getLogger("kd")


class KDRecipe:
    """Distil ``teacher_model`` into ``model`` (the student). See the module docstring for knobs."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise KDUserError("device: cuda is not available on this machine; set device=cpu")
        self.world = distributed.init_distributed(self.device.type)
        if self.world.distributed and self.device.type == "cuda":
            self.device = torch.device("cuda", self.world.local_rank)
        self.dtype = models.DTYPES[cfg.dtype]
        if cfg.optimizer_in_cpu and (self.device.type != "cuda" or self.world.distributed):
            raise KDUserError(
                "optimizer_in_cpu: offloads optimizer states from one GPU (device=cuda, one rank); "
                "with several ranks use fsdp.cpu_offload=true, on CPU set optimizer_in_cpu=false"
            )
        self.output_dir = Path(cfg.output_dir)
        self.seed_given = cfg.seed is not None  # seed: null adopts the checkpoint's on resume
        self.seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(2**31)
        # Every rank must shuffle alike: a drawn seed comes from rank 0.
        self.seed = int(distributed.broadcast_object(self.seed, world=self.world))
        cfg.seed = self.seed  # the snapshot records the seed actually used
        self.settings = train.LossSettings(
            kd_ratio=float(cfg.kd_ratio),
            temperature=float(cfg.temperature),
            divergence=cfg.kd_loss.divergence,
            beta=float(cfg.kd_loss.beta),
            skew_alpha=float(cfg.kd_loss.skew_alpha),
            chunk_size=int(cfg.loss_chunk_size),
            fused=bool(cfg.fused_loss),
        )
        self.batch_size = int(cfg.batch_size)
        self.grad_accum = int(cfg.gradient_accumulation_steps)
        self.epochs = int(cfg.epochs)
        self.max_steps_per_epoch = cfg.max_steps_per_epoch
        self.clip_grad_norm = cfg.clip_grad_norm
        self.log_every = int(cfg.log_every_n_steps)
        self.save_every = cfg.save_every_n_steps
        self.keep_last_n = int(cfg.keep_last_n)
        self.max_bad_steps = int(cfg.max_bad_steps)
        self.config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        self.global_step = 0
        self.epoch = 0
        self.planned_peak_gib: float | None = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Everything before training, in an order that fails early and cheaply."""
        cfg = self.cfg
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        # 1. Shapes only (meta device): vocab checks and the memory plan need no weights.
        self.tokenizer = self._instantiate("tokenizer", "check the tokenizer files and arguments")
        with torch.device("meta"):
            student_meta = self._instantiate("model", "fix the builder's arguments")
            teacher_meta = (
                self._instantiate("teacher_model", "fix the builder's arguments")
                if cfg.teacher_model is not None
                else None
            )
        self.lora = models.is_lora(student_meta)
        problems = models.check_vocab(
            tokenizer_max=models.tokenizer_max_id(self.tokenizer),
            student_vocab=models.vocab_size(student_meta),
            teacher_vocab=models.vocab_size(teacher_meta) if teacher_meta is not None else None,
        )
        if problems:
            raise KDUserError("\n".join(problems))
        del student_meta, teacher_meta
        self._check_memory()
        # 2. Resume state is located before loading weights so a bad resume fails fast.
        self.resume_from = self._find_resume()
        # 3. Data before weights: a bad data file fails in seconds, not after loading the teacher.
        self.dataset = self._instantiate(
            "dataset",
            "check dataset.source, dataset.data_files and the file's contents",
            self.tokenizer,
        )
        truncated, checked = data.check_dataset(
            self.dataset, max_seq_len=self.cfg.tokenizer.get("max_seq_len")
        )
        if truncated and self.world.is_rank_zero:
            log.warning(
                "%d of %d examples checked reach tokenizer.max_seq_len and are truncated",
                truncated,
                checked,
            )
        self.loader, self.sampler = data.build_dataloader(
            self.dataset,
            batch_size=self.batch_size,
            shuffle=bool(cfg.shuffle),
            seed=self.seed,
            pad_id=data.pad_id_of(self.tokenizer),
            world_size=self.world.world_size,
            rank=self.world.rank,
        )
        self.steps_per_epoch = len(self.loader) // self.grad_accum
        if self.max_steps_per_epoch is not None:
            self.steps_per_epoch = min(self.steps_per_epoch, int(self.max_steps_per_epoch))
        if self.steps_per_epoch < 1:
            raise KDUserError(
                f"gradient_accumulation_steps: {self.grad_accum} micro-batches per step but an epoch has "
                f"only {len(self.loader)}; lower gradient_accumulation_steps or batch_size"
            )
        self.total_steps = self.steps_per_epoch * self.epochs
        if self.resume_from is not None:
            marker = checkpoint.read_checkpoint_marker(self.resume_from)
            done_in_epoch = int(marker["step"]) - int(marker["epoch"]) * self.steps_per_epoch
            if not 0 <= done_in_epoch <= self.steps_per_epoch:
                raise KDUserError(
                    f"max_steps_per_epoch: the checkpoint is at step {marker['step']} in epoch "
                    f"{marker['epoch']}, which does not fit epochs of {self.steps_per_epoch} steps; "
                    "resume with the max_steps_per_epoch the run started with"
                )
        # 4. Weights: teacher first (frozen), then the student.
        self.teacher = (
            self._loading("teacher_checkpointer", self._load_teacher)
            if cfg.teacher_model is not None
            else None
        )
        self.student = self._loading("checkpointer", self._load_student)
        # 5. Optimizer, schedule, resume state.
        trainable = [p for p in self.student.parameters() if p.requires_grad]
        self.optimizer = (
            self._cpu_offload_optimizer(trainable)
            if cfg.optimizer_in_cpu
            else self._instantiate("optimizer", "fix the optimizer's arguments", trainable)
        )
        self.lr_scheduler = (
            self._instantiate(
                "lr_scheduler",
                "fix the scheduler's arguments",
                self.optimizer,
                num_training_steps=self.total_steps,
            )
            if cfg.lr_scheduler is not None
            else None
        )
        if self.resume_from is not None:
            self._restore(self.resume_from)
        if self.world.is_rank_zero:
            try:
                self.output_dir.mkdir(parents=True, exist_ok=True)
                (self.output_dir / "config.yaml").write_text(self.config_yaml)
                if self.resume_from is not None:
                    trim_jsonl(self.output_dir / "metrics.jsonl", self.global_step)
                self.metrics = JsonlWriter(self.output_dir / "metrics.jsonl")
            except OSError as e:
                raise KDUserError(
                    f"output_dir: cannot write to {self.output_dir} ({e.strerror or e}); "
                    f"set output_dir to a writable folder with free space"
                ) from e
            self.metric_logger = self._instantiate("metric_logger", "fix the logger's arguments")
            if hasattr(self.metric_logger, "log_config"):
                self.metric_logger.log_config(cfg)

    def _cpu_offload_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The configured optimizer with its states and step on the CPU (torchao).

        Frees the GPU of the optimizer states (for AdamW twice the trainable weights) at the cost of
        a host round trip of the gradients each step.
        """
        from torchao.optim import CPUOffloadOptimizer

        from kd.config.instantiate import locate_target

        node = self.cfg.optimizer
        cls, reason = locate_target(
            node._component_, allow_any=bool(self.cfg.trust_remote_components)
        )
        if reason is not None:
            raise KDUserError(f"optimizer._component_: {reason}")
        kwargs = {k: v for k, v in node.items() if k != "_component_"}
        return CPUOffloadOptimizer(params, optimizer_class=cls, **kwargs)

    def _instantiate(self, key: str, fix: str, *args: Any, **kwargs: Any) -> Any:
        """Build the config node ``key``; a failure inside the user's component names the key.

        Args:
            key: top-level config key (``dataset``, ``optimizer``...).
            fix: the end of the error message (what the user should check).
            *args: positional runtime arguments of the component.
            **kwargs: runtime keyword arguments of the component.
        """
        node = self.cfg[key]
        try:
            return instantiate(
                node, *args, allow_any=bool(self.cfg.trust_remote_components), **kwargs
            )
        except KDUserError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the user's component raises is reported
            target = node.get("_component_") if isinstance(node, DictConfig) else node
            if key == "dataset" and "corresponds to no data" in str(e):
                # Hugging Face's words for a data file without rows.
                files = node.get("data_files") if isinstance(node, DictConfig) else None
                raise KDUserError(
                    f"dataset: {files or 'the data'} has no examples; point dataset.data_files at "
                    "a file with examples"
                ) from e
            raise KDUserError(f"{key}: {target} failed ({brief(e)}); {fix}") from e

    def _loading(self, key: str, load: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """Run ``load`` (a weight loader); unreadable files become an error naming ``key``."""
        try:
            return load()
        except (KDUserError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - torchtune/safetensors raise many types for bad files
            folder = self.cfg[key].get("checkpoint_dir")
            raise KDUserError(
                f"{key}: cannot load the weights in {folder} ({brief(e)}); check that "
                f"{key}.checkpoint_files are complete safetensors of the model its builder names "
                "(re-download truncated files)"
            ) from e

    def _check_memory(self) -> None:
        from kd import memory

        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
        else:
            import psutil

            total = psutil.virtual_memory().total
        plan = memory.check_memory(
            self.cfg, world_size=self.world.world_size, device_total_bytes=total
        )
        if plan is not None:
            self.planned_peak_gib = plan.peak_gib
            if self.world.is_rank_zero:
                log.info(
                    "memory plan: peak %.2f GiB (%s) of %.2f GiB",
                    plan.peak_gib,
                    plan.phase,
                    plan.budget_gib,
                )

    def _build(self, node: DictConfig, *, meta: bool = False) -> torch.nn.Module:
        """Instantiate a model builder in the run's dtype.

        ``meta``: shapes only (no memory, no random draws), the skeleton every rank shards before
        rank 0's weights arrive. Otherwise on the device at world size 1, and on CPU when
        distributed (rank 0's full copy).
        """
        if meta:
            device = torch.device("meta")
        else:
            device = torch.device("cpu") if self.world.distributed else self.device
        with models.default_dtype(self.dtype), device:
            return instantiate(node, allow_any=bool(self.cfg.trust_remote_components))

    def _load_teacher(self) -> torch.nn.Module:
        node = self.cfg.teacher_model

        def load() -> torch.nn.Module:
            teacher = self._build(node)
            ckpt = instantiate(
                self.cfg.teacher_checkpointer,
                should_load_recipe_state=False,
                allow_any=bool(self.cfg.trust_remote_components),
            )
            state = ckpt.load_checkpoint()[tt.MODEL_KEY]
            models.load_weights(
                teacher, state, lora=models.is_lora(teacher), source="teacher_checkpointer"
            )
            return teacher

        # Only rank 0 reads the files; the others get its weights after sharding (_place).
        teacher = distributed.on_rank_zero(load, world=self.world)
        full: dict[str, torch.Tensor] = {}
        if self.world.distributed:
            if teacher is not None:
                full = teacher.state_dict()  # the tensors outlive the module; one full copy
            distributed.sync_cpu_rng(world=self.world)
            teacher = self._build(node, meta=True)
        assert teacher is not None
        models.freeze(teacher)
        models.set_hidden_output(teacher)
        return self._place(teacher, trainable=False, full_state_dict=full)

    def _load_student(self) -> torch.nn.Module:
        node = self.cfg.model
        self._student_ckpt = None  # rank 0's checkpointer (its HF config converts resume weights)

        def load() -> torch.nn.Module:
            student = self._build(node)
            self._student_ckpt = instantiate(
                self.cfg.checkpointer,
                should_load_recipe_state=False,
                allow_any=bool(self.cfg.trust_remote_components),
            )
            state = self._student_ckpt.load_checkpoint()[tt.MODEL_KEY]
            # A LoRA student's adapters keep the builder's random init (drawn under the seed).
            models.load_weights(student, state, lora=self.lora, source="checkpointer")
            return student

        student = distributed.on_rank_zero(load, world=self.world)
        full: dict[str, torch.Tensor] = {}
        if self.world.distributed:
            # Rank 0 broadcasts base weights *and* adapters, so every rank starts from the
            # adapters a single-device run draws.
            if student is not None:
                full = student.state_dict()
            distributed.sync_cpu_rng(world=self.world)
            student = self._build(node, meta=True)
        assert student is not None
        # The same wrapping and flags on every rank, before sharding.
        if self.lora:
            models.setup_lora_trainable(student)
        if self.cfg.enable_activation_checkpointing:
            models.enable_activation_checkpointing(student)
        models.set_hidden_output(student)
        student.train()
        return self._place(student, trainable=True, full_state_dict=full)

    def _place(
        self,
        model: torch.nn.Module,
        *,
        trainable: bool,
        full_state_dict: dict[str, torch.Tensor] | None = None,
    ) -> torch.nn.Module:
        """Shard a meta-built model and load rank 0's ``full_state_dict`` into it (distributed),
        then compile; at world size 1 the loaded model is used as it is."""
        if self.world.distributed:
            fsdp = self.cfg.fsdp
            unknown = models.unrecomputable_buffers(model)
            if unknown:
                raise KDUserError(
                    f"{'model' if trainable else 'teacher_model'}: non-persistent buffers "
                    f"{unknown[:3]} cannot be recomputed after distributed loading; use a builder "
                    "whose only non-persistent buffers are RoPE caches, or run on one device"
                )
            cpu_offload = bool(fsdp.cpu_offload)
            model = distributed.shard_model(
                model,
                device_type=self.device.type,
                param_dtype=self.dtype,
                reduce_dtype=torch.float32 if fsdp.reduce_dtype == "fp32" else torch.bfloat16,
                reshard_after_forward=bool(fsdp.reshard_after_forward),
                cpu_offload=cpu_offload,
            )
            # Shards live on the device, or in CPU memory with cpu_offload.
            distributed.load_into_meta_sharded(
                model,
                full_state_dict or {},
                init_device=torch.device("cpu") if cpu_offload else self.device,
                world=self.world,
            )
            # Buffers are not offloaded: the RoPE caches belong on the compute device.
            with self.device:
                models.reset_rope_buffers(model)
        if self.cfg.compile:
            models.compile_layers(model)
        return model

    # ----------------------------------------------------------- checkpoints
    def _find_resume(self) -> Path | None:
        if not self.cfg.resume_from_checkpoint:
            if any(self.output_dir.glob("step_*")):
                raise KDUserError(
                    f"output_dir: {self.output_dir} already holds step checkpoints of another run; "
                    f"set resume_from_checkpoint=true to continue it, or choose a new output_dir"
                )
            return None
        found = checkpoint.find_latest_checkpoint(self.output_dir)
        if found is None:
            raise KDUserError(
                f"resume_from_checkpoint: no complete checkpoint under {self.output_dir}; "
                f"set resume_from_checkpoint=false to start fresh"
            )
        saved = checkpoint.load_checkpoint_config(found)
        saved_seed = OmegaConf.create(saved).get("seed")
        if not self.seed_given and isinstance(saved_seed, int):
            # seed: null drew a fresh seed for this process; the run being resumed drew its own.
            self.seed = saved_seed
            self.cfg.seed = saved_seed
            self.config_yaml = OmegaConf.to_yaml(self.cfg, resolve=True)
        checkpoint.check_resume_compatible(saved, self.config_yaml, checkpoint=found)
        return found

    def _restore(self, ckpt: Path) -> None:
        # Rank 0 reads the files and broadcasts (tensor by tensor when distributed), so no other
        # rank holds a full copy of the weights or the optimizer state.
        rank0 = self.world.is_rank_zero
        state = checkpoint.load_recipe_state(ckpt) if rank0 else {}
        weights: dict[str, torch.Tensor] = {}
        if self.lora:
            weights = state.get("adapter", {})
        elif rank0:
            weights = checkpoint.hf_to_tune_state_dict(
                checkpoint.load_hf_weights(ckpt),
                model_type=str(self.cfg.checkpointer.model_type),
                hf_config=self._student_ckpt._config,
            )
        distributed.load_full_state_dict(
            self.student, weights, strict=not self.lora, world=self.world
        )
        del weights
        distributed.load_optimizer_state_dict(
            self.student, self.optimizer, state.pop("optimizer", {}), world=self.world
        )
        state.pop("adapter", None)
        state = distributed.broadcast_object(state, world=self.world)
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        checkpoint.restore_rng_state(state["rng"])
        saved_world = int(state.get("world_size", self.world.world_size))
        if rank0 and saved_world != self.world.world_size:
            log.warning(
                "resuming a %d-rank checkpoint on %d ranks: batch_size is per rank, so the global "
                "batch changes and the run will not match an uninterrupted one",
                saved_world,
                self.world.world_size,
            )
        if rank0:
            log.info("resumed from %s at step %d", ckpt, self.global_step)

    def _recipe_state(self) -> dict[str, Any]:
        # Collective when distributed (gathers the optimizer state); complete on rank 0 only.
        state: dict[str, Any] = {
            "optimizer": distributed.optimizer_state_dict(
                self.student, self.optimizer, world=self.world
            ),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else {},
            "global_step": self.global_step,
            "epoch": self.epoch,
            "seed": self.seed,
            "world_size": self.world.world_size,
            "rng": checkpoint.capture_rng_state(),
        }
        if self.lora:
            state["adapter"] = distributed.adapter_state_dict(self.student, world=self.world)
        return state

    def save(self, *, final: bool) -> Path | None:
        """Write the student in HF format (and, for step checkpoints, the full resume state)."""
        full = distributed.full_state_dict(self.student, world=self.world)
        recipe_state = None if final else self._recipe_state()
        if not self.world.is_rank_zero:
            distributed.barrier()
            return None
        adapter = adapter_cfg = None
        if self.lora:
            # save_hf_model merges the LoRA keys of `full` into copies of the base weights.
            adapter = tt.get_adapter_state_dict(full)
            adapter_cfg = {
                "r": int(self.cfg.model.lora_rank),
                "lora_alpha": float(self.cfg.model.lora_alpha),
                "target_modules": tt.get_lora_module_names(
                    list(self.cfg.model.lora_attn_modules),
                    bool(self.cfg.model.get("apply_lora_to_mlp", False)),
                    bool(self.cfg.model.get("apply_lora_to_output", False)),
                ),
                "peft_type": "LORA",
            }
        ckpt = self.cfg.checkpointer

        def write_model(dest: Path) -> None:
            checkpoint.save_hf_model(
                dest,
                full,
                model_type=str(ckpt.model_type),
                source_dir=Path(ckpt.checkpoint_dir),
                adapter_state_dict=adapter,
                adapter_config=adapter_cfg,
            )

        path = checkpoint.save_checkpoint(
            self.output_dir,
            self.global_step,
            epoch=self.epoch,
            write_model=write_model,
            recipe_state=recipe_state,
            config_yaml=self.config_yaml,
            keep_last_n=self.keep_last_n,
        )
        distributed.barrier()
        return path

    # ------------------------------------------------------------------ train
    def _next_micro_batches(self, it) -> list[dict[str, torch.Tensor]]:
        try:
            return [next(it) for _ in range(self.grad_accum)]
        except Exception as e:  # noqa: BLE001 - a bad row raises whatever the transform raises
            raise KDUserError(
                f"dataset: reading the batches of step {self.global_step + 1} failed ({brief(e)}); "
                "fix that row of the data file (the last checkpoint is kept)"
            ) from e

    def train(self) -> None:
        """The loop: accumulate, step, log, checkpoint; stop cleanly on SIGTERM/SIGINT."""
        start_epoch = self.epoch
        done_in_epoch = self.global_step - start_epoch * self.steps_per_epoch
        bad_steps = 0
        saved: tuple[int, Path | None] | None = None  # (step, folder) of the newest step save
        show = self.world.is_rank_zero
        bar = tqdm(
            total=self.total_steps,
            initial=self.global_step,
            disable=not show,
            desc="kd",
            dynamic_ncols=True,
        )
        # Closing the bar on any exit ends its line, so an error message starts a line of its own.
        with bar, GracefulStop() as stop:
            for epoch in range(start_epoch, self.epochs):
                self.epoch = epoch
                self.sampler.set_epoch(epoch)
                skip = done_in_epoch if epoch == start_epoch else 0
                self.sampler.skip = skip * self.grad_accum * self.batch_size
                it = iter(self.loader)
                t0 = time.perf_counter()
                for _ in range(skip, self.steps_per_epoch):
                    batches = self._next_micro_batches(it)
                    labels = [train.shift_labels(b["labels"]) for b in batches]
                    total = distributed.all_reduce_sum(train.count_tokens(labels).to(self.device))
                    sums = torch.zeros(3, device=self.device)
                    for b, lab in zip(batches, labels, strict=True):
                        r = train.micro_step(
                            self.student,
                            self.teacher,
                            b["tokens"].to(self.device),
                            lab.to(self.device),
                            settings=self.settings,
                            num_tokens_total=total,
                            grad_scale=float(self.world.world_size),
                        )
                        sums += torch.stack([r.loss, r.ce, r.kd]).float()
                        # Free the teacher's gathered root (norm + output) before backward peaks.
                        distributed.reshard(self.teacher)
                    sums = distributed.all_reduce_sum(sums)
                    # optimizer_step never applies NaN/inf gradients, so the weights stay those
                    # of the last good step whatever happens below.
                    norm, stepped = train.optimizer_step(
                        self.student, self.optimizer, clip_grad_norm=self.clip_grad_norm
                    )
                    loss = float(sums[0])
                    if not stepped or not math.isfinite(loss):
                        bad_steps += 1
                        if bad_steps > self.max_bad_steps:
                            raise KDUserError(
                                self._non_finite_message(loss, float(norm), bad_steps)
                            )
                        log.warning(
                            "step %d: non-finite loss (%s) or grad norm (%s); step skipped "
                            "(%d of max_bad_steps=%d)",
                            self.global_step + 1,
                            loss,
                            float(norm),
                            bad_steps,
                            self.max_bad_steps,
                        )
                    if self.lr_scheduler is not None:
                        self.lr_scheduler.step()
                    self.global_step += 1
                    bar.update(1)
                    if show and self.global_step % self.log_every == 0:
                        dt = time.perf_counter() - t0
                        self._log(sums, norm, int(total), dt)
                    t0 = time.perf_counter()
                    if self.save_every is not None and self.global_step % int(self.save_every) == 0:
                        saved = (self.global_step, self.save(final=False))
                    if self._stop_requested(stop.requested):
                        bar.close()
                        just_saved = saved[1] if saved and saved[0] == self.global_step else None
                        self._stop(stop.signal_name, just_saved)
                        return
        self.save(final=True)

    def _non_finite_message(self, loss: float, norm: float, bad_steps: int) -> str:
        latest = checkpoint.find_latest_checkpoint(self.output_dir)
        kept = (
            f"the last good checkpoint is {latest} (resume_from_checkpoint=true continues from it)"
            if latest is not None
            else "no step checkpoint was saved (save_every_n_steps keeps some)"
        )
        return (
            f"step {self.global_step + 1}: non-finite loss ({loss}) or gradient norm ({norm}), "
            f"{bad_steps} such steps with max_bad_steps={self.max_bad_steps}; stopped without "
            f"saving and {kept}; lower optimizer.lr, set clip_grad_norm, or raise max_bad_steps to "
            "skip such steps"
        )

    def _stop_requested(self, local: bool) -> bool:
        """A signal on any rank stops every rank after the same step."""
        return distributed.any_rank(local, device=self.device)

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

    def _log(self, sums: torch.Tensor, norm: torch.Tensor, num_tokens: int, dt: float) -> None:
        row: dict[str, Any] = {
            "step": self.global_step,
            "epoch": self.epoch,
            "loss": float(sums[0]),
            "ce_loss": float(sums[1]),
            "kd_loss": float(sums[2]),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "grad_norm": float(norm),
            "num_tokens": num_tokens,
            "tokens_per_second": num_tokens / max(dt, 1e-9),
        }
        if self.cfg.log_peak_memory_stats:
            row.update(peak_memory_gib(self.device))
            if self.planned_peak_gib is not None:
                row["planned_peak_gib"] = self.planned_peak_gib
        self.metrics.write(row)
        self.metric_logger.log_dict(
            {k: v for k, v in row.items() if k != "step"}, step=self.global_step
        )

    def cleanup(self) -> None:
        if self.world.is_rank_zero and hasattr(self, "metrics"):
            self.metrics.close()
            self.metric_logger.close()
        distributed.destroy()


def recipe_main(cfg: DictConfig) -> None:
    """Entry point used by ``kd run`` (and by torchrun through ``kd_distributed``)."""
    recipe = KDRecipe(cfg)
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    from kd.cli import run_recipe

    sys.exit(run_recipe(recipe_main))
