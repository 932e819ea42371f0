"""Bad input: every case of docs/errors.md exits 2 with a `kd: error:` line that names the key or file
and the fix, prints no traceback, and leaves what was saved before untouched.

Most cases run in-process through ``kd.cli.main`` (fast); two run ``python -m kd.cli`` to show that
nothing but the error line reaches the terminal.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import kd.checkpoint
import kd.training.train
from kd import checkpoint, cli
from tests.conftest import STUDENT, builder, make_config, read_metrics, write_config

# One intra-op thread (tests/conftest.py): the same float reductions in every run.
pytestmark = pytest.mark.usefixtures("one_thread")

RUN = ["run", "kd_single_device"]


class MaskedDataset(torch.utils.data.Dataset):
    """A dataset whose every label is masked (a user component, so it needs trust)."""

    def __init__(self, tokenizer: Any, n: int = 16):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"tokens": [1, 2, 3, 4, 5], "labels": [-100] * 5}


class RowFailsLater(torch.utils.data.Dataset):
    """Fine for the first ``good_reads`` reads, then every row raises (a bad row met mid-run)."""

    def __init__(self, tokenizer: Any, n: int = 32, good_reads: int = 48):
        self.n, self.good_reads, self.reads = n, good_reads, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        self.reads += 1
        if self.reads > self.good_reads:
            raise KeyError("output")
        return {"tokens": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5]}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def write_json(path: Path, rows: Any) -> str:
    path.write_text(json.dumps(rows) if not isinstance(rows, str) else rows)
    return str(path)


# ---------------------------------------------------------------------------------------------
# The table. Each case gets (assets, tmp_path, cfg) and returns the argv after `kd` plus what
# the error must contain; `cfg` is a valid config dict (output_dir holds a file from "before")
# that the case may edit; it is written to tmp_path/cfg.yaml after the case returns.
# ---------------------------------------------------------------------------------------------

Case = Callable[[dict, Path, dict], tuple[list[str], str]]


def _run(*overrides: str) -> list[str]:
    return [*RUN, "--config", "{cfg}", *overrides]


def malformed_yaml(assets, tmp, cfg):
    """`model: [unclosed` in the YAML"""
    bad = tmp / "bad.yaml"
    bad.write_text("output_dir: /tmp/x\nmodel: [unclosed\nseed: 1\n")
    return [*RUN, "--config", str(bad)], "malformed YAML"


def missing_config_file(assets, tmp, cfg):
    return [*RUN, "--config", str(tmp / "nope.yaml")], "nope.yaml: no such file"


def config_not_a_mapping(assets, tmp, cfg):
    """a YAML file holding a list"""
    bad = tmp / "list.yaml"
    bad.write_text("- a\n- b\n")
    return [*RUN, "--config", str(bad)], "top level is a list"


def unknown_key(assets, tmp, cfg):
    cfg["kd_ration"] = cfg.pop("kd_ratio")
    return _run(), "kd_ration: unknown key; did you mean kd_ratio?"


def missing_required_key(assets, tmp, cfg):
    del cfg["dataset"]
    return _run(), "dataset: required key is missing"


def wrong_type(assets, tmp, cfg):
    cfg["batch_size"] = "four"
    return _run(), "batch_size: 'four' is not an integer"


def override_without_value(assets, tmp, cfg):
    return _run("batch_size"), "override 'batch_size': expected key=value or ~key"


def override_empty_value(assets, tmp, cfg):
    return _run("batch_size="), "no value after '='"


def override_bad_key(assets, tmp, cfg):
    return _run("optimizer..lr=1"), "is not a config key"


def delete_absent_key(assets, tmp, cfg):
    return _run("~kd_ration"), "no key kd_ration"


def unresolvable_interpolation(assets, tmp, cfg):
    return _run("seed=${nope}"), "seed: interpolation cannot be resolved"


def kd_ratio_out_of_range(assets, tmp, cfg):
    return _run("kd_ratio=1.5"), "kd_ratio: 1.5 is outside [0, 1]"


def temperature_not_positive(assets, tmp, cfg):
    return _run("temperature=0"), "temperature: 0 must be greater than 0"


def batch_size_below_1(assets, tmp, cfg):
    return _run("batch_size=0"), "batch_size: 0 is below the minimum 1"


def accumulation_below_1(assets, tmp, cfg):
    return _run("gradient_accumulation_steps=0"), "gradient_accumulation_steps: 0 is below"


def bad_choice(assets, tmp, cfg):
    return _run("dtype=fp8"), "dtype: 'fp8' is not allowed"


def bad_device(assets, tmp, cfg):
    return _run("device=tpu"), "device: 'tpu' is not a device"


def cuda_not_available(assets, tmp, cfg):
    """`device=cuda` on a machine without CUDA"""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    return _run("device=cuda"), "device: cuda is not available"


def unknown_component(assets, tmp, cfg):
    return _run("optimizer._component_=torch.optim.AdamWW"), "did you mean torch.optim.AdamW?"


def unknown_component_argument(assets, tmp, cfg):
    return _run("optimizer.lrr=0.1"), "optimizer.lrr: not an argument of torch.optim.AdamW"


def bad_component_argument_value(assets, tmp, cfg):
    return _run("optimizer.lr=-1"), "optimizer: torch.optim.AdamW failed (ValueError"


def component_outside_allow_list(assets, tmp, cfg):
    """`metric_logger: {_component_: os.system, command: touch ...}`"""
    cfg["metric_logger"] = {"_component_": "os.system", "command": f"touch {tmp / 'pwned'}"}
    return _run(), "metric_logger._component_: os.system is not something metric_logger may build"


def missing_data_file(assets, tmp, cfg):
    cfg["dataset"]["data_files"] = str(tmp / "nope.json")
    return _run(), "dataset.data_files:"


def missing_checkpoint_dir(assets, tmp, cfg):
    cfg["checkpointer"]["checkpoint_dir"] = str(tmp / "nope")
    return _run(), "checkpointer.checkpoint_dir:"


def missing_checkpoint_file(assets, tmp, cfg):
    cfg["teacher_checkpointer"]["checkpoint_files"] = ["model-00001.safetensors"]
    return _run(), "teacher_checkpointer.checkpoint_files[0]:"


def truncated_checkpoint_file(assets, tmp, cfg):
    """a `model.safetensors` cut after 2000 bytes"""
    student = tmp / "student"
    student.mkdir()
    for p in assets["student"].iterdir():
        data = p.read_bytes()
        (student / p.name).write_bytes(data[:2000] if p.suffix == ".safetensors" else data)
    cfg["checkpointer"]["checkpoint_dir"] = str(student)
    return _run(), "checkpointer: cannot load the weights in"


def teacher_weights_all_zero(assets, tmp, cfg):
    """a teacher `model.safetensors` of zeros (saved from an empty model)"""
    from safetensors.torch import save_file

    teacher = tmp / "teacher"
    shutil.copytree(assets["teacher"], teacher)
    weights = load_file(str(teacher / "model.safetensors"))
    zero = {k: torch.zeros_like(v) for k, v in weights.items()}
    save_file(zero, str(teacher / "model.safetensors"), metadata={"format": "pt"})
    cfg["teacher_checkpointer"]["checkpoint_dir"] = str(teacher)
    return _run(), "teacher_model: the output projection loaded from"


def checkpoint_of_another_model(assets, tmp, cfg):
    return _run("model.num_layers=3"), "checkpointer: the checkpoint does not match the model"


def wrong_model_type(assets, tmp, cfg):
    return _run("checkpointer.model_type=QWEN9"), "checkpointer.model_type: 'QWEN9' is not a"


def model_type_of_another_family(assets, tmp, cfg):
    return _run("checkpointer.model_type=LLAMA3"), "checkpointer.model_type: LLAMA3 converts"


def missing_tokenizer_file(assets, tmp, cfg):
    cfg["tokenizer"]["merges_file"] = str(tmp / "merges.txt")
    return _run(), "tokenizer.merges_file:"


def corrupt_tokenizer_file(assets, tmp, cfg):
    """a `vocab.json` that is not JSON"""
    cfg["tokenizer"]["path"] = write_json(tmp / "vocab.json", "{not json")
    return _run(), f"tokenizer.path: {tmp / 'vocab.json'} is not valid JSON (JSONDecodeError"


def tokenizer_ids_beyond_student_vocab(assets, tmp, cfg):
    return _run("model.vocab_size=200"), "tokenizer: emits ids up to 277 but the student"


def tokenizer_ids_beyond_teacher_vocab(assets, tmp, cfg):
    return _run("teacher_model.vocab_size=200"), "the teacher (teacher_model) has only 200"


def pretokenized_ids_beyond_the_vocabulary(assets, tmp, cfg):
    """`kd.data.pretokenized_dataset` rows of another tokenizer: an id of 100000 in row 1"""
    rows = [{"input_ids": [1 + (r + j) % 200 for j in range(12)]} for r in range(8)]
    rows[1]["input_ids"][5] = 100_000  # an IndexError traceback from the embedding before
    path = tmp / "ids.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg["dataset"] = {"_component_": "kd.data.pretokenized_dataset", "data_files": str(path)}
    return _run(), "dataset: row 1 of"


def teacher_of_another_family(assets, tmp, cfg):
    """a Llama-3 teacher for a Qwen2 student"""
    cfg["teacher_model"] = {
        "_component_": "torchtune.models.llama3.llama3",
        "vocab_size": 320,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "embed_dim": 48,
        "intermediate_dim": 96,
        "max_seq_len": 256,
    }
    cfg["teacher_checkpointer"]["model_type"] = "LLAMA3"
    return _run(), "teacher_model._component_: torchtune.models.llama3.llama3 is a llama3 teacher"


def tokenizer_of_another_family(assets, tmp, cfg):
    return (
        _run(
            "tokenizer._component_=torchtune.models.llama3.llama3_tokenizer",
            "~tokenizer.merges_file",
        ),
        "tokenizer._component_: torchtune.models.llama3.llama3_tokenizer is a llama3 tokenizer",
    )


def empty_dataset(assets, tmp, cfg):
    """a data file holding `[]`"""
    cfg["dataset"]["data_files"] = write_json(tmp / "empty.json", [])
    return _run(), "empty.json has no examples; point dataset.data_files at a file with examples"


def malformed_data_file(assets, tmp, cfg):
    """a data file holding `[{"input": "1+1", `"""
    cfg["dataset"]["data_files"] = write_json(tmp / "bad.json", '[{"input": "1+1", ')
    return _run(), "dataset: torchtune.datasets.instruct_dataset failed (DatasetGenerationError"


def fewer_examples_than_a_batch(assets, tmp, cfg):
    """3 rows, `batch_size: 4`"""
    rows = [{"input": "1+1", "output": "2"}] * 3
    cfg["dataset"]["data_files"] = write_json(tmp / "three.json", rows)
    return _run(), "dataset: 3 examples is fewer than one batch"


def data_without_the_expected_columns(assets, tmp, cfg):
    """rows of `question`/`answer`"""
    rows = [{"question": "1+1", "answer": "2"}] * 8
    cfg["dataset"]["data_files"] = write_json(tmp / "columns.json", rows)
    return _run(), "dataset: example 0 cannot be read (KeyError: 'input')"


def every_example_longer_than_max_seq_len(assets, tmp, cfg):
    """prompts of ~140 tokens, `max_seq_len: 64`"""
    rows = [{"input": "1+" * 60, "output": "2"}] * 8  # prompts of ~140 tokens, max_seq_len 64
    cfg["dataset"]["data_files"] = write_json(tmp / "long.json", rows)
    return _run(), "tokenizer.max_seq_len: every example checked (8 of 8) is at least 64 tokens"


def every_label_masked(assets, tmp, cfg):
    """a dataset whose labels are all -100"""
    cfg["dataset"] = {"_component_": f"{__name__}.MaskedDataset"}
    cfg["trust_remote_components"] = True
    return _run(), "dataset: every label is masked in the 16 examples checked"


def accumulation_longer_than_an_epoch(assets, tmp, cfg):
    return _run("gradient_accumulation_steps=100"), "gradient_accumulation_steps: 100 micro"


def memory_budget_exceeded(assets, tmp, cfg):
    return _run("memory.budget_gib=0.01", "memory.check=error"), "memory: the plan needs"


def output_dir_not_writable(assets, tmp, cfg):
    """`output_dir` under a regular file"""
    # Running as root, permissions do not stop writes; a path under a regular file always fails.
    (tmp / "a_file").write_text("")
    return _run(f"output_dir={tmp / 'a_file' / 'run'}"), "output_dir:"


def unknown_recipe(assets, tmp, cfg):
    return ["run", "kd_singel_device", "--config", "{cfg}"], "did you mean kd_single_device?"


def missing_config_option(assets, tmp, cfg):
    return [*RUN, "batch_size=2"], "missing --config"


def misspelt_config_option(assets, tmp, cfg):
    """`--config` misspelt after the recipe"""
    return [*RUN, "--confg", "{cfg}"], "run: unknown option --confg; did you mean --config?"


def misspelt_flag(assets, tmp, cfg):
    """a command's flag misspelt (argparse alone names no flag meant)"""
    return ["plan", "--config", "{cfg}", "--budgt-gib", "8"], "did you mean --budget-gib?"


