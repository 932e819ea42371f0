"""Few-shot examples of a task folder's task: drawn from the task's other rows, never the row
being scored (its answer would be in its own prompt), and never more than those rows hold (lm-eval's
sampler would fail after the model loaded)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kd.cli import main
from kd.harness.evaluate import FinalEvaluation
from kd.harness.tasks import lm_eval_config, read_task_folder
from kd.testing import write_jsonl

pytest.importorskip("lm_eval")


def _tasks(folder: Path, rows: int = 6, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(
        folder / "mc.jsonl",
        [
            {"question": f"q{i}?", "choices": [f"a{i}", f"b{i}"], "answer": i % 2}
            for i in range(rows)
        ],
    )
    write_jsonl(
        folder / "gen.jsonl", [{"question": f"g{i}?", "answer": f"r{i}"} for i in range(rows)]
    )
    (folder / "mc.yaml").write_text(
        "task: mc\ntype: multiple_choice\ndata: mc.jsonl\nprompt: 'Q: {question}'\n"
    )
    (folder / "gen.yaml").write_text(
        "task: gen\ntype: generate\ndata: gen.jsonl\nprompt: 'Q: {question}'\n" + extra
    )
    return folder


def test_a_row_is_never_its_own_few_shot_example(tmp_path):
    from lm_eval.tasks import TaskManager, get_task_dict

    shots = 4
    specs = read_task_folder(_tasks(tmp_path / "tasks"))
    tasks = get_task_dict([lm_eval_config(s) for s in specs], TaskManager(include_defaults=False))
    for task in tasks.values():
        task.set_config(key="num_fewshot", value=shots)
        task.build_all_requests(rank=0, world_size=1, limit=None)
        assert task.instances
        for instance in task.instances:
            context = instance.args[0]
            assert context.count("Q: ") == shots + 1, context  # the examples, then the row
            assert context.count(instance.doc["question"]) == 1, context  # the row's own, last


def test_more_few_shot_examples_than_other_rows_is_one_line(tmp_path, capsys):
    tasks = _tasks(tmp_path / "tasks", rows=4)
    not_a_model = tmp_path / "model"
    not_a_model.mkdir()
    out = tmp_path / "e.json"
    argv = ["eval", "--model", str(not_a_model), "--tasks", str(tasks), "--output", str(out)]
    assert main([*argv, "--num-fewshot", "4"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "kd: error: --num-fewshot: 4 few-shot examples, but task gen has 3 rows to draw them "
        "from (its other rows than the one scored); ask at most 3 or add rows"
    ], err
    assert not out.exists()


def test_a_task_files_own_few_shot_count_and_duplicate_rows(tmp_path, capsys):
    """An lm-eval-format file's num_fewshot is checked too, and a row's copies are not
    examples for it."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    write_jsonl(folder / "d.jsonl", [{"q": "same", "a": "x"}] * 3 + [{"q": "other", "a": "y"}])
    (folder / "d.yaml").write_text(
        json.dumps(
            {
                "task": "dup",
                "output_type": "generate_until",
                "data": "d.jsonl",
                "doc_to_text": "q",
                "doc_to_target": "a",
                "num_fewshot": 2,
            }
        )
    )
    code = main(
        ["eval", "--model", str(tmp_path), "--tasks", str(folder), "--output", str(tmp_path / "e")]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines() == [
        f"kd: error: num_fewshot: in {folder / 'd.yaml'}: 2 few-shot examples, but task dup has 1 "
        "rows to draw them from (its other rows than the one scored); ask at most 1 or add rows"
    ], err


def test_the_eval_blocks_few_shot_count_is_checked_before_training(tmp_path):
    tasks = _tasks(tmp_path / "tasks", rows=3)
    settings = SimpleNamespace(
        tasks=[str(tasks)], limit=None, batch_size=8, num_fewshot=5, chat=False
    )
    with pytest.raises(Exception, match=r"^eval.num_fewshot: 5 few-shot examples, but task gen"):
        FinalEvaluation(settings, device="cpu")
    FinalEvaluation(SimpleNamespace(**{**vars(settings), "num_fewshot": 2}), device="cpu")
