"""The self teacher's view of the training rows: each row rendered with its privileged context.

A self teacher (``self_teacher:``, :mod:`kd.teachers.self_teacher`) sees the row the student
sees plus a context the student never sees: ``self_teacher.context``, a template over the row's
fields (``"Reference solution: {reference}"``), put in a system message before the conversation
or before the text of the last user message (``self_teacher.place``). The row is rendered through
the dataset's own transforms (torchtune's ``instruct_dataset`` / ``chat_dataset`` message
transform, then the run's tokenizer with its chat template), so the teacher's tokens are exactly
what the model would see with that context, and its labelled tokens (the completion) are the
student's: :class:`PrivilegedRows` checks that for every row, which is what lets the signal take
the teacher's log-probs at its completion positions and put them on the student's.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kd import _torchtune as tt
from kd.config.run import IGNORE_INDEX
from kd.config.teacher_kinds.self_teacher import SelfTeacherSettings, template_fields
from kd.data import filled_fields
from kd.errors import KDUserError, one_line

log = logging.getLogger("kd")

__all__ = [
    "PrivilegedRows",
    "TeacherRow",
    "control_tokens",
    "labelled_positions",
    "with_context",
]


@dataclass(frozen=True)
class TeacherRow:
    """One row as the self teacher sees it.

    Attributes:
        tokens: the row with its context (prompt + context + completion), untruncated.
        labelled: the positions of ``tokens`` whose label is set (the completion's tokens, in
            order), as many as the student's row has.
        prompt_len: tokens before the row's last labelled span, the assistant header included:
            the teacher's prompt of an on-policy completion.
    """

    tokens: list[int]
    labelled: list[int]
    prompt_len: int


def labelled_positions(labels: Sequence[int], ignore_index: int = IGNORE_INDEX) -> list[int]:
    """The positions of ``labels`` (not shifted) that are set."""
    return [j for j, label in enumerate(labels) if int(label) != ignore_index]


def with_context(messages: list[Any], text: str, *, place: str) -> list[Any]:
    """``messages`` (torchtune ``Message``) with ``text`` added where ``place`` says.

    ``system``: a system message first, or, when the conversation starts with one, ``text``, a
    blank line and that message's text. ``user``: ``text`` before the text of the last user
    message. Empty ``text`` changes nothing.

    Raises:
        KDUserError: ``place`` is ``user`` and the conversation has no user message.
    """
    if not text:
        return list(messages)
    out = list(messages)
    if place == "system":
        if out and out[0].role == "system":
            first = out[0]
            out[0] = tt.Message(
                role="system",
                content=f"{text}\n\n{first.text_content}",
                masked=first.masked,
                eot=first.eot,
            )
        else:
            out.insert(0, tt.Message(role="system", content=text, masked=True, eot=True))
        return out
    users = [i for i, m in enumerate(out) if m.role == "user"]
    if not users:
        raise KDUserError(
            "self_teacher.place: user puts the context before the last user message, but a row "
            "has none; set self_teacher.place=system"
        )
    m = out[users[-1]]
    out[users[-1]] = tt.Message(
        role="user", content=f"{text}{m.text_content}", masked=m.masked, eot=m.eot
    )
    return out


def control_tokens(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's special tokens, id -> text (torchtune's tokenizers and kd's Hugging Face
    one both keep ``special_tokens``: text -> id): the ids that mark turns and the sequence's
    ends, which no row's text may turn into."""
    table = getattr(tokenizer, "special_tokens", None)
    if not isinstance(table, dict):
        return {}
    return {int(i): str(text) for text, i in table.items()}


def _sft_part(dataset: Any, index: int) -> tuple[Any, int]:
    """The torchtune SFT dataset holding row ``index`` of ``dataset`` (also inside a
    ``ConcatDataset``) and the row's index in it."""
    parts = getattr(dataset, "_indexes", None)
    if parts is not None:  # torchtune's ConcatDataset
        for start, stop, which in parts:
            if start <= index < stop:
                return _sft_part(dataset._datasets[which], index - start)
    if not all(hasattr(dataset, a) for a in ("_data", "_message_transform", "_model_transform")):
        raise KDUserError(
            f"self_teacher: dataset is a {type(dataset).__name__}, whose rows kd cannot render "
            "with a context (it needs each row's fields and messages); use torchtune's "
            "instruct_dataset or chat_dataset (packed: false)"
        )
    return dataset, index


