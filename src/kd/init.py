"""``kd init``: a runnable, commented config from two local Hugging Face folders and a data file.

    kd init --teacher /models/Qwen2.5-7B-Instruct --student /models/Qwen2.5-0.5B-Instruct \\
        --data train.jsonl --output-dir runs/first --config-out my_kd.yaml [--lora]

It reads both ``config.json`` files and fills every dimension; builds each model with torchtune's
component builder where torchtune 0.6.1 expresses the architecture exactly (Qwen2 / Qwen2.5,
Llama 3.x and other Llama-shaped models) and with the transformers backend (``kd.hf.causal_lm``)
otherwise (:func:`choose_model`); detects the data format from the file's first rows
(:func:`detect_data_format`); checks that teacher and student tokenize alike
(:func:`kd.hf.tokenization.compare_tokenizers`); writes a YAML that ``kd run kd --config FILE`` runs unchanged
(:func:`render_config`, validated before it is written by :func:`write_config`); and prints the
memory plan for this device. Only ``config.json`` and the tokenizer files are read, so it works
before the weights finish downloading (``kd run`` needs them).

Importing this module is cheap: transformers (and with it torch) is imported by the tokenizer
check only, so ``kd --help`` stays fast.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kd import folders
from kd.errors import KDUserError, brief, one_line

Backend = Literal["auto", "torchtune", "transformers"]
BACKENDS: tuple[str, ...] = ("auto", "torchtune", "transformers")
DEVICES: tuple[str, ...] = ("cpu", "cuda")

HF_CONFIG_FILE = folders.CONFIG_JSON
DEFAULT_MAX_SEQ_LEN = 2048
# LoRA knobs of the generated config (torchtune's names; kd.hf.lora_causal_lm takes the same).
LORA_ATTN_MODULES: tuple[str, ...] = ("q_proj", "v_proj")
LORA_RANK = 16
LORA_ALPHA = 32
FULL_LR = 2e-5
LORA_LR = 3e-4
# Rows read from the data file to detect its format.
SAMPLE_ROWS = 32
DATA_SUFFIXES: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}
ACCEPTED_COLUMNS = (
    "messages (chat, OpenAI style), conversations (chat, ShareGPT style), instruction/input/output "
    "or input/output (instruct), or text (text completion)"
)
# torchtune 0.6.1's Llama3ScaledRoPE fixes these; a llama3 rope_scaling with others is not its RoPE.
_LLAMA3_ROPE_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_HF_ROPE_THETA_DEFAULT = 10000.0  # Qwen2Config / LlamaConfig default rope_theta
_HF_NORM_EPS_DEFAULT = 1e-6  # Qwen2Config / LlamaConfig default rms_norm_eps


# ------------------------------------------------------------------------------- models
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
    return folders.read_config_json(folder, key=flag)


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
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
    for bias in ("attention_bias", "mlp_bias"):
        if config.get(bias):
            raise TorchtuneUnsupported(f"it sets {bias}, which torchtune's Llama builders lack")
    if rope_type == "llama3":
        for key, expected in _LLAMA3_ROPE_FIXED.items():
            if rope.get(key) != expected:
                raise TorchtuneUnsupported(
                    f"its llama3 RoPE {key} is {rope.get(key)!r}; torchtune fixes it at {expected}"
                )
        factor = rope.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise TorchtuneUnsupported(f"its llama3 RoPE factor is {factor!r}")
        scale_factor = _number(factor)
    elif rope_type == "default":
        scale_factor = None
    else:
        raise TorchtuneUnsupported(f"its RoPE scaling {rope_type!r} is not torchtune's")
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
    text = _text_config(config)
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


def reconcile_backends(
    teacher: ModelChoice, student: ModelChoice, *, backend: Backend
) -> ModelChoice:
    """The teacher to use beside ``student``: torchtune builders of packages with different token
    ids are refused by the config check, so under ``auto`` such a teacher uses transformers.

    Raises:
        KDUserError: ``--backend torchtune`` with such a pair.
    """
    from kd.families import family_of_builder

    if teacher.torchtune is None or student.torchtune is None:
        return teacher
    groups = [
        family_of_builder(c.torchtune.builder.rsplit(".", 1)[-1])  # type: ignore[union-attr]
        for c in (teacher, student)
    ]
    if groups[0] is None or groups[1] is None or groups[0].tokenizer == groups[1].tokenizer:
        return teacher
    if backend == "torchtune":
        raise KDUserError(
            f"--backend torchtune: the teacher is a torchtune {groups[0].name} model and the "
            f"student a {groups[1].name} one, which kd's config check refuses as different "
            "vocabularies; pass --backend auto to load the teacher with transformers"
        )
    return dataclasses.replace(
        teacher,
        torchtune=None,
        why_not_torchtune=f"torchtune's {groups[0].name} builder beside a {groups[1].name} student",
    )


# --------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class DataFormat:
    """What a data file holds and the ``dataset:`` node that reads it.

    Attributes:
        kind: ``chat``, ``instruct`` or ``text``.
        description: a few words for the config comment and the summary.
        node: the ``dataset:`` node (a torchtune dataset builder and its arguments).
        columns: the columns of the first rows.
    """

    kind: str
    description: str
    node: dict[str, Any]
    columns: tuple[str, ...] = ()


def _read_rows(path: Path, source: str, flag: str) -> list[dict[str, Any]]:
    """The first :data:`SAMPLE_ROWS` rows of a data file, as dicts."""
    try:
        if source == "csv":
            with path.open(newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                return [dict(row) for _, row in zip(range(SAMPLE_ROWS), reader, strict=False)]
        if source == "parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as e:
                raise KDUserError(
                    f"{flag}: reading parquet needs pyarrow (pip install pyarrow), or convert "
                    f"{one_line(str(path))} to JSON lines"
                ) from e
            batches = pq.ParquetFile(str(path)).iter_batches(batch_size=SAMPLE_ROWS)
            batch = next(batches, None)
            return [] if batch is None else list(batch.to_pylist())
        return _read_json_rows(path, flag)
    except KDUserError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, csv.Error) as e:
        raise KDUserError(
            f"{flag}: cannot read {one_line(str(path))} ({brief(e)}); pass a readable {source} file"
        ) from e
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types
        raise KDUserError(
            f"{flag}: cannot read {one_line(str(path))} ({brief(e)}); pass a readable {source} file"
        ) from e


def _read_json_rows(path: Path, flag: str) -> list[dict[str, Any]]:
    """JSON lines, or a JSON array of objects (what Hugging Face's ``json`` loader reads)."""
    rows: list[Any] = []
    with path.open(encoding="utf-8") as f:
        first = ""
        for line in f:
            if line.strip():
                first = line
                break
        if not first:
            return []
        if not first.lstrip().startswith("["):
            try:
                rows.append(json.loads(first))
                for line in f:
                    if len(rows) >= SAMPLE_ROWS:
                        break
                    if line.strip():
                        rows.append(json.loads(line))
            except ValueError as e:
                raise KDUserError(
                    f"{flag}: {one_line(str(path))} is neither JSON lines (one object per line) "
                    f"nor a JSON array of objects ({brief(e)}); fix the file"
                ) from e
    if not rows:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise KDUserError(
                f"{flag}: {one_line(str(path))} is neither JSON lines nor a JSON array of "
                f"objects ({brief(e)}); fix the file"
            ) from e
        rows = data[:SAMPLE_ROWS] if isinstance(data, list) else [data]
    bad = next((r for r in rows if not isinstance(r, dict)), None)
    if bad is not None:
        raise KDUserError(
            f"{flag}: {one_line(str(path))} holds {type(bad).__name__} rows, not objects; write "
            "one JSON object per row with the columns " + ACCEPTED_COLUMNS
        )
    return rows


def _is_conversation(value: Any, keys: tuple[str, str]) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, Mapping) and keys[0] in m and keys[1] in m for m in value)
    )


