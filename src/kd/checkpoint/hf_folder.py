"""Hugging Face model folders: write the student (merged weights, PEFT adapter), read weights back.

A folder written here loads with ``transformers.AutoModelForCausalLM.from_pretrained`` (and, for
LoRA, ``peft.PeftModel.from_pretrained``): ``model.safetensors`` in HF names, ``config.json`` with
the saved dtype, the tokenizer and other non-weight files of the source folder.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kd import folders
from kd.checkpoint.convert import (
    peft_to_tune_adapter_state_dict,
    tune_to_hf_state_dict,
    tune_to_peft_adapter_state_dict,
)
from kd.checkpoint.layout import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_MODEL_FILE,
    CONFIG_SNAPSHOT_FILE,
    HF_CONFIG_FILE,
    MARKER_FILE,
    MODEL_FILE,
    MODEL_INDEX_FILE,
    RECIPE_STATE_FILE,
)
from kd.config.validate import checkpoint_file_names
from kd.errors import KDUserError, brief, one_line

# What makes a folder a tokenizer for AutoTokenizer (kd.models.HF_TOKENIZER_FILES has them all).
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# kd's own files: never copied from a source folder that is itself a kd checkpoint.
# A PEFT adapter's files are never copied either: at the top of a folder they make transformers
# load the adapter's base model instead of the folder's weights.
_KD_FILES = frozenset(
    {
        MARKER_FILE,
        RECIPE_STATE_FILE,
        CONFIG_SNAPSHOT_FILE,
        Path(ADAPTER_CONFIG_FILE).name,
        Path(ADAPTER_MODEL_FILE).name,
    }
)


def read_hf_config(
    model_dir: Path, *, key: str = "checkpointer", folder_arg: str = "checkpoint_dir"
) -> dict[str, Any]:
    """The ``config.json`` of an HF model folder, as a dict (:func:`kd.folders.read_config_json`).

    Args:
        model_dir: the folder.
        key: the key whose folder it is, named in errors.
        folder_arg: ``key``'s argument naming the folder (``checkpoint_dir`` or ``path``).

    Raises:
        KDUserError: the file is missing, unreadable, not a JSON object, outside the folder or
            asks for the folder's own code.
    """
    return folders.read_config_json(model_dir, key=f"{key}.{folder_arg}")


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]] | None:
    """The shape of every tensor in ``files``, read from their headers (no tensor data is read).

    Returns:
        ``{name: shape}`` over all files, or None when a file or its header cannot be read (loading
        the weights then reports it).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[name] = tuple(int(d) for d in f.get_slice(name).get_shape())
    except Exception:  # noqa: BLE001 - safetensors raises its own error type for a bad header
        return None
    return shapes


# HF names of the tensors whose shapes config.json describes (Qwen2 and Llama share them).
_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_GATE = "model.layers.0.mlp.gate_proj.weight"
_Q = "model.layers.0.self_attn.q_proj.weight"
_K = "model.layers.0.self_attn.k_proj.weight"


