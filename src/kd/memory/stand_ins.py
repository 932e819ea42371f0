"""The memory tracer's stand-ins of each teacher kind's signal (named by the kinds'
``stand_in`` references, :mod:`kd.config.teacher_kinds`; called by
:func:`kd.memory.fake_step.build_fake_step`).

Each function sets what the kind's run teaches the traced step with: int8 weights, hidden-state
hooks and projections (trained, so added to the step's trainable parameters), a fake top-k batch
as a store's reader or a server's client returns it, another tokenizer's loss.
"""

from __future__ import annotations

import torch

from kd import models
from kd.config.teacher_kinds import StandIn
from kd.memory import loss_head
from kd.memory.fake_cross import FakeCrossStore, FakeCrossTeacher
from kd.teachers import FixedTopKTeacher, ModelTeacher
from kd.teachers.hidden_states import HiddenStateTeacher
from kd.teachers.quantize import quantize_int8

__all__ = [
    "cross_tokenizer",
    "hidden_states",
    "model",
    "several",
    "served",
    "store",
    "topk",
]


def model(s: StandIn) -> None:
    """The teacher quantized as the run's (one device only: the source refuses int8 under
    FSDP2)."""
    if s.teacher is not None and s.run.teacher_quantization == "int8" and s.shard is None:
        quantize_int8(s.teacher)


def hidden_states(s: StandIn) -> None:
    """The teacher's hooks and the width projections (trained with the student)."""
    model(s)
    assert s.run.hidden_states is not None
    signal = HiddenStateTeacher(ModelTeacher(s.teacher), s.run.hidden_states)
    s.trainable += list(signal.bind_student(s.student).parameters())
    s.signal_teacher = signal


def topk(s: StandIn, *, k: int, tail: str) -> None:
    """A fake ``[b, s, k]`` int64 ids and float16 log-probs batch, as a store's reader and a
    server's client return it, answered with the section's tail treatment
    (:class:`kd.teachers.FixedTopKTeacher`), as the run's file or served teacher does."""
    knobs = s.planned.knobs
    shape = (knobs.batch_size, knobs.seq_len, k)
    s.topk = (
        torch.randint(0, models.vocab_size(s.student), shape),  # [b, s, k] int64 ids
        torch.zeros(shape, dtype=torch.float16),  # [b, s, k] log-probs
    )
    s.signal_teacher = FixedTopKTeacher(*s.topk, tail=tail)


def store(s: StandIn) -> None:
    """kd's store or another tool's files (``teacher_logits``)."""
    settings = s.run.teacher_logits
    assert settings is not None
    topk(s, k=settings.k, tail=settings.tail)


def served(s: StandIn) -> None:
    """A served teacher's answers (``teacher_server``)."""
    settings = s.run.teacher_server
    assert settings is not None
    topk(s, k=settings.top_k, tail=settings.tail)


def _cross_model(s: StandIn) -> None:
    planned = s.planned
    sizes = (models.vocab_size(s.student), models.vocab_size(s.teacher))
    s.signal_teacher = FakeCrossTeacher(
        s.teacher,
        sizes=sizes,
        matched=loss_head.cross_matched(planned.student, planned.teacher, planned.knobs),
        matched_weight=s.run.cross_tokenizer.matched_weight,  # type: ignore[union-attr]
    )


def cross_tokenizer(s: StandIn) -> None:
    """A teacher model scoring its own tokens (:class:`FakeCrossTeacher`), or the dense rows of
    a store of one (:class:`FakeCrossStore`)."""
    run, planned = s.run, s.planned
    assert run.cross_tokenizer is not None
    if run.teacher_logits is None:
        model(s)
        _cross_model(s)
        return
    crossed = loss_head.cross_teacher(planned.student, None, planned.knobs)
    assert crossed is not None
    s.signal_teacher = FakeCrossStore(
        sizes=(models.vocab_size(s.student), crossed.vocab_size),
        matched=loss_head.cross_matched(planned.student, crossed, planned.knobs),
        matched_weight=run.cross_tokenizer.matched_weight,
    )


def several(s: StandIn) -> None:
    """The planned member stands in for all; one with another tokenizer as such."""
    if s.teacher is not None and s.planned.knobs.cross_tokenizer:
        _cross_model(s)