def detect_data_format(path: Path, *, flag: str = "--data") -> DataFormat:
    """Detect the format of a data file from its first rows and build its ``dataset:`` node.

    Rows with ``messages`` (lists of ``{role, content}``) -> ``chat_dataset`` (OpenAI style);
    ``conversations`` (lists of ``{from, value}``) -> ``chat_dataset`` (ShareGPT style);
    ``instruction`` and ``output`` -> ``instruct_dataset`` with ``input: instruction``, or
    ``alpaca_dataset`` when rows also have a non-empty ``input`` (it joins instruction and input
    in one prompt); ``input`` and ``output`` -> ``instruct_dataset``; ``text`` ->
    ``text_completion_dataset``. Prompts are masked from the loss (``train_on_input: false``).

    Args:
        path: a ``.jsonl`` / ``.json`` (JSON lines or an array of objects), ``.csv`` or
            ``.parquet`` file.
        flag: the command-line flag naming the file, for errors.

    Raises:
        KDUserError: an unreadable, empty or unknown file; names ``flag`` and the accepted columns.
    """
    path = Path(os.path.abspath(path.expanduser()))
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise KDUserError(f"{flag}: {one_line(str(path))} {what}; pass a .jsonl data file")
    source = DATA_SUFFIXES.get(path.suffix.lower())
    if source is None:
        raise KDUserError(
            f"{flag}: {one_line(str(path))}: kd init reads .jsonl, .json, .csv and .parquet "
            "files; convert it to JSON lines (one object per line)"
        )
    rows = _read_rows(path, source, flag)
    if not rows:
        raise KDUserError(f"{flag}: {one_line(str(path))} has no rows; add training examples")
    # Columns every sampled row has (a column missing from some rows cannot be relied on).
    columns = [c for c in rows[0] if all(c in r for r in rows)]
    have = set(columns)
    base: dict[str, Any] = {"source": source, "data_files": str(path), "split": "train"}
    if "messages" in have or "conversations" in have:
        column, style, keys = (
            ("messages", "openai", ("role", "content"))
            if "messages" in have
            else ("conversations", "sharegpt", ("from", "value"))
        )
        if not all(_is_conversation(r[column], keys) for r in rows):
            raise KDUserError(
                f"{flag}: the {column} column of {one_line(str(path))} is not a list of "
                f"{{{keys[0]}, {keys[1]}}} messages in every row; fix the rows"
            )
        node = {
            "_component_": "torchtune.datasets.chat_dataset",
            **base,
            "conversation_column": column,
            "conversation_style": style,
        }
        description = f"chat rows ({column}, {style} style)"
        return DataFormat("chat", description, node, tuple(columns))
    if {"instruction", "output"} <= have:
        if "input" in have and any(r.get("input") for r in rows):
            node = {"_component_": "torchtune.datasets.alpaca_dataset", **base}
            description = "instruct rows (instruction + input -> output, Alpaca prompt)"
        else:
            node = {
                "_component_": "torchtune.datasets.instruct_dataset",
                **base,
                "column_map": {"input": "instruction", "output": "output"},
            }
            description = "instruct rows (instruction -> output)"
        node["train_on_input"] = False
        return DataFormat("instruct", description, node, tuple(columns))
    if {"input", "output"} <= have:
        node = {
            "_component_": "torchtune.datasets.instruct_dataset",
            **base,
            "train_on_input": False,
        }
        return DataFormat("instruct", "instruct rows (input -> output)", node, tuple(columns))
    if "text" in have:
        node = {"_component_": "torchtune.datasets.text_completion_dataset", **base}
        return DataFormat("text", "text rows (text completion)", node, tuple(columns))
    shown = ", ".join(columns[:8]) + (", ..." if len(columns) > 8 else "") or "none"
    raise KDUserError(
        f"{flag}: cannot tell the format of {one_line(str(path))} from its columns ({shown}); "
        f"kd init reads rows with {ACCEPTED_COLUMNS}: rename the columns"
    )