def torchrun_option_after_the_recipe(assets, tmp, cfg):
    """`--nproc_per_node 2` after the recipe name"""
    return (
        [*RUN, "--config", "{cfg}", "--nproc_per_node", "2"],
        "--nproc_per_node is a torchrun option; put it before the recipe name",
    )


def torchrun_options_on_single_device(assets, tmp, cfg):
    return (
        ["run", "--nproc_per_node", "2", *RUN[1:], "--config", "{cfg}"],
        "kd_single_device runs on one device and cannot take torchrun options",
    )


# Inputs of every kind: files that are not YAML text, numbers no key can hold, overrides that
# cannot be applied, and the flags of run (torchrun's), validate, plan, cp and demo.


def _plan(*args: str) -> list[str]:
    return ["plan", "--config", "{cfg}", *args]


def _validate(*args: str) -> list[str]:
    return ["validate", "--config", "{cfg}", *args]


def config_not_utf8(assets, tmp, cfg):
    """a Latin-1 file (`caf\\xe9`)"""
    bad = tmp / "latin1.yaml"
    bad.write_bytes("output_dir: /tmp/caf\xe9\n".encode("latin-1"))
    return [*RUN, "--config", str(bad)], "latin1.yaml:1: is not UTF-8 text (byte 0xe9)"


def config_binary_file(assets, tmp, cfg):
    """a binary file"""
    bad = tmp / "model.safetensors"
    bad.write_bytes(bytes(range(256)) * 4)
    return ["validate", "--config", str(bad)], "is a binary file, not YAML"


def config_not_a_regular_file(assets, tmp, cfg):
    return ["validate", "--config", "/dev/null"], "config /dev/null: is not a regular file"


def integer_beyond_int64(assets, tmp, cfg):
    return _run("batch_size=99999999999999999999"), "beyond the 64-bit integer range"


def nan_in_float_key(assets, tmp, cfg):
    return _run("kd_ratio=nan"), "kd_ratio: nan is not a finite number"


def yaml_nan_in_float_key(assets, tmp, cfg):
    cfg["temperature"] = float("nan")
    return _run(), "temperature: nan is not a finite number"


def inf_in_float_key(assets, tmp, cfg):
    return _plan("clip_grad_norm=inf"), "clip_grad_norm: inf is not a finite number"


def negative_inf_in_float_key(assets, tmp, cfg):
    return _plan("memory.reserve_gib=-.inf"), "memory.reserve_gib: -inf is not a finite number"


def nan_in_component_argument(assets, tmp, cfg):
    cfg["optimizer"]["lr"] = float("nan")
    return _validate(), "optimizer.lr: nan is not a finite number"


def text_in_component_number(assets, tmp, cfg):
    return _validate("optimizer.lr=fast"), "optimizer.lr: 'fast' is not a number"


def list_index_out_of_range(assets, tmp, cfg):
    return (
        _run("checkpointer.checkpoint_files.5=x.safetensors"),
        "checkpointer.checkpoint_files has 1 entries, so index 5 is out of range",
    )


def lora_list_index_out_of_range(assets, tmp, cfg):
    """a LoRA student (two attention modules); `model.lora_attn_modules.9=q_proj`"""
    cfg["model"] = builder(STUDENT, lora=True)
    return (
        _validate("model.lora_attn_modules.9=q_proj"),
        "model.lora_attn_modules has 2 entries, so index 9 is out of range",
    )


def list_index_not_a_number(assets, tmp, cfg):
    return _plan("checkpointer.checkpoint_files.first=x"), "is a list, so 'first' is not an index"


def nproc_per_node_zero(assets, tmp, cfg):
    return (
        ["run", "--nproc_per_node", "0", "kd_distributed", "--config", "{cfg}"],
        "run: --nproc_per_node 0 starts no process; pass a number >= 1",
    )


def nproc_per_node_not_a_number(assets, tmp, cfg):
    return (
        ["run", "--nproc_per_node", "abc", "kd_distributed", "--config", "{cfg}"],
        "run: --nproc_per_node 'abc' is not a process count",
    )


def torchrun_option_bad_value(assets, tmp, cfg):
    return (
        ["run", "--master_port", "abc", "kd_distributed", "--config", "{cfg}"],
        "run: torchrun argument --master-port/--master_port: invalid int value: 'abc'",
    )


def torchrun_nnodes_reversed(assets, tmp, cfg):
    return (
        ["run", "--nnodes", "2:1", "kd_distributed", "--config", "{cfg}"],
        "run: torchrun options --nnodes 2:1: min_nodes must be > 0 and <= max_nodes",
    )


def budget_gib_zero(assets, tmp, cfg):
    return _validate("--budget-gib", "0"), "--budget-gib: 0 must be greater than 0"


def budget_gib_negative(assets, tmp, cfg):
    return _plan("--budget-gib", "-1"), "--budget-gib: -1 must be greater than 0"


def budget_gib_nan(assets, tmp, cfg):
    return _plan("--budget-gib", "nan"), "--budget-gib: nan is not a finite number"


def budget_gib_inf(assets, tmp, cfg):
    return _validate("--budget-gib", "inf"), "--budget-gib: inf is not a finite number"


def world_size_zero(assets, tmp, cfg):
    return _plan("--world-size", "0"), "--world-size: 0 ranks; pass a whole number >= 1"


def world_size_negative(assets, tmp, cfg):
    return _validate("--world-size", "-2"), "--world-size: -2 ranks"


def world_size_not_a_number(assets, tmp, cfg):
    return _plan("--world-size", "abc"), "argument --world-size/--nproc_per_node/--nproc-per-node"


def plot_folder_missing(assets, tmp, cfg):
    return _plan("--plot", str(tmp / "no_such_folder" / "plan.png")), "--plot: the folder"


def plot_path_is_a_folder(assets, tmp, cfg):
    return _plan("--plot", str(tmp)), "is a folder; pass a file path"


def plot_under_a_file(assets, tmp, cfg):
    (tmp / "a_file").write_text("")
    return _plan("--plot", str(tmp / "a_file" / "plan.png")), "a_file is a file, not a folder"


def plot_unsupported_format(assets, tmp, cfg):
    return _plan("--plot", str(tmp / "plan.txt")), "--plot: cannot write .txt images"


def cp_destination_under_a_file(assets, tmp, cfg):
    (tmp / "a_file").write_text("")
    name = "qwen2_5/14B_to_3B_full_single_device"
    return ["cp", name, str(tmp / "a_file" / "my.yaml")], "a_file is a file; choose another path"


def cp_destination_name_too_long(assets, tmp, cfg):
    name = "qwen2_5/14B_to_3B_full_single_device"
    return ["cp", name, "x" * 300], "is not a usable destination (file name too long)"


def demo_output_dir_under_a_file(assets, tmp, cfg):
    (tmp / "a_file").write_text("")
    return ["demo", "--output-dir", str(tmp / "a_file" / "demo")], "--output-dir: cannot create"


def override_without_key(assets, tmp, cfg):
    return _plan("=1"), "override '=1': no key before '='"


def override_bare_tilde(assets, tmp, cfg):
    return _plan("~"), "override '~': no key after '~'; write ~key to delete a key"


def override_double_equals(assets, tmp, cfg):
    return _plan("kd_ratio==0.5"), "kd_ratio: '=0.5' is not a number"


def override_non_ascii_key(assets, tmp, cfg):
    return _plan("ключ=1"), "'ключ' is not a config key"


def override_number_too_long(assets, tmp, cfg):
    return _plan("seed=" + "9" * 5000), "a number has too many digits"


def override_very_long_path(assets, tmp, cfg):
    return _validate("output_dir=" + "x" * 5000), "is not a usable path (file name too long)"


def path_with_nul_byte(assets, tmp, cfg):
    cfg["dataset"]["data_files"] = "train\0.json"
    return _validate(), "dataset.data_files: 'train\\x00.json' is not a usable path"


def path_of_unknown_user(assets, tmp, cfg):
    return _validate("output_dir=~no_such_user_kd/run"), "~no_such_user_kd is not a user"


def missing_config_value(assets, tmp, cfg):
    return ["validate", "--config"], "argument --config: expected one argument"


def empty_dataset_list(assets, tmp, cfg):
    cfg["dataset"] = []
    return _validate(), "dataset: an empty list"


def missing_file_in_dataset_list(assets, tmp, cfg):
    cfg["dataset"] = [cfg["dataset"], dict(cfg["dataset"], data_files=str(tmp / "nope.json"))]
    return _validate(), "dataset[1].data_files:"


def bad_rows_in_dataset_list(assets, tmp, cfg):
    """the second of two datasets is not JSON"""
    bad = write_json(tmp / "bad.json", '[{"input": "1+1", ')
    cfg["dataset"] = [cfg["dataset"], dict(cfg["dataset"], data_files=bad)]
    return _run(), "dataset[1]: torchtune.datasets.instruct_dataset failed"


def _validation(cfg: dict) -> dict:
    """A ``validation:`` node on the training data (a valid one)."""
    return {"dataset": dict(cfg["dataset"]), "every_n_steps": 2}


def validation_every_zero_steps(assets, tmp, cfg):
    """`validation: {dataset: ..., every_n_steps: 2}`, then `validation.every_n_steps=0`"""
    cfg["validation"] = _validation(cfg)
    return _run("validation.every_n_steps=0"), "validation.every_n_steps: 0 is below the minimum 1"


def validation_without_dataset(assets, tmp, cfg):
    """`validation: {every_n_steps: 2}` (no dataset)"""
    cfg["validation"] = {"every_n_steps": 2}
    return _run(), "validation.dataset: required key is missing"


def keep_best_without_validation(assets, tmp, cfg):
    """`keep_best: {metric: val_loss}` without `validation`"""
    cfg["keep_best"] = {"metric": "val_loss"}
    return _run(), "keep_best: needs validation"


def keep_best_unknown_metric(assets, tmp, cfg):
    """`keep_best: {metric: val_acc}` with `validation`"""
    cfg["validation"] = _validation(cfg)
    cfg["keep_best"] = {"metric": "val_acc"}
    return _run(), "keep_best.metric: 'val_acc' is not allowed"


