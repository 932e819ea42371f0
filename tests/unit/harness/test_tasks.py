"""A task file's YAML that PyYAML composes but cannot construct, or whose aliases repeat nodes
without end: one line naming the file, at once (no traceback, no recursion, no exponential walk).
The rows reach lm-eval as written (kd's functions of the row, no template lm-eval reparses)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kd.errors import KDUserError
from kd.harness.tasks import read_task_folder
from kd.testing import write_jsonl


def _folder(tmp_path: Path, body: str) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    write_jsonl(folder / "mc.jsonl", [{"question": "1+1=", "choices": ["2", "3"], "answer": 0}])
    (folder / "t.yaml").write_text(body)
    return folder


def _laughs(levels: int) -> str:
    """Aliases of aliases: 9**levels strings once expanded, ``levels`` lines of text."""
    lines = ["a: &l0 [x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("? [a, b]\n: 1\ntask: x\n", "cannot read {file} (found unhashable key); fix the YAML"),
        ("a: &a [*a]\ntask: x\n", "a: unknown key in {file}"),
        ("task: x\n" + _laughs(40), "a: unknown key in {file}"),
    ],
    ids=["list_as_key", "alias_in_its_own_anchor", "aliases_of_aliases"],
)
def test_yaml_that_cannot_be_built_or_walked_is_one_line(tmp_path, body, message):
    folder = _folder(tmp_path, body)
    expected = message.format(file=folder / "t.yaml")
    with pytest.raises(KDUserError, match=re.escape(expected)):
        read_task_folder(folder)


def test_rows_reach_lm_eval_as_written(tmp_path):
    """A perfect model scores 1 on rows whose text lm-eval's templates would reparse: an all-digit
    multiple-choice prompt (an int: "multiple input"), bracketed or zero-led references (a list,
    a number), numbers of a column of ints and floats (1, not the loader's 1.0)."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    from kd.harness.tasks import lm_eval_config

    folder = tmp_path / "tasks"
    folder.mkdir()
    mc = [{"question": str(10 + i), "choices": ["a", "b", "c"], "answer": i % 3} for i in range(4)]
    answers = (("s", "[3, 1]"), ("t", "[1,2]"), ("u", "007"), ("v", 1), ("w", 2.5))
    gen = [{"question": q, "answer": a} for q, a in answers]
    write_jsonl(folder / "mc.jsonl", mc)
    write_jsonl(folder / "gen.jsonl", gen)
    (folder / "mc.yaml").write_text("task: mc\ntype: multiple_choice\ndata: mc.jsonl\n")
    (folder / "gen.yaml").write_text("task: gen\ntype: generate\ndata: gen.jsonl\n")
    right = {r["question"]: " " + r["choices"][r["answer"]] for r in mc}
    reference = {r["question"]: str(r["answer"]) for r in gen}

    class Perfect(LM):
        def loglikelihood(self, requests):
            return [
                (0.0 if right.get(c) == x else -1.0, False) for c, x in (r.args for r in requests)
            ]

        def generate_until(self, requests):
            return [reference[r.args[0]] for r in requests]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    out = simple_evaluate(
        model=Perfect(),
        tasks=[lm_eval_config(s) for s in read_task_folder(folder)],
        task_manager=TaskManager(include_defaults=False),
        bootstrap_iters=0,
    )
    assert out["results"]["mc"]["acc,none"] == 1.0
    assert out["results"]["gen"]["exact_match,none"] == 1.0
