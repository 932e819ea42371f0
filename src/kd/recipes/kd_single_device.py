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

import hashlib
import logging
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from kd import _torchtune as tt
from kd import checkpoint, data, distributed, models, train
from kd.config import instantiate
from kd.errors import KDUserError
from kd.metrics import JsonlWriter, peak_memory_gib
from kd.signals import GracefulStop, resume_hint

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
        self.output_dir = Path(cfg.output_dir)
        self.seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(2**31)
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
        self.tokenizer = instantiate(cfg.tokenizer)
        with torch.device("meta"):
            student_meta = instantiate(cfg.model)
            teacher_meta = instantiate(cfg.teacher_model) if cfg.teacher_model is not None else None
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
        # 3. Weights: teacher first (frozen), then the student.
        self.teacher = self._load_teacher() if cfg.teacher_model is not None else None
        self.student = self._load_student()
        # 4. Data, optimizer, schedule.
        self.dataset = instantiate(cfg.dataset, self.tokenizer)
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
        trainable = [p for p in self.student.parameters() if p.requires_grad]
        self.optimizer = instantiate(cfg.optimizer, trainable)
        self.lr_scheduler = (
            instantiate(cfg.lr_scheduler, self.optimizer, num_training_steps=self.total_steps)
            if cfg.lr_scheduler is not None
            else None
        )
        if self.resume_from is not None:
            self._restore(self.resume_from)
        if self.world.is_rank_zero:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(self.config_yaml)
            self.metrics = JsonlWriter(self.output_dir / "metrics.jsonl")
            self.metric_logger = instantiate(cfg.metric_logger)
            if hasattr(self.metric_logger, "log_config"):
                self.metric_logger.log_config(cfg)

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

    def _build(self, node: DictConfig) -> torch.nn.Module:
        with (
            models.default_dtype(self.dtype),
            torch.device("cpu" if self.world.distributed else self.device),
        ):
            return instantiate(node)

    def _load_teacher(self) -> torch.nn.Module:
        teacher = self._build(self.cfg.teacher_model)
        ckpt = instantiate(self.cfg.teacher_checkpointer, should_load_recipe_state=False)
        state = ckpt.load_checkpoint()[tt.MODEL_KEY]
        models.load_weights(
            teacher, state, lora=models.is_lora(teacher), source="teacher_checkpointer"
        )
        del state
        models.freeze(teacher)
        models.set_hidden_output(teacher)
        return self._place(teacher, trainable=False)

    def _load_student(self) -> torch.nn.Module:
        student = self._build(self.cfg.model)
        self._student_ckpt = instantiate(self.cfg.checkpointer, should_load_recipe_state=False)
        state = self._student_ckpt.load_checkpoint()[tt.MODEL_KEY]
        models.load_weights(student, state, lora=self.lora, source="checkpointer")
        del state
        if self.lora:
            models.setup_lora_trainable(student)
        if self.cfg.enable_activation_checkpointing:
            models.enable_activation_checkpointing(student)
        models.set_hidden_output(student)
        student.train()
        return self._place(student, trainable=True)

    def _place(self, model: torch.nn.Module, *, trainable: bool) -> torch.nn.Module:
        if self.world.distributed:
            fsdp = self.cfg.fsdp
            # fully_shard moves the shards (and buffers) to the device, or keeps them in CPU
            # memory with cpu_offload.
            model = distributed.shard_model(
                model,
                device_type=self.device.type,
                param_dtype=self.dtype,
                reduce_dtype=torch.float32 if fsdp.reduce_dtype == "fp32" else torch.bfloat16,
                reshard_after_forward=bool(fsdp.reshard_after_forward),
                cpu_offload=bool(fsdp.cpu_offload),
            )
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
        saved = (found / "config.yaml").read_text()
        checkpoint.check_resume_compatible(saved, self.config_yaml)
        return found

    def _restore(self, ckpt: Path) -> None:
        state = checkpoint.load_recipe_state(ckpt)
        if self.lora:
            self.student.load_state_dict(state["adapter"], strict=False)
        else:
            hf = checkpoint.load_hf_weights(ckpt)
            tune_sd = checkpoint.hf_to_tune_state_dict(
                hf,
                model_type=str(self.cfg.checkpointer.model_type),
                hf_config=self._student_ckpt._config,
            )
            self.student.load_state_dict(tune_sd, strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        checkpoint.restore_rng_state(state["rng"])
        if self.world.is_rank_zero:
            log.info("resumed from %s at step %d", ckpt, self.global_step)

    def _recipe_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else {},
            "global_step": self.global_step,
            "epoch": self.epoch,
            "seed": self.seed,
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
            config_hash=hashlib.sha256(self.config_yaml.encode()).hexdigest(),
            keep_last_n=self.keep_last_n,
        )
        distributed.barrier()
        return path

    # ------------------------------------------------------------------ train
    def _next_micro_batches(self, it) -> list[dict[str, torch.Tensor]]:
        return [next(it) for _ in range(self.grad_accum)]

    def train(self) -> None:
        """The loop: accumulate, step, log, checkpoint; stop cleanly on SIGTERM/SIGINT."""
        start_epoch = self.epoch
        done_in_epoch = self.global_step - start_epoch * self.steps_per_epoch
        bad_steps = 0
        show = self.world.is_rank_zero
        bar = tqdm(
            total=self.total_steps,
            initial=self.global_step,
            disable=not show,
            desc="kd",
            dynamic_ncols=True,
        )
        with GracefulStop() as stop:
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
                    sums = distributed.all_reduce_sum(sums)
                    norm, stepped = train.optimizer_step(
                        self.student, self.optimizer, clip_grad_norm=self.clip_grad_norm
                    )
                    loss = float(sums[0])
                    if not stepped or not math.isfinite(loss):
                        bad_steps += 1
                        if bad_steps > self.max_bad_steps:
                            raise KDUserError(
                                f"step {self.global_step + 1}: non-finite loss ({loss}) or grad norm ({float(norm)}); "
                                f"the last good checkpoint is kept in {self.output_dir}; lower the optimizer lr, "
                                f"set clip_grad_norm, or allow skips with max_bad_steps"
                            )
                        log.warning(
                            "step %d: non-finite values, step skipped", self.global_step + 1
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
                        self.save(final=False)
                    if self._stop_requested(stop.requested):
                        self._stop(stop.signal_name)
                        bar.close()
                        return
        bar.close()
        self.save(final=True)

    def _stop_requested(self, local: bool) -> bool:
        """A signal on any rank stops every rank after the same step."""
        if not self.world.distributed:
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=self.device)
        return bool(distributed.all_reduce_sum(flag).item() > 0)

    def _stop(self, signal_name: str | None) -> None:
        path = self.save(final=False)
        if self.world.is_rank_zero:
            print(
                f"kd: received {signal_name}; stopped after step {self.global_step}",
                file=sys.stderr,
            )
            print(resume_hint(["kd", *sys.argv[1:]], path), file=sys.stderr)

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
