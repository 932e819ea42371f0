"""Hidden-state distillation: the student's mapped layer outputs are matched to the teacher's.

``hidden_states:`` (:class:`kd.config.teacher_kinds.hidden_states.HiddenStateSettings`) turns a local teacher model into a
:class:`HiddenStateTeacher`: it wraps the :class:`kd.teachers.ModelTeacher` and adds, to the
logits loss, ``weight * hidden_loss``, the mean over the mapped pairs of

* ``mse``: the squared error per dimension, ``mean_d (P s - t)^2`` (DistillKit's ``hs_mse``);
* ``nmse``: the squared error over the teacher's squared norm, ``|P s - t|^2 / |t|^2``;
* ``cosine``: ``1 - cos(P s, t)`` (DistillKit's ``hs_cosine``, ModelOpt's default);

each averaged over the labelled positions, where ``P`` is a learned linear projection from the
student's width to the teacher's (none when they are equal). Points are captured by forward hooks
on the mapped modules only: the token embedding (``embed``), a decoder layer's output (its index)
and the final norm's output (``norm``). The student's captured outputs are tensors its backward
keeps anyway; of the teacher (which runs without autograd) only the mapped outputs stay alive, until
the loss. The projections are the extra trainable module :meth:`HiddenStateTeacher.bind_student`
returns: the recipe trains them with the student, saves them in step checkpoints and restores them
on resume, and never exports them into ``final/``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kd import folders, models
from kd.config.run import LossSettings
from kd.config.teacher_kinds.hidden_states import HiddenStateSettings
from kd.errors import KDUserError
from kd.teachers.base import Teacher, TeacherInput
from kd.teachers.model import ModelTeacher
from kd.teachers.signals import LogitsSignal

# The name its loss term is logged under (``hidden_loss``, ``val_hidden_loss``).
HIDDEN_TERM = "hidden_loss"

__all__ = [
    "HIDDEN_LOSSES",
    "HIDDEN_TERM",
    "HiddenStateSignal",
    "HiddenStateTeacher",
    "Point",
    "check_layer_map",
    "hidden_state_loss",
    "parse_layer_map",
    "point_module",
]

# A point of a decoder whose output is matched: a decoder layer's index, "embed" or "norm".
Point = int | str
HIDDEN_LOSSES: tuple[str, ...] = ("mse", "nmse", "cosine")
_KEY = "hidden_states.layer_map"


def _parse_point(text: str, *, layers: int, side: str, entry: str) -> Point:
    text = text.strip()
    if text in ("embed", "norm"):
        return text
    if text.lstrip("-").isdigit() and 0 <= int(text) < layers:
        return int(text)
    raise KDUserError(
        f"{_KEY}: {entry!r} names {side} point {text!r}, which is not embed, norm or a layer "
        f"index 0..{layers - 1} of the {side} ({layers} layers); fix the entry or rerun kd init"
    )


def parse_layer_map(
    entries: Sequence[str], *, student_layers: int, teacher_layers: int
) -> list[tuple[Point, Point]]:
    """The ``(student point, teacher point)`` pairs of ``hidden_states.layer_map``.

    Raises:
        KDUserError: an entry is not ``'student:teacher'`` of known points, a student point is
            mapped twice, or the map is empty.
    """
    pairs: list[tuple[Point, Point]] = []
    for entry in entries:
        parts = str(entry).split(":")
        if len(parts) != 2:
            raise KDUserError(
                f"{_KEY}: {entry!r} is not a 'student:teacher' pair; write entries such as "
                "'embed:embed', '0:0', '19:29', 'norm:norm'"
            )
        s = _parse_point(parts[0], layers=student_layers, side="student", entry=str(entry))
        t = _parse_point(parts[1], layers=teacher_layers, side="teacher", entry=str(entry))
        if any(s == done for done, _ in pairs):
            raise KDUserError(f"{_KEY}: the student point {s!r} is mapped twice; keep one entry")
        pairs.append((s, t))
    if not pairs:
        raise KDUserError(
            f"{_KEY}: the map is empty; list 'student:teacher' pairs or rerun kd init"
        )
    return pairs


def _final_norm(model: nn.Module) -> nn.Module:
    norm = getattr(model, "norm", None)  # torchtune's TransformerDecoder
    if isinstance(norm, nn.Module):
        return norm
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    if isinstance(norm, nn.Module):
        return norm
    raise KDUserError(
        f"hidden_states.layer_map: cannot find the final norm of {type(model).__name__}; map "
        "decoder layers and embed only"
    )


def point_module(model: nn.Module, point: Point) -> nn.Module:
    """The module whose output is ``point`` of ``model`` (either backend)."""
    if point == "embed":
        return models.input_embeddings(model)
    if point == "norm":
        return _final_norm(model)
    return models.decoder_layers(model)[int(point)]


def _width(model: nn.Module) -> int:
    return int(models.input_embeddings(model).weight.shape[-1])


def _capture(store: dict[Point, torch.Tensor], point: Point, *, detach: bool) -> Any:
    """A forward hook that keeps ``point``'s output in ``store`` (the last call wins)."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        store[point] = out.detach() if detach else out

    return hook


