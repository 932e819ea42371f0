"""The training step on fake tensors: what both memory traces run.

:mod:`kd.memory.trace` (one device, MemTracker) and :mod:`kd.memory.trace_fsdp` (rank 0 of N
FSDP2 ranks, FSDPMemTracker) build a run's models on fake CPU tensors, prepare them as the
recipe does (:mod:`kd.runtime.prepare`), and run one micro-step plus the optimizer step inside a
tracker; this module builds what both run: the fake models, optimizer and batch of a RunConfig
(:func:`build_fake_step`), and the context managers that make torchtune, transformers and torchao
run on fake tensors (:func:`fake_friendly`, :func:`fake_friendly_kv_cache`).
:mod:`kd.memory.trace_phases` runs the step phase by phase inside the tracker.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from kd.config import teacher_kinds as kinds
from kd.config.run import RunConfig
from kd.config.teacher_kinds import StandIn
from kd.errors import KDUserError
from kd.memory.knobs import TrainKnobs

if TYPE_CHECKING:
    from kd.runtime.prepare import ShardSpec


@contextlib.contextmanager
def fake_friendly_rope() -> Iterator[None]:
    """Skip Llama 3.1's RoPE frequency scaling while building on fake tensors.

    ``Llama3ScaledRoPE.apply_scaling`` branches on tensor values (a data-dependent Python ``if``),
    which FakeTensorMode cannot evaluate; the values do not matter for memory, only the shape,
    which the unscaled frequencies share.
    """
    from kd import _torchtune as tt

    original = tt.Llama3ScaledRoPE.apply_scaling
    tt.Llama3ScaledRoPE.apply_scaling = lambda self, freqs, *args, **kwargs: freqs  # type: ignore[method-assign]
    try:
        yield
    finally:
        tt.Llama3ScaledRoPE.apply_scaling = original  # type: ignore[method-assign]


@contextlib.contextmanager
def fake_friendly_transformers(enabled: bool) -> Iterator[None]:
    """Let transformers build the causal-mask inputs on fake tensors as it does on real ones.

    On real tensors kd's hidden forward passes no position ids, transformers finds no packed
    sequences and lets SDPA apply causality itself (``is_causal``, grouped-query attention without
    copies of k and v). Its packed-sequence test reads tensor values, which FakeTensorMode cannot,
    so under fake tensors it keeps a packed-sequence mask: an explicit ``[b, 1, s, s]`` mask per
    layer and repeated k/v heads that the real step never allocates. Positions are ``0..s-1`` in
    every row, so the test's real answer (no packing) is returned instead.

    peft moves each new LoRA adapter (and its wrapped layer) to the base layer's device and dtype
    with ``module.to``, which fails on fake parameters (they cannot be swapped). The adapters are
    built in the base layer's dtype on its device already, so a ``module.to`` that would change
    nothing returns the module unchanged.

    Args:
        enabled: a model of the trace comes from transformers (else nothing is imported or patched).
    """
    if not enabled:
        yield
        return
    from transformers import masking_utils

    packed = masking_utils.find_packed_sequence_indices
    to = nn.Module.to

    def to_if_needed(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if memory_format is None and all(
            (device is None or t.device == device)
            and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
            for t in tensors
        ):
            return self
        return to(self, *args, **kwargs)

    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    nn.Module.to = to_if_needed  # type: ignore[method-assign]
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = packed
        nn.Module.to = to  # type: ignore[method-assign]


def uses_transformers(*nodes: Any) -> bool:
    """Whether any of the model nodes builds a transformers model (``kd.hf.*``)."""
    return any(
        node is not None and str(node.get("_component_", "")).startswith("kd.hf.") for node in nodes
    )


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence warnings and torchao's log while tracing (fake tensors trigger many)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def check_traceable_optimizer(optimizer: Any) -> None:
    """Refuse torchao's low-bit optimizers before building anything.

    They cannot run on fake tensors: their state subclasses read tensor values and crash the
    process under FakeTensorMode.

    Args:
        optimizer: the optimizer ``_component_`` node, or None.

    Raises:
        KDUserError: a ``torchao.*`` optimizer.
    """
    comp = str(optimizer.get("_component_", "")) if optimizer is not None else ""
    if comp.startswith("torchao."):
        raise KDUserError(
            f"--trace: optimizer {comp} cannot run on fake tensors; the plan estimates its states "
            "analytically; trace with optimizer._component_=torch.optim.AdamW to check the rest"
        )


def build_optimizer(
    node: Any, params: list[nn.Parameter], *, foreach: bool = True
) -> torch.optim.Optimizer:
    """The config's optimizer for a trace; torch optimizers get ``foreach`` unless ``fused``.

    One device traces foreach (torch's CUDA default; CPU would pick the for-loop). The FSDP2 trace
    passes ``foreach=False``: FSDPMemTracker misattributes foreach temporaries on DTensors.

    Args:
        node: the optimizer ``_component_`` node; None means AdamW.
        params: the trainable parameters.
        foreach: the ``foreach`` a torch optimizer gets unless its node sets ``fused``.
    """
    from kd.config import instantiate

    if node is None:
        return torch.optim.AdamW(params, foreach=foreach)
    data = (
        OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    )
    assert isinstance(data, dict)
    extra: dict[str, Any] = {}
    if str(data.get("_component_", "")).startswith("torch.optim.") and not data.get("fused"):
        if not foreach or data.get("foreach") is None:
            data.pop("foreach", None)
            extra["foreach"] = foreach
    return instantiate(OmegaConf.create(data), params, key="optimizer", **extra)


def prime_steady_state(
    opt: torch.optim.Optimizer | None,
    trainable: list[nn.Parameter],
    *,
    grads_resident: bool,
) -> None:
    """Create the optimizer states (they exist from the first step on) and, when later micro-batches
    find earlier gradients resident (accumulation, CPU-offloaded states), those gradients."""
    if opt is not None:
        for p in trainable:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if grads_resident:
        for p in trainable:
            p.grad = torch.zeros_like(p)


@dataclass
class FakeStep:
    """Everything one traced training step runs on (fake tensors).

    Attributes:
        student: the prepared student (:func:`kd.runtime.prepare.prepare_student`).
        teacher: the prepared teacher, or None.
        trainable: the student's parameters that require grad.
        optimizer: over ``trainable``, states primed; None when the optimizer is not traced.
        tokens: ``[b, s]`` input ids.
        labels: ``[b, s]`` targets, every position labelled (the worst case).
        num_tokens_total: labelled tokens of the whole optimizer step (all micro-batches, all
            ranks).
        teacher_topk: stored or served teacher logits ``(ids [b, s, k] int64, logprobs
            [b, s, k] float16)`` as the run's teacher puts them on the device; None with an
            online teacher or none.
        signal_teacher: what the step asks for the teacher's signal when it is not ``teacher``
            itself (``hidden_states:``: the :class:`kd.teachers.hidden_states.HiddenStateTeacher` over it,
            bound to the student; its projections are in ``trainable``; with ``teacher_topk`` a
            :class:`kd.teachers.FixedTopKTeacher` over them); None: ``teacher``.
        knobs: the planner's knobs of the run (:func:`kd.memory.plan.inputs_from_run`): the
            micro-batch, the validation batch and the on-policy sampling the trace runs.
    """

    student: nn.Module
    teacher: nn.Module | None
    trainable: list[nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    tokens: torch.Tensor
    labels: torch.Tensor
    num_tokens_total: torch.Tensor
    knobs: TrainKnobs
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None
    signal_teacher: Any = None

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The micro-batch's input tensors: tokens, labels and the stored top-k when present."""
        return (self.tokens, self.labels, *(self.teacher_topk or ()))


def teacher_node(run: RunConfig) -> Any:
    """The teacher's ``_component_`` node, or None: with stored teacher logits a
    ``teacher_model`` node only names their teacher, and none is built; nor is one the run asks
    nothing of (:func:`kd.config.teacher_kinds.in_use`: ``kd_ratio: 0`` without ``seq_kd``)."""
    asked = run.has_teacher and kinds.in_use(run) is not None
    return run.components["teacher_model"] if asked else None


@contextlib.contextmanager
def fake_friendly(run: RunConfig) -> Iterator[None]:
    """Quiet warnings, and let torchtune's RoPE and (for ``kd.hf`` models) transformers run on
    fake tensors, for tracing ``run``; enter ``FakeTensorMode`` inside it."""
    hf = uses_transformers(run.components["model"], teacher_node(run))
    with quiet(), fake_friendly_rope(), fake_friendly_transformers(hf):
        yield


HOST = torch.device("meta")
"""Where the trace keeps what the run keeps in host memory (offloaded activations, a parked
teacher's weights): a device of its own, so the tracker counts it apart from the device's."""


def _offload_as_run(
    run: RunConfig, student: nn.Module, teacher: nn.Module | None, shard: ShardSpec | None
) -> None:
    """The run's host offloading on the trace's models, with the host copies on :data:`HOST`:
    ``enable_activation_offloading`` (the student's saved activations), ``teacher_offload``
    (the teacher's weights but its output projection; one device only, as the recipe)."""
    if run.activation_offloading:
        from kd.runtime.offload import enable_activation_offloading

        enable_activation_offloading(student, "cpu", host=HOST)
    if teacher is not None and run.teacher_offload != "none" and shard is None:
        from kd.teachers.parking import ParkedWeights

        ParkedWeights(teacher, torch.device("cpu"), mode=run.teacher_offload, host=HOST)


def build_fake_step(
    run: RunConfig,
    *,
    shard: ShardSpec | None = None,
    num_ranks: int = 1,
    foreach: bool = True,
) -> FakeStep:
    """Build, prepare and (when ``shard``) shard ``run``'s models, its optimizer and one
    micro-batch.

    Call it inside ``FakeTensorMode`` (and, when sharding, a fake process group): the models are
    built at full size in the run's dtype without storage, prepared exactly as the recipe
    prepares them (LoRA trainable set, activation checkpointing, hidden-state output, frozen
    teacher), and the optimizer is primed to its steady state (:func:`prime_steady_state`). The
    micro-batch is the plan's: ``batch_size`` rows (per rank) of the planned sequence length,
    every position labelled (the worst case); with gradient accumulation the gradients of the
    earlier micro-batches are pre-created; with ``optimizer_in_cpu`` no optimizer is built and
    the gradients stay resident. The run's teacher kind sets its stand-in
    (:attr:`kd.config.teacher_kinds.TeacherKind.stand_in`): with a store or a served teacher no
    teacher is built, the step gets a fake ``[b, s, k]`` int64 ids and float16 log-probs batch
    (``teacher_topk``) answered as the run's teacher does (``signal_teacher``).

    Args:
        run: the run configuration.
        shard: FSDP2 settings (over the fake process group's mesh); None for one device.
        num_ranks: ranks whose tokens the loss normalises by.
        foreach: see :func:`build_optimizer`.
    """
    from kd import models
    from kd.config import instantiate
    from kd.memory.plan import inputs_from_run
    from kd.runtime.prepare import prepare_student, prepare_teacher

    planned = inputs_from_run(run)
    knobs = planned.knobs
    b, s = knobs.batch_size, knobs.seq_len
    teacher_model = teacher_node(run)
    torch.manual_seed(0)
    with models.default_dtype(models.DTYPES[run.dtype]):
        student = instantiate(run.components["model"], key="model")
        teacher = (
            instantiate(teacher_model, key="teacher_model") if teacher_model is not None else None
        )
    student = prepare_student(
        student,
        lora=models.is_lora(student),
        activation_checkpointing=run.activation_checkpointing,
        shard=shard,
    )
    if teacher is not None:
        teacher = prepare_teacher(teacher, shard=shard)
    # The run's teacher kind sets its stand-in (kd.memory.stand_ins); trained parameters it adds
    # (hidden-state projections) join the student's before the optimizer is built.
    trainable = [p for p in student.parameters() if p.requires_grad]
    stand_in = StandIn(run, planned, student, teacher, shard, trainable)
    kind = kinds.in_use(run)
    if kind is not None and kind.stand_in is not None:
        kinds.resolve(kind.stand_in)(stand_in)
    _offload_as_run(run, student, teacher, shard)  # after the stand-in: the teacher as it runs
    in_cpu = run.optimizer.in_cpu
    opt = None if in_cpu else build_optimizer(run.optimizer.node, trainable, foreach=foreach)
    prime_steady_state(opt, trainable, grads_resident=knobs.grad_accum > 1 or in_cpu)
    vocab = models.vocab_size(student)
    return FakeStep(
        student=student,
        teacher=teacher,
        trainable=trainable,
        optimizer=opt,
        tokens=torch.randint(0, vocab, (b, s)),  # [b, s]
        labels=torch.randint(0, vocab, (b, s)),  # [b, s]
        num_tokens_total=torch.tensor(b * s * knobs.grad_accum * num_ranks),
        knobs=knobs,
        teacher_topk=stand_in.topk,
        signal_teacher=stand_in.signal_teacher,
    )


@contextlib.contextmanager
def fake_friendly_kv_cache() -> Iterator[None]:
    """Let torchtune's KV cache take new keys and values on fake tensors.

    ``KVCache.update`` asserts that the new positions fit the cache by reading the position
    buffer's value, which FakeTensorMode cannot; the sizes are checked when the cache is set up
    (``rollout`` sizes it for prompt + completion). The update is otherwise the same: the keys and
    values are written in place at the cache's positions, which then advance.
    """
    from torchtune.modules.kv_cache import KVCache

    original = KVCache.update

    def update(
        self: KVCache, k_val: torch.Tensor, v_val: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len = k_val.shape[2]
        self.k_cache[:, :, self.cache_pos[:seq_len]] = k_val
        self.v_cache[:, :, self.cache_pos[:seq_len]] = v_val
        self.cache_pos.add_(seq_len)
        return self.k_cache, self.v_cache

    KVCache.update = update  # type: ignore[method-assign]
    try:
        yield
    finally:
        KVCache.update = original  # type: ignore[method-assign]
