"""lm-eval-format task YAML in the subset that runs nothing: a multiple-choice and a generation
task written with lm-eval's keys score as the same tasks written with kd's keys, through
``kd eval`` on a tiny model; every construct outside the subset is refused in one line naming the
key and the file, exit status 2, before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kd.testing import write_jsonl
from tests.integration.test_harness_cli import (  # noqa: F401, F811 (models: a fixture)
    PLANTED_PY,
    assert_refused_before_running,
    models,
    run_eval,
    write_mc_task,
)

pytest.importorskip("lm_eval")

MC_LM_EVAL = """task: arith_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
metadata:
  version: 1.0
"""
GEN_ROWS = [{"q": f"{a}*{a}=", "answer": str(a * a)} for a in range(8)]
GEN_KD = """task: sq
type: generate
data: gen.jsonl
prompt: "Q: {q} A:"
reference: answer
extract: "(\\\\S+)"
until: ["\\n"]
max_new_tokens: 5
ignore_case: true
"""
GEN_LM_EVAL = """task: sq
dataset_path: json
dataset_kwargs:
  data_files: gen.jsonl
output_type: generate_until
doc_to_text: "Q: {{ q }} A:"
doc_to_target: "{{answer}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 5
  do_sample: false
  temperature: 0
filter_list:
  - name: extract
    filter:
      - function: regex
        regex_pattern: "(\\\\S+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
"""


def scores(capsys, model: Path, tasks: Path, out: Path) -> dict:
    code, _, err = run_eval(
        capsys, "--model", f"m={model}", "--tasks", str(tasks), "--output", str(out)
    )
    assert code == 0, err
    return json.loads(out.read_text())["results"]


def test_multiple_choice_scores_as_kds_format(models, tmp_path, capsys):  # noqa: F811
    kd_format = write_mc_task(tmp_path / "kd")
    lm_format = write_mc_task(tmp_path / "lm")
    (lm_format / "mc.yaml").write_text(MC_LM_EVAL)
    want = scores(capsys, models["student"], kd_format, tmp_path / "kd.json")
    got = scores(capsys, models["student"], lm_format, tmp_path / "lm.json")
    assert got == want and set(got["arith_mc"]) == {"acc", "acc_norm"}


def test_generation_scores_as_kds_format(models, tmp_path, capsys):  # noqa: F811
    from tests.integration.test_harness_cli import greedy

    # References: the model's own first word on even rows, so some rows score.
    rows = [
        {**r, "answer": (greedy(models["student"], f"Q: {r['q']} A:", 5).split() or ["-"])[0]}
        if i % 2 == 0
        else r
        for i, r in enumerate(GEN_ROWS)
    ]
    got_scores = []
    for name, body in (("kd", GEN_KD), ("lm", GEN_LM_EVAL)):
        folder = tmp_path / name
        folder.mkdir()
        write_jsonl(folder / "gen.jsonl", rows)
        (folder / "gen.yaml").write_text(body)
        got_scores.append(scores(capsys, models["student"], folder, tmp_path / f"{name}.json"))
    assert got_scores[0] == got_scores[1]
    assert got_scores[0]["sq"]["exact_match"]["m"]["value"] > 0


BASE = MC_LM_EVAL.replace("metadata:\n  version: 1.0\n", "")
GEN_BASE = GEN_LM_EVAL
# (case, task file, the words the line names)
REFUSED = [
    (
        "function_tag",
        BASE.replace("doc_to_target: answer", "doc_to_target: !function utils.f"),
        ["doc_to_target", "!function"],
    ),
    ("class", BASE + "class: !function utils.T\n", ["class", "!function"]),
    ("class_name", BASE + "class: utils.T\n", ["class", "Python class"]),
    ("include", BASE + "include: other.yaml\n", ["include", "another YAML file"]),
    ("process_docs", BASE + "process_docs: utils.f\n", ["process_docs", "Python code"]),
    ("process_results", BASE + "process_results: utils.f\n", ["process_results", "Python code"]),
    (
        "custom_metric",
        BASE.replace("metric: acc_norm", "metric: utils.score"),
        ["metric_list", "utils.score"],
    ),
    (
        "custom_aggregation",
        BASE.replace("aggregation: mean", "aggregation: utils.agg"),
        ["metric_list.aggregation", "utils.agg"],
    ),
    (
        "hub_dataset",
        BASE.replace("dataset_path: json", "dataset_path: allenai/ai2_arc"),
        ["dataset_path", "loading script"],
    ),
    ("data_outside", BASE.replace("test: mc.jsonl", "test: ../mc.jsonl"), ["data", "outside"]),
    (
        "jinja_filter",
        BASE.replace("{{question}}", "{{question|upper}}"),
        ["doc_to_text", "Jinja beyond"],
    ),
    (
        "jinja_expression",
        BASE.replace("{{question}}", "{{ question.__class__ }}"),
        ["doc_to_text", "Jinja beyond"],
    ),
    (
        "jinja_block",
        BASE.replace("Question: ", "{% if 1 %}x{% endif %}"),
        ["doc_to_text", "Jinja beyond"],
    ),
    (
        "jinja_target",
        BASE.replace("doc_to_target: answer", 'doc_to_target: "{{answer + 1}}"'),
        ["doc_to_target", "not one field"],
    ),
    (
        "yaml_python_tag",
        BASE + "description: !!python/object/apply:os.system ['touch ran.txt']\n",
        ["description", "python"],
    ),
    ("unknown_key", BASE + "description: hi\n", ["description", "not in the lm-eval subset"]),
    (
        "filter_function",
        GEN_BASE.replace("function: take_first", "function: utils.pick"),
        ["filter_list", "run code"],
    ),
    (
        "sampling",
        GEN_BASE.replace("do_sample: false", "do_sample: true"),
        ["generation_kwargs.do_sample", "greedy"],
    ),
    (
        "metric_option",
        GEN_BASE.replace("ignore_punctuation: false", "regexes_to_ignore: [x]"),
        ["metric_list.regexes_to_ignore"],
    ),
    (
        "output_type",
        BASE.replace("output_type: multiple_choice", "output_type: loglikelihood_rolling"),
        ["output_type", "loglikelihood_rolling"],
    ),
]


@pytest.mark.parametrize("body,named", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_constructs_outside_the_subset_are_refused(tmp_path, capsys, body, named):
    folder = write_mc_task(tmp_path / "tasks")
    (folder / "mc.yaml").unlink()
    write_jsonl(folder / "gen.jsonl", GEN_ROWS)
    write_jsonl(tmp_path / "mc.jsonl", [{"question": "1", "choices": ["a", "b"], "answer": 0}])
    (folder / "utils.py").write_text(PLANTED_PY)
    (folder / "task.yaml").write_text(body)
    assert_refused_before_running(capsys, tmp_path, folder, named, [folder / "task.yaml"])
