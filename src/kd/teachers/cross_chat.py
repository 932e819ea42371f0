"""Chat rows for a teacher with another tokenizer: each side renders the conversation with its
own chat template, and the labelled (trained) spans of both renderings are aligned.

With chat data (torchtune's ``instruct_dataset`` / ``chat_dataset``, whose rows are messages),
a ``kd.hf.tokenizer`` student tokenizer and a teacher folder whose tokenizer has a chat template, the teacher's input is the row's
messages rendered by the teacher's template (:class:`kd.hf.tokenization.HFTokenizer`, the same
prefix rendering that masks the student's rows), not the student's rendering re-tokenized. The
two texts then differ outside the messages' contents (headers, end-of-turn markers), so the
character walk of :func:`kd.cross_tokenizer.align_spans` runs on a coordinate both sides share
(:func:`chat_spans`):

* each side's labelled tokens form runs (one per trained message; headers are never trained);
  the k-th run of one side is paired with the k-th of the other;
* within a pair, the longest common substring of the two runs' texts (the message's content,
  :class:`difflib.SequenceMatcher`) keeps its character offsets; the tokens that end before it
  (a header one template trains) and those that end past it (each template's end of turn) form
  a head and a tail group per side, and each side's last token closes the pair, so what the two
  templates add around the content is compared merged (GOLD's chain-rule merge); a side without
  a head merges the other's head with its first content group;
* pairs follow one another (each at a base past the previous pair's end).

A row whose teacher rendering has fewer trained runs than the student's is refused in one line
(the templates train different messages); runs past the student's (a student row truncated by
``tokenizer.max_seq_len``) are not used.
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import SequenceMatcher
from typing import Any

import torch

from kd.errors import KDUserError
from kd.teachers.privileged import _sft_part

__all__ = ["ChatRows", "chat_spans", "runs_of"]

Span = tuple[int, int]


def runs_of(positions: Sequence[int]) -> list[list[int]]:
    """``positions`` (ascending) cut into runs of consecutive values."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _ends(pieces: Sequence[str]) -> list[int]:
    out, pos = [], 0
    for piece in pieces:
        pos += len(piece)
        out.append(pos)
    return out


def _section_ends(
    ends: Sequence[int], content: tuple[int, int], widths: tuple[int, int], parity: int
) -> list[int]:
    """One run's token ends on the shared axis (relative to its pair's base).

    Args:
        ends: the run's token ends in its own text.
        content: ``[start, end)`` of the common content in that text.
        widths: the head and tail sections' widths on the shared axis (0: neither side has one).
        parity: 0 for the student, 1 for the teacher (their inner ends never meet).
    """
    c0, c1 = content
    head_w, tail_w = widths
    head = [e for e in ends if e <= c0]
    tail = [e for e in ends if e > c1]
    out = [2 * (j + 1) + parity for j in range(len(head) - 1)] + ([head_w] if head else [])
    out += [head_w + e - c0 for e in ends[len(head) : len(ends) - len(tail)]]
    out += [head_w + c1 - c0 + 2 * (j + 1) + parity for j in range(len(tail))]
    out[-1] = head_w + c1 - c0 + tail_w  # each side's last token closes the pair together
    return out


def _pair_spans(
    student: Sequence[str], teacher: Sequence[str], base: int
) -> tuple[list[Span], list[Span], int]:
    """One pair of runs' spans on the shared axis, and the next pair's base."""
    s_text, t_text = "".join(student), "".join(teacher)
    match = SequenceMatcher(None, s_text, t_text, autojunk=False).find_longest_match(
        0, len(s_text), 0, len(t_text)
    )
    contents = ((match.a, match.a + match.size), (match.b, match.b + match.size))
    s_ends, t_ends = _ends(student), _ends(teacher)
    heads = [
        sum(e <= c[0] for e in ends) for ends, c in zip((s_ends, t_ends), contents, strict=True)
    ]
    tails = [
        sum(e > c[1] for e in ends) for ends, c in zip((s_ends, t_ends), contents, strict=True)
    ]
    widths = (
        2 * max(heads) + 2 if max(heads) else 0,
        2 * max(tails) + 2 if max(tails) else 0,
    )
    spans = []
    for ends, content, parity in ((s_ends, contents[0], 0), (t_ends, contents[1], 1)):
        out = [base + e for e in _section_ends(ends, content, widths, parity)]
        spans.append(list(zip([base, *out[:-1]], out, strict=True)))
    return spans[0], spans[1], base + widths[0] + match.size + widths[1] + 1


