"""Trace the real training step under FakeTensorMode + MemTracker (``kd plan --trace``).

Builds the config's real-size student and teacher with the config's torchtune builders on *fake CPU*
tensors (no storage is allocated), applies what the recipe applies (LoRA trainable set, frozen
teacher, activation checkpointing, hidden-state output), then runs ``kd.train.micro_step`` (teacher
forward, student forward, loss, backward) and the optimizer step, while torch's ``MemTracker`` counts
every storage by category. Peaks are read per phase.

Workarounds (memory_anchors.md section 6), all needed on a CPU-only torch build:

* fake *CPU* tensors, never fake CUDA (the first autograd op on fake CUDA aborts the process);
* modules are built directly in the target dtype (``module.to(dtype)`` fails on fake params);
* MemTracker hooks only trainable parameters (it raises on frozen ones);
* the optimizer state is created once before tracking (steady state: states exist from step 1);
  with gradient accumulation the gradients of earlier micro-batches are pre-created too;
* phases are split by wrapping ``Tensor.backward`` and resetting the tracker's private peak.

The trace counts allocated bytes exactly (MemTracker rounds nothing on CPU); the plan's runtime
reserve is added on top when the two are shown side by side.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from kd.errors import KDUserError


@dataclass
class TraceResult:
    """Allocated bytes per phase of one traced training step.

    Attributes:
        phase_peaks: forward / backward / optimizer_step -> peak allocated bytes.
        subphases: finer peaks: student_forward, teacher_forward, loss_forward, backward,
            optimizer_step (forward = the max of the first three).
        currents: allocated bytes at the boundaries (after_student_forward, after_teacher_forward,
            before_backward, after_backward).
        categories: phase -> MemTracker category (Parameter, Gradient, Optstate, Activation,
            Temp, Buffer, Other) -> bytes at that phase's peak.
        wall_s: seconds the trace took.
    """

    phase_peaks: dict[str, int]
    subphases: dict[str, int] = field(default_factory=dict)
    currents: dict[str, int] = field(default_factory=dict)
    subphase_categories: dict[str, dict[str, int]] = field(default_factory=dict)
    categories: dict[str, dict[str, int]] = field(default_factory=dict)
    wall_s: float = 0.0


class _FrozenSafeMemTracker(MemTracker):
    """MemTracker that installs gradient hooks only on parameters that require grad, and keeps
    only the global peak.

    torch's tracker calls ``param.register_hook`` on every parameter of every module it sees run,
    which raises for the frozen teacher and LoRA base weights. It also updates per-module peaks
    after every op by walking every module seen so far, which makes a real-size trace (1000+
    modules) quadratic; the plan needs only the global peak.
    """

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        if not install_grad_hooks or all(p.requires_grad for p in module.parameters()):
            return super()._track_module_params_and_buffers(module, install_grad_hooks)
        totals = super()._track_module_params_and_buffers(module, False)
        trainable = [p for p in module.parameters() if p.requires_grad]
        if trainable:
            holder = nn.Module()
            holder.trainable = nn.ParameterList(trainable)
            super()._track_module_params_and_buffers(holder, True)
        return totals


def _snapshot(mt: MemTracker, kind: str) -> dict[str, int]:
    snap = mt.get_tracker_snapshot(kind)
    dev = next(iter(snap.values()), {})
    return {str(getattr(k, "value", k)): int(v) for k, v in dev.items()}


def _take_phase_peak(mt: MemTracker) -> dict[str, int]:
    """The tracker's peak since the last call, then restart the peak from the current usage."""
    peak = _snapshot(mt, "peak")
    current = mt.get_tracker_snapshot("current")
    mt._peak_mem_snap = current
    mt._peak_mem = {d: v["Total"] for d, v in current.items()}
    return peak


