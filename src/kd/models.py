"""Teacher and student models: kd's one model interface, loading, vocab checks, the hidden forward.

Two backends build the models: torchtune builders (``TransformerDecoder``, loaded through torchtune
checkpointers, all imported via :mod:`kd._torchtune`) and transformers (any causal LM of a local
Hugging Face folder, :mod:`kd.hf.model`), each behind one adapter (:mod:`kd.backends`). The
functions here take either and call the adapter :func:`kd.backends.backend_of` picks,
so the recipe, :mod:`kd.runtime.prepare`, :mod:`kd.runtime.distributed` and the memory tracers never ask which
backend built a model. The recipes run the decoders *without* their output projection
(:func:`set_hidden_output`) and hand the final-norm hidden states plus the projection weight
(:func:`output_weight`) to the fused loss, so no full-vocab logits tensor is built.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kd import folders as kd_folders
from kd.backends import WeightsSource, backend_named, backend_of

# Re-exported: the torchtune backend's loading, as kd.models always offered it.
from kd.backends.torchtune import MODEL_KEY as MODEL_KEY
from kd.backends.torchtune import load_checkpointer_weights as load_checkpointer_weights
from kd.backends.torchtune import load_weights as load_weights
from kd.backends.torchtune import peft_adapter_config as peft_adapter_config
from kd.errors import KDUserError, brief
from kd.hf import tokenizer_compare

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules in ``dtype`` (parameters are created directly in it, no fp32 copy)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def vocab_size(model: nn.Module) -> int:
    """Rows of the output projection (the padded vocabulary size)."""
    return int(output_weight(model).shape[0])


def has_plain_output(model: nn.Module) -> bool:
    """Whether the output projection is a plain (or tied) linear the fused loss can use directly.

    A LoRA output projection (``apply_lora_to_output``) is not: its logits need the adapter path, so the
    recipe uses the unfused loss for such students.
    """
    return backend_of(model).has_plain_output(model)


def output_weight(model: nn.Module) -> torch.Tensor:
    """The output projection weight ``[V, D]`` (the embedding for tied models; the base weight of LoRA)."""
    return backend_of(model).output_weight(model)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers: what FSDP2 shards one by one, activation checkpointing wraps and
    ``compile`` compiles."""
    return backend_of(model).decoder_layers(model)


def input_embeddings(model: nn.Module) -> nn.Module:
    """The token embedding module."""
    return backend_of(model).input_embeddings(model)


def is_tied(model: nn.Module) -> bool:
    """Whether the output projection shares the embedding's weight."""
    return backend_of(model).is_tied(model)


def set_hidden_output(model: nn.Module, enabled: bool = True) -> None:
    """Make ``model(tokens)`` return final-norm hidden states ``[b, s, d]`` instead of logits.

    The module's forward (and so FSDP's hooks on it) still runs; only the last projection is skipped.
    """
    backend_of(model).set_hidden_output(model, enabled)


