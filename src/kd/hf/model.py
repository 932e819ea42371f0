"""The transformers backend: any decoder-only causal LM in a local Hugging Face folder.

A model given by ``_component_: kd.hf.causal_lm`` (or ``kd.hf.lora_causal_lm``) and ``path`` (a
folder with ``config.json`` and safetensors) is built by ``transformers.AutoModelForCausalLM``
from its ``config.json`` and loaded from the folder's safetensors by :func:`load_folder_weights`.
Building and loading are separate, as for torchtune's builders, so the recipe builds on the meta
device for its checks, on fake tensors for the memory trace, and on rank 0 only when distributed.

LoRA students get peft adapters injected in place (``peft.inject_adapter_in_model``): the model
stays the transformers class, its base weights are named ``<module>.base_layer.weight`` and the
adapters ``<module>.lora_A.default.weight``. The functions here are the transformers half of kd's
one model interface (:mod:`kd.models`), which the recipe, the planner and the checkpoints use.

Nothing is downloaded: a folder must hold ``config.json`` and the weights; the hub is never asked.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kd import folders
from kd.errors import KDUserError, brief

HF_CONFIG_FILE = folders.CONFIG_JSON
ADAPTER_NAME = "default"
PEFT_PREFIX = "base_model.model."
# torchtune's LoRA module names -> the transformers names of Llama-like attention.
_ATTN_ALIASES = {"output_proj": "o_proj"}
_ATTN_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "output_proj")


def _folder(path: str | Path, *, key: str) -> Path:
    """``path`` as a model folder holding a config.json, or a one-line error naming ``key``.

    The folder is checked as :func:`kd.folders.check_folder` does (no ``auto_map``, no link out
    of the folder, no named pipe), before transformers reads anything in it.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise KDUserError(
            f"{key}.path: {folder} is not a folder; point it at a local Hugging Face model "
            "folder (config.json + *.safetensors)"
        )
    folders.read_config_json(folder, key=f"{key}.path")
    folders.check_folder(folder, key=f"{key}.path")
    return folder


def read_config(path: str | Path, *, key: str = "model") -> Any:
    """The ``transformers`` config of a local folder (never downloaded, never its own code).

    Raises:
        KDUserError: the folder or its config.json is missing or unreadable, asks for the folder's
            own code, or transformers does not know the architecture.
    """
    folder = _folder(path, key=key)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError/OSError/KeyError
        raise KDUserError(
            f"{key}.path: transformers cannot read {folder / HF_CONFIG_FILE} ({brief(e)}); "
            "restore the file from the model's source or upgrade transformers for this "
            "architecture"
        ) from e


def _check_causal_lm(config: Any, *, key: str) -> None:
    """Refuse configs whose logits are not ``hidden @ lm_head.T`` (the fused loss's premise)."""
    if getattr(config, "is_encoder_decoder", False):
        raise KDUserError(
            f"{key}.path: {config.model_type} is an encoder-decoder model; kd distils "
            "decoder-only causal LMs"
        )
    for name in ("final_logit_softcapping", "logit_scale"):
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise KDUserError(
                f"{key}.path: its config.json sets {name}={value}, which changes the logits "
                "after the output projection and kd's losses do not apply it; set it to null "
                "in config.json only if the model was trained without it"
            )


def build_causal_lm(
    path: str | Path,
    *,
    key: str = "model",
    dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """A causal LM built from ``path/config.json`` with initial (not loaded) weights.

    Built on the current default device (``with torch.device("meta")`` for shapes only) and in
    ``dtype`` (default: torch's default dtype, which the recipe sets to the run's dtype).

    Args:
        path: a local Hugging Face model folder.
        key: the config key naming the model, for errors.
        dtype: parameter dtype.
        attn_implementation: transformers' attention (``sdpa``, ``eager``, ``flash_attention_2``).

    Raises:
        KDUserError: the folder is not a decoder-only model transformers can build.
    """
    config = read_config(path, key=key)
    _check_causal_lm(config, key=key)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=dtype or torch.get_default_dtype(),
            attn_implementation=attn_implementation,
            trust_remote_code=False,
        )
    except (ValueError, KeyError) as e:
        raise KDUserError(
            f"{key}.path: transformers cannot build a causal LM from {Path(path) / HF_CONFIG_FILE} "
            f"({brief(e)}); kd distils decoder-only models (AutoModelForCausalLM)"
        ) from e
    model.kd_path = Path(path).expanduser()
    return model


