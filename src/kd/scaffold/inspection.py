"""``kd init``'s folder inspection: a model folder's ``config.json`` -> how kd builds the model.

Only ``config.json`` (and the safetensors index or names) is read: :func:`choose_model` picks
torchtune's component builder where torchtune 0.6.1 builds the architecture exactly
(:func:`torchtune_build`: Qwen2 / Qwen2.5, Llama 3.x and other Llama-shaped models) and the
transformers backend (``kd.hf.causal_lm``) otherwise. No torch is imported here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kd import folders as kd_folders
from kd.errors import KDUserError, brief, one_line

Backend = Literal["auto", "torchtune", "transformers"]
BACKENDS: tuple[str, ...] = ("auto", "torchtune", "transformers")
HF_CONFIG_FILE = kd_folders.CONFIG_JSON
# torchtune 0.6.1's Llama3ScaledRoPE fixes these; a llama3 rope_scaling with others is not its RoPE.
_LLAMA3_ROPE_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_HF_ROPE_THETA_DEFAULT = 10000.0  # Qwen2Config / LlamaConfig default rope_theta
_HF_NORM_EPS_DEFAULT = 1e-6  # Qwen2Config / LlamaConfig default rms_norm_eps


class TorchtuneUnsupported(ValueError):
    """torchtune 0.6.1 has no component builder that builds this ``config.json`` exactly."""


@dataclass(frozen=True)
class TorchtuneBuild:
    """How torchtune builds one ``config.json``.

    Attributes:
        builder: the component builder (``torchtune.models.qwen2.qwen2``).
        lora_builder: its LoRA twin (``torchtune.models.qwen2.lora_qwen2``).
        kwargs: the builder's arguments, every dimension from ``config.json``.
        model_type: torchtune ``ModelType`` name of the checkpointer (``QWEN2``, ``LLAMA3``...).
    """

    builder: str
    lora_builder: str
    kwargs: dict[str, Any]
    model_type: str


def read_hf_config(folder: Path, *, flag: str) -> dict[str, Any]:
    """The ``config.json`` of a model folder, as a dict (nothing else is read).

    Raises:
        KDUserError: the folder or its config.json is missing, not a JSON object, or asks for
            the folder's own code (:func:`kd.folders.read_config_json`); names ``flag``.
    """
    return kd_folders.read_config_json(folder, key=flag)


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (multimodal configs nest it in ``text_config``)."""
    text = config.get("text_config")
    if "vocab_size" not in config and isinstance(text, Mapping):
        return text
    return config