def keep_best_teacher_metric_without_teacher(assets, tmp, cfg):
    """`keep_best: {metric: val_top1_agreement}`, `teacher_model: null`, `kd_ratio: 0`"""
    cfg.update(teacher_model=None, teacher_checkpointer=None, kd_ratio=0)
    cfg["validation"] = _validation(cfg)
    cfg["keep_best"] = {"metric": "val_top1_agreement"}
    return _run(), "keep_best.metric: val_top1_agreement compares the student with the teacher"


def keep_best_teacher_metric_with_kd_ratio_0(assets, tmp, cfg):
    """`keep_best: {metric: val_kd_loss}`, `kd_ratio: 0` with a teacher"""
    cfg.update(kd_ratio=0)
    cfg["validation"] = _validation(cfg)
    cfg["keep_best"] = {"metric": "val_kd_loss"}
    return _run(), "keep_best.metric: val_kd_loss compares the student with the teacher's logits"


def early_stopping_without_validation(assets, tmp, cfg):
    """`early_stopping: {patience: 3}` without `validation`"""
    cfg["early_stopping"] = {"patience": 3}
    return _run(), "early_stopping: needs validation"


def early_stopping_only_at_the_end(assets, tmp, cfg):
    """`early_stopping: {patience: 3}`, `validation.every_n_steps: null`"""
    cfg["validation"] = dict(_validation(cfg), every_n_steps=None)
    cfg["early_stopping"] = {"patience": 3}
    return _run(), "early_stopping: validation.every_n_steps is null"


def validation_data_file_missing(assets, tmp, cfg):
    """`validation.dataset.data_files` names a missing file (`kd validate`)"""
    cfg["validation"] = _validation(cfg)
    cfg["validation"]["dataset"]["data_files"] = str(tmp / "heldout.json")
    return _validate(), "validation.dataset.data_files:"


def validation_every_label_masked(assets, tmp, cfg):
    """a validation dataset whose labels are all -100 (`kd validate`)"""
    cfg["validation"] = _validation(cfg)
    cfg["validation"]["dataset"] = {"_component_": f"{__name__}.MaskedDataset"}
    cfg["trust_remote_components"] = True
    return _validate(), "validation.dataset: every label is masked"


# --- the transformers backend (kd.hf), kd init, kd generate -----------------------------------
def _hf_student(assets: dict, cfg: dict, **node: Any) -> None:
    """The student as a Hugging Face folder (``kd.hf.causal_lm``), without a checkpointer."""
    cfg["model"] = {"_component_": "kd.hf.causal_lm", "path": str(assets["student"]), **node}
    del cfg["checkpointer"]


def hf_model_folder_missing(assets, tmp, cfg):
    """`model: {_component_: kd.hf.causal_lm, path: <a missing folder>}`"""
    _hf_student(assets, cfg, path=str(tmp / "SmolLM2-360M"))
    return _run(), "model.path:"


def hf_model_with_a_checkpointer(assets, tmp, cfg):
    """`model: kd.hf.causal_lm` and a `checkpointer` too"""
    checkpointer = cfg["checkpointer"]
    _hf_student(assets, cfg)
    cfg["checkpointer"] = checkpointer
    return _run(), "checkpointer: model is kd.hf.causal_lm"


def hf_model_weights_not_downloaded(assets, tmp, cfg):
    """`model.path` holds config.json only (`kd validate`)"""
    folder = tmp / "partial"
    folder.mkdir()
    shutil.copyfile(assets["student"] / "config.json", folder / "config.json")
    _hf_student(assets, cfg, path=str(folder))
    return _validate(), "holds no *.safetensors weights"