class PrivilegedRows:
    """The training rows rendered with the self teacher's context, checked against the
    student's rows.

    Args:
        dataset: the training dataset (torchtune ``SFTDataset`` or a ``ConcatDataset`` of them).
        tokenizer: the run's tokenizer (rendering without truncation: the teacher's input is
            longer, and a row that does not fit is refused, not cut).
        settings: ``self_teacher:``.
        header: the assistant header tokens (:func:`kd.models.assistant_header`).
        key: the dataset's config key, named in errors.
    """

    def __init__(
        self,
        dataset: Any,
        tokenizer: Any,
        settings: SelfTeacherSettings,
        *,
        header: Sequence[int] = (),
        key: str = "dataset",
    ):
        self.dataset = dataset
        self.settings = settings
        self.fields = template_fields(settings.context)
        self.header = list(header)
        self.key = key
        untruncated = copy.copy(tokenizer)
        if getattr(tokenizer, "max_seq_len", None) is not None:
            # A limit no row reaches, not None: torchtune's tokenizers mask the final eos
            # whenever a limit is set (their truncate()), and the student's rows had one.
            untruncated.max_seq_len = 1 << 30
        self.transform = tt.SFTTransform(model_transform=untruncated)
        self.tokenizer = tokenizer
        self.control = control_tokens(tokenizer)
        self.rows: dict[int, TeacherRow] = {}

    def context(self, index: int, raw: Any) -> str:
        """The context text of row ``index`` (its fields put into the template)."""
        values = {}
        for name in self.fields:
            value = raw.get(name) if hasattr(raw, "get") else None
            if value is None:
                # A Hugging Face dataset fills a field some rows lack with null in the others:
                # name the fields this row fills, not its keys.
                have = ", ".join(filled_fields(raw)) or "none"
                raise KDUserError(
                    f"self_teacher.context: row {index + 1} of {self.key} has no value in field "
                    f"{name!r} (the row fills: {one_line(have)[:200]}); give every row a "
                    f"{name}, or change self_teacher.context"
                )
            values[name] = str(value)
            self._check_text(index, name, values[name])
        return self.settings.context.format(**values)

    def _check_text(self, index: int, name: str, text: str) -> None:
        """Refuse a field whose text the tokenizer reads as one of its control tokens
        (``<|im_end|>`` in a row): in the teacher's prompt it would end the turn, not be text."""
        if not self.control or not text:
            return
        ids = self.tokenizer.encode(text, add_bos=False, add_eos=False)
        hit = next((int(i) for i in ids if int(i) in self.control), None)
        if hit is not None:
            raise KDUserError(
                f"self_teacher.context: row {index + 1} of {self.key}: field {name!r} holds "
                f"{one_line(self.control[hit])!r}, which the tokenizer reads as its control token "
                f"{hit}, not as text (in the teacher's prompt it would open or end a turn); "
                "remove or reword it in the row (kd does not alter a row's text)"
            )

    def render(self, index: int) -> TeacherRow:
        """Row ``index`` as the teacher sees it (rendered once, then kept)."""
        row = self.rows.get(index)
        if row is not None:
            return row
        sft, local = _sft_part(self.dataset, index)
        raw = sft._data[local]
        text = self.context(index, raw)
        messages = sft._message_transform(raw)["messages"]
        sample = self.transform(
            {"messages": with_context(messages, text, place=self.settings.place)}
        )
        tokens = [int(t) for t in sample["tokens"]]
        labelled = labelled_positions(sample["labels"])
        start = _last_span_start(labelled, len(tokens))
        if self.header and tokens[start : start + len(self.header)] == self.header:
            start += len(self.header)
        row = TeacherRow(tokens=tokens, labelled=labelled, prompt_len=start)
        self.rows[index] = row
        return row

    def check(self, *, max_seq_len: int | None, new_tokens: int | None) -> tuple[int, int]:
        """Render every row and check it against the student's row; returns the longest
        teacher input and its row (1-based).

        Args:
            max_seq_len: ``tokenizer.max_seq_len`` (None: no limit).
            new_tokens: ``on_policy.max_new_tokens`` (None: off-policy only): an on-policy
                teacher input is the teacher's prompt plus that many tokens at most.

        Raises:
            KDUserError: a row whose context is missing, whose teacher input is over
                ``max_seq_len``, or whose completion the context changes.
        """
        longest, longest_row = 0, 0
        for index in range(len(self.dataset)):
            row = self.render(index)
            student = self.dataset[index]
            s_tokens, s_labels = list(student["tokens"]), list(student["labels"])
            s_pos = labelled_positions(s_labels)
            need = len(row.tokens)
            if new_tokens is not None:
                need = max(need, row.prompt_len + new_tokens)
            if need > longest:
                longest, longest_row = need, index + 1
            if max_seq_len is not None and need > max_seq_len:
                what = (
                    "prompt + context + on_policy.max_new_tokens"
                    if need > len(row.tokens)
                    else "prompt + context + completion"
                )
                raise KDUserError(
                    f"self_teacher: row {index + 1} of {self.key}: the teacher's input ({what}) "
                    f"is {need} tokens, over tokenizer.max_seq_len {max_seq_len}; raise "
                    "tokenizer.max_seq_len, shorten self_teacher.context, or drop the row"
                )
            t_labels = [row.tokens[j] for j in row.labelled]
            if t_labels != [int(s_tokens[j]) for j in s_pos]:
                raise KDUserError(
                    f"self_teacher: row {index + 1} of {self.key}: with the context the "
                    f"completion is other tokens ({len(t_labels)} labelled) than the student's "
                    f"({len(s_pos)}); put the context where it does not touch the reply "
                    "(self_teacher.place=system), or check the template"
                )
        return longest, longest_row


def _last_span_start(labelled: Sequence[int], length: int) -> int:
    """Where the last run of consecutive labelled positions starts (``length`` without one)."""
    if not labelled:
        return length
    start = labelled[-1]
    for j in reversed(labelled[:-1]):
        if j != start - 1:
            break
        start = j
    return start