# ------------------------------------------------------------------------------- render
def _yaml(value: Any) -> str:
    """One YAML value on one line (flow style for lists and mappings)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True)
    text = text.strip()
    return text.removesuffix("...").strip()


def _node(key: str, node: Mapping[str, Any], comments: Mapping[str, str]) -> list[str]:
    lines = [f"{key}:"]
    for name, value in node.items():
        line = f"  {name}: {_yaml(value)}"
        if name in comments:
            line += f"  # {comments[name]}"
        lines.append(line)
    return lines


def _line(key: str, value: Any, comment: str = "") -> str:
    return f"{key}: {_yaml(value)}" + (f"  # {comment}" if comment else "")


def _about(choice: ModelChoice, *, lora: bool = False) -> str:
    layers = f", {choice.num_layers} layers" if choice.num_layers else ""
    how = (
        f"torchtune's {choice.torchtune.lora_builder if lora else choice.torchtune.builder}"
        if choice.torchtune is not None
        else f"transformers, kd.hf.{'lora_' if lora else ''}causal_lm ({choice.why_not_torchtune})"
    )
    return (
        f"{one_line(str(choice.folder))} ({choice.hf_model_type}{layers}, vocab "
        f"{choice.vocab_size}): {how}"
    )


_LORA_COMMENTS = {
    "lora_attn_modules": "adapted attention projections: q_proj, k_proj, v_proj, output_proj",
    "apply_lora_to_mlp": "adapters on the MLP projections too",
    "lora_rank": "adapter rank: more capacity, more memory",
    "lora_alpha": "adapter scale alpha / rank; usually 2 x lora_rank",
}


def render_config(
    *,
    teacher: ModelChoice,
    student: ModelChoice,
    data: DataFormat,
    output_dir: Path,
    max_seq_len: int,
    device: str,
    lora: bool,
    budget_gib: float | None = None,
    config_name: str = "my_kd.yaml",
) -> str:
    """The commented YAML of a run: every model dimension set, the knobs users change commented.

    Keys the run needs are written; the others keep their defaults (:mod:`kd.config.schema`).

    Args:
        teacher: the teacher (:func:`choose_model`).
        student: the student.
        data: the data format (:func:`detect_data_format`).
        output_dir: the run's output folder.
        max_seq_len: ``tokenizer.max_seq_len``.
        device: ``cuda`` (bf16) or ``cpu`` (fp32).
        lora: a LoRA student (rank :data:`LORA_RANK` on q/v projections and the MLP).
        budget_gib: ``memory.budget_gib`` (None: the device's memory).
        config_name: the config file, for the commands in the header.
    """
    dtype = "bf16" if device.startswith("cuda") else "fp32"
    cfg = one_line(config_name)
    out: list[str] = [
        "# Written by `kd init`: distil the teacher into the student on the data below.",
        f"#   teacher: {_about(teacher)}",
        f"#   student: {_about(student, lora=lora)}",
        f"#   data:    {one_line(data.node['data_files'])}: {data.description}",
        "# Teacher and student tokenize alike (checked by kd init); the data is tokenized with the",
        "# student's tokenizer and chat template.",
        "#",
        f"#   kd validate --config {cfg}        # every check and the memory plan, no weight loaded",
        f"#   kd plan --config {cfg} --fit      # settings that fit a smaller GPU",
        f"#   kd run kd --config {cfg}          # train (kd run --nproc_per_node N kd ... for N GPUs)",
        f"#   kd run kd --config {cfg} max_steps_per_epoch=10   # any key=value overrides",
        "# Keys not written here keep kd's defaults (e.g. seed: null, save_every_n_steps: null,",
        "# compile: false, lr_scheduler: cosine without warmup); add them to change them.",
        "",
        _line(
            "output_dir",
            str(output_dir),
            "checkpoints, metrics.jsonl and final/ (a new or empty folder)",
        ),
        "",
    ]
    models = (
        ("model", "checkpointer", student, lora),
        ("teacher_model", "teacher_checkpointer", teacher, False),
    )
    for model_key, ckpt_key, choice, use_lora in models:
        what = "Student (trained" + (", LoRA adapters" if use_lora else "") + ")"
        if model_key == "teacher_model":
            what = "Teacher (frozen)"
        source = (
            f"dimensions from {one_line(str(choice.folder / HF_CONFIG_FILE))}"
            if choice.torchtune is not None
            else "the transformers model of this folder (config.json + *.safetensors)"
        )
        out.append(f"# {what}: {source}")
        node = choice.model_node(lora=use_lora)
        comments: dict[str, str] = {}
        if use_lora:
            node.update(
                lora_attn_modules=list(LORA_ATTN_MODULES),
                apply_lora_to_mlp=True,
                lora_rank=LORA_RANK,
                lora_alpha=LORA_ALPHA,
            )
            comments = _LORA_COMMENTS
        out += _node(model_key, node, comments)
        checkpointer = choice.checkpointer_node()
        if checkpointer is not None:
            ckpt_comments = {}
            if not choice.weight_files:
                ckpt_comments["checkpoint_files"] = (
                    "weights not downloaded yet: list the folder's *.safetensors here"
                )
            out += _node(ckpt_key, checkpointer, ckpt_comments)
        out.append("")
    tokenizer = {
        "_component_": "kd.hf.tokenizer",
        "path": str(student.folder),
        "max_seq_len": max_seq_len,
    }
    out.append(
        "# The student's tokenizer and chat template (tokenizer.json / tokenizer_config.json)"
    )
    out += _node(
        "tokenizer",
        tokenizer,
        {
            "max_seq_len": "tokens per example (longer ones are truncated); the plan assumes all "
            "are this long"
        },
    )
    out.append("")
    masked = " (prompts masked from the loss)" if data.kind != "text" else ""
    out.append(f"# Data: {data.description}{masked}")
    data_comments = {"train_on_input": "true also trains on the prompts"}
    out += _node("dataset", data.node, data_comments)
    out += [
        "",
        "# Training",
        _line("batch_size", 4, "micro-batch per device; memory grows linearly with it"),
        _line(
            "gradient_accumulation_steps",
            8,
            "micro-batches per optimizer step (global batch = batch_size x this x devices)",
        ),
        _line("epochs", 1),
        _line("max_steps_per_epoch", None, "an int caps optimizer steps per epoch (quick trials)"),
        "",
        "optimizer:",
        "  _component_: torch.optim.AdamW",
        f"  lr: {_yaml(LORA_LR if lora else FULL_LR)}",
        "  weight_decay: 0.01",
        "",
        "# Loss = (1 - kd_ratio) * CE + kd_ratio * T^2 * divergence(teacher || student)",
        "kd_loss:",
        "  divergence: forward_kl  # forward_kl, reverse_kl, symmetric_kl, jsd, tvd, "
        "skew_forward_kl, skew_reverse_kl",
        _line("kd_ratio", 0.5, "0 = plain fine-tuning on labels, 1 = distillation only"),
        _line("temperature", 1.0, ">1 softens both distributions (the KD term is scaled by T^2)"),
        "",
        _line("device", device, "cuda, cuda:N or cpu"),
        _line("dtype", dtype, "bf16 halves memory vs fp32 (bf16 on GPUs)"),
        _line(
            "enable_activation_checkpointing",
            False,
            "true recomputes layers in backward: less memory, ~30% slower",
        ),
        "",
        "# Memory plan (checked before any weight loads; kd plan --fit lists settings that fit)",
        "memory:",
        f"  budget_gib: {_yaml(budget_gib)}  # GiB per device; null = the device's total memory",
        "",
    ]
    return "\n".join(out)


def _weights_missing_problem(problem: Any, missing_keys: Sequence[str]) -> bool:
    return any(str(problem.key).startswith(f"{k}.checkpoint_files") for k in missing_keys)


def write_config(text: str, dest: Path, *, weights_pending: Sequence[str] = ()) -> None:
    """Validate a generated config as ``kd run`` loads it, then write it to ``dest`` atomically.

    Args:
        text: the YAML.
        dest: the file to write (its folder is created).
        weights_pending: checkpointer keys whose weight files are not downloaded yet; their
            missing ``checkpoint_files`` are the only problems allowed.

    Raises:
        KDUserError: ``dest`` cannot be written.
        RuntimeError: the config does not validate (a bug in kd init).
    """
    from omegaconf import OmegaConf

    from kd.config import load_config
    from kd.config.validate import schema_problems

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.kd-init.tmp")
        tmp.write_text(text, encoding="utf-8")
    except OSError as e:
        raise KDUserError(
            f"--config-out: cannot write {one_line(str(dest))} ({e.strerror or e}); choose a "
            "file in a folder you can write to"
        ) from e
    try:
        cfg = load_config(str(tmp), [])
        data = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(data, dict)
        problems = [
            p
            for p in schema_problems(data, check_paths=True)
            if not _weights_missing_problem(p, weights_pending)
        ]
        if problems:
            raise RuntimeError(
                "kd init generated a config that does not validate (a bug in kd init): "
                + "; ".join(str(p) for p in problems)
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------ command
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``init`` subcommand to ``kd``'s argparse subparsers."""
    p = subparsers.add_parser(
        "init",
        help="write a config for two local Hugging Face model folders and a data file",
        description="Write a commented config that `kd run kd --config FILE` runs unchanged: "
        "dimensions from both config.json files, torchtune builders where they fit and the "
        "transformers backend otherwise, the data format from the file's first rows, a "
        "tokenizer agreement check, and the memory plan for this device. Needs only config.json "
        "and the tokenizer files (the weights may still be downloading).",
    )
    p.add_argument("--teacher", required=True, metavar="DIR", help="teacher model folder")
    p.add_argument("--student", required=True, metavar="DIR", help="student model folder")
    p.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="training data: .jsonl/.json (or .csv/.parquet) with messages (or conversations), "
        "instruction/output, input/output or text columns",
    )
    p.add_argument("--output-dir", required=True, metavar="DIR", help="the run's output folder")
    p.add_argument("--config-out", required=True, metavar="FILE", help="the YAML to write")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters instead of all weights")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="auto: torchtune builders where torchtune 0.6.1 builds the model exactly, "
        "transformers otherwise (default auto)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="N",
        help=f"tokens per example (default {DEFAULT_MAX_SEQ_LEN}, at most the models' maximum)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="device of the run (default: cuda when this machine has one, else cpu)",
    )
    p.add_argument(
        "--budget-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="memory.budget_gib (default: the device's memory)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing --config-out")
    return p


def _max_seq_len(flag: int | None, teacher: ModelChoice, student: ModelChoice) -> int:
    limits = [c.max_positions for c in (teacher, student) if c.max_positions is not None]
    limit = min(limits) if limits else None
    if flag is None:
        return min(DEFAULT_MAX_SEQ_LEN, limit) if limit is not None else DEFAULT_MAX_SEQ_LEN
    if flag < 1:
        raise KDUserError(f"--max-seq-len: {flag} is not a length; pass a number >= 1")
    if limit is not None and flag > limit:
        raise KDUserError(
            f"--max-seq-len: {flag} is beyond the models' max_position_embeddings ({limit}); pass "
            f"at most {limit}"
        )
    return flag


def _config_out(value: str, *, force: bool) -> Path:
    dest = Path(value).expanduser()
    if dest.is_dir():
        raise KDUserError(
            f"--config-out: {one_line(value)} is a folder; pass a file name such as "
            f"{one_line(str(dest / 'kd.yaml'))}"
        )
    if dest.exists() and not force:
        raise KDUserError(
            f"--config-out: {one_line(value)} already exists; remove it or pass --force to "
            "overwrite it"
        )
    return dest


def _device(flag: str | None) -> str:
    if flag is not None:
        return flag
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _print_plan(config: Path) -> tuple[bool, bool]:
    """Print the memory plan of the written config as ``kd plan --fit`` does.

    Returns:
        Whether the plan fits, and (when it does not) whether a searched setting fits.
    """
    from kd.commands import resolve_target
    from kd.device import resolve_budget
    from kd.memory.fit import format_options
    from kd.memory.plan import attach_fit, inputs_from_run, make_plan

    args = argparse.Namespace(config=str(config), overrides=[], budget_gib=None, world_size=None)
    target = resolve_target(args, for_plan=True)
    run = target.run
    inputs = inputs_from_run(run, world_size=target.world_size, config_name=str(config))
    budget = resolve_budget(budget_gib=run.memory.budget_gib, device=run.device)
    if budget.source != "memory.budget_gib":
        inputs.notes.append(f"budget = {budget.source}")
    plan = make_plan(inputs, budget.gib)
    print(plan.table())
    if plan.fits:
        return True, True
    note = attach_fit(plan, run)
    print(format_options(plan.fit, note=note))
    return False, any(not option.suggestion for option in plan.fit)


def run(args: argparse.Namespace) -> int:
    """Run ``kd init``: write the config, print the plan; 0 also when the plan does not fit."""
    dest = _config_out(args.config_out, force=args.force)
    if args.budget_gib is not None:
        from kd.commands import budget_flag

        budget_flag(args.budget_gib)
    output_dir = Path(os.path.abspath(Path(args.output_dir).expanduser()))
    from kd.config.validate import writable_dir_problem

    problem = writable_dir_problem(str(output_dir))
    if problem is not None:
        raise KDUserError(f"--output-dir: {problem.split('; ')[0]}; pass another folder")
    backend: Backend = args.backend
    student = choose_model(Path(args.student), role="student", flag="--student", backend=backend)
    teacher = choose_model(Path(args.teacher), role="teacher", flag="--teacher", backend=backend)
    teacher = reconcile_backends(teacher, student, backend=backend)
    for choice in (teacher, student):
        if output_dir == choice.folder or choice.folder in output_dir.parents:
            raise KDUserError(
                f"--output-dir: {one_line(str(output_dir))} is inside the {choice.role} folder "
                f"{one_line(str(choice.folder))}; pass a folder outside the model folders"
            )
    data = detect_data_format(Path(args.data))
    max_seq_len = _max_seq_len(args.max_seq_len, teacher, student)
    from kd.hf.tokenization import compare_tokenizers  # imports torch (kd.hf)

    check = compare_tokenizers(
        teacher.folder,
        student.folder,
        teacher_vocab=teacher.vocab_size,
        student_vocab=student.vocab_size,
    )
    check_transformers_config(student, flag="--student")
    check_transformers_config(teacher, flag="--teacher")
    device = _device(args.device)
    text = render_config(
        teacher=teacher,
        student=student,
        data=data,
        output_dir=output_dir,
        max_seq_len=max_seq_len,
        device=device,
        lora=args.lora,
        budget_gib=args.budget_gib,
        config_name=str(dest),
    )
    pending = [
        key
        for key, choice in (("checkpointer", student), ("teacher_checkpointer", teacher))
        if choice.torchtune is not None and not choice.weight_files
    ]
    write_config(text, dest, weights_pending=pending)
    print(f"teacher: {_about(teacher)}")
    print(f"student: {_about(student, lora=args.lora)}")
    print(f"data:    {one_line(str(data.node['data_files']))}: {data.description}")
    print(f"tokenizers agree ({check.size} token ids; same ids on {len(check.probes)} probes)")
    for note in check.notes:
        print(f"note: {note}")
    if data.kind == "chat" and not check.chat_template:
        print(
            f"note: the student's tokenizer in {one_line(str(student.folder))} has no chat "
            "template; kd.hf.tokenizer joins the messages as plain text"
        )
    for choice in (teacher, student):
        if not choice.weight_files:
            print(
                f"note: {one_line(str(choice.folder))} holds no *.safetensors yet; kd run needs "
                "the weights there"
            )
    if output_dir.is_dir() and any(output_dir.iterdir()):
        print(
            f"note: {one_line(str(output_dir))} is not empty; kd run refuses it unless "
            "overwrite_output_dir=true (or resume_from_checkpoint=true)"
        )
    print(f"wrote {one_line(str(dest))}")
    fits, fixable = _print_plan(dest)
    config = one_line(str(dest))
    if fits:
        print(f"next: kd run kd --config {config}")
    elif fixable:
        print(
            f"the plan does not fit this device: add one of the settings above to `kd run kd "
            f"--config {config}` (or set them in {config})"
        )
    else:
        print(
            "the plan does not fit this device and no setting of kd does: pick a smaller "
            + ("student or teacher" if args.lora else "student or teacher, pass --lora")
            + ", or use a device with more memory (or several: kd run --nproc_per_node N kd)"
        )
    return 0