def hf_config_problems(
    model_dir: Path,
    shapes: dict[str, tuple[int, ...]],
    *,
    key: str,
    heads: tuple[int, int, int] | None = None,
    folder_arg: str = "checkpoint_dir",
) -> list[str]:
    """Where a model folder's ``config.json`` contradicts its weights (empty when it agrees).

    torchtune converts the weights with the config's heads and kd copies the config next to the
    student it saves, so a config.json that does not describe its safetensors trains a scrambled
    model or writes a ``final/`` that transformers cannot load. Checked: ``vocab_size``,
    ``hidden_size``, ``num_hidden_layers``, ``intermediate_size``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``tie_word_embeddings`` (against ``lm_head.weight``).

    Args:
        model_dir: the HF folder (its ``config.json`` is read).
        shapes: tensor shapes of its weight files, :func:`safetensors_shapes`.
        key: the checkpointer key whose ``checkpoint_dir`` the folder is, named in each problem.
        heads: ``(num_heads, num_kv_heads, head_dim)`` of the model's builder; the attention
            projections only fix products of heads and head_dim, so when these agree with the
            weights they say which of the config's values is wrong.
        folder_arg: ``key``'s argument naming the folder (``checkpoint_dir``; ``path`` for a
            Hugging Face model of the transformers backend).

    Returns:
        One line per contradiction: the field, both values and the fix.
    """
    config = read_hf_config(model_dir, key=key, folder_arg=folder_arg)
    where = f"{key}.{folder_arg}: {Path(model_dir) / HF_CONFIG_FILE}"
    problems: list[str] = []

    def setting(field: str) -> int | None:
        value = config.get(field)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def compare(field: str, actual: int, evidence: str) -> None:
        said = setting(field)
        if said is not None and said != actual:
            problems.append(
                f"{where} says {field}={said} but the weights have {actual} ({evidence}); set "
                f"{field} to {actual} in that file (or restore it from the model's source)"
            )

    embed = shapes.get(_EMBED)
    if embed is not None and len(embed) == 2:
        compare("vocab_size", embed[0], f"rows of {_EMBED}")
        compare("hidden_size", embed[1], f"columns of {_EMBED}")
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if layers:
        compare("num_hidden_layers", max(layers) + 1, "model.layers.N in the weights")
    gate = shapes.get(_GATE)
    if gate is not None and len(gate) == 2:
        compare("intermediate_size", gate[0], f"rows of {_GATE}")
    q, k = shapes.get(_Q), shapes.get(_K)
    if q is not None and k is not None and len(q) == 2 and len(k) == 2:
        if heads is not None and q[0] == heads[0] * heads[2] and k[0] == heads[1] * heads[2]:
            num_heads, num_kv_heads, head_dim = heads
            how = f"{_Q} rows {q[0]} = {num_heads} heads x {head_dim}, as in the model builder"
            compare("num_attention_heads", num_heads, how)
            compare("num_key_value_heads", num_kv_heads, f"{_K} rows {k[0]} / head_dim {head_dim}")
            compare("head_dim", head_dim, how)
        else:
            num_heads, hidden = setting("num_attention_heads"), setting("hidden_size")
            head_dim = setting("head_dim") or (
                hidden // num_heads if num_heads and hidden else None
            )
            if num_heads and head_dim and q[0] != num_heads * head_dim and q[0] % head_dim == 0:
                compare("num_attention_heads", q[0] // head_dim, f"{_Q} rows / head_dim {head_dim}")
            if head_dim and k[0] % head_dim == 0:
                compare("num_key_value_heads", k[0] // head_dim, f"{_K} rows / head_dim {head_dim}")
    if embed is not None:
        # transformers and torchtune default to untied for Qwen2 and Llama.
        tied = bool(config.get("tie_word_embeddings", False))
        if tied and _LM_HEAD in shapes:
            problems.append(
                f"{where} says tie_word_embeddings=true but the weights hold a separate "
                f"{_LM_HEAD}; set tie_word_embeddings to false in that file (or restore it)"
            )
        elif not tied and _LM_HEAD not in shapes:
            problems.append(
                f"{where} says tie_word_embeddings=false but the weights have no {_LM_HEAD} (the "
                "output shares the embedding); set tie_word_embeddings to true in that file "
                "(or restore it)"
            )
    return problems


def checkpoint_config_problems(
    checkpoint_dir: str | None,
    checkpoint_files: Any,
    *,
    key: str,
    heads: tuple[int, int, int] | None = None,
    folder_arg: str = "checkpoint_dir",
) -> list[str]:
    """Where a checkpointer's ``config.json`` contradicts its safetensors, read from the headers
    only (no weight is read), so a wrong config never converts the weights nor reaches ``final/``.

    Also checked, from the same headers: a safetensors file whose tensors run past its end
    (truncated), and a floating weight stored as integers (loading would cast the raw integers;
    a quantized checkpoint needs its own loader).

    Args:
        checkpoint_dir: the checkpointer's ``checkpoint_dir`` (anything but a string: unchecked).
        checkpoint_files: its ``checkpoint_files`` as plain values: a list, a file name, or
            torchtune's ``{filename_format, max_filename}``.
        key: the checkpointer key (``checkpointer``, ``teacher_checkpointer``), named in each problem.
        heads: ``(num_heads, num_kv_heads, head_dim)`` of the model's builder, as in
            :func:`hf_config_problems`.
        folder_arg: ``key``'s argument naming the folder (``checkpoint_dir`` or ``path``).

    Returns:
        The problems of the headers, else those of :func:`hf_config_problems`; empty when the
        files name no readable safetensors (loading the weights reports those).

    Raises:
        KDUserError: the folder is refused by :func:`kd.folders.check_folder`, or a weight file
            leads outside it or is not a regular file.
    """
    names = checkpoint_file_names(checkpoint_files)
    if not isinstance(checkpoint_dir, str) or not names:
        return []
    root = Path(checkpoint_dir).expanduser()
    where = f"{key}.{folder_arg}"
    folders.check_folder(root, key=where)
    found = [(n, folders.file_in(root, n, key=where)) for n in names]
    files = [f for n, f in found if f is not None and n.endswith(".safetensors")]
    problems = safetensors_header_problems(files, key=key, folder=root)
    if problems:
        return problems
    shapes = safetensors_shapes(files)
    if not shapes:
        return []
    return hf_config_problems(root, shapes, key=key, heads=heads, folder_arg=folder_arg)


# safetensors dtypes that hold integers (a model's floating weights never should).
_INTEGER_DTYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"})
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the bytes of data after it (nothing else read).

    Raises:
        ValueError: the file is too short for its header, or the header is not a JSON object.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"its header length {length} runs past the end of the file")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return header, size - 8 - length


def safetensors_header_problems(files: list[Path], *, key: str, folder: Path) -> list[str]:
    """Truncated or damaged safetensors headers, and floating weights stored as integers.

    Args:
        files: safetensors files (regular files inside ``folder``).
        key: the config key whose weights they are (``checkpointer``, ``model``), first on each
            line.
        folder: their folder, named on each line.

    Returns:
        At most one line per file: the file, what is wrong and the fix.
    """
    problems: list[str] = []
    where = f"{key}: cannot load the weights in {one_line(str(folder))}"
    redownload = "re-download the truncated or damaged file"
    for path in files:
        try:
            header, data_bytes = safetensors_header(path)
        except (OSError, ValueError, struct.error) as e:
            problems.append(f"{where} ({path.name}: {brief(e)}); {redownload}")
            continue
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            offsets = info.get("data_offsets")
            end = offsets[1] if isinstance(offsets, list) and len(offsets) == 2 else None
            if not isinstance(end, int) or end > data_bytes:
                problems.append(
                    f"{where} ({path.name} is truncated: tensor {name} ends at byte {end} of its "
                    f"data but the file holds {data_bytes}); {redownload}"
                )
                break
            dtype = info.get("dtype")
            if dtype in _INTEGER_DTYPES and name.endswith((".weight", ".bias")):
                problems.append(
                    f"{where} ({path.name} stores the weight {name} as integers ({dtype}), which "
                    "would be cast into the floating parameters as raw numbers); use the model's "
                    "unquantized (float16, bfloat16 or float32) safetensors"
                )
                break
    return problems


def _prepare(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    # safetensors needs contiguous CPU tensors that share no storage with another entry.
    return t.to("cpu").contiguous()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")


def save_hf_model(
    dest: Path,
    state_dict: dict[str, torch.Tensor],
    *,
    model_type: str,
    source_dir: Path,
    adapter_state_dict: dict[str, torch.Tensor] | None = None,
    adapter_config: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, Path] | None = None,
    adapter_only: bool = False,
) -> None:
    """Write a torchtune student as an HF model folder into the existing folder ``dest``.

    Args:
        dest: an existing (usually temporary) folder.
        state_dict: the student's torchtune state dict on CPU (full tensors, not DTensors). LoRA keys
            (``*.lora_a.weight``, ``*.lora_b.weight``, ``*.magnitude``) are merged into the base
            weights with ``adapter_config["r"]`` and ``["lora_alpha"]``; the input is not modified.
        model_type: torchtune ``ModelType`` name of the student.
        source_dir: the student's original HF folder (``checkpointer.checkpoint_dir``): its
            ``config.json`` and other non-weight files (tokenizer, generation config) are copied.
        adapter_state_dict: LoRA only: adapter params in torchtune names; saved in PEFT format.
        adapter_config: LoRA only: ``{"r", "lora_alpha", "target_modules", ...}`` in torchtune's
            form (target modules ``q_proj``, ``output_proj``, ``w1``...).
        dtype: cast floating tensors to this dtype (None keeps each tensor's dtype).
        extra_files: as in :func:`write_hf_folder`.
        adapter_only: write the PEFT adapter alone (``adapter/``): no merge, no base weights
            (a served sampler's LoRA push: the server holds the base model).
    """
    from kd import _torchtune as tt  # only writing a model needs torchtune (a multi-second import)

    source_dir = Path(source_dir)
    hf_config = read_hf_config(source_dir)

    state_dict = dict(state_dict)
    lora_modules = [k[: -len(".lora_a.weight")] for k in state_dict if k.endswith(".lora_a.weight")]
    if adapter_only:
        lora_modules, state_dict = [], {}
    if lora_modules:
        if adapter_config is None:
            raise ValueError(
                "state_dict has LoRA params; pass adapter_config with r and lora_alpha"
            )
        # get_merged_lora_ckpt adds B @ A in place: on a live model's state dict that would
        # change the parameters being trained, so merge into copies.
        for module in lora_modules:
            state_dict[f"{module}.weight"] = state_dict[f"{module}.weight"].clone()
        state_dict = tt.get_merged_lora_ckpt(
            state_dict, rank=int(adapter_config["r"]), alpha=float(adapter_config["lora_alpha"])
        )
    hf_state = tune_to_hf_state_dict(state_dict, model_type=model_type, hf_config=hf_config)
    peft_state = peft_config = None
    if adapter_state_dict is not None:
        if adapter_config is None:
            raise ValueError("adapter_state_dict needs adapter_config")
        peft_state = tune_to_peft_adapter_state_dict(
            adapter_state_dict, model_type=model_type, hf_config=hf_config
        )
        peft_config = tt.tune_to_peft_adapter_config(
            copy.deepcopy(dict(adapter_config)), base_model_name_or_path=str(source_dir.resolve())
        )
        peft_config.setdefault("peft_type", "LORA")
        peft_config.setdefault("task_type", "CAUSAL_LM")
        peft_config.setdefault("bias", "none")
        peft_config.setdefault(
            "use_dora", any(k.endswith(".magnitude") for k in adapter_state_dict)
        )
    write_hf_folder(
        dest,
        hf_state,
        source_dir=source_dir,
        adapter_state=peft_state,
        adapter_config=peft_config,
        dtype=dtype,
        extra_files=extra_files,
        adapter_only=adapter_only,
    )


def write_hf_folder(
    dest: Path,
    hf_state: dict[str, torch.Tensor],
    *,
    source_dir: Path,
    adapter_state: dict[str, torch.Tensor] | None = None,
    adapter_config: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, Path] | None = None,
    adapter_only: bool = False,
) -> None:
    """Write an HF model folder (either backend) into the existing folder ``dest``.

    Args:
        dest: an existing (usually temporary) folder.
        hf_state: weights in transformers' names (merged; no LoRA keys), on CPU.
        source_dir: the student's original HF folder: its ``config.json`` (with the saved dtype)
            and every non-weight file (tokenizer files, chat template, generation config) are
            copied, so the folder loads with ``AutoModelForCausalLM`` and ``AutoTokenizer``.
        adapter_state: LoRA only: the adapter in PEFT's names (``base_model.model.*.lora_A.weight``).
        adapter_config: LoRA only: the contents of ``adapter_config.json``.
        dtype: cast floating tensors to this dtype (None keeps each tensor's dtype).
        extra_files: file name -> a tokenizer file to copy too when ``source_dir`` holds no
            tokenizer file (the files of a tokenizer kept outside the model folder).
        adapter_only: write ``adapter_state`` alone (``hf_state`` is ignored): the PEFT adapter
            folder ``adapter/`` and nothing else.
    """
    dest = Path(dest)
    if adapter_only:
        if adapter_state is None or adapter_config is None:
            raise ValueError("adapter_only needs adapter_state and adapter_config")
        _write_adapter(dest, adapter_state, adapter_config, dtype)
        return
    source_dir = Path(source_dir)
    hf_config = read_hf_config(source_dir)
    hf_state = {k: _prepare(v, dtype) for k, v in hf_state.items()}

    copied = set()
    for item in sorted(source_dir.iterdir()):
        name = item.name
        if item.is_dir() or name.startswith(".") or name == HF_CONFIG_FILE:
            continue
        if _is_weight_file(name) or name in _KD_FILES:
            continue
        # Only regular files inside the folder: never a link out of it, never a named pipe.
        source = folders.file_in(source_dir, name, key=f"{source_dir}")
        if source is not None:
            shutil.copyfile(source, dest / name)
            copied.add(name)
    if not copied & set(TOKENIZER_FILE_NAMES):
        for name, path in (extra_files or {}).items():
            if name in copied or name == HF_CONFIG_FILE:
                continue
            source = folders.file_in(Path(path).parent, Path(path).name, key="tokenizer")
            if source is not None:
                shutil.copyfile(source, dest / name)

    # config.json says which dtype the weights are in; transformers' dtype="auto" reads it.
    saved_dtype = dtype or next((v.dtype for v in hf_state.values() if v.is_floating_point()), None)
    if saved_dtype is not None:
        dtype_keys = [k for k in ("torch_dtype", "dtype") if k in hf_config] or ["torch_dtype"]
        for k in dtype_keys:
            hf_config[k] = _dtype_name(saved_dtype)
    (dest / HF_CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_file(hf_state, str(dest / MODEL_FILE), metadata={"format": "pt"})

    if adapter_state is not None:
        if adapter_config is None:
            raise ValueError("adapter_state needs adapter_config")
        _write_adapter(dest, adapter_state, adapter_config, dtype)


def _write_adapter(
    dest: Path,
    adapter_state: dict[str, torch.Tensor],
    adapter_config: dict[str, Any],
    dtype: torch.dtype | None,
) -> None:
    """The PEFT adapter folder (``adapter/``: weights and ``adapter_config.json``) in ``dest``."""
    (dest / ADAPTER_MODEL_FILE).parent.mkdir(exist_ok=True)
    save_file(
        {k: _prepare(v, dtype) for k, v in adapter_state.items()},
        str(dest / ADAPTER_MODEL_FILE),
        metadata={"format": "pt"},
    )
    (dest / ADAPTER_CONFIG_FILE).write_text(
        json.dumps(adapter_config, indent=2, sort_keys=True, default=sorted) + "\n"
    )


def load_hf_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The HF-named weights of a checkpoint folder (single file or sharded with an index), on CPU."""
    ckpt = Path(ckpt)
    index = ckpt / MODEL_INDEX_FILE
    try:
        if index.exists():
            shards = folders.index_weight_files(ckpt, key=str(ckpt)) or []
            out: dict[str, torch.Tensor] = {}
            for shard in shards:
                path = folders.file_in(ckpt, shard, key=str(ckpt)) or ckpt / shard
                out.update(load_file(str(path)))
            return out
        path = folders.file_in(ckpt, MODEL_FILE, key=str(ckpt)) or ckpt / MODEL_FILE
        return load_file(str(path))
    except KDUserError:
        raise
    except Exception as e:  # safetensors raises its own error type for corrupt files
        raise KDUserError(
            f"{ckpt}: cannot read the model weights ({e}); delete this folder to resume from an older checkpoint"
        ) from e


def load_adapter_weights(
    ckpt: Path, *, model_type: str, hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The LoRA adapter of a checkpoint folder, in torchtune names (to resume a LoRA run)."""
    path = Path(ckpt) / ADAPTER_MODEL_FILE
    try:
        peft_state = load_file(str(path))
    except Exception as e:
        raise KDUserError(
            f"{path}: cannot read the adapter ({e}); delete this folder to resume from an older checkpoint"
        ) from e
    return peft_to_tune_adapter_state_dict(peft_state, model_type=model_type, hf_config=hf_config)
