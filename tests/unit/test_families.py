"""kd.families: lookups of the model-family table, and the table against torchtune 0.6.1."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import subprocess
import sys

import pytest

from kd import families


@pytest.mark.parametrize(
    "builder,family",
    [
        ("qwen2_5_3b", "qwen2_5"),
        ("lora_qwen2_5_14b_instruct", "qwen2_5"),
        ("qwen2", "qwen2"),
        ("qwen2_7b", "qwen2"),
        ("llama3_2_1b", "llama3_2"),
        ("lora_llama3_2_vision_11b", "llama3_2_vision"),
        ("llama3_8b", "llama3"),
        ("llama3_1", "llama3_1"),
        ("code_llama2_7b", "code_llama2"),
        ("gemma2_2b", "gemma2"),
        ("phi3_mini", "phi3"),
    ],
)
def test_family_of_builder_takes_the_longest_prefix(builder: str, family: str) -> None:
    assert families.family_of_builder(builder).name == family


def test_unknown_builders_and_packages_have_no_family() -> None:
    assert families.family_of_builder("my_decoder_1b") is None
    assert families.family_of_package("t5") is None
    assert families.family_of_package("qwen2_5").tokenizer == "qwen2"


def test_model_types_map_to_tokenizer_groups() -> None:
    assert families.tokenizer_of_model_type("QWEN2") == "qwen2"
    assert families.tokenizer_of_model_type("LLAMA3_2") == "llama3"
    assert families.tokenizer_of_model_type("GEMMA2") == "gemma"
    assert families.tokenizer_of_model_type("REWARD") is None
    assert families.model_types_of_tokenizer("llama3") == ["LLAMA3", "LLAMA3_2", "LLAMA3_VISION"]
    assert families.model_types_of_tokenizer("gemma") == ["GEMMA", "GEMMA2"]
    assert families.model_types_of_tokenizer("nothing") == []


def test_architecture_decides_the_qk_permutation() -> None:
    assert families.architecture_of_model_type("QWEN2") == families.QWEN2
    assert not families.permutes_qk("QWEN2")
    for model_type in ("LLAMA2", "LLAMA3", "LLAMA3_2", "MISTRAL", "T5_ENCODER"):
        assert families.architecture_of_model_type(model_type) == families.LLAMA
        assert families.permutes_qk(model_type)
    assert families.architecture_of_hf_model_type("qwen2") == families.QWEN2
    assert families.architecture_of_hf_model_type("qwen2_moe") == families.QWEN2
    assert families.architecture_of_hf_model_type("llama") == families.LLAMA
    assert families.architecture_of_hf_model_type("mllama") == families.LLAMA
    assert families.architecture_of_hf_model_type("unknown") == families.LLAMA


def test_table_names_torchtune_packages_and_model_types() -> None:
    from kd._torchtune import ModelType

    for family in families.FAMILIES.values():
        # find_spec, not import: llama3_2_vision imports torchvision, which kd does not need.
        assert importlib.util.find_spec(f"torchtune.models.{family.name}"), family.name
        assert set(family.model_types) <= set(ModelType.__members__), family.name
        assert family.architecture in (families.QWEN2, families.LLAMA)
        if family.component_tied is not None:
            # The component builder the planner sizes, and its default tie_word_embeddings.
            module = importlib.import_module(f"torchtune.models.{family.name}")
            tie = inspect.signature(getattr(module, family.name)).parameters.get(
                "tie_word_embeddings"
            )
            assert (tie.default if tie is not None else False) == family.component_tied


def test_import_does_not_import_torch() -> None:
    code = "import sys, kd.families; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
