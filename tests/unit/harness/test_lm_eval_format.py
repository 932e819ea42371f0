"""lm-eval task YAML translated into kd's spec with lm-eval's own meanings: its defaults (until the
few-shot delimiter, 256 new tokens), the split it evaluates, a doc_to_text naming a field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kd.errors import KDUserError
from kd.harness.tasks import lm_eval_config, read_task_file
from kd.testing import write_jsonl


def spec_of(folder: Path, body: str):
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "dev.jsonl", [{"q": "1+1=", "a": "2"}])
    write_jsonl(folder / "test.jsonl", [{"q": "2+2=", "a": "4"}, {"q": "3+3=", "a": "6"}])
    (folder / "t.yaml").write_text(body)
    return read_task_file(folder / "t.yaml", folder)


GEN = "task: g\ndataset_path: json\noutput_type: generate_until\ndoc_to_target: a\n"


def test_lm_evals_defaults_and_a_field_as_the_prompt(tmp_path):
    spec = spec_of(
        tmp_path,
        GEN + "dataset_kwargs:\n  data_files: {test: test.jsonl, validation: dev.jsonl}\n"
        'test_split: test\ndoc_to_text: q\nfewshot_delimiter: "\\n"\nnum_fewshot: 1\n',
    )
    assert spec.data_file.name == "test.jsonl" and spec.rows == 2
    assert spec.prompt == (("", "q"),)  # the field q, not the text "q"
    assert spec.until == ("\n",) and spec.max_new_tokens == 256
    config = lm_eval_config(spec)
    assert config["num_fewshot"] == 1 and config["target_delimiter"] == " "
    assert config["generation_kwargs"]["until"] == ["\n"]


def test_the_validation_split_when_there_is_no_test_split(tmp_path):
    spec = spec_of(
        tmp_path,
        GEN + "dataset_kwargs:\n  data_files: {test: test.jsonl, validation: dev.jsonl}\n"
        "validation_split: validation\ndoc_to_text: 'Q: {{q}}'\n",
    )
    assert spec.data_file.name == "dev.jsonl" and spec.prompt == (("Q: ", "q"),)


def test_a_split_data_files_lacks_is_refused(tmp_path):
    with pytest.raises(KDUserError, match="dataset_kwargs.data_files: in .*t.yaml must be one"):
        spec_of(
            tmp_path, GEN + "dataset_kwargs:\n  data_files: {test: test.jsonl}\ntest_split: dev\n"
        )