@contextlib.contextmanager
def _split_at_backward(on_backward_start: Any, on_backward_end: Any) -> Iterator[None]:
    """Call hooks right before and after ``Tensor.backward`` (micro_step's forward/backward split)."""
    original = torch.Tensor.backward

    def wrapped(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        on_backward_start()
        original(self, *args, **kwargs)
        on_backward_end()

    torch.Tensor.backward = wrapped  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.backward = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _fake_friendly_rope() -> Iterator[None]:
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
def _quiet() -> Iterator[None]:
    logging.getLogger("torchao").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _check_traceable_optimizer(optimizer: Any) -> None:
    """torchao's low-bit optimizers cannot run on fake tensors (their state subclasses read tensor
    values and crash the process under FakeTensorMode); refuse before building anything."""
    comp = str(optimizer.get("_component_", "")) if optimizer is not None else ""
    if comp.startswith("torchao."):
        raise KDUserError(
            f"--trace: optimizer {comp} cannot run on fake tensors; the plan estimates its states "
            "analytically; trace with optimizer._component_=torch.optim.AdamW to check the rest"
        )


def trace_config(cfg: DictConfig, *, world_size: int = 1) -> TraceResult:
    """Trace one training step of ``cfg`` (fake tensors, no real memory), per rank when sharded.

    Args:
        cfg: a resolved config (``kd.config.load_config``).
        world_size: ranks; above 1, rank 0 of an FSDP2 run is traced over a fake process group.

    Returns:
        Per-phase allocated peaks.

    Raises:
        KDUserError: CPU offload with world size > 1, or a component that cannot run on fake
            tensors.
    """
    from kd.memory.plan import inputs_from_config

    inputs = inputs_from_config(cfg)
    seq = inputs.knobs.seq_len
    if world_size > 1:
        # Rank 0 of world_size FSDP2 ranks over a fake process group (FSDPMemTracker).
        from kd.memory.trace_fsdp import trace_fsdp_step

        fsdp = cfg.get("fsdp") or {}
        if bool(fsdp.get("cpu_offload", False)) or bool(cfg.get("optimizer_in_cpu", False)):
            raise KDUserError(
                "--trace: CPU offload cannot be traced on fake tensors; drop --trace (the estimate "
                "covers it) or trace with fsdp.cpu_offload=false"
            )
        return trace_fsdp_step(
            model=cfg.model,
            teacher_model=cfg.get("teacher_model"),
            optimizer=cfg.get("optimizer"),
            world_size=world_size,
            batch_size=inputs.knobs.batch_size,
            seq_len=seq,
            grad_accum=inputs.knobs.grad_accum,
            dtype=str(cfg.get("dtype", "bf16")),
            activation_checkpointing=bool(cfg.get("enable_activation_checkpointing", False)),
            reshard_after_forward=bool(fsdp.get("reshard_after_forward", True)),
            reduce_dtype=str(fsdp.get("reduce_dtype", "fp32")),
            clip_grad_norm=cfg.get("clip_grad_norm"),
            loss=_loss_settings(cfg),
        )
    return trace_step(
        model=cfg.model,
        teacher_model=cfg.get("teacher_model"),
        optimizer=cfg.get("optimizer"),
        batch_size=inputs.knobs.batch_size,
        seq_len=seq,
        grad_accum=inputs.knobs.grad_accum,
        dtype=str(cfg.get("dtype", "bf16")),
        activation_checkpointing=bool(cfg.get("enable_activation_checkpointing", False)),
        optimizer_in_cpu=bool(cfg.get("optimizer_in_cpu", False)),
        clip_grad_norm=cfg.get("clip_grad_norm"),
        loss=_loss_settings(cfg),
    )


def _loss_settings(cfg: DictConfig) -> dict[str, Any]:
    """``kd.train.LossSettings`` fields from a resolved config."""
    return {
        "kd_ratio": float(cfg.get("kd_ratio", 0.5)),
        "temperature": float(cfg.get("temperature", 1.0)),
        "divergence": str(cfg.kd_loss.get("divergence", "forward_kl")),
        "beta": float(cfg.kd_loss.get("beta", 0.5)),
        "skew_alpha": float(cfg.kd_loss.get("skew_alpha", 0.1)),
        "chunk_size": int(cfg.get("loss_chunk_size", 1024)),
        "fused": bool(cfg.get("fused_loss", True)),
    }


def _build_optimizer(
    node: Any, params: list[nn.Parameter], *, foreach: bool = True
) -> torch.optim.Optimizer:
    """The config's optimizer for a trace; torch optimizers get ``foreach`` unless ``fused``.

    One device traces foreach (torch's CUDA default; CPU would pick the for-loop). The FSDP2 trace
    passes ``foreach=False``: FSDPMemTracker misattributes foreach temporaries on DTensors.
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
    return instantiate(OmegaConf.create(data), params, **extra)


def _prime_steady_state(
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


def trace_step(
    *,
    model: Any,
    teacher_model: Any,
    optimizer: Any,
    batch_size: int,
    seq_len: int,
    grad_accum: int = 1,
    dtype: str = "bf16",
    activation_checkpointing: bool = False,
    optimizer_in_cpu: bool = False,
    clip_grad_norm: float | None = None,
    loss: dict[str, Any] | None = None,
) -> TraceResult:
    """Trace one micro-batch + optimizer step with the given builder nodes.

    Args:
        model: student ``_component_`` node.
        teacher_model: teacher node or None.
        optimizer: optimizer node (None = AdamW foreach).
        batch_size: micro-batch b.
        seq_len: tokens per sequence s (every position labelled: the worst case).
        grad_accum: > 1 pre-creates the gradients of the earlier micro-batches.
        dtype: ``bf16`` or ``fp32``.
        activation_checkpointing: recompute decoder layers in backward.
        optimizer_in_cpu: states off the device (the step is not traced; states not counted).
        clip_grad_norm: traced like the recipe (norm, optional clip).
        loss: ``kd.train.LossSettings`` fields.

    Returns:
        Per-phase allocated peaks and categories.
    """
    from kd import models, train
    from kd.config import instantiate

    t0 = time.perf_counter()
    settings = train.LossSettings(**(loss or {}))
    tdtype = models.DTYPES[dtype]
    gc.collect()
    _check_traceable_optimizer(optimizer)
    with _quiet(), _fake_friendly_rope(), FakeTensorMode():
        torch.manual_seed(0)
        with models.default_dtype(tdtype):
            student = instantiate(model)
            teacher = instantiate(teacher_model) if teacher_model is not None else None
        if models.is_lora(student):
            models.setup_lora_trainable(student)
        if teacher is not None:
            models.freeze(teacher)
            models.set_hidden_output(teacher)
        if activation_checkpointing:
            models.enable_activation_checkpointing(student)
        models.set_hidden_output(student)
        trainable = [p for p in student.parameters() if p.requires_grad]
        opt = None if optimizer_in_cpu else _build_optimizer(optimizer, trainable)
        _prime_steady_state(opt, trainable, grads_resident=grad_accum > 1 or optimizer_in_cpu)
        vocab = models.vocab_size(student)
        tokens = torch.randint(0, vocab, (batch_size, seq_len))
        labels = torch.randint(0, vocab, (batch_size, seq_len))
        total = torch.tensor(batch_size * seq_len * grad_accum)

        mt = _FrozenSafeMemTracker()
        mt.track_external(student, tokens, labels, total)
        if teacher is not None:
            mt.track_external(teacher)
        if opt is not None:
            mt.track_external(opt)

        result = trace_step_phases(
            mt,
            student=student,
            teacher=teacher,
            tokens=tokens,
            labels=labels,
            settings=settings,
            num_tokens_total=total,
            trainable=trainable,
            optimizer=opt,
            clip_grad_norm=clip_grad_norm,
        )
    result.wall_s = time.perf_counter() - t0
    return result


def trace_step_phases(
    mt: Any,
    *,
    student: nn.Module,
    teacher: nn.Module | None,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    settings: Any,
    num_tokens_total: torch.Tensor,
    trainable: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    clip_grad_norm: float | None,
    grad_scale: float = 1.0,
) -> TraceResult:
    """Run one micro-step and the optimizer step inside tracker ``mt``; peaks per phase.

    Shared by the one-device trace (MemTracker) and the FSDP2 trace (FSDPMemTracker): forward
    (student, teacher, loss sub-phases), backward, optimizer step.
    """
    from kd import train

    phases: dict[str, dict[str, int]] = {}
    subphases: dict[str, dict[str, int]] = {}
    currents: dict[str, int] = {}

    def mark(name: str) -> None:
        subphases[name] = _take_phase_peak(mt)

    def now(name: str) -> None:
        currents[name] = _snapshot(mt, "current").get("Total", 0)

    def start_backward() -> None:
        now("before_backward")
        mark("loss_forward")
        phases["forward"] = max(
            (
                subphases[k]
                for k in ("student_forward", "teacher_forward", "loss_forward")
                if k in subphases
            ),
            key=lambda d: d.get("Total", 0),
        )

    def end_backward() -> None:
        now("after_backward")
        mark("backward")
        phases["backward"] = subphases["backward"]

    def after(name: str) -> Any:
        def hook(*_: Any) -> None:  # returns None: the module's output is kept
            mark(f"{name}_forward")
            now(f"after_{name}_forward")

        return hook

    hooks = [student.register_forward_hook(after("student"))]
    if teacher is not None:
        hooks.append(teacher.register_forward_hook(after("teacher")))
    try:
        with mt:
            _take_phase_peak(mt)
            with _split_at_backward(start_backward, end_backward):
                train.micro_step(
                    student,
                    teacher,
                    tokens,
                    labels,
                    settings=settings,
                    num_tokens_total=num_tokens_total,
                    grad_scale=grad_scale,
                )
            train.grad_norm(trainable, max_norm=clip_grad_norm)
            if optimizer is not None:
                optimizer.step()
            phases["optimizer_step"] = _take_phase_peak(mt)
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
    finally:
        for h in hooks:
            h.remove()
    return TraceResult(
        phase_peaks={p: v.get("Total", 0) for p, v in phases.items()},
        subphases={p: v.get("Total", 0) for p, v in subphases.items()},
        subphase_categories=subphases,
        currents=currents,
        categories=phases,
        wall_s=0.0,
    )
