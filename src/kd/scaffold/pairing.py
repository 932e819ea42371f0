"""``kd init``'s teacher/student pairing: what the two models must share before one config
holds both.

:func:`reconcile_backends` keeps torchtune builders of different token-id families apart;
:func:`max_seq_len` bounds the length by both models; :func:`check_tokenizers` compares the two
tokenizers' whole vocabularies (:func:`kd.hf.tokenizer_compare.compare_tokenizers`) and has the
student's chat template render a probe conversation and the data's first chat rows
(:func:`render_rows`), as ``kd run`` will.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kd.errors import KDUserError
from kd.scaffold.data import DataFormat
from kd.scaffold.inspection import Backend, ModelChoice

if TYPE_CHECKING:
    from kd.hf.tokenizer_compare import TokenizerCheck

DEFAULT_MAX_SEQ_LEN = 2048


def reconcile_backends(
    teacher: ModelChoice, student: ModelChoice, *, backend: Backend
) -> ModelChoice:
    """The teacher to use beside ``student``: torchtune builders of packages with different token
    ids are refused by the config check, so under ``auto`` such a teacher uses transformers.

    Raises:
        KDUserError: ``--backend torchtune`` with such a pair.
    """
    from kd.families import family_of_builder

    if teacher.torchtune is None or student.torchtune is None:
        return teacher
    groups = [
        family_of_builder(c.torchtune.builder.rsplit(".", 1)[-1])  # type: ignore[union-attr]
        for c in (teacher, student)
    ]
    if groups[0] is None or groups[1] is None or groups[0].tokenizer == groups[1].tokenizer:
        return teacher
    if backend == "torchtune":
        raise KDUserError(
            f"--backend torchtune: the teacher is a torchtune {groups[0].name} model and the "
            f"student a {groups[1].name} one, which kd's config check refuses as different "
            "vocabularies; pass --backend auto to load the teacher with transformers"
        )
    return dataclasses.replace(
        teacher,
        torchtune=None,
        why_not_torchtune=f"torchtune's {groups[0].name} builder beside a {groups[1].name} student",
    )


def max_seq_len(flag: int | None, teacher: ModelChoice, student: ModelChoice) -> int:
    """``tokenizer.max_seq_len``: ``--max-seq-len``, else :data:`DEFAULT_MAX_SEQ_LEN`, at most
    both models' ``max_position_embeddings``.

    Raises:
        KDUserError: ``--max-seq-len`` below 1 or beyond a model's positions.
    """
    limits = [c.max_positions for c in (teacher, student) if c.max_positions is not None]
    limit = min(limits) if limits else None
    if flag is None:
        return min(DEFAULT_MAX_SEQ_LEN, limit) if limit is not None else DEFAULT_MAX_SEQ_LEN
    if flag < 1:
        raise KDUserError(f"--max-seq-len: {flag} is not a length; pass a number >= 1")
    if limit is not None and flag > limit:
        raise KDUserError(
            f"--max-seq-len: {flag} is beyond the models' max_position_embeddings ({limit}); pass "
            f"at most {limit}"
        )
    return flag


def check_tokenizers(
    teacher: ModelChoice, student: ModelChoice, data: DataFormat
) -> TokenizerCheck:
    """The two tokenizers are one (their whole vocabularies, special tokens and encodings), and the
    student's chat template renders (:func:`kd.hf.tokenizer_compare.compare_tokenizers`).

    Imports transformers (and torch); everything before it in ``kd init`` stays cheap.

    Args:
        teacher: the teacher.
        student: the student (its tokenizer and template tokenize the data).
        data: the data format; chat rows sampled by :func:`kd.scaffold.data.detect_data_format`
            are rendered by the student's template as ``kd run`` renders them.

    Raises:
        KDUserError: the first difference, or a template that cannot render (one line each).
    """
    from kd.hf.tokenizer_compare import compare_tokenizers

    check = compare_tokenizers(
        teacher.folder,
        student.folder,
        teacher_vocab=teacher.vocab_size,
        student_vocab=student.vocab_size,
    )
    if check.chat_template and data.conversations:
        render_rows(student, data)
    return check


def render_rows(student: ModelChoice, data: DataFormat) -> None:
    """Tokenize the sampled chat rows as ``kd run`` will: the student's ``kd.hf.tokenizer``
    renders each with its chat template and splits it per message.

    Raises:
        KDUserError: the template fails on a row (one line blaming the template) or cannot be
            split per message.
    """
    from kd import _torchtune as tt
    from kd.hf.tokenization import tokenizer

    tok = tokenizer(str(student.folder))
    for conversation in data.conversations:
        if not all(isinstance(content, str) for _, content in conversation):
            continue  # content parts (images...): kd.hf.tokenizer names them in kd run
        messages = [tt.Message(role=role, content=content) for role, content in conversation]
        tok.tokenize_messages(messages)