def hf_config_contradicts_weights(assets, tmp, cfg):
    """`model.path`'s config.json says another intermediate_size than its weights"""
    folder = tmp / "edited"
    shutil.copytree(assets["student"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    _hf_student(assets, cfg, path=str(folder))
    return _run(), "says intermediate_size=96 but the weights have 64"


def hf_lora_module_not_in_model(assets, tmp, cfg):
    """`kd.hf.lora_causal_lm` with `lora_attn_modules: [qkv_proj]`"""
    _hf_student(assets, cfg, lora_attn_modules=["qkv_proj"], lora_rank=4, lora_alpha=8)
    cfg["model"]["_component_"] = "kd.hf.lora_causal_lm"
    return _run(), "model.lora_attn_modules: 'qkv_proj'"


def hf_tokenizer_folder_missing(assets, tmp, cfg):
    """`tokenizer: {_component_: kd.hf.tokenizer, path: <a missing folder>}`"""
    cfg["tokenizer"] = {"_component_": "kd.hf.tokenizer", "path": str(tmp / "tok")}
    return _run(), "tokenizer.path:"


def init_data_of_unknown_format(assets, tmp, cfg):
    """`kd init --data` rows without messages / instruction / input+output / text"""
    data = write_json(tmp / "rows.jsonl", '{"question": "1+1", "answer": "2"}\n')
    argv = ["init", "--teacher", str(assets["teacher"]), "--student", str(assets["student"])]
    argv += ["--data", data, "--output-dir", str(tmp / "out"), "--config-out", str(tmp / "k.yaml")]
    return argv, "--data:"


def generate_model_folder_missing(assets, tmp, cfg):
    """`kd generate --model <a missing folder>`"""
    return ["generate", "--model", str(tmp / "final"), "--prompt", "hi"], "--model: folder"


# --- stored teacher logits (kd run teacher_logits, teacher_logits.path) -----------------------
_STORES: dict[str, Path] = {}


def _teacher_logits(assets: dict, tmp: Path, cfg: dict, **settings: Any) -> Path:
    """A copy in ``tmp/logits`` of a complete store made for ``make_config`` (k=8, made once per
    assets folder), set as ``cfg``'s ``teacher_logits``."""
    root = Path(assets["data"]).parent
    if str(root) not in _STORES:
        made = root.parent / f"{root.name}_teacher_logits"
        if not (made / "logits" / "manifest.json").is_file():
            made.mkdir(exist_ok=True)
            store = {"path": str(made / "logits"), "k": 8, "rows_per_shard": 16}
            config = write_config(
                made / "cfg.yaml", make_config(assets, made / "run", teacher_logits=store)
            )
            assert cli.main(["run", "teacher_logits", "--config", str(config)]) == 0
        _STORES[str(root)] = made / "logits"
    shutil.copytree(_STORES[str(root)], tmp / "logits")
    cfg["teacher_logits"] = {"path": str(tmp / "logits"), "k": 8, **settings}
    return tmp / "logits"


def teacher_logits_store_missing(assets, tmp, cfg):
    """`teacher_logits.path` names a folder that does not exist (`kd validate`)"""
    cfg["teacher_logits"] = {"path": str(tmp / "logits")}
    return _validate(), "teacher_logits.path: <tmp>/logits does not exist".replace(
        "<tmp>", str(tmp)
    )


def teacher_logits_store_incomplete(assets, tmp, cfg):
    """the store's precompute did not finish (manifest `complete: false`)"""
    store = _teacher_logits(assets, tmp, cfg)
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    return _validate(), "is incomplete (its precompute did not finish)"


def teacher_logits_shard_missing(assets, tmp, cfg):
    """a shard of the store deleted"""
    store = _teacher_logits(assets, tmp, cfg)
    (store / "rank00000-00002.parquet").unlink()
    return _validate(), "rank00000-00002.parquet is missing"


def teacher_logits_shard_truncated(assets, tmp, cfg):
    """a shard cut to 100 bytes"""
    store = _teacher_logits(assets, tmp, cfg)
    shard = store / "rank00000-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    return _validate(), "rank00000-00001.parquet has 100 bytes, the manifest says"


def teacher_logits_of_another_teacher(assets, tmp, cfg):
    """the store was made by the teacher; the config's teacher is now the student's model"""
    _teacher_logits(assets, tmp, cfg)
    cfg["teacher_model"] = builder(STUDENT)
    cfg["teacher_checkpointer"] = dict(cfg["checkpointer"])
    return _validate(), "holds the logits of another teacher"


def teacher_logits_k_larger_than_stored(assets, tmp, cfg):
    """`teacher_logits.k: 16`, the store holds k=8"""
    _teacher_logits(assets, tmp, cfg, k=16)
    return _validate(), "teacher_logits.k: 16 is more than the 8 stored"


def teacher_logits_other_tokenizer(assets, tmp, cfg):
    """the tokenizer's vocab.json changed since the precompute (a space added)"""
    _teacher_logits(assets, tmp, cfg)
    folder = tmp / "tokenizer"
    shutil.copytree(assets["tokenizer"], folder)
    (folder / "vocab.json").write_text((folder / "vocab.json").read_text() + " ")
    cfg["tokenizer"]["path"] = str(folder / "vocab.json")
    return _validate(), "was made with other tokenizer files than this run's"


def teacher_logits_other_max_seq_len(assets, tmp, cfg):
    """`tokenizer.max_seq_len: 48`, the store was made with 64"""
    _teacher_logits(assets, tmp, cfg)
    cfg["tokenizer"]["max_seq_len"] = 48
    return _validate(), "another tokenizer.max_seq_len than this run's (64 there, 48 here)"


def teacher_logits_other_dataset(assets, tmp, cfg):
    """`dataset.data_files` holds other rows than the precompute's"""
    _teacher_logits(assets, tmp, cfg)
    rows = [{"input": f"{a}+1", "output": str(a + 1)} for a in range(64)]
    cfg["dataset"]["data_files"] = write_json(tmp / "other.json", rows)
    return _validate(), "was made with other rows (the tokenized dataset)"


def teacher_logits_plain_store_with_cross_tokenizer(assets, tmp, cfg):
    """`cross_tokenizer: {}` beside a store of the student's tokens (no teacher ids and offsets)"""
    _teacher_logits(assets, tmp, cfg)
    cfg.update(cross_tokenizer={}, teacher_model=None, teacher_checkpointer=None)
    return _validate(), "without the teacher's token ids and offsets cross_tokenizer needs"


def teacher_logits_cross_store_without_cross_tokenizer(assets, tmp, cfg):
    """a store of a teacher with another tokenizer (version 2) used without `cross_tokenizer`"""
    store = _teacher_logits(assets, tmp, cfg)
    manifest = json.loads((store / "manifest.json").read_text())
    cross = {"teacher_size": 8, "teacher_tokenizer_sha256": "0" * 64, "teacher_vocab": {"a": 0}}
    manifest.update(version=2, cross_tokenizer=cross)
    (store / "manifest.json").write_text(json.dumps(manifest))
    return _validate(), "holds a teacher with another tokenizer (its own token ids and offsets)"


def cross_tokenizer_store_with_renorm_tail(assets, tmp, cfg):
    """`cross_tokenizer: {}` with `teacher_logits.tail: renorm`"""
    cfg.update(cross_tokenizer={}, teacher_model=None, teacher_checkpointer=None)
    cfg["teacher_logits"] = {"path": str(tmp / "logits"), "tail": "renorm"}
    return _validate(), "teacher_logits.tail: renorm is not used with cross_tokenizer"


def cross_tokenizer_with_a_foreign_file(assets, tmp, cfg):
    """`cross_tokenizer: {}` with `teacher_logits.format: axolotl`"""
    cfg.update(cross_tokenizer={}, teacher_model=None, teacher_checkpointer=None)
    cfg["teacher_logits"] = {"path": str(tmp / "logits"), "format": "axolotl"}
    return _validate(), "teacher_logits.format: axolotl files hold no teacher token ids"


def teacher_logits_with_validation(assets, tmp, cfg):
    """`validation: {...}` and `teacher_logits: {path: ...}`"""
    cfg["validation"] = _validation(cfg)
    cfg["teacher_logits"] = {"path": str(tmp / "logits")}
    return _run(), "validation: needs the online teacher"


# --- on-policy distillation (on_policy:) ----------------------------------------------------
def _on_policy(**settings: Any) -> dict:
    return {"lmbda": 0.5, "max_new_tokens": 8, "temperature": 1.0, **settings}


def on_policy_with_stored_logits(assets, tmp, cfg):
    """`on_policy: {...}` and `teacher_logits: {path: ...}`"""
    cfg["on_policy"] = _on_policy()
    cfg["teacher_logits"] = {"path": str(tmp / "logits")}
    return _validate(), "on_policy: needs the online teacher"


def on_policy_without_teacher(assets, tmp, cfg):
    """`on_policy: {...}` with `teacher_model: null` (`kd_ratio: 0`)"""
    cfg["on_policy"] = _on_policy()
    cfg.update(teacher_model=None, teacher_checkpointer=None, kd_ratio=0.0)
    return _validate(), "on_policy: needs a teacher to score the completions"


def on_policy_no_room_for_a_prompt(assets, tmp, cfg):
    """`on_policy.max_new_tokens: 64` with `tokenizer.max_seq_len: 64`"""
    cfg["on_policy"] = _on_policy(max_new_tokens=64)
    return _validate(), "on_policy.max_new_tokens: 64 leaves no room for a prompt"


def on_policy_rows_without_prompt(assets, tmp, cfg):
    """`on_policy: {...}` on rows labelled from their first token (`train_on_input: true`)"""
    cfg["on_policy"] = _on_policy()
    cfg["dataset"]["train_on_input"] = True
    return _run(), "dataset: row 0 has no prompt (every token is labelled)"


def teacher_logits_precompute_into_another_store(assets, tmp, cfg):
    """`kd run teacher_logits` with `temperature: 2` into a store made with 1"""
    _teacher_logits(assets, tmp, cfg, rows_per_shard=16)
    cfg["temperature"] = 2.0
    return [
        "run",
        "teacher_logits",
        "--config",
        "{cfg}",
    ], "already holds the teacher logits of another config"


def _foreign(tmp: Path, cfg: dict, fmt: str = "axolotl", *, k: int = 2, **edit: Any) -> Path:
    """A tiny axolotl (or DistillKit) top-k file of 8 rows set as ``cfg``'s teacher and data;
    ``edit`` replaces columns of every row."""
    ids_col, values_col = (
        ("target_token_ids", "logprobs")
        if fmt == "axolotl"
        else (
            "token_ids",
            "top_values",
        )
    )
    rows = []
    for r in range(8):
        tokens = [1 + (r + j) % 200 for j in range(12)]
        row = {
            "input_ids": tokens,
            "labels": [-100] * 4 + tokens[4:],
            ids_col: [[t, t + 1] for t in tokens],
            values_col: [[-0.5, -1.5] for _ in tokens],
        }
        rows.append({**row, **edit})
    path = tmp / f"{fmt}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg.pop("teacher_model"), cfg.pop("teacher_checkpointer")
    cfg["dataset"] = {"_component_": "kd.data.pretokenized_dataset", "data_files": str(path)}
    # The rows' top-1 is each token itself, which auto-detection reads as `current`: named.
    cfg["teacher_logits"] = {
        "path": str(path),
        "format": fmt,
        "k": k,
        "tail": "renorm",
        "alignment": "next",
    }
    return path


def teacher_logits_foreign_missing_field(assets, tmp, cfg):
    """`teacher_logits.format: distillkit`, the rows have no `top_values`"""
    _foreign(tmp, cfg, "distillkit")
    path = tmp / "distillkit.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if k != "top_values"} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return _validate(), "has no column 'top_values'"


def teacher_logits_foreign_k_larger_than_stored(assets, tmp, cfg):
    """`teacher_logits.k: 4`, the axolotl file holds 2 entries per position"""
    _foreign(tmp, cfg, k=4)
    return _validate(), "teacher_logits.k: 4 is more than the 2 entries stored at position 3"


def teacher_logits_foreign_mismatched_lengths(assets, tmp, cfg):
    """an axolotl row with 13 target positions for 12 input_ids"""
    _foreign(tmp, cfg, target_token_ids=[[5, 6]] * 13, logprobs=[[-0.5, -1.5]] * 13)
    return _validate(), "has 13 positions of target_token_ids for 12 input_ids"


def teacher_logits_foreign_bucket_retempered(assets, tmp, cfg):
    """`source_temperature: 2` (re-tempered to 1) with `tail: bucket`"""
    _foreign(tmp, cfg)
    cfg["teacher_logits"].update(source_temperature=2.0, tail="bucket")
    return _validate(), "teacher_logits.tail: bucket needs the teacher mass outside the top-k"


def teacher_logits_foreign_other_dataset(assets, tmp, cfg):
    """an axolotl file with `dataset` left at the instruct rows, not the file's own"""
    dataset = dict(cfg["dataset"])
    _foreign(tmp, cfg)
    cfg["dataset"] = dataset
    return _validate(), "dataset: its 64 rows are not the 8 rows of"


def teacher_logits_precompute_locked(assets, tmp, cfg):
    """another `kd run teacher_logits` (pid 1 on another host) holds the store's `.lock`"""
    _teacher_logits(assets, tmp, cfg, rows_per_shard=16)
    lock = tmp / "logits" / ".lock"
    lock.write_text(json.dumps({"pid": 1, "host": "another-host.example"}))
    return ["run", "teacher_logits", "--config", "{cfg}"], "is being written by another kd run"


def teacher_logits_precompute_without_teacher(assets, tmp, cfg):
    """`kd run teacher_logits` with `teacher_model: null`"""
    cfg.update(teacher_model=None, teacher_checkpointer=None)
    cfg["teacher_logits"] = {"path": str(tmp / "logits")}
    return ["run", "teacher_logits", "--config", "{cfg}"], "teacher_model: null, but kd run"


def _served(tmp: Path, cfg: dict, **section: Any) -> None:
    """A served teacher (nothing listens at its URL) in place of the teacher's nodes."""
    cfg.update(teacher_model=None, teacher_checkpointer=None)
    cfg["teacher_server"] = {"url": "http://127.0.0.1:9", "model": "m", **section}


def teacher_server_store_not_at_temperature_1(assets, tmp, cfg):
    """`teacher_server.store` (write-through) with `temperature=2`"""
    _served(tmp, cfg, store=str(tmp / "kept"), tail="renorm")
    cfg["temperature"] = 2.0
    return _validate(), "teacher_server.store: temperature is 2"


def teacher_server_store_beside_teacher_logits(assets, tmp, cfg):
    """`teacher_server.store` and `teacher_logits.path` both set"""
    _served(tmp, cfg, store=str(tmp / "kept"))
    cfg["teacher_logits"] = {"path": str(tmp / "logits")}
    return _validate(), "beside teacher_logits.path"


def teacher_server_store_of_other_files(assets, tmp, cfg):
    """`teacher_server.store` names a folder of other files"""
    _served(tmp, cfg, store=str(tmp / "kept"))
    (tmp / "kept").mkdir()
    (tmp / "kept" / "notes.txt").write_text("mine")
    return _validate(), "holds other files (notes.txt)"


# --- issues 24, 26, 27, 29: hidden states, several teachers, int8 teacher, self teacher --------
def self_teacher_context_field_missing(assets, tmp, cfg):
    """`self_teacher.context` names a field no row has"""
    cfg.update(teacher_model=None, teacher_checkpointer=None)
    cfg["self_teacher"] = {"context": "Reference: {reference}"}
    return _validate(), "self_teacher.context: row 1 of dataset has no value in field 'reference'"


def teachers_weights_sum_to_zero(assets, tmp, cfg):
    """`teachers:` whose members' weights are all 0"""
    member = {
        "teacher_model": cfg["teacher_model"],
        "teacher_checkpointer": cfg["teacher_checkpointer"],
    }
    cfg.update(teacher_model=None, teacher_checkpointer=None)
    cfg["teachers"] = {
        "combine": "weights",
        "members": [{"name": "a", "weight": 0, **member}, {"name": "b", "weight": 0, **member}],
    }
    return _validate(), "the weights sum to 0"


def hidden_states_with_stored_logits(assets, tmp, cfg):
    """`hidden_states:` beside `teacher_logits` (a store holds no hidden states)"""
    cfg["hidden_states"] = {"layer_map": ["0:0"]}
    cfg["teacher_logits"] = {"path": str(tmp / "logits")}
    return _validate(), "hidden_states: needs the teacher's hidden states"


def teacher_quantization_with_served_teacher(assets, tmp, cfg):
    """`teacher_quantization: int8` with a served teacher"""
    _served(tmp, cfg)
    cfg["teacher_quantization"] = "int8"
    return _validate(), "teacher_quantization: int8 quantizes a local teacher_model"


# --- issue 23: folders that ask to run code or lead outside, config.json fields, usability -----
def _student_copy(assets: dict, tmp: Path, cfg: dict) -> Path:
    """A copy of the student's folder as the run's ``kd.hf.causal_lm`` student."""
    import shutil

    folder = tmp / "student_copy"
    shutil.copytree(assets["student"], folder)
    _hf_student(assets, cfg, path=str(folder))
    return folder


def model_folder_asks_for_its_own_code(assets, tmp, cfg):
    """the student's config.json has `auto_map` and a `custom.py` beside it"""
    folder = _student_copy(assets, tmp, cfg)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "custom.Model"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(f"open({str(tmp / 'pwned')!r}, 'w')\n")
    return _validate(), "auto_map"


def tokenizer_file_links_out_of_its_folder(assets, tmp, cfg):
    """a file of the student's folder is a link to `../secret`"""
    folder = _student_copy(assets, tmp, cfg)
    (tmp / "secret").write_text("not the model's")
    (folder / "notes.txt").symlink_to(tmp / "secret")
    return _validate(), "notes.txt"


def index_names_a_file_outside_the_folder(assets, tmp, cfg):
    """`model.safetensors.index.json` maps a weight to `../outside/x.safetensors`"""
    folder = _student_copy(assets, tmp, cfg)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "../outside/x.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return _validate(), "../outside/x.safetensors"


def config_json_field_not_a_number(assets, tmp, cfg):
    """the student's config.json says `max_position_embeddings: "abc"`"""
    folder = _student_copy(assets, tmp, cfg)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = "abc"
    (folder / "config.json").write_text(json.dumps(config))
    return _validate(), "max_position_embeddings is 'abc'"


def top_level_key_of_a_section(assets, tmp, cfg):
    """`eval_every_n_steps=10` (a key of `validation:` written at the top level)"""
    return _run("eval_every_n_steps=10"), "validation.every_n_steps"


def component_not_a_string(assets, tmp, cfg):
    return _run("optimizer._component_=5"), "not a string"


# ------------------------------------------------------------ hardening 4 and this wave's keys
def _down_server(cfg: dict, **server: Any) -> None:
    del cfg["teacher_model"], cfg["teacher_checkpointer"]
    cfg["teacher_server"] = {"url": "http://127.0.0.1:9", "model": "m", **server}


def served_timeout_unbounded(assets, tmp, cfg):
    _down_server(cfg, timeout=1e300)
    return _validate(), "teacher_server.timeout"


def _members(cfg: dict, *weights: Any, combine: str = "weights") -> None:
    teacher, ckpt = cfg.pop("teacher_model"), cfg.pop("teacher_checkpointer")
    cfg["teachers"] = {
        "combine": combine,
        "members": [
            {"name": f"t{i}", "weight": w, "teacher_model": teacher, "teacher_checkpointer": ckpt}
            for i, w in enumerate(weights)
        ],
    }


def member_weight_nan(assets, tmp, cfg):
    _members(cfg, float("nan"), 1.0)
    return _validate(), "teachers.members[0].weight"


def member_weight_huge(assets, tmp, cfg):
    _members(cfg, 1e308, 1.0)
    return _validate(), "teachers.members[0].weight"


def data_file_is_a_folder(assets, tmp, cfg):
    folder = tmp / "a_folder.jsonl"
    folder.mkdir()
    cfg["dataset"]["data_files"] = str(folder)
    return _validate(), "dataset.data_files"


def teacher_offload_with_int8_teacher(assets, tmp, cfg):
    cfg["teacher_offload"] = "park"
    cfg["teacher_quantization"] = "int8"
    return _validate(), "teacher_offload"


def eval_task_file_names_python(assets, tmp, cfg):
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / "t.yaml").write_text("task: t\nprocess_docs: !function utils.process\n")
    cfg["eval"] = {"tasks": [str(tasks)]}
    return _validate(), "t.yaml"


# ------------------------------------------------------------ teacher_device, served sampler, eval
def teacher_device_not_a_device(assets, tmp, cfg):
    """`teacher_device: gpu9`"""
    cfg["teacher_device"] = "gpu9"
    return _validate(), "teacher_device"


def teacher_device_with_teacher_offload(assets, tmp, cfg):
    """`teacher_device: cuda:1` with `teacher_offload: park`"""
    cfg["teacher_device"] = "cuda:1"
    cfg["teacher_offload"] = "park"
    return _validate(), "teacher_device"


def teacher_device_with_seq_kd(assets, tmp, cfg):
    """`teacher_device: cuda:1` with `on_policy.seq_kd: true`"""
    cfg["teacher_device"] = "cuda:1"
    cfg["on_policy"] = {"lmbda": 0.5, "seq_kd": True, "max_new_tokens": 4}
    return _validate(), "teacher_device"


def teacher_device_not_on_this_machine(assets, tmp, cfg):
    """`teacher_device: cuda:1` on a machine without it"""
    cfg["teacher_device"] = "cuda:1"
    return _validate(), "teacher_device: cuda:1 is not on this machine"


def teacher_device_under_torchrun(assets, tmp, cfg):
    """`teacher_device: cpu`, `--world-size 2`"""
    cfg["teacher_device"] = "cpu"
    return _validate("--world-size", "2"), "teacher_device: cpu puts the teacher"


def async_sampler_under_torchrun(assets, tmp, cfg):
    """`on_policy.async_steps: 1`, `--world-size 2`"""
    cfg["on_policy"] = {"lmbda": 1.0, "max_new_tokens": 4, "async_steps": 1}
    return _validate("--world-size", "2"), "on_policy.async_steps"


def sampling_dtype_under_torchrun(assets, tmp, cfg):
    """`on_policy.sampling_dtype: bf16` on an fp32 student, `--world-size 2`"""
    cfg["on_policy"] = {"lmbda": 1.0, "max_new_tokens": 4, "sampling_dtype": "bf16"}
    return _validate("--world-size", "2"), "on_policy.sampling_dtype keeps a whole copy"


def sampling_dtype_with_served_sampler(assets, tmp, cfg):
    """`on_policy.sampling_dtype: bf16` with `on_policy.sampler: served`"""
    cfg["on_policy"] = {
        "lmbda": 1.0,
        "max_new_tokens": 4,
        "sampler": "served",
        "server_url": "http://127.0.0.1:9",
        "server_model": "m",
        "sampling_dtype": "bf16",
    }
    return _validate(), "on_policy.sampling_dtype: applies to the local sampler"


def cuda_graphs_on_the_cpu(assets, tmp, cfg):
    """`on_policy.cuda_graphs: true` (with `batch_rollouts: true`) and `device: cpu`"""
    cfg["on_policy"] = {
        "lmbda": 1.0,
        "max_new_tokens": 4,
        "batch_rollouts": True,
        "cuda_graphs": True,
    }
    return _validate(), "on_policy.cuda_graphs: needs device: cuda (device is cpu)"


def cuda_graphs_without_batch_rollouts(assets, tmp, cfg):
    """`on_policy.cuda_graphs: true` without `on_policy.batch_rollouts`"""
    cfg["on_policy"] = {"lmbda": 1.0, "max_new_tokens": 4, "cuda_graphs": True}
    return _validate(), "on_policy.cuda_graphs: replays the fast local decode"


def rollout_batch_size_without_batch_rollouts(assets, tmp, cfg):
    """`on_policy.rollout_batch_size` without `on_policy.batch_rollouts: true`"""
    cfg["on_policy"] = {"lmbda": 1.0, "max_new_tokens": 4, "rollout_batch_size": 2}
    return _validate(), "on_policy.rollout_batch_size: cuts the one generation per step"


def served_sampler_unreachable(assets, tmp, cfg):
    """`on_policy.sampler: served`, nothing listening at `server_url`"""
    cfg["on_policy"] = {
        "lmbda": 1.0,
        "max_new_tokens": 4,
        "sampler": "served",
        "server_url": "http://127.0.0.1:9",
        "server_model": "m",
        "server_timeout": 1,
    }
    return _validate(), "on_policy.server_url"


# What a case starts for kd to meet (a test server): closed by run_case once kd has answered.
AFTER_CASE = contextlib.ExitStack()


def _rollout_server(assets: dict, cfg: dict, **server: Any) -> None:
    """The served sampler pointed at kd's vLLM test server of the student, set up as ``server``."""
    from kd.testing_rollout_server import RolloutTestServer

    served = AFTER_CASE.enter_context(
        RolloutTestServer(assets["student"], **{"model_name": "student", **server})
    )
    cfg["on_policy"] = {
        "lmbda": 1.0,
        "max_new_tokens": 4,
        "sampler": "served",
        "server_url": served.url,
        "server_model": "student",
    }


def served_sampler_serves_another_model(assets, tmp, cfg):
    """the server serves another model than `on_policy.server_model`"""
    _rollout_server(assets, cfg, model_name="other")
    return _validate(), "on_policy.server_model"


def served_sampler_context_too_short(assets, tmp, cfg):
    """the server's `--max-model-len` is below `tokenizer.max_seq_len`"""
    _rollout_server(assets, cfg, max_model_len=16)
    return _validate(), "--max-model-len"


def served_sampler_lora_without_runtime_loading(assets, tmp, cfg):
    """a LoRA student, the vLLM server without runtime LoRA loading"""
    cfg["model"] = builder(STUDENT, lora=True)
    _rollout_server(assets, cfg, runtime_lora=False)
    return _validate(), "does not load LoRA adapters"


def served_sampler_full_reload_without_dev_mode(assets, tmp, cfg):
    """a full student, the vLLM server without `VLLM_SERVER_DEV_MODE=1`"""
    _rollout_server(assets, cfg, dev_mode=False)
    return _validate(), "/collective_rpc"


def _token_env(name: str, value: str) -> None:
    """``name`` holds ``value`` for this case only."""
    old = os.environ.get(name)
    os.environ[name] = value
    AFTER_CASE.callback(
        lambda: os.environ.pop(name, None) if old is None else os.environ.update({name: old})
    )


def served_sampler_without_the_servers_token(assets, tmp, cfg):
    """the vLLM server has an `--api-key`, kd sends no token"""
    _rollout_server(assets, cfg, token="s3cret")
    return _validate(), "on_policy.server_token_env"


def served_sampler_sglang_admin_key(assets, tmp, cfg):
    """an SGLang server with `--admin-api-key`, kd sends its `--api-key` to push weights"""
    _rollout_server(assets, cfg, api="sglang", token="s3cret", admin_token="adm1n")
    _token_env("KD_TEST_SGLANG_TOKEN", "s3cret")
    cfg["on_policy"].update(server_api="sglang", server_token_env="KD_TEST_SGLANG_TOKEN")
    return _validate(), "on_policy.server_admin_token_env"


def served_sampler_sleep_without_sleep_mode(assets, tmp, cfg):
    """`on_policy.server_sleep: true`, the vLLM server without `--enable-sleep-mode`"""
    _rollout_server(assets, cfg)
    cfg["on_policy"]["server_sleep"] = True
    return _validate(), "--enable-sleep-mode"


def served_sampler_sleep_with_sglang(assets, tmp, cfg):
    """`on_policy.server_sleep: true` with `server_api: sglang`"""
    _rollout_server(assets, cfg, api="sglang")
    cfg["on_policy"].update(server_api="sglang", server_sleep=True)
    return _validate(), "on_policy.server_sleep: puts a vLLM server to sleep"


def served_sampler_admin_token_for_vllm(assets, tmp, cfg):
    """`on_policy.server_admin_token_env` with a vLLM server (only SGLang has one)"""
    _rollout_server(assets, cfg)
    cfg["on_policy"]["server_admin_token_env"] = "KD_TEST_ADMIN"
    return _validate(), "only SGLang has an admin key"


def _lm_eval_task(tmp: Path, cfg: dict, body: str) -> None:
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / "mc.jsonl").write_text('{"question": "1+1=", "choices": ["2", "3"], "answer": 0}\n')
    head = "task: t\ndataset_path: json\ndataset_kwargs: {data_files: mc.jsonl}\n"
    (tasks / "t.yaml").write_text(head + "output_type: multiple_choice\n" + body)
    cfg["eval"] = {"tasks": [str(tasks)]}