def _pair_name(pair: tuple[Point, Point]) -> str:
    return f"{pair[0]}_to_{pair[1]}"


def hidden_state_loss(
    student_states: Sequence[torch.Tensor],
    teacher_states: Sequence[torch.Tensor],
    mask: torch.Tensor,
    *,
    kind: str,
    projections: Sequence[nn.Module | None] = (),
) -> torch.Tensor:
    """Mean over pairs of the per-position loss ``kind`` averaged over the positions of ``mask``.

    Args:
        student_states: ``[b, s, d_s]`` per pair (with autograd).
        teacher_states: ``[b, s, d_t]`` per pair.
        mask: ``[b, s]`` bool, the positions that count (labelled ones).
        kind: ``mse``, ``nmse`` or ``cosine``.
        projections: per pair, the projection from ``d_s`` to ``d_t`` or None (empty: none).

    Returns:
        A 0-d fp32 tensor (fp64 when the states are fp64).
    """
    weight = mask.to(torch.float32)
    count = weight.sum().clamp(min=1.0)
    total = None
    for i, (s, t) in enumerate(zip(student_states, teacher_states, strict=True)):
        proj = projections[i] if projections else None
        dtype = torch.promote_types(s.dtype, torch.float32)
        if proj is not None:
            s = proj(s.to(proj.weight.dtype))
        s, t = s.to(dtype), t.to(device=s.device, dtype=dtype)
        if kind == "mse":
            per = (s - t).pow(2).mean(-1)
        elif kind == "nmse":
            per = (s - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp(min=1e-12)
        elif kind == "cosine":
            per = 1.0 - F.cosine_similarity(s, t, dim=-1, eps=1e-8)
        else:
            raise ValueError(f"hidden state loss {kind!r} is not one of {HIDDEN_LOSSES}")
        layer = (per * weight.to(per.device, per.dtype)).sum() / count.to(per.device, per.dtype)
        total = layer if total is None else total + layer
    assert total is not None, "at least one pair"
    return total / len(student_states)


@dataclass
class HiddenStateSignal:
    """A :class:`LogitsSignal` plus the mapped hidden states of both models.

    Attributes:
        base: the teacher's logits signal (the CE and KD terms).
        student_states: the student's outputs at the mapped points, in map order.
        teacher_states: the teacher's, in map order.
        projections: per pair, the student-to-teacher projection or None.
        settings: the ``hidden_states:`` settings (loss kind and weight).
    """

    base: LogitsSignal
    student_states: list[torch.Tensor]
    teacher_states: list[torch.Tensor]
    projections: list[nn.Module | None]
    settings: HiddenStateSettings
    terms: dict[str, torch.Tensor] = field(default_factory=dict)

    def loss(
        self,
        student: nn.Module,
        student_hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        settings: LossSettings,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss + weight * hidden_loss, ce, kd)``; :attr:`terms` then holds
        ``{"hidden_loss": hidden_loss}`` (detached) beside the base signal's own terms."""
        loss, ce, kd = self.base.loss(student, student_hidden, labels, settings=settings)
        hidden = hidden_state_loss(
            self.student_states,
            self.teacher_states,
            labels != settings.ignore_index,
            kind=self.settings.loss,
            projections=self.projections,
        )
        total = loss + self.settings.weight * hidden.to(loss.dtype)
        self.student_states, self.teacher_states = [], []  # free them before the backward
        self.terms = {**getattr(self.base, "terms", {}), HIDDEN_TERM: hidden.detach()}
        return total, ce, kd

    def term_sums(
        self, labels: torch.Tensor, ignore_index: int
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The hidden loss times the labelled positions, and their number (evaluation sums both
        over batches and divides once; :func:`kd.training.evaluate.token_sums`)."""
        mask = labels != ignore_index
        with torch.no_grad():
            hidden = hidden_state_loss(
                self.student_states,
                self.teacher_states,
                mask,
                kind=self.settings.loss,
                projections=self.projections,
            )
        self.student_states, self.teacher_states = [], []
        return {HIDDEN_TERM: (hidden.double() * mask.sum(), mask.sum())}

    def labelled_hidden(self, index: torch.Tensor | None) -> torch.Tensor:
        return self.base.labelled_hidden(index)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.base.logits(hidden)


class HiddenStateTeacher(Teacher):
    """A local teacher model whose signal also carries its hidden states at the mapped points.

    Args:
        inner: the loaded teacher model.
        settings: ``hidden_states:``.
    """

    own_loss = True  # weight * hidden_loss trains whatever kd_ratio

    def __init__(self, inner: ModelTeacher, settings: HiddenStateSettings):
        self.inner = inner
        self.settings = settings
        self.generator = inner.generator
        self.terms = (*inner.terms, HIDDEN_TERM)
        self.pairs: list[tuple[Point, Point]] = []
        self.projections: nn.ModuleDict | None = None
        self._teacher: dict[Point, torch.Tensor] = {}
        self._student: dict[Point, torch.Tensor] = {}
        self._handles: list[Any] = []

    def bind_student(self, student: nn.Module) -> nn.Module:
        """Hook the student's and the teacher's mapped points; make a projection per pair whose
        widths differ. Returns the projections (the extra trainable module)."""
        teacher = self.inner.model
        self.pairs = parse_layer_map(
            self.settings.layer_map,
            student_layers=len(models.decoder_layers(student)),
            teacher_layers=len(models.decoder_layers(teacher)),
        )
        d_s, d_t = _width(student), _width(teacher)
        device = models.input_embeddings(student).weight.device
        projections = nn.ModuleDict()
        if d_s != d_t:
            # nn.Linear's initialisation from a generator of its own: the same projections
            # whatever the backend or the loading consumed of the global RNG.
            generator = torch.Generator().manual_seed(0)
            for pair in self.pairs:
                # Made where it trains (no .to(): a traced step keeps weak references to it).
                proj = nn.Linear(d_s, d_t, bias=False, dtype=torch.float32, device=device)
                with torch.no_grad():
                    init = torch.empty(d_t, d_s, dtype=torch.float32)
                    nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
                    proj.weight.copy_(init)
                projections[_pair_name(pair)] = proj
        for s, _ in self.pairs:
            hook = _capture(self._student, s, detach=False)
            self._handles.append(point_module(student, s).register_forward_hook(hook))
        for t in dict.fromkeys(t for _, t in self.pairs):
            hook = _capture(self._teacher, t, detach=True)
            self._handles.append(point_module(teacher, t).register_forward_hook(hook))
        self.projections = projections
        return projections

    def signal(self, batch: TeacherInput) -> HiddenStateSignal:
        if not self.pairs:
            raise RuntimeError("HiddenStateTeacher.bind_student must run before signal")
        self._teacher.clear()
        logits = self.inner.signal(batch)
        missing = [s for s, _ in self.pairs if s not in self._student]
        if missing:
            raise RuntimeError(f"the student's forward did not reach the mapped points {missing}")
        signal = HiddenStateSignal(
            base=logits,
            student_states=[self._student[s] for s, _ in self.pairs],
            teacher_states=[self._teacher[t] for _, t in self.pairs],
            projections=[
                self.projections[_pair_name(p)]
                if self.projections is not None and _pair_name(p) in self.projections
                else None
                for p in self.pairs
            ],
            settings=self.settings,
        )
        self._student.clear()
        self._teacher.clear()
        return signal

    def check_loaded(self) -> None:
        self.inner.check_loaded()

    def after_step(self, step: int) -> None:
        self.inner.after_step(step)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def generator_for(self, route: str | None) -> nn.Module | None:
        return self.inner.generator_for(route)

    def release(self) -> None:
        self.inner.release()


def _layer_count(folder: Path | None, *, key: str) -> int | None:
    """``num_hidden_layers`` of the folder's config.json (None when it has none)."""
    if folder is None or not folders.file_in(folder, folders.CONFIG_JSON, key=key):
        return None
    value = folders.read_config_json(folder, key=key).get("num_hidden_layers")
    return int(value) if isinstance(value, int) else None


def check_layer_map(settings: HiddenStateSettings, facts: Any) -> None:
    """``hidden_states.layer_map`` against both models' layer counts (their config.json), before
    any weight loads (:class:`kd.teachers.build.ModelTeacherSource`).

    Raises:
        KDUserError: an entry names no point of its model (:func:`parse_layer_map`).
    """
    student = _layer_count(facts.sources["model"].folder, key="model")
    teacher = _layer_count(facts.sources["teacher_model"].folder, key="teacher_model")
    if student is not None and teacher is not None:
        parse_layer_map(settings.layer_map, student_layers=student, teacher_layers=teacher)