def _whole(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TorchtuneUnsupported(f"its {key} is {value!r}, not a whole number >= 1")
    return value


def _rope(config: Mapping[str, Any]) -> tuple[str, float, Mapping[str, Any]]:
    """``(rope_type, theta, parameters)`` from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` / ``rope_scaling`` (older files)."""
    params = config.get("rope_parameters")
    if not isinstance(params, Mapping):
        params = config.get("rope_scaling")
    params = params if isinstance(params, Mapping) else {}
    rope_type = str(params.get("rope_type", params.get("type", "default")) or "default")
    theta = params.get("rope_theta", config.get("rope_theta", _HF_ROPE_THETA_DEFAULT))
    return rope_type, float(theta), params


def _number(value: float) -> int | float:
    """A float that is a whole number as an int (``32.0`` -> ``32``), for integer arguments."""
    return int(value) if float(value).is_integer() else float(value)


def torchtune_build(config: Mapping[str, Any]) -> TorchtuneBuild:
    """The torchtune 0.6.1 component builder that builds ``config`` exactly.

    ``qwen2`` (Qwen2 / Qwen2.5) -> ``torchtune.models.qwen2.qwen2``. ``llama`` -> ``llama3_1``
    (Llama 3.1-style ``llama3`` RoPE scaling, untied) or ``llama3_2`` (the same scaling, or none
    with ``scale_factor: 1``, tied embeddings) or ``llama3`` (no scaling, untied). Anything else
    (Qwen3, Gemma, Mistral, sliding windows, biases torchtune's builder lacks, other RoPE
    scalings, a head_dim that is not hidden_size / num_attention_heads) is not built exactly.

    Args:
        config: a Hugging Face ``config.json`` as a dict.

    Raises:
        TorchtuneUnsupported: with the reason (a few words naming the config.json field).
    """
    model_type = config.get("model_type")
    if model_type not in ("qwen2", "llama"):
        raise TorchtuneUnsupported(f"torchtune 0.6.1 has no {model_type} builder")
    embed_dim = _whole(config, "hidden_size")
    num_heads = _whole(config, "num_attention_heads")
    head_dim = config.get("head_dim")
    if embed_dim % num_heads or head_dim not in (None, embed_dim // num_heads):
        raise TorchtuneUnsupported(
            f"its head_dim {head_dim} is not hidden_size / num_attention_heads "
            f"({embed_dim} / {num_heads}), which torchtune's builders assume"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise TorchtuneUnsupported(f"its hidden_act is {config.get('hidden_act')!r}, not silu")
    rope_type, theta, rope = _rope(config)
    tied = bool(config.get("tie_word_embeddings", False))
    kwargs: dict[str, Any] = {
        "vocab_size": _whole(config, "vocab_size"),
        "num_layers": _whole(config, "num_hidden_layers"),
        "num_heads": num_heads,
        "num_kv_heads": _whole(config, "num_key_value_heads")
        if "num_key_value_heads" in config
        else num_heads,
        "embed_dim": embed_dim,
        "intermediate_dim": _whole(config, "intermediate_size"),
        "max_seq_len": _whole(config, "max_position_embeddings"),
        "norm_eps": float(config.get("rms_norm_eps", _HF_NORM_EPS_DEFAULT)),
        "rope_base": _number(theta),
    }
    if model_type == "qwen2":
        layer_types = config.get("layer_types") or []
        if config.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise TorchtuneUnsupported("it uses sliding-window attention")
        if rope_type != "default":
            raise TorchtuneUnsupported(f"its RoPE scaling {rope_type!r} is not torchtune's")
        kwargs["tie_word_embeddings"] = tied
        return TorchtuneBuild(
            "torchtune.models.qwen2.qwen2", "torchtune.models.qwen2.lora_qwen2", kwargs, "QWEN2"
        )
    return _llama_build(config, kwargs, rope_type=rope_type, rope=rope, tied=tied)


def _llama_scale_factor(rope_type: str, rope: Mapping[str, Any]) -> int | float | None:
    """The ``scale_factor`` of torchtune's Llama 3 RoPE (None: plain RoPE)."""
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise TorchtuneUnsupported(f"its RoPE scaling {rope_type!r} is not torchtune's")
    for key, expected in _LLAMA3_ROPE_FIXED.items():
        if rope.get(key) != expected:
            raise TorchtuneUnsupported(
                f"its llama3 RoPE {key} is {rope.get(key)!r}; torchtune fixes it at {expected}"
            )
    factor = rope.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise TorchtuneUnsupported(f"its llama3 RoPE factor is {factor!r}")
    return _number(factor)


def _llama_build(
    config: Mapping[str, Any],
    kwargs: dict[str, Any],
    *,
    rope_type: str,
    rope: Mapping[str, Any],
    tied: bool,
) -> TorchtuneBuild:
    """The Llama half of :func:`torchtune_build`: ``llama3_2`` (tied), ``llama3_1`` (scaled RoPE)
    or ``llama3``."""
    for bias in ("attention_bias", "mlp_bias"):
        if config.get(bias):
            raise TorchtuneUnsupported(f"it sets {bias}, which torchtune's Llama builders lack")
    scale_factor = _llama_scale_factor(rope_type, rope)
    if tied:
        # Llama 3.2's builder is the only tied Llama; scale_factor 1 is plain RoPE.
        kwargs.update(scale_factor=1 if scale_factor is None else scale_factor)
        kwargs["tie_word_embeddings"] = True
        package, model_type_name = "llama3_2", "LLAMA3_2"
    elif scale_factor is not None:
        kwargs["scale_factor"] = scale_factor
        package, model_type_name = "llama3_1", "LLAMA3"
    else:
        package, model_type_name = "llama3", "LLAMA3"
    return TorchtuneBuild(
        f"torchtune.models.{package}.{package}",
        f"torchtune.models.{package}.lora_{package}",
        kwargs,
        model_type_name,
    )


@dataclass(frozen=True)
class ModelChoice:
    """One model of the config: what it is and how kd will build it.

    Attributes:
        folder: the model folder (absolute, as given: symbolic links are kept).
        role: ``teacher`` or ``student``.
        hf_model_type: ``model_type`` of its config.json.
        vocab_size: rows of its embedding.
        max_positions: ``max_position_embeddings`` (None when config.json has none).
        num_layers: decoder layers (None when config.json has none).
        torchtune: the torchtune build, or None for the transformers backend.
        why_not_torchtune: why torchtune does not build it ("" when it does).
        weight_files: the folder's safetensors names (from the index when there is one); empty
            while the weights are not downloaded.
    """

    folder: Path
    role: str
    hf_model_type: str
    vocab_size: int
    max_positions: int | None
    num_layers: int | None
    torchtune: TorchtuneBuild | None
    why_not_torchtune: str = ""
    weight_files: tuple[str, ...] = ()

    def model_node(self, *, lora: bool) -> dict[str, Any]:
        """The ``model:`` / ``teacher_model:`` node (LoRA knobs added by :func:`render_config`)."""
        if self.torchtune is not None:
            target = self.torchtune.lora_builder if lora else self.torchtune.builder
            return {"_component_": target, **self.torchtune.kwargs}
        target = "kd.hf.lora_causal_lm" if lora else "kd.hf.causal_lm"
        return {"_component_": target, "path": str(self.folder)}

    def checkpointer_node(self) -> dict[str, Any] | None:
        """The torchtune checkpointer node (None for the transformers backend, whose folder is
        its checkpoint)."""
        if self.torchtune is None:
            return None
        return {
            "_component_": "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": str(self.folder),
            "checkpoint_files": list(self.weight_files or ("model.safetensors",)),
            "model_type": self.torchtune.model_type,
            "output_dir": "${output_dir}",
        }


def weight_file_names(folder: Path) -> tuple[str, ...]:
    """The safetensors a folder holds or will hold: the names its index lists, else its
    ``*.safetensors`` (sorted); empty when neither is there yet."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
            return tuple(sorted({str(n) for n in names}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # an unreadable index: list the files instead
    return tuple(
        sorted(
            p.name
            for p in folder.glob("*.safetensors")
            if not p.name.startswith(("adapter_model", "."))
        )
    )


def choose_model(folder: Path, *, role: str, flag: str, backend: Backend) -> ModelChoice:
    """Read a model folder's config.json and pick how kd builds it.

    Args:
        folder: the model folder.
        role: ``teacher`` or ``student`` (named in the config comments).
        flag: the command-line flag that named the folder, for errors.
        backend: ``auto`` (torchtune where it builds the model exactly, else transformers),
            ``torchtune`` or ``transformers``.

    Raises:
        KDUserError: no readable config.json or no vocab_size; ``--backend torchtune`` for a model
            torchtune cannot build (names the reason and the fix).
    """
    folder = Path(os.path.abspath(folder.expanduser()))
    config = read_hf_config(folder, flag=flag)
    text = text_config(config)
    vocab = text.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise KDUserError(
            f"{flag}: {one_line(str(folder / HF_CONFIG_FILE))} has no vocab_size; kd distils "
            "causal language models, whose config.json gives it"
        )
    model_type = str(config.get("model_type", ""))
    build: TorchtuneBuild | None = None
    reason = "--backend transformers"
    if backend != "transformers":
        try:
            build = torchtune_build(config)
            reason = ""
        except TorchtuneUnsupported as e:
            reason = str(e)
            if backend == "torchtune":
                raise KDUserError(
                    f"--backend torchtune: torchtune 0.6.1 cannot build the {role} "
                    f"{one_line(str(folder))} exactly ({reason}); pass --backend auto (or "
                    "transformers) to load it with transformers"
                ) from e
    positions = text.get("max_position_embeddings")
    layers = text.get("num_hidden_layers")
    return ModelChoice(
        folder=folder,
        role=role,
        hf_model_type=model_type,
        vocab_size=vocab,
        max_positions=positions if isinstance(positions, int) and positions > 0 else None,
        num_layers=layers if isinstance(layers, int) else None,
        torchtune=build,
        why_not_torchtune=reason,
        weight_files=weight_file_names(folder),
    )


def check_transformers_config(choice: ModelChoice, *, flag: str) -> None:
    """For the transformers backend: transformers must know the architecture (read offline).

    Raises:
        KDUserError: transformers cannot read the config.json, or the model is encoder-decoder.
    """
    if choice.torchtune is not None:
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            str(choice.folder), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError/OSError/KeyError
        raise KDUserError(
            f"{flag}: transformers cannot read {one_line(str(choice.folder / HF_CONFIG_FILE))} "
            f"({brief(e)}); upgrade transformers for this architecture or restore the file"
        ) from e
    if getattr(config, "is_encoder_decoder", False):
        raise KDUserError(
            f"{flag}: {choice.hf_model_type} is an encoder-decoder model; kd distils decoder-only "
            "causal language models"
        )