def eval_lm_eval_task_jinja_filter(assets, tmp, cfg):
    """an lm-eval-format task with `doc_to_text: "{{question|upper}}"`"""
    _lm_eval_task(tmp, cfg, 'doc_to_text: "{{question|upper}}"\n')
    return _validate(), "doc_to_text"


def eval_lm_eval_task_custom_metric(assets, tmp, cfg):
    """an lm-eval-format task naming a metric function"""
    _lm_eval_task(tmp, cfg, "metric_list:\n  - metric: utils.score\n")
    return _validate(), "metric_list"


def eval_num_fewshot_beyond_the_rows(assets, tmp, cfg):
    """`eval.num_fewshot: 1` for a task of one row (lm-eval draws the examples from the others)"""
    _lm_eval_task(tmp, cfg, "")
    cfg["eval"]["num_fewshot"] = 1
    return _validate(), "eval.num_fewshot"


def eval_lm_eval_task_hub_dataset(assets, tmp, cfg):
    """an lm-eval-format task reading a Hub dataset"""
    _lm_eval_task(tmp, cfg, "")
    path = tmp / "tasks" / "t.yaml"
    path.write_text(path.read_text().replace("dataset_path: json", "dataset_path: allenai/ai2_arc"))
    return _validate(), "dataset_path"


