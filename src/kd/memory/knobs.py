"""The knobs a memory estimate reads: batch, sequence, precision, optimizer, loss, sharding,
evaluation and on-policy sampling (:class:`TrainKnobs`), built from the RunConfig by
:func:`kd.memory.plan.inputs_from_run`. Pure data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class OptimizerSpec:
    """What the optimizer keeps per trainable parameter.

    Attributes:
        kind: ``adamw`` (torch Adam/AdamW: 2 states in the parameter dtype), ``adamw8bit``
            (torchao), ``sgd`` (momentum buffer or none), ``other`` (treated like adamw).
        fused: torch ``fused=True`` (one kernel, no per-step temporaries).
        foreach: torch ``foreach``; None = torch's default (foreach on CUDA).
        momentum: SGD momentum (0 = no state).
        in_cpu: states live on the CPU (torchao CPUOffloadOptimizer, ``optimizer_in_cpu``).
    """

    kind: str = "adamw"
    fused: bool = False
    foreach: bool | None = None
    momentum: float = 0.0
    in_cpu: bool = False


@dataclass(frozen=True)
class GenerationKnobs:
    """On-policy sampling at the start of each optimizer step (``on_policy:``,
    :func:`kd.rollouts.sampling.rollout`).

    The micro-batch's prompts sample together: ``TrainKnobs.batch_size`` rows, left-padded to
    ``seq_len - new_tokens`` tokens at most (``tokenizer.max_seq_len`` leaves room for the
    completion), so the KV cache spans ``TrainKnobs.seq_len`` positions.

    Attributes:
        new_tokens: tokens sampled per prompt at most (``on_policy.max_new_tokens``).
        models: the models that may sample: ``student`` (``lmbda`` > 0) and/or ``teacher``
            (``seq_kd``); the plan takes the larger.
        temperature: sampling temperature (0 = greedy: no sampler buffers beyond the logits).
        top_p: nucleus mass (< 1 sorts the logits).
        rows: prompts the student samples together (:func:`kd.rollouts.plan.rollout_rows`);
            None: ``TrainKnobs.batch_size``.
        student_copy: the sampler keeps a frozen copy of the student's weights on the device
            (``on_policy.async_steps: 1``, or ``on_policy.sampling_dtype`` other than the
            student's; :func:`kd.rollouts.plan.student_copy`).
        copy_dtype_bytes: bytes per value of that copy, of its KV cache and of its logits when
            they are not the student's (``on_policy.sampling_dtype``: 2 for bf16, 4 for fp32);
            None: the student's ``TrainKnobs.dtype_bytes``.
        cuda_graphs: the student's decode steps are replayed from CUDA graphs
            (``on_policy.cuda_graphs``): their memory pool holds a decode step's temporaries for
            the rest of the rollout.
    """

    new_tokens: int
    models: tuple[str, ...] = ("student",)
    temperature: float = 0.9
    top_p: float = 1.0
    rows: int | None = None
    student_copy: bool = False
    copy_dtype_bytes: int | None = None
    cuda_graphs: bool = False


@dataclass(frozen=True)
class EvalBatch:
    """The largest batches of one ``eval:`` task as lm-eval's HFLM runs them
    (:mod:`kd.harness.requests`).

    Attributes:
        task: the task's name.
        kind: ``loglikelihood`` (full logits of every position) or ``generate`` (a KV cache).
        rows: requests in the batch (``eval.batch_size``, or fewer when the task has fewer).
        tokens: the longest request's input tokens (a generation's context).
        next_tokens: the second batch's longest (loglikelihood: its logits are computed while the
            first batch's log-probs are still referenced); 0 when there is one batch.
        next_rows: the second batch's requests.
        new_tokens: tokens a generation samples at most (0 for loglikelihood).
        measured: the lengths come from the task's rows (False: lm-eval's task by name, planned
            at the run's sequence length).
    """

    task: str
    kind: str
    rows: int
    tokens: int
    next_tokens: int = 0
    next_rows: int = 0
    new_tokens: int = 0
    measured: bool = True


@dataclass(frozen=True)
class FinalEvalKnobs:
    """The end-of-training evaluation (``eval:``): ``final/`` scored by lm-eval on the training
    device once the run's models and optimizer are freed (:mod:`kd.memory.eval_phase`).

    Attributes:
        batches: each task's largest batches.
        batch_size: ``eval.batch_size``.
    """

    batches: tuple[EvalBatch, ...]
    batch_size: int


@dataclass(frozen=True)
class TrainKnobs:
    """The config knobs that change memory.

    Attributes:
        batch_size: micro-batch per device.
        seq_len: tokens per sequence (the plan's worst case, ``tokenizer.max_seq_len``).
        grad_accum: micro-batches per optimizer step (>1 keeps gradients resident in forward).
        dtype_bytes: parameter/activation dtype (2 for bf16, 4 for fp32).
        activation_checkpointing: recompute each decoder layer in backward.
        optimizer: optimizer state layout.
        fused_loss: kd's fused linear+loss (no full logits).
        loss_chunk_size: tokens per fused-loss chunk.
        divergence: KD divergence name.
        temperature: KD softmax temperature (T != 1 adds a tempered copy of the logits).
        world_size: FSDP2 ranks (1 = single device, no sharding).
        fsdp_cpu_offload: FSDP2 CPUOffloadPolicy (sharded params, grads, states on CPU).
        reshard_after_forward: FSDP2 frees unsharded layers after forward.
        reduce_dtype_bytes: FSDP2 gradient reduce-scatter dtype (4 = fp32).
        reserve_bytes: runtime reserve override (None = the named terms of
            :mod:`kd.memory.runtime` for :attr:`device_type`).
        device_type: ``cuda`` or ``cpu``: which runtime's terms the plan adds.
        select_labelled: the real fused path copies labelled rows of both hidden states; the
            fake-tensor trace keeps all rows instead (False reproduces the trace).
        teacher_bytes_per_param: a quantized teacher's bytes per parameter (the fit search's
            suggestions; no config key sets it); None: the dtype's.
        eval_batch: sequences per validation batch per device (``validation.batch_size``); None:
            no validation, so no evaluation phase.
        stored_topk: k of stored teacher logits (``teacher_logits.k``): the run trains from them,
            with no teacher model (``estimate``'s teacher is None); None: an online teacher or none.
        generation: on-policy sampling (``on_policy:``); None: no generation phase.
        self_teacher_copy: the teacher is a frozen copy of the student (``self_teacher:`` with
            a full fine-tune): a LoRA student would need no copy (its base is the teacher).
        other_teacher_params: parameters of the local teachers beside the planned one
            (``teachers:``: they stay resident; only one teacher runs forward at a time).
        hidden_map: ``hidden_states.layer_map`` (``()``: no hidden-state distillation).
        hidden_loss: ``hidden_states.loss`` (what its backward keeps).
        cross_tokenizer: the teacher has another tokenizer (``cross_tokenizer:`` with a teacher
            model): the loss is GOLD's aligned hybrid loss on the student's full logits
            (:func:`kd.memory.loss_head.cross_loss_bytes`), not the fused head.
        activation_offloading: the student's saved activations wait in host memory
            (``enable_activation_offloading``; :mod:`kd.memory.offload`).
        teacher_offload: ``none``, ``park`` or ``stream``: the teacher's weights but its output projection
            wait in host memory between its forwards (:mod:`kd.memory.offload`).
        teacher_own_device: the teacher runs on a device of its own (``teacher_device``): this
            device holds its output projection's copy and the hidden states it sends, not its
            weights or forward (:mod:`kd.memory.teacher_device` plans its device).
        teacher_parkable: the config takes ``teacher_offload: park | stream``
            (:func:`kd.config.teacher_kinds.model.offload_accepted`: not with ``compile``,
            ``teacher_device``, ...); ``kd plan --fit`` suggests parking only then.
        other_teacher_head_params: the output projections of :attr:`other_teacher_params` (what
            stays on the device of a parked member).
        cross_vocab: the distribution size of the teacher with another tokenizer when it is not
            the planned ``teacher``: a cross-tokenizer store's teacher (no teacher model), or a
            member of ``teachers:`` beside a larger one (the members' losses run one after
            another; the largest's forward is planned). None: the planned teacher's.
        final_eval: the end-of-training evaluation (``eval:``); None: no such phase.
        teacher_logits: the loss has a KD term (``kd_ratio`` above 0,
            :attr:`kd.config.run.LossSettings.needs_teacher_logits`). False: the training step
            and the evaluation run no teacher forward (unless :attr:`hidden_map` needs its
            states) and the loss head is the student's CE; a teacher that samples ``seq_kd``
            completions keeps its weights and its generation phase.
    """

    batch_size: int
    seq_len: int
    grad_accum: int = 1
    dtype_bytes: int = 2
    activation_checkpointing: bool = False
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    fused_loss: bool = True
    loss_chunk_size: int = 1024
    divergence: str = "forward_kl"
    temperature: float = 1.0
    world_size: int = 1
    fsdp_cpu_offload: bool = False
    reshard_after_forward: bool = True
    reduce_dtype_bytes: int = 4
    reserve_bytes: int | None = None
    device_type: str = "cuda"
    select_labelled: bool = True
    teacher_bytes_per_param: float | None = None
    eval_batch: int | None = None
    stored_topk: int | None = None
    generation: GenerationKnobs | None = None
    self_teacher_copy: bool = False
    other_teacher_params: int = 0
    hidden_map: tuple[str, ...] = ()
    hidden_loss: str = "cosine"
    cross_tokenizer: bool = False
    cross_vocab: int | None = None
    activation_offloading: bool = False
    teacher_offload: str = "none"
    teacher_parkable: bool = True
    other_teacher_head_params: int = 0
    teacher_own_device: bool = False
    final_eval: FinalEvalKnobs | None = None
    teacher_logits: bool = True

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def teacher_dtype_bytes(self) -> float:
        """Bytes per teacher parameter: :attr:`teacher_bytes_per_param` when set, else the dtype's."""
        if self.teacher_bytes_per_param is None:
            return self.dtype_bytes
        return self.teacher_bytes_per_param

    @property
    def num_ranks(self) -> int:
        """FSDP2 ranks, at least 1."""
        return max(1, self.world_size)

    def per_rank(self, nbytes: int) -> int:
        """The device share of bytes FSDP2 shards over the ranks: all of them on one device, none
        with ``fsdp.cpu_offload`` (the shards live on the CPU), else a ceiling division."""
        if self.num_ranks == 1:
            return nbytes
        return 0 if self.fsdp_cpu_offload else -(-nbytes // self.num_ranks)