def chat_spans(
    student: Sequence[Sequence[str]], teacher: Sequence[Sequence[str]]
) -> tuple[list[Span], list[Span]]:
    """Both sides' labelled tokens' spans on a shared coordinate (see the module docstring).

    Args:
        student: the student's runs of labelled tokens, each its tokens' decoded pieces.
        teacher: the teacher's, as many runs (or more: the rest is not used).

    Returns:
        ``(student spans, teacher spans)`` of every token of the paired runs, in order.
    """
    s_spans: list[Span] = []
    t_spans: list[Span] = []
    base = 0
    for s_run, t_run in zip(student, teacher, strict=False):
        s, t, base = _pair_spans(s_run, t_run, base)
        s_spans += s
        t_spans += t
    return s_spans, t_spans


def chat_rows_of(dataset: Any, student_tokenizer: Any, teacher_tokenizer: Any) -> ChatRows | None:
    """A :class:`ChatRows` when the rows are messages, the student's tokenizer is a
    ``kd.hf.tokenizer`` (its rows rendered by its chat template, or concatenated without one)
    and the teacher's has a chat template; None otherwise: the teacher tokenizes the student's
    rendering (torchtune's built-in tokenizers render chats in code, their header trained)."""
    from kd.hf.tokenization import HFTokenizer

    if (
        len(dataset) == 0
        or not isinstance(student_tokenizer, HFTokenizer)
        or getattr(teacher_tokenizer, "chat_template", None) is None
    ):
        return None
    try:
        _sft_part(dataset, 0)
    except KDUserError:
        return None
    return ChatRows(dataset, teacher_tokenizer)


class ChatRows:
    """The training rows rendered by the teacher's own chat template.

    Args:
        dataset: the training dataset (torchtune ``SFTDataset``, or a ``ConcatDataset`` of them).
        teacher_tokenizer: the teacher folder's :class:`kd.hf.tokenization.HFTokenizer`
            (untruncated).
        key: the dataset's config key, named in errors.
    """

    def __init__(self, dataset: Any, teacher_tokenizer: Any, *, key: str = "dataset"):
        self.dataset = dataset
        self.tokenizer = teacher_tokenizer
        self.key = key

    def render(self, index: int) -> tuple[list[int], list[int]]:
        """Row ``index``'s teacher tokens and their labelled positions (>= 1), rendered each
        time it is asked (not kept: a large dataset's renderings would not fit in memory)."""
        sft, local = _sft_part(self.dataset, index)
        messages = sft._message_transform(sft._data[local])["messages"]
        tokens, mask = self.tokenizer.tokenize_messages(messages)
        return [int(t) for t in tokens], [j for j, m in enumerate(mask) if not m and j >= 1]

    def row(
        self, index: int, student_tokenizer: Any, s_targets: Sequence[int], s_ids: Sequence[int]
    ) -> tuple[list[int], dict[str, Any]]:
        """Row ``index`` for the loss: the teacher's input tokens and both sides' alignment.

        Args:
            index: the dataset row.
            student_tokenizer: the run's tokenizer (decodes the student's tokens).
            s_targets: positions of the student's labelled target tokens (``rows + 1``).
            s_ids: those tokens.

        Returns:
            ``(teacher tokens, {s_spans, t_rows, t_ids, t_spans})``.
        """
        t_all, labelled = self.render(index)
        s_runs = runs_of(list(s_targets))
        t_runs = runs_of(labelled)
        if len(t_runs) < len(s_runs):
            raise KDUserError(
                f"{self.key}: row {index + 1} trains {len(s_runs)} span(s) as the student "
                f"renders it, but {len(t_runs)} as the teacher's chat template renders it "
                "(cross_tokenizer); use data whose trained messages both templates keep"
            )
        t_runs = t_runs[: len(s_runs)]
        target = dict(zip(s_targets, s_ids, strict=True))
        s_pieces = [
            [student_tokenizer.decode([int(target[p])], skip_special_tokens=False) for p in run]
            for run in s_runs
        ]
        t_pieces = [
            [self.tokenizer.decode([t_all[q]], skip_special_tokens=False) for q in run]
            for run in t_runs
        ]
        s_spans, t_spans = chat_spans(s_pieces, t_pieces)
        used = [q for run in t_runs for q in run]
        return t_all[: used[-1] + 1] if used else t_all[:1], {
            "s_spans": s_spans,
            "t_rows": [q - 1 for q in used],
            "t_ids": torch.tensor([t_all[q] for q in used], dtype=torch.long),
            "t_spans": t_spans,
        }
