"""The served kind: a vLLM or SGLang server answering the teacher's top-k log-probs over HTTP
(``teacher_server:``), optionally written through to kd's store (``teacher_server.store``).

Beside ``teacher_logits`` the server is the one that filled the store (``kd run
teacher_logits``) and the store kind teaches. Its source is
:class:`kd.teachers.build.ServedTeacherSource`; its teacher
:class:`kd.teachers.served.ServedTeacher`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kd.config.checks.features import check_teacher_server
from kd.config.teacher_kinds.base import TeacherKind, TeacherPlan, no_quantization
from kd.errors import redact

if TYPE_CHECKING:
    from kd.config.run import RunConfig
    from kd.config.teacher_settings import TeacherServerSettings

__all__ = ["KIND", "prefetch_bytes"]


def prefetch_bytes(settings: TeacherServerSettings, *, batch_size: int, seq_len: int) -> int:
    """Host memory of the answers asked ahead: ``prefetch + 1`` micro-batches of ``[b, s, k]``
    int64 ids and float32 log-probs (the parsed rows) plus the float16 signal."""
    per = batch_size * seq_len * settings.top_k * (8 + 4 + 8 + 2)
    return (settings.prefetch + 1) * per


def _selects(run: RunConfig) -> bool:
    return run.teacher_server is not None and run.teacher_logits is None


def _refuse(run: RunConfig) -> None:
    no_quantization(run, "this run's teacher is served (teacher_server)")


def _plan(p: TeacherPlan) -> None:
    """No teacher weights or forward; the table's line names the server and the host memory
    of its prefetch."""
    s, run = p.run.teacher_server, p.run
    assert s is not None
    p.stored_topk = s.top_k
    buffer = prefetch_bytes(s, batch_size=run.batch_size, seq_len=p.seq_len)
    p.line = (
        f"served top-{s.top_k} log-probs of {s.model} ({s.api} at {redact(s.url)}), no teacher weights "
        f"or forward; prefetch buffer {s.prefetch} micro-batches ahead, {buffer / 2**20:.1f} MiB "
        "of host memory"
    )


KIND = TeacherKind(
    name="served",
    section="teacher_server",
    selects=_selects,
    source="kd.teachers.build:ServedTeacherSource",
    refuse=_refuse,
    precedence=20,
    replaces_teacher_model=True,
    checks=(check_teacher_server,),
    member=True,
    plan=_plan,
    stand_in="kd.memory.stand_ins:served",
    doc="docs/served_teacher.md",
    teacher="kd.teachers.served.ServedTeacher",
    modules=(
        "teachers/build.py",
        "teachers/served.py",
        "teachers/transport.py",
        "teachers/protocols.py",
        "teachers/store_folder.py",
        "config/checks/features.py",
        "recipes/teacher_logits.py",
    ),
)
