"""Model shapes and exact parameter counts, without importing torch or torchtune.

The planner needs only a decoder's dimensions. They come, in this order, from:

1. a table of torchtune's model builders (numbers read once from torchtune 0.6.1's
   ``models/*/_model_builders.py``; a unit test checks every row against the meta-device builder),
2. the explicit shape kwargs of torchtune's component builders (``torchtune.models.qwen2.qwen2``,
   ``torchtune.models.llama3.llama3``, ``lora_*``...), which the tests and ``kd demo`` use,
3. the checkpoint's Hugging Face ``config.json``.

Parameter counts follow torchtune's modules exactly: q/k/v biases for the Qwen2 family, tied
embeddings (``TiedLinear``) where the builder ties them, LoRA ``lora_a``/``lora_b`` (and DoRA
``magnitude``) per adapted linear.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from kd import families

# name -> (vocab, layers, heads, kv_heads, embed_dim, intermediate_dim, tied, max_seq_len); the
# architecture comes from `kd.families` by the name's prefix. Read from torchtune 0.6.1 model
# builders; `tests/unit/test_memory.py` rebuilds each on the meta device and compares the
# parameter count.
BUILDERS: dict[str, tuple[int, int, int, int, int, int, bool, int]] = {
    "qwen2_0_5b": (151936, 24, 14, 2, 896, 4864, True, 32768),
    "qwen2_1_5b": (151936, 28, 12, 2, 1536, 8960, True, 32768),
    "qwen2_7b": (152064, 28, 28, 4, 3584, 18944, False, 32768),
    "qwen2_5_0_5b": (151936, 24, 14, 2, 896, 4864, True, 32768),
    "qwen2_5_1_5b_base": (151936, 28, 12, 2, 1536, 8960, True, 131072),
    "qwen2_5_1_5b_instruct": (151936, 28, 12, 2, 1536, 8960, True, 32768),
    "qwen2_5_3b": (151936, 36, 16, 2, 2048, 11008, True, 32768),
    "qwen2_5_7b_base": (152064, 28, 28, 4, 3584, 18944, False, 131072),
    "qwen2_5_7b_instruct": (152064, 28, 28, 4, 3584, 18944, False, 32768),
    "qwen2_5_14b_base": (152064, 48, 40, 8, 5120, 13824, False, 131072),
    "qwen2_5_14b_instruct": (152064, 48, 40, 8, 5120, 13824, False, 32768),
    "qwen2_5_32b_base": (152064, 64, 40, 8, 5120, 27648, False, 131072),
    "qwen2_5_32b_instruct": (152064, 64, 40, 8, 5120, 27648, False, 32768),
    "qwen2_5_72b_base": (152064, 80, 64, 8, 8192, 29568, False, 131072),
    "qwen2_5_72b_instruct": (152064, 80, 64, 8, 8192, 29568, False, 32768),
    "llama2_7b": (32000, 32, 32, 32, 4096, 11008, False, 4096),
    "llama2_13b": (32000, 40, 40, 40, 5120, 13824, False, 4096),
    "llama2_70b": (32000, 80, 64, 8, 8192, 28672, False, 4096),
    "llama3_8b": (128256, 32, 32, 8, 4096, 14336, False, 8192),
    "llama3_70b": (128256, 80, 64, 8, 8192, 28672, False, 8192),
    "llama3_1_8b": (128256, 32, 32, 8, 4096, 14336, False, 131072),
    "llama3_1_70b": (128256, 80, 64, 8, 8192, 28672, False, 131072),
    "llama3_1_405b": (128256, 126, 128, 8, 16384, 53248, False, 131072),
    "llama3_2_1b": (128256, 16, 32, 8, 2048, 8192, True, 131072),
    "llama3_2_3b": (128256, 28, 24, 8, 3072, 8192, True, 131072),
}

# The seven linears of a decoder layer, in torchtune's names (attention, then MLP).
ATTN_LINEARS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "output_proj")
MLP_LINEARS: tuple[str, ...] = ("w1", "w2", "w3")

# torchao NF4 (QLoRA ``quantize_base``): 4-bit codes + an int8 scaler per 64 values + an fp32
# scaler-of-scalers per 256 scalers, measured 0.516 B/param under FakeTensorMode (memory_anchors.md).
NF4_BYTES_PER_PARAM = 0.5 + 1.0 / 64 + 4.0 / (64 * 256)


@dataclass(frozen=True)
class LoraSpec:
    """Which linears carry LoRA adapters (torchtune ``lora_*`` builder kwargs).

    Attributes:
        rank: ``lora_rank``.
        alpha: ``lora_alpha``.
        attn_modules: ``lora_attn_modules`` (subset of q_proj, k_proj, v_proj, output_proj).
        mlp: ``apply_lora_to_mlp`` (w1, w2, w3).
        output: ``apply_lora_to_output``.
        dropout: ``lora_dropout`` (> 0 saves a dropout mask and copy per adapted input).
        use_dora: DoRA adds a ``magnitude`` vector per adapted linear.
        quantize_base: QLoRA, frozen base linears stored in NF4.
    """

    rank: int
    alpha: float = 16.0
    attn_modules: tuple[str, ...] = ("q_proj", "v_proj")
    mlp: bool = False
    output: bool = False
    dropout: float = 0.0
    use_dora: bool = False
    quantize_base: bool = False

    def adapted(self, name: str) -> bool:
        """Whether the layer linear ``name`` (q_proj ... w3) has an adapter."""
        if name in ATTN_LINEARS:
            return name in self.attn_modules
        return self.mlp


@dataclass(frozen=True)
class ModelShape:
    """A torchtune decoder's dimensions.

    Attributes:
        name: builder name (for messages).
        family: architecture, ``qwen2`` (q/k/v biases, rotate-half RoPE) or ``llama``
            (:mod:`kd.families`).
        vocab_size: rows of the embedding / output projection (padded vocab).
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads.
        embed_dim: hidden size h.
        intermediate_dim: MLP size f.
        tie_word_embeddings: output projection shares the embedding weight.
        max_seq_len: builder's max_seq_len (sizes the RoPE cache buffer).
        lora: adapters, or None for a fully trainable model.
        rope_per_layer: torchtune's ``lora_qwen2``, ``lora_llama2`` and ``lora_llama3`` build one RoPE
            module (and cache) per layer instead of sharing one.
    """

    name: str
    family: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    tie_word_embeddings: bool
    max_seq_len: int
    lora: LoraSpec | None = field(default=None)
    rope_per_layer: bool = False

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each layer linear."""
        h, f = self.embed_dim, self.intermediate_dim
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "output_proj": (self.q_dim, h),
            "w1": (h, f),
            "w2": (f, h),
            "w3": (h, f),
        }

    # ---- parameter counts (exact) ----
    def layer_base_params(self) -> int:
        """Base (non-adapter) parameters of one decoder layer: 7 linears, biases, 2 norms."""
        n = sum(i * o for i, o in self.linear_dims().values())
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        return n + 2 * self.embed_dim

    def layer_lora_params(self) -> int:
        """Adapter parameters of one decoder layer (0 without LoRA)."""
        if self.lora is None:
            return 0
        n = 0
        for name, (i, o) in self.linear_dims().items():
            if self.lora.adapted(name):
                n += self.lora.rank * (i + o) + (o if self.lora.use_dora else 0)
        return n

    def head_lora_params(self) -> int:
        if self.lora is None or not self.lora.output:
            return 0
        v, h = self.vocab_size, self.embed_dim
        return self.lora.rank * (h + v) + (v if self.lora.use_dora else 0)

    def embedding_params(self) -> int:
        return self.vocab_size * self.embed_dim

    def output_params(self) -> int:
        """Output projection parameters not shared with the embedding."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.embed_dim

    def base_params(self) -> int:
        """Every non-adapter parameter (embedding, layers, final norm, untied output)."""
        return (
            self.embedding_params()
            + self.num_layers * self.layer_base_params()
            + self.embed_dim
            + self.output_params()
        )

    def lora_params(self) -> int:
        return self.num_layers * self.layer_lora_params() + self.head_lora_params()

    def total_params(self) -> int:
        return self.base_params() + self.lora_params()

    def quantizable_params(self) -> int:
        """Base weights of the adapted layer linears (what QLoRA's ``quantize_base`` stores in NF4)."""
        if self.lora is None or not self.lora.quantize_base:
            return 0
        per_layer = sum(
            i * o for name, (i, o) in self.linear_dims().items() if self.lora.adapted(name)
        )
        return self.num_layers * per_layer

    def largest_layer_params(self) -> int:
        """Parameters of one decoder layer including adapters (an FSDP unit)."""
        return self.layer_base_params() + self.layer_lora_params()

    def rope_buffer_bytes(self) -> int:
        """RoPE cache + theta buffers (fp32; one module shared by all layers, or one per layer).

        Qwen2 caches ``cat([cos, sin])`` as ``[max_seq_len, 2 * head_dim]``; Llama caches
        ``[max_seq_len, head_dim // 2, 2]``.
        """
        hd = self.head_dim
        cache = self.max_seq_len * hd * (2 if self.family == "qwen2" else 1)
        one = 4 * (cache + hd // 2)
        return one * (self.num_layers if self.rope_per_layer else 1)


def _scale_hidden_dim_for_mlp(dim: int, multiple_of: int = 256) -> int:
    # torchtune's default MLP size for llama builders when intermediate_dim is None.
    hidden = 4 * int(2 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class ShapeError(ValueError):
    """The model's shape cannot be determined from the config."""


def _lora_from_kwargs(kwargs: dict[str, Any]) -> LoraSpec:
    attn = kwargs.get("lora_attn_modules")
    if attn is None:
        raise ShapeError("lora builder without lora_attn_modules")
    return LoraSpec(
        rank=int(kwargs.get("lora_rank", 8)),
        alpha=float(kwargs.get("lora_alpha", 16)),
        attn_modules=tuple(str(a) for a in attn),
        mlp=bool(kwargs.get("apply_lora_to_mlp", False)),
        output=bool(kwargs.get("apply_lora_to_output", False)),
        dropout=float(kwargs.get("lora_dropout", 0.0) or 0.0),
        use_dora=bool(kwargs.get("use_dora", False)),
        quantize_base=bool(kwargs.get("quantize_base", False)),
    )


def _dim(kwargs: dict[str, Any], key: str) -> int:
    """A builder's size argument as a whole number >= 1.

    Raises:
        KeyError: the argument is missing.
        ShapeError: it is not a whole number >= 1 (0 heads would divide by zero in the plan).
    """
    value = kwargs[key]
    whole = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, float) and value.is_integer():
        whole, value = True, int(value)
    if not whole or value < 1:
        raise ShapeError(f"{key} must be a whole number >= 1, got {value!r}")
    return int(value)


def shape_from_component(
    component: str, kwargs: dict[str, Any], *, hf_config_path: str | None = None
) -> ModelShape:
    """The shape built by ``component(**kwargs)``.

    Args:
        component: dotted builder path (``torchtune.models.qwen2_5.qwen2_5_3b``) or its last name.
        kwargs: the builder's other config keys.
        hf_config_path: a Hugging Face ``config.json`` to fall back on for unknown builders.

    Raises:
        ShapeError: unknown builder and no usable ``config.json``.
    """
    name = component.rsplit(".", 1)[-1]
    is_lora = name.startswith("lora_")
    base = name[len("lora_") :] if is_lora else name
    lora = _lora_from_kwargs(kwargs) if is_lora else None
    family = families.family_of_builder(base)
    arch = family.architecture if family is not None else families.LLAMA
    per_layer_rope = is_lora and (family is None or family.lora_rope_per_layer)
    if base in BUILDERS:
        v, n_layers, nh, nkv, h, f, tied, msl = BUILDERS[base]
        tied = bool(kwargs.get("tie_word_embeddings", tied))
        return ModelShape(name, arch, v, n_layers, nh, nkv, h, f, tied, msl, lora, per_layer_rope)
    if family is not None and family.name == base and family.component_tied is not None:
        tied_default = family.component_tied
        try:
            h = _dim(kwargs, "embed_dim")
            nh = _dim(kwargs, "num_heads")
            return ModelShape(
                name=name,
                family=arch,
                vocab_size=_dim(kwargs, "vocab_size"),
                num_layers=_dim(kwargs, "num_layers"),
                num_heads=nh,
                num_kv_heads=_dim(kwargs, "num_kv_heads") if kwargs.get("num_kv_heads") else nh,
                embed_dim=h,
                intermediate_dim=_dim(kwargs, "intermediate_dim")
                if kwargs.get("intermediate_dim")
                else _scale_hidden_dim_for_mlp(h),
                tie_word_embeddings=bool(kwargs.get("tie_word_embeddings", tied_default)),
                max_seq_len=_dim(kwargs, "max_seq_len"),
                lora=lora,
                rope_per_layer=per_layer_rope,
            )
        except KeyError as e:
            raise ShapeError(f"{component} needs the shape kwarg {e.args[0]}") from e
    if hf_config_path and os.path.isfile(hf_config_path):
        shape = shape_from_hf_config(hf_config_path)
        return replace(shape, name=name, lora=lora, rope_per_layer=per_layer_rope)
    raise ShapeError(
        f"unknown model builder {component!r} and no config.json in the checkpoint_dir to read "
        "its shape from"
    )


def shape_from_hf_config(path: str) -> ModelShape:
    """Shape from a Hugging Face ``config.json`` (Llama / Qwen2 style keys).

    Raises:
        ShapeError: missing keys.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as e:
        raise ShapeError(f"{path}: not a readable JSON config ({e})") from e
    if not isinstance(cfg, dict):
        raise ShapeError(f"{path}: not a JSON object")
    try:
        nh = _dim(cfg, "num_attention_heads")
        h = _dim(cfg, "hidden_size")
        model_type = str(cfg.get("model_type", "llama"))
        return ModelShape(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or model_type,
            family=families.architecture_of_hf_model_type(model_type),
            vocab_size=_dim(cfg, "vocab_size"),
            num_layers=_dim(cfg, "num_hidden_layers"),
            num_heads=nh,
            num_kv_heads=_dim(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") else nh,
            embed_dim=h,
            intermediate_dim=_dim(cfg, "intermediate_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_seq_len=_dim(cfg, "max_position_embeddings")
            if cfg.get("max_position_embeddings")
            else 4096,
        )
    except KeyError as e:
        raise ShapeError(f"{path}: missing key {e.args[0]}") from e
    except ShapeError as e:
        raise ShapeError(f"{path}: {e}") from e