CASES: list[Case] = [
    malformed_yaml,
    missing_config_file,
    config_not_a_mapping,
    unknown_key,
    missing_required_key,
    wrong_type,
    override_without_value,
    override_empty_value,
    override_bad_key,
    delete_absent_key,
    unresolvable_interpolation,
    kd_ratio_out_of_range,
    temperature_not_positive,
    batch_size_below_1,
    accumulation_below_1,
    bad_choice,
    bad_device,
    cuda_not_available,
    unknown_component,
    unknown_component_argument,
    bad_component_argument_value,
    component_outside_allow_list,
    missing_data_file,
    missing_checkpoint_dir,
    missing_checkpoint_file,
    truncated_checkpoint_file,
    teacher_weights_all_zero,
    checkpoint_of_another_model,
    wrong_model_type,
    model_type_of_another_family,
    missing_tokenizer_file,
    corrupt_tokenizer_file,
    tokenizer_ids_beyond_student_vocab,
    tokenizer_ids_beyond_teacher_vocab,
    pretokenized_ids_beyond_the_vocabulary,
    teacher_of_another_family,
    tokenizer_of_another_family,
    empty_dataset,
    malformed_data_file,
    fewer_examples_than_a_batch,
    data_without_the_expected_columns,
    every_example_longer_than_max_seq_len,
    every_label_masked,
    accumulation_longer_than_an_epoch,
    memory_budget_exceeded,
    output_dir_not_writable,
    unknown_recipe,
    missing_config_option,
    misspelt_config_option,
    misspelt_flag,
    torchrun_option_after_the_recipe,
    torchrun_options_on_single_device,
    config_not_utf8,
    config_binary_file,
    config_not_a_regular_file,
    integer_beyond_int64,
    nan_in_float_key,
    yaml_nan_in_float_key,
    inf_in_float_key,
    negative_inf_in_float_key,
    nan_in_component_argument,
    text_in_component_number,
    list_index_out_of_range,
    lora_list_index_out_of_range,
    list_index_not_a_number,
    nproc_per_node_zero,
    nproc_per_node_not_a_number,
    torchrun_option_bad_value,
    torchrun_nnodes_reversed,
    budget_gib_zero,
    budget_gib_negative,
    budget_gib_nan,
    budget_gib_inf,
    world_size_zero,
    world_size_negative,
    world_size_not_a_number,
    plot_folder_missing,
    plot_path_is_a_folder,
    plot_under_a_file,
    plot_unsupported_format,
    cp_destination_under_a_file,
    cp_destination_name_too_long,
    demo_output_dir_under_a_file,
    override_without_key,
    override_bare_tilde,
    override_double_equals,
    override_non_ascii_key,
    override_number_too_long,
    override_very_long_path,
    path_with_nul_byte,
    path_of_unknown_user,
    missing_config_value,
    empty_dataset_list,
    missing_file_in_dataset_list,
    bad_rows_in_dataset_list,
    validation_every_zero_steps,
    validation_without_dataset,
    keep_best_without_validation,
    keep_best_unknown_metric,
    keep_best_teacher_metric_without_teacher,
    early_stopping_without_validation,
    early_stopping_only_at_the_end,
    validation_data_file_missing,
    validation_every_label_masked,
    hf_model_folder_missing,
    hf_model_with_a_checkpointer,
    hf_model_weights_not_downloaded,
    hf_config_contradicts_weights,
    hf_lora_module_not_in_model,
    hf_tokenizer_folder_missing,
    init_data_of_unknown_format,
    generate_model_folder_missing,
    teacher_logits_store_missing,
    teacher_logits_store_incomplete,
    teacher_logits_shard_missing,
    teacher_logits_shard_truncated,
    teacher_logits_of_another_teacher,
    teacher_logits_k_larger_than_stored,
    teacher_logits_other_tokenizer,
    teacher_logits_other_max_seq_len,
    teacher_logits_other_dataset,
    teacher_logits_with_validation,
    teacher_logits_plain_store_with_cross_tokenizer,
    teacher_logits_cross_store_without_cross_tokenizer,
    cross_tokenizer_store_with_renorm_tail,
    cross_tokenizer_with_a_foreign_file,
    on_policy_with_stored_logits,
    on_policy_without_teacher,
    on_policy_no_room_for_a_prompt,
    on_policy_rows_without_prompt,
    teacher_logits_precompute_into_another_store,
    teacher_logits_precompute_without_teacher,
    teacher_server_store_not_at_temperature_1,
    teacher_server_store_beside_teacher_logits,
    teacher_server_store_of_other_files,
    self_teacher_context_field_missing,
    teachers_weights_sum_to_zero,
    hidden_states_with_stored_logits,
    teacher_quantization_with_served_teacher,
    teacher_logits_foreign_missing_field,
    teacher_logits_foreign_k_larger_than_stored,
    teacher_logits_foreign_mismatched_lengths,
    teacher_logits_foreign_bucket_retempered,
    teacher_logits_foreign_other_dataset,
    teacher_logits_precompute_locked,
    model_folder_asks_for_its_own_code,
    tokenizer_file_links_out_of_its_folder,
    index_names_a_file_outside_the_folder,
    config_json_field_not_a_number,
    top_level_key_of_a_section,
    component_not_a_string,
    served_timeout_unbounded,
    member_weight_nan,
    member_weight_huge,
    data_file_is_a_folder,
    teacher_offload_with_int8_teacher,
    eval_task_file_names_python,
    teacher_device_not_a_device,
    teacher_device_with_teacher_offload,
    teacher_device_with_seq_kd,
    teacher_device_not_on_this_machine,
    teacher_device_under_torchrun,
    async_sampler_under_torchrun,
    served_sampler_unreachable,
    served_sampler_serves_another_model,
    served_sampler_context_too_short,
    served_sampler_lora_without_runtime_loading,
    served_sampler_full_reload_without_dev_mode,
    served_sampler_without_the_servers_token,
    served_sampler_sglang_admin_key,
    served_sampler_admin_token_for_vllm,
    served_sampler_sleep_without_sleep_mode,
    served_sampler_sleep_with_sglang,
    eval_lm_eval_task_jinja_filter,
    eval_lm_eval_task_custom_metric,
    eval_lm_eval_task_hub_dataset,
    eval_num_fewshot_beyond_the_rows,
    keep_best_teacher_metric_with_kd_ratio_0,
    sampling_dtype_under_torchrun,
    sampling_dtype_with_served_sampler,
    cuda_graphs_on_the_cpu,
    cuda_graphs_without_batch_rollouts,
    rollout_batch_size_without_batch_rollouts,
]


@dataclass
class Outcome:
    """What one table case did: the command, the exit status and the `kd: error:` lines."""

    argv: list[str]
    needle: str
    code: int
    stderr: str
    errors: list[str]
    config_before: dict
    config_after: dict


def run_case(case: Case, assets: dict, tmp_path: Path) -> Outcome:
    """Run one case of the table in this process, as `kd` would (also used by
    scripts/errors_doc.py to write docs/errors.md)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("saved before")
    cfg = make_config(assets, out)
    before = copy.deepcopy(cfg)
    argv, needle = case(assets, tmp_path, cfg)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    argv = [a.replace("{cfg}", str(config)) for a in argv]
    stderr = io.StringIO()
    with AFTER_CASE, contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    err = stderr.getvalue()
    errors = [line for line in err.splitlines() if line.startswith("kd: error: ")]
    return Outcome(argv, needle, code, err, errors, before, cfg)


def doc_text(text: str, tmp_path: Path, assets: dict) -> str:
    """``text`` with this run's temporary folders replaced by ``<tmp>`` and ``<assets>``, and a
    test server's free port by ``<port>``."""
    root = Path(assets["data"]).parent
    text = text.replace(str(tmp_path), "<tmp>").replace(str(root), "<assets>")
    return re.sub(r"http://127\.0\.0\.1:[0-9]{4,5}", "http://127.0.0.1:<port>", text)


def md_code(text: str) -> str:
    """``text`` as a code span that fits in a Markdown table cell."""
    text = text.replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def doc_row_of(doc: str, name: str) -> str:
    """The line of docs/errors.md's generated table for case ``name``."""
    rows = [line for line in doc.splitlines() if line.startswith("|") and f" `{name}` |" in line]
    assert len(rows) == 1, f"docs/errors.md has {len(rows)} rows for {name}"
    return rows[0]


DOC = Path(__file__).parents[2] / "docs" / "errors.md"


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_exits_2_with_one_clear_line(case: Case, assets, tmp_path):
    assets_before = {
        name: snapshot(p) if p.is_dir() else p.read_bytes() for name, p in assets.items()
    }

    outcome = run_case(case, assets, tmp_path)

    err, errors = outcome.stderr, outcome.errors
    assert outcome.code == 2, err
    assert "Traceback" not in err
    assert errors, err
    assert any(outcome.needle in line for line in errors), errors
    first = errors[0]
    # One line that names the key or file, then the fix after a ';' (the memory table ends with
    # its fixes).
    assert ";" in first or case is memory_budget_exceeded, first
    assert snapshot(tmp_path / "run") == {"notes.txt": b"saved before"}
    assert not (tmp_path / "pwned").exists()
    assert {
        name: snapshot(p) if p.is_dir() else p.read_bytes() for name, p in assets.items()
    } == assets_before
    # docs/errors.md quotes this exact line (scripts/errors_doc.py writes it).
    quoted = md_code(doc_text(first.removeprefix("kd: error: "), tmp_path, assets))
    assert quoted in doc_row_of(DOC.read_text(), case.__name__), (
        "docs/errors.md is out of date: run python scripts/errors_doc.py"
    )


def test_table_in_docs_lists_every_case():
    doc = DOC.read_text()
    missing = [c.__name__ for c in CASES if f"`{c.__name__}`" not in doc]
    assert not missing


# ---------------------------------------------------------------------------------------------
# Failures during training
# ---------------------------------------------------------------------------------------------


def _nan_at_step(monkeypatch, step: int, accumulation: int) -> None:
    """The first micro-batch of optimizer step ``step`` gets a NaN loss (so NaN gradients)."""
    original = kd.training.train.compute_loss
    calls = {"n": 0}

    def compute_loss(*args, **kwargs):
        calls["n"] += 1
        loss, ce, kd_term = original(*args, **kwargs)
        if calls["n"] == (step - 1) * accumulation + 1:
            loss = loss * float("nan")
        return loss, ce, kd_term

    monkeypatch.setattr(kd.training.train, "compute_loss", compute_loss)