def causal_lm(path: str, attn_implementation: str = "sdpa") -> nn.Module:
    """Config builder (``_component_: kd.hf.causal_lm``): the model of a local HF folder.

    The weights are read from the same folder when the recipe loads the model (this builds the
    architecture only, like torchtune's builders).

    Args:
        path: a local Hugging Face model folder (config.json + safetensors).
        attn_implementation: transformers' attention implementation.
    """
    return build_causal_lm(path, attn_implementation=attn_implementation)


def lora_target_modules(
    model: nn.Module,
    *,
    attn_modules: Sequence[str],
    apply_to_mlp: bool,
    apply_to_output: bool,
    key: str = "model",
) -> list[str]:
    """The qualified names of the linear layers that get LoRA adapters.

    Args:
        model: a transformers causal LM.
        attn_modules: torchtune's names (``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``;
            ``o_proj`` is accepted too): the attention projections of every decoder layer.
        apply_to_mlp: every linear layer of each decoder layer's MLP.
        apply_to_output: the output projection (``lm_head``).
        key: the config key, for errors.

    Raises:
        KDUserError: a name that is no attention projection of this model.
    """
    wanted = set()
    for name in attn_modules:
        if name not in _ATTN_NAMES:
            raise KDUserError(
                f"{key}.lora_attn_modules: {name!r} is not an attention projection; use "
                "q_proj, k_proj, v_proj and output_proj (o_proj)"
            )
        wanted.add(_ATTN_ALIASES.get(name, name))
    layers = decoder_layers(model)
    targets: list[str] = []
    found: set[str] = set()
    layer_ids = {id(layer) for layer in layers}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parts = name.split(".")
        leaf = parts[-1]
        if leaf in wanted and len(parts) >= 2 and "attn" in parts[-2]:
            targets.append(name)
            found.add(leaf)
        elif apply_to_mlp and ".mlp." in f".{name}." and _in_layer(model, name, layer_ids):
            targets.append(name)
    missing = sorted(wanted - found)
    if missing:
        raise KDUserError(
            f"{key}.lora_attn_modules: this {type(model).__name__} has no attention projection "
            f"named {missing[0]}; choose among "
            + ", ".join(sorted({n.split(".")[-1] for n in _attention_linears(model)}))
        )
    if apply_to_output:
        targets.append(_output_name(model))
    return targets


def _in_layer(model: nn.Module, name: str, layer_ids: set[int]) -> bool:
    parts = name.split(".")
    for i in range(len(parts)):
        if id(model.get_submodule(".".join(parts[:i]))) in layer_ids:
            return True
    return False


def _attention_linears(model: nn.Module) -> list[str]:
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and len(n.split(".")) >= 2 and "attn" in n.split(".")[-2]
    ]


def _output_name(model: nn.Module) -> str:
    out = model.get_output_embeddings()
    return next(n for n, m in model.named_modules() if m is out)


