"""A task file's YAML that PyYAML composes but cannot construct, or whose aliases repeat nodes
without end: one line naming the file, at once (no traceback, no recursion, no exponential walk)."""

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
