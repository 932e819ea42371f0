"""``kd init``'s detections: the data format of a file's first rows, and which torchtune 0.6.1
component builder (if any) builds a Hugging Face config.json exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kd.errors import KDUserError
from kd.scaffold.data import ACCEPTED_COLUMNS, detect_data_format
from kd.scaffold.inspection import TorchtuneUnsupported, torchtune_build

CHAT = {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("rows", "component", "args"),
    [
        (
            [CHAT, CHAT],
            "chat_dataset",
            {"conversation_column": "messages", "conversation_style": "openai"},
        ),
        (
            [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}],
            "chat_dataset",
            {"conversation_column": "conversations", "conversation_style": "sharegpt"},
        ),
        (
            [{"instruction": "Add 1 and 1.", "output": "2"}],
            "instruct_dataset",
            {"column_map": {"input": "instruction", "output": "output"}, "train_on_input": False},
        ),
        (
            # input empty everywhere: the instruction alone is the prompt
            [{"instruction": "Add 1 and 1.", "input": "", "output": "2"}],
            "instruct_dataset",
            {"column_map": {"input": "instruction", "output": "output"}},
        ),
        (
            [
                {"instruction": "Add.", "input": "", "output": "0"},
                {"instruction": "Add.", "input": "1 1", "output": "2"},
            ],
            "alpaca_dataset",
            {"train_on_input": False},
        ),
        ([{"input": "1+1", "output": "2"}], "instruct_dataset", {"train_on_input": False}),
        ([{"text": "one two three", "id": 3}], "text_completion_dataset", {}),
        # messages win over a text column beside them
        ([{**CHAT, "text": "x"}], "chat_dataset", {"conversation_style": "openai"}),
    ],
)
def test_json_lines_formats(tmp_path, rows, component, args):
    path = _jsonl(tmp_path / "d.jsonl", rows)
    fmt = detect_data_format(path)
    assert fmt.node["_component_"] == f"torchtune.datasets.{component}"
    assert fmt.node["source"] == "json"
    assert fmt.node["data_files"] == str(path)
    assert fmt.node["split"] == "train"
    assert {k: fmt.node[k] for k in args} == args
    if component == "instruct_dataset" and "column_map" not in args:
        assert "column_map" not in fmt.node


def test_json_array_csv_and_parquet(tmp_path):
    array = tmp_path / "d.json"
    array.write_text(json.dumps([CHAT, CHAT], indent=2))
    assert detect_data_format(array).kind == "chat"

    table = tmp_path / "d.csv"
    table.write_text('instruction,output\n"Add 1, 1",2\n')
    fmt = detect_data_format(table)
    assert (fmt.kind, fmt.node["source"]) == ("instruct", "csv")

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a b", "c d"]}), parquet)
    fmt = detect_data_format(parquet)
    assert (fmt.kind, fmt.node["source"]) == ("text", "parquet")


def test_relative_path_becomes_absolute(tmp_path, monkeypatch):
    _jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    monkeypatch.chdir(tmp_path)
    assert detect_data_format(Path("d.jsonl")).node["data_files"] == str(tmp_path / "d.jsonl")


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("d.jsonl", '{"question": "q", "answer": "a"}\n', "columns (question, answer)"),
        ("d.jsonl", "", "has no rows"),
        ("d.jsonl", '{"text": "a"}\nnot json\n', "neither JSON lines"),
        ("d.jsonl", "[1, 2]\n", "holds int rows"),
        ("d.jsonl", '{"messages": "hello"}\n', "not a list of {role, content} messages"),
        ("d.txt", "hello\n", "reads .jsonl, .json, .csv and .parquet"),
        ("missing.jsonl", None, "does not exist"),
    ],
)
def test_refusals_are_one_line_naming_the_flag(tmp_path, name, content, needle):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(KDUserError) as e:
        detect_data_format(path)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("--data: ")
    assert needle in message
    if "columns (" in needle:
        assert ACCEPTED_COLUMNS in message


# ---------------------------------------------------------------------- builder choice
def _config(model_type: str, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    config.update(extra)
    return config


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
DIMS = {
    "vocab_size": 1000,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "intermediate_dim": 128,
    "max_seq_len": 512,
    "norm_eps": 1e-5,
}


@pytest.mark.parametrize(
    ("config", "builder", "model_type", "extra"),
    [
        (
            _config("qwen2", rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False),
            "torchtune.models.qwen2.qwen2",
            "QWEN2",
            {"rope_base": 1_000_000, "tie_word_embeddings": True},
        ),
        (  # transformers 5 writes rope_parameters
            _config("qwen2", rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
            "torchtune.models.qwen2.qwen2",
            "QWEN2",
            {"rope_base": 500_000, "tie_word_embeddings": False},
        ),
        (
            _config("llama", rope_theta=5e5),
            "torchtune.models.llama3.llama3",
            "LLAMA3",
            {"rope_base": 500_000},
        ),
        (
            _config("llama", rope_theta=5e5, rope_scaling={**LLAMA3_ROPE, "factor": 8.0}),
            "torchtune.models.llama3_1.llama3_1",
            "LLAMA3",
            {"rope_base": 500_000, "scale_factor": 8},
        ),
        (  # Llama 3.2 1B / 3B
            _config(
                "llama",
                tie_word_embeddings=True,
                rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5},
            ),
            "torchtune.models.llama3_2.llama3_2",
            "LLAMA3_2",
            {"rope_base": 500_000, "scale_factor": 32, "tie_word_embeddings": True},
        ),
        (  # SmolLM2: tied Llama without RoPE scaling = llama3_2 with scale_factor 1
            _config("llama", tie_word_embeddings=True, rope_theta=1e5),
            "torchtune.models.llama3_2.llama3_2",
            "LLAMA3_2",
            {"rope_base": 100_000, "scale_factor": 1, "tie_word_embeddings": True},
        ),
    ],
)
def test_torchtune_builders(config, builder, model_type, extra):
    build = torchtune_build(config)
    assert build.builder == builder
    assert build.lora_builder == builder.rsplit(".", 1)[0] + ".lora_" + builder.rsplit(".", 1)[1]
    assert build.model_type == model_type
    assert build.kwargs == {**DIMS, **extra}


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (_config("qwen3", head_dim=16), "no qwen3 builder"),
        (_config("gemma3_text"), "no gemma3_text builder"),
        (_config("mistral"), "no mistral builder"),
        (_config("qwen2", use_sliding_window=True), "sliding-window"),
        (
            _config("qwen2", layer_types=["full_attention", "sliding_attention"]),
            "sliding-window",
        ),
        (_config("qwen2", rope_scaling={"type": "yarn", "factor": 4.0}), "'yarn'"),
        (_config("llama", head_dim=32), "head_dim 32"),
        (_config("llama", attention_bias=True), "attention_bias"),
        (_config("llama", hidden_act="gelu"), "gelu"),
        (_config("llama", rope_scaling={**LLAMA3_ROPE, "high_freq_factor": 2.0}), "high_freq"),
        (_config("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}), "'linear'"),
        (_config("llama", num_hidden_layers=None), "num_hidden_layers"),
    ],
)
def test_not_built_exactly_by_torchtune(config, needle):
    with pytest.raises(TorchtuneUnsupported, match=None) as e:
        torchtune_build(config)
    assert needle in str(e.value)


def _chat(*roles: str) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": f"{r} says hi"} for r in roles]}


def test_chat_roles_kd_renders_are_accepted(tmp_path):
    rows = [_chat("system", "user", "assistant"), _chat("user", "assistant", "tool", "assistant")]
    fmt = detect_data_format(_jsonl(tmp_path / "d.jsonl", rows))
    assert fmt.kind == "chat"
    assert [[role for role, _ in c] for c in fmt.conversations] == [
        ["system", "user", "assistant"],
        ["user", "assistant", "tool", "assistant"],
    ]


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        (
            [CHAT, CHAT, _chat("user", "narrator", "assistant")],
            "--data: row 3, message 2 has role 'narrator', which kd does not render; use system, "
            "user, assistant, tool",
        ),
        (
            [_chat("developer", "user", "assistant")],
            "--data: row 1, message 1 has role 'developer'",
        ),
        (
            [
                {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
                {"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]},
            ],
            "--data: row 2, message 2 of ",
        ),
    ],
)
def test_other_chat_roles_are_refused_with_the_row(tmp_path, rows, needle):
    with pytest.raises(KDUserError) as e:
        detect_data_format(_jsonl(tmp_path / "d.jsonl", rows))
    message = str(e.value)
    assert message.startswith(needle) and "\n" not in message
