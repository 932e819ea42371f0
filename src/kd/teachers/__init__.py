"""Teachers: one interface (:class:`Teacher`), one implementation per kind of teacher.

Every kind is declared once in :mod:`kd.teachers.kinds` (its config section, checks, planner
inputs, tracer stand-in and source); ``docs/teachers.md`` lists them. The interface and the
implementations the tracers and tests name are exported here:

* :class:`ModelTeacher`: a local model of either backend (:mod:`kd.teachers.model`).
* :class:`FileTeacher`: top-k log-probs from kd's store or another tool's file
  (:mod:`kd.teachers.files`); :class:`FixedTopKTeacher`: the memory tracer's stand-in.
* :class:`LogitsSignal`, :class:`TopKSignal`: what they answer (:mod:`kd.teachers.signals`).

The recipe gets its teacher from :func:`kd.teachers.build.teacher_source` (the one place the
config's teacher is chosen, through the registry) and never asks which kind it holds.

The names are imported on first use, so :mod:`kd.teachers.kinds` (no torch) can be imported by
``kd validate`` and ``kd plan`` without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kd.teachers.base import Teacher, TeacherInput, TeacherSignal, TeacherStopped
    from kd.teachers.files import FileTeacher, FixedTopKTeacher, TeacherLogitsFile
    from kd.teachers.model import ModelTeacher, as_teacher
    from kd.teachers.signals import LogitsSignal, TopKSignal

_WHERE = {
    "Teacher": "kd.teachers.base",
    "TeacherInput": "kd.teachers.base",
    "TeacherSignal": "kd.teachers.base",
    "TeacherStopped": "kd.teachers.base",
    "FileTeacher": "kd.teachers.files",
    "FixedTopKTeacher": "kd.teachers.files",
    "TeacherLogitsFile": "kd.teachers.files",
    "ModelTeacher": "kd.teachers.model",
    "as_teacher": "kd.teachers.model",
    "LogitsSignal": "kd.teachers.signals",
    "TopKSignal": "kd.teachers.signals",
}

__all__ = [
    "FileTeacher",
    "FixedTopKTeacher",
    "LogitsSignal",
    "ModelTeacher",
    "Teacher",
    "TeacherInput",
    "TeacherLogitsFile",
    "TeacherSignal",
    "TeacherStopped",
    "TopKSignal",
    "as_teacher",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kd.teachers' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