def logits_from_hidden(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Full logits ``[..., V]`` in fp32 from hidden states (the unfused path and evaluation)."""
    return backend_of(model).logits_from_hidden(model, hidden)


def is_lora(model: nn.Module) -> bool:
    return backend_of(model).is_lora(model)


def adapters_disabled(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """A context in which a LoRA model runs as its base model (adapters off)."""
    return backend_of(model).adapters_disabled(model)


def freeze(model: nn.Module) -> nn.Module:
    """Teacher mode: eval, no gradients anywhere."""
    model.eval()
    model.requires_grad_(False)
    return model


def reset_rope_buffers(model: nn.Module) -> None:
    """Recompute torchtune's RoPE caches after ``to_empty`` (buffers, not in the checkpoint)."""
    for m in model.modules():
        if hasattr(m, "rope_init"):
            m.rope_init()


def unrecomputable_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Non-persistent buffers other than torchtune's RoPE caches, by qualified name.

    Non-persistent buffers are in no state dict, so after distributed loading (meta build + rank 0
    broadcast) they hold garbage: torchtune's RoPE caches are recomputed
    (:func:`reset_rope_buffers`); these (transformers' ``inv_freq``, Gemma's ``embed_scale``) are
    small and are sent from rank 0's real model instead (:func:`set_buffers`).
    """
    return {
        f"{name}.{buf}" if name else buf: m._buffers[buf]
        for name, m in model.named_modules()
        if not hasattr(m, "rope_init")
        for buf in m._non_persistent_buffers_set
        if m._buffers.get(buf) is not None
    }


def set_buffers(
    model: nn.Module, buffers: Mapping[str, torch.Tensor], device: torch.device
) -> None:
    """Replace buffers by qualified name (rank 0's values of :func:`unrecomputable_buffers`)."""
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[leaf] = value.to(device)


def check_teacher_tokenizer(
    teacher: WeightsSource | None,
    tokenizer_node: Mapping[str, Any],
    *,
    teacher_vocab: int,
    student_vocab: int,
) -> None:
    """Refuse a Hugging Face teacher whose own tokenizer differs from the run's ``kd.hf.tokenizer``.

    KD compares the two models' distributions token id by token id, so a teacher trained with
    another tokenizer would be taught ids that mean other text. Checked when the teacher is a
    folder of the transformers backend holding tokenizer files and the tokenizer is another folder's
    (the same probe texts and special tokens must give the same ids; :func:`kd.hf.tokenizer_compare.
    compare_tokenizers`). A torchtune teacher is checked by the config's family rule instead.

    Raises:
        KDUserError: the first difference, naming both folders.
    """
    path = tokenizer_node.get("path")
    if teacher is None or not backend_named(teacher.backend).folder_is_model:
        return
    if not isinstance(path, str):
        return
    if tokenizer_node.get("_component_") != "kd.hf.tokenizer":
        return
    folder = Path(path).expanduser()
    if folder.resolve() == teacher.folder.resolve():
        return
    if not any((teacher.folder / n).is_file() for n in tokenizer_compare.HF_TOKENIZER_FOLDER_FILES):
        return
    tokenizer_compare.compare_tokenizers(
        teacher.folder, folder, teacher_vocab=teacher_vocab, student_vocab=student_vocab
    )


def load_model_weights(
    model: nn.Module, source: WeightsSource, build_checkpointer: Callable[[], Any]
) -> None:
    """Load ``model``'s weights from ``source`` (its folder's safetensors, or its torchtune
    checkpointer, built by ``build_checkpointer``); a LoRA student's adapters keep their init."""
    backend_named(source.backend).load_weights(model, source, build_checkpointer)


def setup_lora_trainable(model: nn.Module) -> None:
    """Only adapter weights train; everything else is frozen."""
    backend_of(model).setup_lora_trainable(model)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (saves ~all per-layer activations but its input)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    layers = {id(layer) for layer in decoder_layers(model)}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=checkpoint_wrapper,
        check_fn=lambda m: id(m) in layers,
    )


def compile_layers(model: nn.Module) -> None:
    """torch.compile each decoder layer (per-layer compile keeps compile time bounded)."""
    for layer in decoder_layers(model):
        layer.compile()


def tokenizer_max_id(tokenizer: Any) -> int:
    """Largest token id the tokenizer can emit (base vocabulary and special tokens)."""
    ids: list[int] = []
    for attr in ("encoder", "special_tokens"):
        table = getattr(tokenizer, attr, None)
        if isinstance(table, dict) and table:
            ids.append(max(int(v) for v in table.values()))
    tt_model = getattr(tokenizer, "tt_model", None)  # tiktoken-based (llama3)
    if tt_model is not None and hasattr(tt_model, "tt_model"):
        ids.append(int(tt_model.tt_model.n_vocab) - 1)
    for attr in ("vocab_size",):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            ids.append(value - 1)
    if not ids:
        raise KDUserError(
            "tokenizer: cannot read its vocabulary size; use a torchtune tokenizer builder"
        )
    return max(ids)


def attention_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """``(num_heads, num_kv_heads, head_dim)`` of a decoder's attention, or None."""
    return backend_of(model).attention_shape(model)


TOKENIZER_PROBE = tokenizer_compare.TOKENIZER_PROBE


def tokenizer_file_problems(files: Mapping[str, Path], *, parse_json: bool) -> list[str]:
    """Problems with the files a tokenizer is built from (empty when none is found).

    Args:
        files: ``{config key: path}`` of the tokenizer's files (``tokenizer.path``...).
        parse_json: also parse the ``.json`` files (the builder failed and the reason is sought).

    Returns:
        One line per empty file, and per ``.json`` file that is not JSON when ``parse_json``.
    """
    problems = []
    for key, path in files.items():
        try:
            empty = path.stat().st_size == 0
        except OSError:
            continue  # a missing file is reported by the config check
        if empty:
            problems.append(
                f"{key}: {path} is empty; restore the tokenizer files from the model's source"
            )
        elif parse_json and path.suffix == ".json":
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                problems.append(
                    f"{key}: {path} is not valid JSON ({brief(e)}); restore the tokenizer files "
                    "from the model's source"
                )
    return problems


def tokenizer_files(node: Mapping[str, Any]) -> dict[str, Path]:
    """The files a tokenizer node names: ``{"tokenizer.<argument>": path}`` for each string
    argument that is an existing file (``~`` expanded).

    Args:
        node: the ``tokenizer`` node's plain values (``_component_`` and its arguments).
    """
    return {
        f"tokenizer.{k}": Path(v).expanduser()
        for k, v in node.items()
        if k != "_component_" and isinstance(v, str) and Path(v).expanduser().is_file()
    }


# The files of a Hugging Face tokenizer folder (what AutoTokenizer reads).
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def tokenizer_files_to_copy(node: Mapping[str, Any]) -> dict[str, Path]:
    """The Hugging Face tokenizer files of the folder(s) a ``tokenizer`` node reads, by name.

    Copied into a saved student whose model folder has no tokenizer of its own, so ``final/``
    loads with ``AutoTokenizer``.

    Args:
        node: the ``tokenizer`` node's plain values: a ``path`` folder (``kd.hf.tokenizer``) or
            file arguments (torchtune's builders; their folders are searched).
    """
    folders: list[Path] = []
    for k, v in node.items():
        if k == "_component_" or not isinstance(v, str):
            continue
        p = Path(v).expanduser()
        folder = p if p.is_dir() else p.parent if p.is_file() else None
        if folder is not None and folder not in folders:
            folders.append(folder)
    # Only regular files inside their folder (kd.folders): a link out of it is refused, not copied.
    return {
        name: folder / name
        for folder in reversed(folders)
        for name in HF_TOKENIZER_FILES
        if kd_folders.file_in(folder, name, key="tokenizer") is not None
    }


def checked_tokenizer(build: Callable[[], Any], files: Mapping[str, Path]) -> Any:
    """Build the tokenizer with a damaged file blamed on the key naming it, not on the first data
    row the tokenizer fails on.

    Args:
        build: builds the tokenizer (raising :class:`KDUserError` when it fails).
        files: its files, :func:`tokenizer_files`.

    Returns:
        The tokenizer, which encodes :data:`TOKENIZER_PROBE` to token ids.

    Raises:
        KDUserError: a file is empty; the builder failed (then a ``.json`` file that is not JSON
            is named, if one is); the tokenizer cannot encode the probe text.
    """
    problems = tokenizer_file_problems(files, parse_json=False)
    if problems:
        raise KDUserError("\n".join(problems))
    try:
        tokenizer = build()
    except KDUserError as e:
        problems = tokenizer_file_problems(files, parse_json=True)
        if problems:
            raise KDUserError("\n".join(problems)) from e
        raise
    key = "tokenizer.path" if "tokenizer.path" in files else next(iter(files), None)
    vocabulary = f"{key} ({files[key]})" if key else "the tokenizer files"
    problem = tokenizer_encode_problem(tokenizer, vocabulary=vocabulary)
    if problem is not None:
        raise KDUserError(problem)
    return tokenizer


def tokenizer_encode_problem(tokenizer: Any, *, vocabulary: str) -> str | None:
    """Why ``tokenizer`` cannot encode :data:`TOKENIZER_PROBE` to token ids, or None.

    An empty or cut vocabulary file builds a tokenizer that maps text to ``None``; found here, it
    is blamed on the file rather than on the first data row it meets.

    Args:
        tokenizer: a built tokenizer with ``encode(text)`` (others are not checked).
        vocabulary: where its vocabulary comes from, named in the message
            (``tokenizer.path (/models/qwen/vocab.json)``).
    """
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        return None
    fix = f"restore {vocabulary} from the model's source"
    try:
        ids = list(encode(TOKENIZER_PROBE))
    except TypeError:
        return None  # another encode signature: not this check's to judge
    except Exception as e:  # noqa: BLE001 - a damaged tokenizer raises anything
        return f"tokenizer: encoding {TOKENIZER_PROBE!r} failed ({brief(e)}); {fix}"
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
    if bad:
        return (
            f"tokenizer: maps parts of {TOKENIZER_PROBE!r} to no token id ({bad[0]!r}), so its "
            f"vocabulary is empty or cut short; {fix}"
        )
    return None


def check_vocab(*, tokenizer_max: int, student_vocab: int, teacher_vocab: int | None) -> list[str]:
    """Problems with token ids against both models' vocabularies (empty when fine).

    Teacher and student may have different *padded* vocabularies (Qwen2.5-14B 152064 vs 3B 151936):
    that is fine as long as every id the tokenizer emits fits both; the KD term is computed on the
    shared first ``min(Vs, Vt)`` entries.
    """
    problems = []
    if tokenizer_max >= student_vocab:
        problems.append(
            f"tokenizer: emits ids up to {tokenizer_max} but the student (model) has only "
            f"{student_vocab} vocab rows; use the tokenizer that belongs to the student"
        )
    if teacher_vocab is not None and tokenizer_max >= teacher_vocab:
        problems.append(
            f"tokenizer: emits ids up to {tokenizer_max} but the teacher (teacher_model) has only "
            f"{teacher_vocab} vocab rows; teacher and student must share a tokenizer (same family)"
        )
    return problems


def check_decoders(built: dict[str, tuple[Any, Any]]) -> None:
    """Refuse a model builder that built something other than a decoder with an output projection.

    Args:
        built: config key -> (its ``_component_``, what it built; None for an absent teacher).

    Raises:
        KDUserError: naming the key and its ``_component_``.
    """
    for key, (target, model) in built.items():
        if model is not None and not backend_of(model).is_decoder(model):
            raise KDUserError(
                f"{key}._component_: {target} built a {type(model).__name__}, not a decoder "
                f"with an output projection; set {key}._component_ to a torchtune model builder"
            )


def max_seq_len_problems(built: dict[str, Any], *, max_seq_len: int | None) -> list[str]:
    """``tokenizer.max_seq_len`` longer than a model takes (it would fail at the first step).

    Args:
        built: config key -> the built (meta-device) model, or None.
        max_seq_len: ``tokenizer.max_seq_len`` (None: untruncated, nothing to check).
    """
    problems = []
    for key, model in built.items():
        longest = backend_of(model).max_seq_len(model)
        if isinstance(longest, int) and max_seq_len is not None and max_seq_len > longest:
            problems.append(
                f"tokenizer.max_seq_len: {max_seq_len} tokens per example but {key} takes "
                f"at most {longest} (its max_seq_len); lower tokenizer.max_seq_len to "
                f"{longest} or raise {key}.max_seq_len"
            )
    return problems


def assistant_header(tokenizer: object) -> list[int]:
    """The tokens every assistant turn starts with when they are labelled (torchtune's chat
    formats label ``<|im_start|>assistant\\n``): they belong to the prompt, as a chat template's
    generation prompt does, so the student does not sample its own turn header.

    Found by tokenizing one conversation with two different answers: the common start of the two
    labelled spans. Empty when the tokenizer labels the answer alone, or cannot say.
    """
    from kd._torchtune import Message

    spans = []
    for answer in ("a", "b"):
        messages = [
            Message(role="user", content="q", masked=True),
            Message(role="assistant", content=answer),
        ]
        try:
            tokens, mask = tokenizer.tokenize_messages(messages)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - no chat format to ask: no header
            return []
        spans.append([int(t) for t, masked in zip(tokens, mask, strict=True) if not masked])
    header: list[int] = []
    for x, y in zip(*spans, strict=False):
        if x != y:
            break
        header.append(x)
    return header
