"""The shared axis of chat rows rendered by two templates (kd.teachers.cross_chat.chat_spans):
contents align character for character, what each template adds around them is one group."""

from __future__ import annotations

from kd.cross_tokenizer import align_spans
from kd.teachers.cross_chat import chat_spans, runs_of


def _groups(student: list[list[str]], teacher: list[list[str]]) -> list[tuple[str, str]]:
    s_spans, t_spans = chat_spans(student, teacher)
    s_flat = [p for run in student for p in run]
    t_flat = [p for run in teacher[: len(student)] for p in run]
    assert len(s_spans) == len(s_flat) and len(t_spans) == len(t_flat)
    for spans in (s_spans, t_spans):
        ends = [e for _, e in spans]
        assert ends == sorted(ends)
    s_groups, t_groups = align_spans(s_spans, t_spans)
    return [
        ("".join(s_flat[i] for i in sg), "".join(t_flat[j] for j in tg))
        for sg, tg in zip(s_groups, t_groups, strict=True)
    ]


def test_same_pieces_are_one_group_each():
    run = [["he", "llo", "<e>"]]
    assert _groups(run, run) == [("he", "he"), ("llo", "llo"), ("<e>", "<e>")]


def test_each_templates_end_of_turn_is_one_group():
    student = [["a", "b", "c", "<|im_end|>", "\n"]]
    teacher = [["ab", "c", "<end_of_turn>\n"]]
    assert _groups(student, teacher) == [
        ("ab", "ab"),
        ("c", "c"),
        ("<|im_end|>\n", "<end_of_turn>\n"),
    ]


def test_a_header_one_side_trains_merges_with_the_first_content_group():
    student = [["<s>", "assistant\n", "x", "y", "<e>"]]
    teacher = [["xy", "</t>"]]
    assert _groups(student, teacher) == [("<s>assistant\nxy", "xy"), ("<e>", "</t>")]


def test_a_side_without_end_of_turn_closes_the_pair_with_its_last_token():
    student = [["x", "y"]]
    teacher = [["x", "y", "</t>"]]
    assert _groups(student, teacher) == [("x", "x"), ("y", "y</t>")]


def test_runs_pair_in_order_and_extra_teacher_runs_are_not_used():
    student = [["q"], ["r", "<e>"]]
    teacher = [["q", "!"], ["r", "</t>"], ["unused"]]
    assert _groups(student, teacher) == [("q", "q!"), ("r", "r"), ("<e>", "</t>")]
    assert runs_of([3, 4, 5, 9, 10, 12]) == [[3, 4, 5], [9, 10], [12]]


def test_a_teacher_rendering_that_trains_fewer_messages_is_one_line():
    import pytest

    from kd.errors import KDUserError
    from kd.teachers.cross_chat import ChatRows

    class OneTrainedRun(ChatRows):
        def render(self, index: int) -> tuple[list[int], list[int]]:
            return [1, 2, 3, 4], [2]

    with pytest.raises(KDUserError) as e:
        OneTrainedRun(None, None).row(4, None, [2, 5], [7, 8])
    assert str(e.value).startswith("dataset: row 5 trains 2 span(s) as the student renders it")