def test_non_finite_loss_stops_naming_the_step_and_keeps_checkpoints(
    assets, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    cfg = make_config(assets, out, max_steps_per_epoch=4, save_every_n_steps=1, keep_last_n=4)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    _nan_at_step(monkeypatch, 3, accumulation=cfg["gradient_accumulation_steps"])
    assert cli.main([*RUN, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (error,) = [line for line in err.splitlines() if line.startswith("kd: error:")]
    assert error.startswith("kd: error: step 3: non-finite loss (nan)")
    latest = checkpoint.find_latest_checkpoint(out)
    assert latest == out / "step_000002"
    assert f"the last good checkpoint is {latest}" in error
    assert not (out / "step_000003").exists() and not (out / "final").exists()
    assert all(t.isfinite().all() for t in checkpoint.load_hf_weights(latest).values())
    assert checkpoint.load_recipe_state(latest)["global_step"] == 2


def test_max_bad_steps_skips_non_finite_steps(assets, tmp_path, caplog, monkeypatch):
    out = tmp_path / "run"
    cfg = make_config(
        assets, out, max_steps_per_epoch=4, save_every_n_steps=1, keep_last_n=4, max_bad_steps=1
    )
    config = write_config(tmp_path / "cfg.yaml", cfg)
    _nan_at_step(monkeypatch, 3, accumulation=cfg["gradient_accumulation_steps"])
    assert cli.main([*RUN, "--config", str(config)]) == 0
    assert "step 3: non-finite loss (nan)" in caplog.text and "step skipped" in caplog.text
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["loss"] != rows[2]["loss"]  # NaN
    # The skipped step leaves the weights as they were; the next step trains again.
    w2, w3, w4 = (load_file(out / f"step_00000{s}" / "model.safetensors") for s in (2, 3, 4))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)
    assert not all(torch.equal(w3[k], w4[k]) for k in w3)
    assert all(t.isfinite().all() for t in load_file(out / "final" / "model.safetensors").values())


def test_disk_full_while_saving_keeps_previous_checkpoint(assets, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    cfg = make_config(assets, out, max_steps_per_epoch=3, save_every_n_steps=1)
    config = write_config(tmp_path / "cfg.yaml", cfg)
    original = kd.checkpoint.hf_folder.save_file
    calls = {"n": 0}

    def save_file(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:  # the save of step 2: half a file, then the disk is full
            Path(filename).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(tensors, filename, metadata=metadata)

    monkeypatch.setattr(kd.checkpoint.hf_folder, "save_file", save_file)
    assert cli.main([*RUN, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (error,) = [line for line in err.splitlines() if line.startswith("kd: error:")]
    assert "could not write checkpoint" in error and "No space left on device" in error
    assert "free disk space" in error
    assert checkpoint.find_latest_checkpoint(out) == out / "step_000001"
    assert checkpoint.load_recipe_state(out / "step_000001")["global_step"] == 1
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step_", ".tmp"))) == [
        "step_000001"
    ]


def test_bad_row_during_training_names_the_step(assets, tmp_path, capsys):
    out = tmp_path / "run"
    # 32 reads by the setup check, 8 per step (batch 4 x accumulation 2): step 3 meets the bad row.
    cfg = make_config(assets, out, max_steps_per_epoch=4, save_every_n_steps=1, shuffle=False)
    cfg["dataset"] = {"_component_": f"{__name__}.RowFailsLater"}
    cfg["trust_remote_components"] = True
    config = write_config(tmp_path / "cfg.yaml", cfg)
    assert cli.main([*RUN, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (error,) = [line for line in err.splitlines() if line.startswith("kd: error:")]
    assert error.startswith("kd: error: dataset: reading the batches of step 3 failed (KeyError")
    assert checkpoint.find_latest_checkpoint(out) == out / "step_000002"


# ---------------------------------------------------------------------------------------------
# Through the terminal: nothing but the error line
# ---------------------------------------------------------------------------------------------


def _kd(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kd.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_refused_component_runs_nothing_subprocess(assets, tmp_path):
    pwned = tmp_path / "pwned"
    cfg = make_config(assets, tmp_path / "run")
    cfg["metric_logger"] = {"_component_": "os.system", "command": f"touch {pwned}"}
    proc = _kd(*RUN, "--config", str(write_config(tmp_path / "cfg.yaml", cfg)))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "kd: error: metric_logger._component_: os.system is not something metric_logger may build "
        "(allowed: kd.metrics.StdoutLogger, kd.metrics.WandBLogger or a "
        "torchtune.training.metric_logging logger); set trust_remote_components: true only if you "
        "trust whoever wrote this config"
    ]
    assert not pwned.exists() and not (tmp_path / "run").exists()


def test_error_inside_the_recipe_subprocess(assets, tmp_path):
    """An error found after the dataset is built (torch, torchtune and the models' shapes loaded)."""
    cfg = make_config(assets, tmp_path / "run")
    rows = [{"input": "1+" * 60, "output": "2"}] * 8
    cfg["dataset"]["data_files"] = write_json(tmp_path / "long.json", rows)
    proc = _kd(*RUN, "--config", str(write_config(tmp_path / "cfg.yaml", cfg)))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kd: error:")]
    assert errors == [
        "kd: error: tokenizer.max_seq_len: every example checked (8 of 8) is at least 64 tokens, "
        "so truncation removed every response token; raise tokenizer.max_seq_len or shorten the "
        "prompts"
    ]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# Runtime inputs (issue 12, parts 3 and 4): damaged tokenizer, model and resume files, a full
# disk, metric loggers that fail, folders the checkpointers cannot create. Same contract as the
# table above, plus: exactly one error line, and every file in output_dir from before is kept
# byte for byte. Each case gets a `Runtime` and returns the argv after `kd` and the needle.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Runtime:
    assets: dict[str, Path]
    tmp: Path
    out: Path  # the run's output_dir; holds notes.txt from "before"
    cfg: dict  # a valid config for `out`, written after the case returns
    monkeypatch: pytest.MonkeyPatch
    saved_run: Path  # a finished 3-step run with step_000001..3, see `saved_run`

    def resume_from_saved(self) -> list[str]:
        """Copy the saved run's step checkpoints and metrics into `out`; the argv resumes them."""
        for item in self.saved_run.iterdir():
            if item.name.startswith("step_"):
                shutil.copytree(item, self.out / item.name)
        shutil.copyfile(self.saved_run / "metrics.jsonl", self.out / "metrics.jsonl")
        self.cfg.update(SAVED_RUN)
        return _run("resume_from_checkpoint=true")


SAVED_RUN = {"max_steps_per_epoch": 3, "save_every_n_steps": 1, "keep_last_n": 5}


@pytest.fixture(scope="module")
def saved_run(assets, tmp_path_factory) -> Path:
    """A run of 3 steps with a checkpoint after each (and final/), made once for the module."""
    out = tmp_path_factory.mktemp("saved") / "run"
    config = write_config(out.parent / "cfg.yaml", make_config(assets, out, **SAVED_RUN))
    assert cli.main([*RUN, "--config", str(config)]) == 0
    return out


RuntimeCase = Callable[[Runtime], tuple[list[str], str]]


def _not_a_folder(ctx: Runtime, key: str) -> tuple[list[str], str]:
    (ctx.tmp / "a_file").write_text("")
    ctx.cfg[key]["output_dir"] = str(ctx.tmp / "a_file" / "tt")
    return _run(), f"{key}.output_dir: cannot create {ctx.tmp / 'a_file' / 'tt'} (Not a directory)"


def checkpointer_output_dir_not_a_folder(ctx):
    """`checkpointer.output_dir` under a regular file"""
    return _not_a_folder(ctx, "checkpointer")


def teacher_checkpointer_output_dir_not_a_folder(ctx):
    """the same for the teacher"""
    return _not_a_folder(ctx, "teacher_checkpointer")


def output_dir_disk_full_when_created(ctx):
    """`ENOSPC` creating `output_dir`"""
    new = ctx.out / "new"
    ctx.cfg["output_dir"] = str(new)
    for key in ("checkpointer", "teacher_checkpointer"):
        ctx.cfg[key]["output_dir"] = str(new)
    mkdir = Path.mkdir

    def full_disk(self, *args, **kwargs):
        if self == new or new in self.parents:
            raise OSError(errno.ENOSPC, "No space left on device", str(new))
        return mkdir(self, *args, **kwargs)

    ctx.monkeypatch.setattr(Path, "mkdir", full_disk)
    return _run(), f"output_dir: cannot write to {new} (No space left on device)"


def _damaged_tokenizer(ctx: Runtime, name: str, text: str) -> Path:
    folder = ctx.tmp / "tokenizer"
    shutil.copytree(ctx.assets["tokenizer"], folder)
    (folder / name).write_text(text)
    ctx.cfg["tokenizer"].update(
        path=str(folder / "vocab.json"),
        merges_file=str(folder / "merges.txt"),
        special_tokens_path=str(folder / "tokenizer.json"),
    )
    return folder / name


def empty_vocab_file(ctx):
    """`vocab.json` of 0 bytes"""
    path = _damaged_tokenizer(ctx, "vocab.json", "")
    return _run(), f"tokenizer.path: {path} is empty"


def empty_merges_file(ctx):
    """`merges.txt` of 0 bytes (trained on a wrong tokenization before)"""
    path = _damaged_tokenizer(ctx, "merges.txt", "")
    return _run(), f"tokenizer.merges_file: {path} is empty"


def broken_special_tokens_file(ctx):
    """`tokenizer.json` cut short"""
    path = _damaged_tokenizer(ctx, "tokenizer.json", '{"added_tokens": [')
    return _run(), f"tokenizer.special_tokens_path: {path} is not valid JSON"


def vocab_without_tokens(ctx):
    """`vocab.json` is `{}` (before: blamed on the first data row)"""
    path = _damaged_tokenizer(ctx, "vocab.json", "{}")
    return (
        _run(),
        f"to no token id (None), so its vocabulary is empty or cut short; restore tokenizer.path ({path})",
    )


def _contradicting_config(ctx: Runtime, which: str, **fields: Any) -> str:
    """A copy of the `which` model whose config.json says `fields`; the checkpointer loads it."""
    folder = ctx.tmp / which
    shutil.copytree(ctx.assets[which], folder)
    hf_config = json.loads((folder / "config.json").read_text())
    hf_config.update(fields)
    (folder / "config.json").write_text(json.dumps(hf_config))
    key = "checkpointer" if which == "student" else "teacher_checkpointer"
    ctx.cfg[key]["checkpoint_dir"] = str(folder)
    return f"{key}.checkpoint_dir: {folder / 'config.json'} says "


def config_json_vocab_size(ctx):
    """config.json `vocab_size: 300`, weights 288 rows"""
    where = _contradicting_config(ctx, "student", vocab_size=300)
    return _run(), where + "vocab_size=300 but the weights have 288 (rows of"


def config_json_hidden_size(ctx):
    """teacher `hidden_size: 64`, weights 48"""
    where = _contradicting_config(ctx, "teacher", hidden_size=64)
    return _run(), where + "hidden_size=64 but the weights have 48 (columns of"


def config_json_num_attention_heads(ctx):
    """`num_attention_heads: 8`, weights 4 heads"""
    where = _contradicting_config(ctx, "student", num_attention_heads=8)
    return _run(), where + "num_attention_heads=8 but the weights have 4"


def config_json_num_key_value_heads(ctx):
    """teacher `num_key_value_heads: 4`, weights 2"""
    where = _contradicting_config(ctx, "teacher", num_key_value_heads=4)
    return _run(), where + "num_key_value_heads=4 but the weights have 2"


def config_json_num_hidden_layers(ctx):
    """`num_hidden_layers: 3`, weights 2 layers"""
    where = _contradicting_config(ctx, "student", num_hidden_layers=3)
    return _run(), where + "num_hidden_layers=3 but the weights have 2"


def config_json_intermediate_size(ctx):
    """`intermediate_size: 128`, weights 64"""
    where = _contradicting_config(ctx, "student", intermediate_size=128)
    return _run(), where + "intermediate_size=128 but the weights have 64"


def config_json_tied_with_lm_head(ctx):
    """teacher `tie_word_embeddings: true` with an `lm_head.weight`"""
    where = _contradicting_config(ctx, "teacher", tie_word_embeddings=True)
    return _run(), where + "tie_word_embeddings=true but the weights hold a separate lm_head"


def config_json_untied_without_lm_head(ctx):
    """`tie_word_embeddings: false`, no `lm_head.weight`"""
    where = _contradicting_config(ctx, "student", tie_word_embeddings=False)
    return _run(), where + "tie_word_embeddings=false but the weights have no lm_head.weight"


def metrics_disk_full(ctx):
    """`ENOSPC` writing the step 2 metrics row"""
    _disk_full_on_metrics_row(ctx.monkeypatch, ctx.out / "metrics.jsonl", row=2)
    return _run(), "output_dir: cannot write the step 2 row of"


def final_save_disk_full(ctx):
    """`ENOSPC` writing `final/`"""
    ctx.cfg.update(SAVED_RUN)
    _disk_full_in_save(ctx.monkeypatch, ".tmp_final_")
    return _run(), (
        f"output_dir: could not write checkpoint {ctx.out / 'final'}: [Errno 28] No space left "
        f"on device; free disk space under {ctx.out} or set output_dir to a disk with room (the "
        "earlier checkpoints are kept; the newest, step_000003, resumes with"
    )


def _logger(ctx: Runtime, name: str) -> str:
    ctx.cfg["metric_logger"] = {"_component_": f"{__name__}.{name}"}
    ctx.cfg["trust_remote_components"] = True
    return f"metric_logger: {__name__}.{name}"


def metric_logger_fails_to_start(ctx):
    """the logger's constructor raises"""
    return _run(), _logger(ctx, "LoggerFailsToStart") + " failed (ConnectionError: no server"


def metric_logger_log_dict_fails(ctx):
    """`log_dict` raises at step 2 (and `close` too)"""
    # Its close() fails too: the first error is the one reported.
    return _run(), _logger(ctx, "LoggerFailsAtStep2") + ".log_dict() failed (ValueError: rejected"


def metric_logger_close_fails(ctx):
    """`close` raises after a finished run"""
    return _run(), _logger(ctx, "LoggerFailsToClose") + ".close() failed (RuntimeError: flush"


def metric_logger_log_config_fails(ctx):
    """`log_config` raises"""
    return _run(), _logger(ctx, "LoggerRejectsConfig") + ".log_config() failed (TypeError"


def metric_logger_without_log_dict(ctx):
    """a class without `log_dict` (before: an AttributeError in cleanup)"""
    return _run(), _logger(ctx, "NotALogger") + " has no log_dict(payload, step) method"


def _crafted(step_dir: Path, name: str, write: Callable[[Path], None]) -> Path:
    """Replace `name` in a checkpoint and record its size and hash in the marker (as if kd wrote
    it): only reading the file can tell it is wrong."""
    path = step_dir / name
    write(path)
    marker = json.loads((step_dir / checkpoint.MARKER_FILE).read_text())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    marker["files"][name] = {"size": path.stat().st_size, "sha256": digest}
    (step_dir / checkpoint.MARKER_FILE).write_text(json.dumps(marker))
    return path


def recipe_state_not_a_dict(ctx):
    """resume; `recipe_state.pt` holds a list (marker rewritten to match)"""
    argv = ctx.resume_from_saved()
    state = _crafted(ctx.out / "step_000003", "recipe_state.pt", lambda p: torch.save([1, 2], p))
    return argv, f"{state}: holds a list, not a recipe state (a dict); delete step_000003"


def recipe_state_without_optimizer(ctx):
    """resume; a dict without kd's entries"""
    argv = ctx.resume_from_saved()
    state = _crafted(
        ctx.out / "step_000003", "recipe_state.pt", lambda p: torch.save({"global_step": 3}, p)
    )
    return argv, f"{state}: its 'optimizer' is missing, so this is not a kd recipe state"


def config_snapshot_not_yaml(ctx):
    """resume; the checkpoint's `config.yaml` is not YAML"""
    argv = ctx.resume_from_saved()
    path = _crafted(ctx.out / "step_000003", "config.yaml", lambda p: p.write_text("a: [\n"))
    return argv, f"{path}: not a readable config snapshot"


def every_checkpoint_damaged(ctx):
    """resume; every marker unreadable"""
    argv = ctx.resume_from_saved()
    for step_dir in ctx.out.glob("step_*"):
        (step_dir / checkpoint.MARKER_FILE).write_text("{")
    return argv, f"resume_from_checkpoint: every step checkpoint under {ctx.out} is incomplete"


RUNTIME_CASES: list[RuntimeCase] = [
    checkpointer_output_dir_not_a_folder,
    teacher_checkpointer_output_dir_not_a_folder,
    output_dir_disk_full_when_created,
    empty_vocab_file,
    empty_merges_file,
    broken_special_tokens_file,
    vocab_without_tokens,
    config_json_vocab_size,
    config_json_hidden_size,
    config_json_num_attention_heads,
    config_json_num_key_value_heads,
    config_json_num_hidden_layers,
    config_json_intermediate_size,
    config_json_tied_with_lm_head,
    config_json_untied_without_lm_head,
    metrics_disk_full,
    final_save_disk_full,
    metric_logger_fails_to_start,
    metric_logger_log_dict_fails,
    metric_logger_close_fails,
    metric_logger_log_config_fails,
    metric_logger_without_log_dict,
    recipe_state_not_a_dict,
    recipe_state_without_optimizer,
    config_snapshot_not_yaml,
    every_checkpoint_damaged,
]
# The run finished (final/ written) before the error.
_FINISHED = (metric_logger_close_fails,)


def run_runtime_case(
    case: RuntimeCase, assets: dict, tmp_path: Path, saved_run: Path, monkeypatch
) -> tuple[Outcome, dict, dict]:
    """Run one runtime case in this process (also used by scripts/errors_doc.py).

    Returns:
        What it did, and snapshots of output_dir before and after.
    """
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("saved before")
    cfg = make_config(assets, out)
    ctx = Runtime(assets, tmp_path, out, cfg, monkeypatch, saved_run)
    config_before = copy.deepcopy(cfg)
    argv, needle = case(ctx)
    config = write_config(tmp_path / "cfg.yaml", ctx.cfg)
    before = snapshot(out)
    argv = [a.replace("{cfg}", str(config)) for a in argv]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(argv)
    finally:
        monkeypatch.undo()
    err = stderr.getvalue()
    errors = [line for line in err.splitlines() if line.startswith("kd: error: ")]
    outcome = Outcome(argv, needle, code, err, errors, config_before, ctx.cfg)
    return outcome, before, snapshot(out)


@pytest.mark.parametrize("case", RUNTIME_CASES, ids=[c.__name__ for c in RUNTIME_CASES])
def test_bad_runtime_input_exits_2_with_one_clear_line(
    case: RuntimeCase, assets, saved_run, tmp_path, monkeypatch
):
    assets_before = {
        name: snapshot(p) if p.is_dir() else p.read_bytes() for name, p in assets.items()
    }

    outcome, before, after = run_runtime_case(case, assets, tmp_path, saved_run, monkeypatch)

    err, errors = outcome.stderr, outcome.errors
    assert outcome.code == 2, err
    assert "Traceback" not in err
    assert len(errors) == 1, err
    assert outcome.needle in errors[0], errors
    assert ";" in errors[0]
    assert {name: after.get(name) for name in before} == before  # nothing written before is lost
    assert not (tmp_path / "run" / "final").exists() or case in _FINISHED
    assert {
        name: snapshot(p) if p.is_dir() else p.read_bytes() for name, p in assets.items()
    } == assets_before
    # docs/errors.md quotes this exact line (scripts/errors_doc.py writes it).
    quoted = md_code(doc_text(errors[0].removeprefix("kd: error: "), tmp_path, assets))
    assert quoted in doc_row_of(DOC.read_text(), case.__name__), (
        "docs/errors.md is out of date: run python scripts/errors_doc.py"
    )


def test_runtime_cases_in_docs():
    doc = (Path(__file__).parents[2] / "docs" / "errors.md").read_text()
    assert not [c.__name__ for c in RUNTIME_CASES if f"`{c.__name__}`" not in doc]


class LoggerFailsToStart:
    def __init__(self, **_: Any):
        raise ConnectionError("no server at the tracking URL")


class LoggerFailsAtStep2:
    def log_dict(self, payload: dict, step: int) -> None:
        if step >= 2:
            raise ValueError("rejected payload")

    def close(self) -> None:
        raise RuntimeError("flush failed")


class LoggerFailsToClose:
    def log_dict(self, payload: dict, step: int) -> None:
        pass

    def close(self) -> None:
        raise RuntimeError("flush failed")


class LoggerRejectsConfig(LoggerFailsToClose):
    def log_config(self, config: Any) -> None:
        raise TypeError("config values must be strings")


class NotALogger:
    def close(self) -> None:
        pass


def _disk_full_on_metrics_row(monkeypatch, metrics: Path, row: int) -> None:
    """Writing the `row`-th row of `metrics` writes half of it, then the disk is full."""
    write, rows = os.write, {"n": 0}

    def full_disk(fd: int, data) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == str(metrics):
            rows["n"] += 1
            if rows["n"] == row:
                write(fd, bytes(data)[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)


def _disk_full_in_save(monkeypatch, folder_prefix: str) -> None:
    """safetensors' save into a temporary folder named `folder_prefix...`: half a file, then ENOSPC."""
    original = kd.checkpoint.hf_folder.save_file

    def save_file(tensors, filename, metadata=None):
        if Path(filename).parent.name.startswith(folder_prefix):
            Path(filename).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(tensors, filename, metadata=metadata)

    monkeypatch.setattr(kd.checkpoint.hf_folder, "save_file", save_file)


def test_disk_full_in_metrics_keeps_whole_rows_and_resumes(assets, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", make_config(assets, out, **SAVED_RUN))
    _disk_full_on_metrics_row(monkeypatch, out / "metrics.jsonl", row=3)
    assert cli.main([*RUN, "--config", str(config)]) == 2
    monkeypatch.undo()
    assert "No space left on device" in capsys.readouterr().err
    # The half row is gone: the file holds whole rows only, and the checkpoints before it.
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert checkpoint.find_latest_checkpoint(out) == out / "step_000002"
    assert cli.main([*RUN, "--config", str(config), "resume_from_checkpoint=true"]) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert (out / "final" / "model.safetensors").exists()


def test_disk_full_in_final_save_then_resume_writes_final(assets, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", make_config(assets, out, **SAVED_RUN))
    _disk_full_in_save(monkeypatch, ".tmp_final_")
    assert cli.main([*RUN, "--config", str(config)]) == 2
    monkeypatch.undo()
    assert "step_000003, resumes with resume_from_checkpoint=true" in capsys.readouterr().err
    assert not (out / "final").exists() and not list(out.glob(".tmp_*"))
    assert cli.main([*RUN, "--config", str(config), "resume_from_checkpoint=true"]) == 0
    assert (out / "final" / "model.safetensors").exists()
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def _marker_not_json(step_dir: Path) -> str:
    (step_dir / checkpoint.MARKER_FILE).write_text('{"step": 3')
    return "kd_checkpoint.json is unreadable (JSONDecodeError"


def _marker_of_another_shape(step_dir: Path) -> str:
    marker = json.loads((step_dir / checkpoint.MARKER_FILE).read_text())
    marker["files"] = list(marker["files"])
    (step_dir / checkpoint.MARKER_FILE).write_text(json.dumps(marker))
    return "kd_checkpoint.json is unreadable (ValueError: not a kd marker"


def _recipe_state_truncated(step_dir: Path) -> str:
    state = step_dir / checkpoint.RECIPE_STATE_FILE
    state.write_bytes(state.read_bytes()[:100])
    return "recipe_state.pt has 100 bytes"


@pytest.mark.parametrize(
    "damage", [_marker_not_json, _marker_of_another_shape, _recipe_state_truncated]
)
def test_resume_skips_a_damaged_newest_checkpoint(
    damage, assets, saved_run, tmp_path, caplog, capsys
):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "step_000003")
    reason = damage(out / "step_000002")
    before = snapshot(out / "step_000001")
    config = write_config(tmp_path / "cfg.yaml", make_config(assets, out, **SAVED_RUN))
    assert cli.main([*RUN, "--config", str(config), "resume_from_checkpoint=true"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert f"skipping checkpoint {out / 'step_000002'}: {reason}" in caplog.text
    assert f"resumed from {out / 'step_000001'} at step 1" in caplog.text
    assert snapshot(out / "step_000001") == before
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_resume_drops_damaged_metric_rows_and_says_so(assets, saved_run, tmp_path, caplog, capsys):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "step_000003")
    rows = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    damaged = [b"not json\n", rows[0], b'{"loss": 1.0}\n', b"\xff\xfe\n", rows[1], rows[2][:9]]
    (out / "metrics.jsonl").write_bytes(b"".join(damaged))
    config = write_config(tmp_path / "cfg.yaml", make_config(assets, out, **SAVED_RUN))
    assert cli.main([*RUN, "--config", str(config), "resume_from_checkpoint=true"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert "dropped 4 damaged line(s) while resuming at step 2" in caplog.text
    assert "not JSON: lines 1, 4, 6; no integer step: line 3" in caplog.text
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