def lora_causal_lm(
    path: str,
    lora_attn_modules: list[str],
    lora_rank: int,
    lora_alpha: float,
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_dropout: float = 0.0,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """Config builder (``_component_: kd.hf.lora_causal_lm``): a LoRA student (peft adapters).

    Adapters are injected in place; only they train. The knobs are those of torchtune's
    ``lora_*`` builders.
    """
    model = build_causal_lm(path, attn_implementation=attn_implementation)
    config = lora_config(
        model,
        attn_modules=lora_attn_modules,
        apply_to_mlp=apply_lora_to_mlp,
        apply_to_output=apply_lora_to_output,
        rank=lora_rank,
        alpha=lora_alpha,
        dropout=lora_dropout,
    )
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    model.kd_lora_config = config
    return model


def lora_config(
    model: nn.Module,
    *,
    attn_modules: Sequence[str],
    apply_to_mlp: bool,
    apply_to_output: bool,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
) -> Any:
    """The ``peft.LoraConfig`` of a LoRA student (target modules by qualified name)."""
    from peft import LoraConfig

    targets = lora_target_modules(
        model, attn_modules=attn_modules, apply_to_mlp=apply_to_mlp, apply_to_output=apply_to_output
    )
    return LoraConfig(
        r=int(rank),
        lora_alpha=alpha,
        lora_dropout=float(dropout),
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


# ------------------------------------------------------------------ the model interface
def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a transformers model (also after FSDP2 or peft changed it)."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers (``model.model.layers`` for Llama-like models)."""
    n = int(getattr(model.config, "num_hidden_layers", 0) or 0)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise KDUserError(
        f"model: cannot find the decoder layers of {type(model).__name__}; kd supports "
        "decoder-only models whose layers form one ModuleList"
    )


def output_module(model: nn.Module) -> nn.Module:
    """The output projection module (``lm_head``; a peft layer when LoRA is on it)."""
    return model.get_output_embeddings()


def output_weight(model: nn.Module) -> torch.Tensor:
    """The output projection weight ``[V, D]`` (the base weight under a LoRA adapter)."""
    out = output_module(model)
    base = getattr(out, "base_layer", out)
    return base.weight


def input_embeddings(model: nn.Module) -> nn.Module:
    return model.get_input_embeddings()


def is_tied(model: nn.Module) -> bool:
    """Whether the output projection shares the embedding's weight."""
    return output_weight(model) is input_embeddings(model).weight


def has_plain_output(model: nn.Module) -> bool:
    return type(output_module(model)) is nn.Linear


def _hidden_forward(self: nn.Module, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    # The decoder without the output projection: final-norm hidden states [b, s, d]. Called
    # through the CausalLM's own __call__, so FSDP's hooks on the root still run. Generation
    # (kd.training.on_policy) passes attention_mask, position_ids and a cache that the decoder fills.
    kwargs.setdefault("use_cache", False)
    return self.get_decoder()(input_ids=tokens, **kwargs).last_hidden_state


def set_hidden_output(model: nn.Module, enabled: bool = True) -> None:
    """Make ``model(tokens)`` return final-norm hidden states instead of a CausalLM output."""
    if enabled:
        model.forward = types.MethodType(_hidden_forward, model)
    elif "forward" in model.__dict__:
        del model.__dict__["forward"]


def logits_from_hidden(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return output_module(model)(hidden).float()


def is_lora(model: nn.Module) -> bool:
    return any(".lora_A." in name for name, _ in model.named_parameters())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """peft's adapters of ``model`` switched off (``BaseTunerLayer.enable_adapters``, what
    ``PeftModel.disable_adapter`` calls; kd injects adapters without a ``PeftModel``). peft turns
    the adapters' ``requires_grad`` off and back on; the flags are restored as they were."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    flags = {name: p.requires_grad for name, p in model.named_parameters() if ".lora_" in name}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for name, p in model.named_parameters():
            if name in flags:
                p.requires_grad_(flags[name])


def setup_lora_trainable(model: nn.Module) -> None:
    """Only the adapters train."""
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)


def attention_shape(model: nn.Module) -> tuple[int, int, int] | None:
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(heads, int) or not isinstance(hidden, int):
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return heads, int(kv), int(head_dim)


def max_seq_len(model: nn.Module) -> int | None:
    value = getattr(model.config, "max_position_embeddings", None)
    return value if isinstance(value, int) else None


# ------------------------------------------------------------------ weights
def weight_files(folder: Path, *, key: str) -> list[Path]:
    """The safetensors files of a model folder (those its index names, else ``*.safetensors``).

    Raises:
        KDUserError: there are none (only ``.bin`` or ``.gguf`` files, or no weights at all).
    """
    names = folders.index_weight_files(folder, key=f"{key}.path")
    if names is not None:
        files = [folder / n for n in names]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise KDUserError(
                f"{key}.path: {missing[0]} is missing ({len(missing)} of {len(files)} weight "
                "files); finish downloading the model's weights into that folder"
            )
        return files
    files = sorted(
        p
        for p in folder.glob("*.safetensors")
        if not p.name.startswith("adapter_model")
        and not p.name.startswith(".")
        and folders.file_in(folder, p.name, key=f"{key}.path")
    )
    if not files:
        other = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".gguf", ".pt"))
        hint = f" (found {other[0]}; convert it to safetensors)" if other else ""
        raise KDUserError(
            f"{key}.path: {folder} holds no *.safetensors weights{hint}; kd plan needs only "
            "config.json, but kd run needs the weights: download them into that folder"
        )
    return files


def read_folder_weights(folder: Path, *, key: str) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder's safetensors, on CPU, in transformers' names."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder, key=key):
        try:
            state.update(load_file(str(path)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            raise KDUserError(
                f"{key}.path: cannot read {path} ({brief(e)}); re-download the truncated or "
                "damaged file"
            ) from e
    return state


def to_model_names(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> this model's names: ``.base_layer.`` under LoRA adapters, and the
    output weight of a tied model (checkpoints often leave ``lm_head.weight`` out)."""
    out = dict(state)
    names = model.state_dict().keys()
    for name in names:
        if ".base_layer." in name:
            plain = name.replace(".base_layer.", ".")
            if plain in out:
                out[name] = out.pop(plain)
    if is_tied(model):
        head = _output_name(model) + ".weight"
        embed = next(n for n, m in model.named_modules() if m is input_embeddings(model))
        if head not in out and f"{embed}.weight" in out:
            out[head] = out[f"{embed}.weight"]
    return out


def load_folder_weights(model: nn.Module, folder: Path, *, key: str) -> None:
    """Load a model folder's safetensors into ``model`` (a LoRA student's adapters stay at init).

    Raises:
        KDUserError: missing or unreadable files, or weights that do not fit the model (names the
            first missing or unexpected tensor).
    """
    state = to_model_names(model, read_folder_weights(Path(folder), key=key))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [n for n in missing if ".lora_" not in n]
    # transformers keeps some buffers persistent that checkpoints omit (none for Llama/Qwen).
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise KDUserError(
            f"{key}.path: the weights in {folder} do not fit its config.json ({what}); restore "
            "the folder's files from one model"
        )


def hf_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor], *, lora_alpha: float | None, rank: int | None
) -> dict[str, torch.Tensor]:
    """A (full, CPU) state dict as the folder ``AutoModelForCausalLM`` loads: LoRA merged into
    copies of the base weights (``W + alpha/r * B @ A``), adapters dropped, ``lm_head.weight``
    dropped when tied. The input is not modified."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            module = name[: name.index(".base_layer.")]
            a = state.get(f"{module}.lora_A.{ADAPTER_NAME}.weight")
            b = state.get(f"{module}.lora_B.{ADAPTER_NAME}.weight")
            name = name.replace(".base_layer.", ".")
            if a is not None and b is not None and name.endswith(".weight"):
                assert lora_alpha is not None and rank is not None
                scale = float(lora_alpha) / int(rank)
                merged = value.float() + scale * (b.float() @ a.float())
                value = merged.to(value.dtype)
        out[name] = value
    if is_tied(model):
        out.pop(_output_name(model) + ".weight", None)
    return out


def peft_adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a state dict in PEFT's file names
    (``base_model.model.<module>.lora_A.weight``)."""
    tag = f".{ADAPTER_NAME}."
    return {
        PEFT_PREFIX + name.replace(tag, "."): value
        for name, value in state.items()
        if ".lora_" in name
    }


def peft_adapter_config(model: nn.Module, *, base: Path) -> dict[str, Any]:
    """The ``adapter_config.json`` of a LoRA student (peft's own fields), its base ``base``."""
    config = model.kd_lora_config
    data = config.to_dict()
    data["base_model_name_or_path"] = str(Path(base).resolve())
    targets = data.get("target_modules")
    if isinstance(targets, (set, list, tuple)):
        data["target_modules"] = _short_targets(model, sorted(targets))
    return data


def _short_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """Leaf names (``q_proj``) when they select exactly ``targets`` (peft matches suffixes);
    else the qualified names."""
    leaves = sorted({t.rsplit(".", 1)[-1] for t in targets})
    names = [n for n, _ in model.named_modules() if ".lora_" not in n and "base_layer" not in n]
    selected = {n for n in names if n.rsplit(".", 1)[-1] in leaves}
    return leaves if selected == set(targets) else targets
