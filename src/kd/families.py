"""Model families: what kd knows about each torchtune model package, in one table.

One row per ``torchtune.models.<name>`` package. Its builders are named after it
(``qwen2_5_3b``, ``lora_qwen2_5_3b``), its tokenizer fixes the token ids, and a torchtune
``ModelType`` names the weight conversion its checkpointer uses. Three places read the table:

- ``kd.config.validate``: teacher, student and tokenizer must share token ids (one ``tokenizer``
  group), and ``checkpointer.model_type`` must convert weights of the builder's group;
- ``kd.memory.shapes``: the ``architecture`` sizes q/k/v biases and the RoPE cache, and the
  component builders' default ``tie_word_embeddings`` and per-layer LoRA RoPE count parameters;
- ``kd.checkpoint``: the ``architecture`` of a ``ModelType`` picks the weight-name map and whether
  q/k rows are permuted between torchtune and Hugging Face.

kd converts and sizes two decoder architectures: ``qwen2`` (q/k/v biases; torchtune keeps HF's
half-split RoPE order, so q/k rows are not permuted) and ``llama`` (every other family: no biases;
torchtune's RoPE is interleaved, HF's half-split, so q/k rows are permuted on conversion).

Importing this module must not import torch: the config validator and the memory planner read it
before any model is built.
"""

from __future__ import annotations

from dataclasses import dataclass

QWEN2 = "qwen2"
LLAMA = "llama"


@dataclass(frozen=True)
class Family:
    """One torchtune model package.

    Attributes:
        name: the package, ``torchtune.models.<name>``; its builders' names start with it.
        tokenizer: token-id group. KD compares the two models' distributions id by id, so
            teacher, student and tokenizer come from packages of one group.
        model_types: torchtune ``ModelType`` names that convert this package's HF weights.
        architecture: ``qwen2`` or ``llama`` (see the module docstring).
        hf_model_type: ``model_type`` in the HF ``config.json`` of its checkpoints.
        component_tied: default ``tie_word_embeddings`` of the component builder
            ``torchtune.models.<name>.<name>``, which the planner sizes from its shape kwargs;
            None where kd does not size that builder.
        lora_rope_per_layer: the ``lora_*`` builders build one RoPE module (and cache) per layer
            instead of sharing one.
    """

    name: str
    tokenizer: str
    model_types: tuple[str, ...]
    architecture: str = LLAMA
    hf_model_type: str = "llama"
    component_tied: bool | None = None
    lora_rope_per_layer: bool = True


# Read from torchtune 0.6.1: `models/<name>/` (builders, lora RoPE), the `model_type` of its
# recipe configs, and the HF configs of the checkpoints those configs download.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen2", QWEN2, ("QWEN2",), QWEN2, "qwen2", component_tied=False),
        Family("qwen2_5", QWEN2, ("QWEN2",), QWEN2, "qwen2"),
        Family("llama2", "llama2", ("LLAMA2",), component_tied=False),
        Family("code_llama2", "llama2", ("LLAMA2",)),
        Family("llama3", "llama3", ("LLAMA3",), component_tied=False),
        Family("llama3_1", "llama3", ("LLAMA3",), component_tied=False, lora_rope_per_layer=False),
        Family("llama3_2", "llama3", ("LLAMA3_2",), component_tied=True, lora_rope_per_layer=False),
        # llama3_3's builders are llama3_1's.
        Family("llama3_3", "llama3", ("LLAMA3",), lora_rope_per_layer=False),
        Family(
            "llama3_2_vision",
            "llama3",
            ("LLAMA3_VISION",),
            hf_model_type="mllama",
            lora_rope_per_layer=False,
        ),
        Family("gemma", "gemma", ("GEMMA",), hf_model_type="gemma"),
        Family("gemma2", "gemma", ("GEMMA2",), hf_model_type="gemma2"),
        Family("mistral", "mistral", ("MISTRAL",), hf_model_type="mistral"),
        Family("phi3", "phi3", ("PHI3_MINI",), hf_model_type="phi3"),
        Family("phi4", "phi4", ("PHI4",), hf_model_type="phi3"),
    )
}

# Longest names first, so `llama3_2_1b` finds llama3_2 and not llama3.
_BY_NAME_LENGTH = sorted(FAMILIES.values(), key=lambda f: len(f.name), reverse=True)


def family_of_package(package: str) -> Family | None:
    """The row of ``torchtune.models.<package>``, or None for a package not in the table."""
    return FAMILIES.get(package)


def family_of_builder(name: str) -> Family | None:
    """The row whose builders include ``name`` (``qwen2_5_3b``, ``lora_llama3_2_1b``, ``qwen2``).

    Args:
        name: a builder's name, without its module path.

    Returns:
        The family with the longest name that the builder's name (after ``lora_``) starts with,
        or None.
    """
    base = name.removeprefix("lora_")
    return next((f for f in _BY_NAME_LENGTH if base.startswith(f.name)), None)


def tokenizer_of_model_type(model_type: str) -> str | None:
    """Token-id group of the weights a torchtune ``ModelType`` name converts, or None if unknown."""
    return next((f.tokenizer for f in FAMILIES.values() if model_type in f.model_types), None)


def model_types_of_tokenizer(tokenizer: str) -> list[str]:
    """``ModelType`` names of a token-id group, each once, in table order."""
    out: list[str] = []
    for f in FAMILIES.values():
        if f.tokenizer == tokenizer:
            out += [t for t in f.model_types if t not in out]
    return out


def architecture_of_model_type(model_type: str) -> str:
    """``qwen2`` or ``llama`` for a torchtune ``ModelType`` name (``llama`` when not in the table).

    Args:
        model_type: upper-case ``ModelType`` name (``QWEN2``, ``LLAMA3_2``).
    """
    return next((f.architecture for f in FAMILIES.values() if model_type in f.model_types), LLAMA)


def architecture_of_hf_model_type(hf_model_type: str) -> str:
    """``qwen2`` or ``llama`` for an HF ``config.json`` ``model_type`` (``qwen2_moe`` -> qwen2).

    The family whose ``hf_model_type`` is the longest prefix decides; ``llama`` when none is.
    """
    fits = [f for f in FAMILIES.values() if hf_model_type.startswith(f.hf_model_type)]
    return max(fits, key=lambda f: len(f.hf_model_type)).architecture if fits else LLAMA


def permutes_qk(model_type: str) -> bool:
    """Whether converting a ``ModelType``'s weights between torchtune and HF permutes q/k rows.

    torchtune's Llama RoPE is interleaved and HF's half-split, so q/k output rows are permuted;
    torchtune's Qwen2 uses HF's layout (torchtune's own ``tune_to_peft_adapter_weights`` permutes
    anyway, which breaks Qwen2 adapters; hence kd's converter).
    """
    return architecture_of_model_type(model_type) != QWEN2
