"""Teachers: one interface (:class:`Teacher`), one implementation per kind of teacher.

* :class:`ModelTeacher`: a local model of either backend (:mod:`kd.teachers.model`).
* :class:`StoreTeacher`: top-k log-probs from kd's store or another tool's file
  (:mod:`kd.teachers.files`).
* :class:`kd.teachers.served.ServedTeacher`: top-k log-probs from a vLLM or SGLang server
  (:mod:`kd.teachers.served`, imported on its own: it needs an HTTP client).

Every kind of teacher is declared once in :mod:`kd.config.teacher_kinds` (``docs/teachers.md``:
its section, checks, planner inputs, tracer stand-in and source). The recipe gets its teacher from
:func:`kd.teachers.build.teacher_source` (the kind the registry selects) and never asks which kind
it holds.
"""

from kd.teachers.base import Teacher, TeacherInput, TeacherSignal, TeacherStopped
from kd.teachers.files import FixedTopKTeacher, StoreFile, StoreTeacher
from kd.teachers.model import ModelTeacher, as_teacher
from kd.teachers.signals import LogitsSignal, TopKSignal

__all__ = [
    "FixedTopKTeacher",
    "LogitsSignal",
    "ModelTeacher",
    "StoreTeacher",
    "Teacher",
    "TeacherInput",
    "StoreFile",
    "TeacherSignal",
    "TeacherStopped",
    "TopKSignal",
    "as_teacher",
]
