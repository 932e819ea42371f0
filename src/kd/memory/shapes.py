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

A model of the transformers backend (``kd.hf.*``) is sized from its folder's ``config.json`` by
:mod:`kd.memory.hf_config`, which fills the fields below that describe transformers' layers
(head size, q/k norms, Gemma's extra norms and (1 + w) scales, sliding-window layers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from kd import families, folders

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

# Which library's modules a shape describes (their saved activations differ).
TORCHTUNE = "torchtune"
TRANSFORMERS = "transformers"
# RMSNorm kinds: ``rms`` scales by w in the input dtype (torchtune, Llama, Qwen); ``rms_1p`` scales
# by (1 + w) in fp32 (Gemma).
RMS = "rms"
RMS_1P = "rms_1p"
# Attention layer kinds of transformers' ``layer_types``.
FULL = "full_attention"
SLIDING = "sliding_attention"

# torchao NF4 (QLoRA ``quantize_base``): 4-bit codes + an int8 scaler per 64 values + an fp32
# scaler-of-scalers per 256 scalers, measured 0.516 B/param under FakeTensorMode.
NF4_BYTES_PER_PARAM = 0.5 + 1.0 / 64 + 4.0 / (64 * 256)
# torchao int8 weight-only (``teacher_quantization: int8``): int8 codes + one scale per output
# channel, measured 1.006 B/param under FakeTensorMode.
INT8_BYTES_PER_PARAM = 1.006


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
        backend: ``torchtune`` or ``transformers``: whose modules run the layers.
        head_size: attention head size when it is not ``embed_dim // num_heads`` (Qwen3, Gemma 3).
        bias_linears: the layer linears (torchtune names) with a bias; None: q/k/v for ``qwen2``.
        qk_norm: an RMSNorm over each head of q and of k (Qwen3, Gemma 3).
        norm: ``rms`` or ``rms_1p`` (see :data:`RMS_1P`).
        sandwich_norms: also a norm after attention and after the MLP (Gemma 3: 4 per layer).
        embed_scale: the embedding output is scaled by sqrt(h) (Gemma 3).
        layer_types: per layer ``full_attention`` or ``sliding_attention`` (empty: all full).
        sliding_window: window of the sliding layers.
        rope_types: rotary tables (transformers keeps one ``inv_freq`` pair per layer kind).
        model_type: config.json's ``model_type`` (transformers backend).
        counted_params: parameters counted by building the model on the meta device (an
            architecture kd has no closed form for); replaces :meth:`base_params`.
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
    backend: str = TORCHTUNE
    head_size: int | None = None
    bias_linears: tuple[str, ...] | None = None
    qk_norm: bool = False
    norm: str = RMS
    sandwich_norms: bool = False
    embed_scale: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_types: int = 1
    model_type: str = ""
    counted_params: int | None = None

    @property
    def hf(self) -> bool:
        """Whether transformers' modules run this model."""
        return self.backend == TRANSFORMERS

    @property
    def head_dim(self) -> int:
        return self.head_size or self.embed_dim // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_bias(self) -> bool:
        return "q_proj" in self.biases

    @property
    def biases(self) -> tuple[str, ...]:
        """The layer linears (torchtune names) that have a bias."""
        if self.bias_linears is not None:
            return self.bias_linears
        return ("q_proj", "k_proj", "v_proj") if self.family == "qwen2" else ()

    def layer_kind(self, index: int) -> str:
        """``full_attention`` or ``sliding_attention`` of decoder layer ``index``."""
        return self.layer_types[index] if self.layer_types else FULL

    def masked(self, index: int, seq: int) -> bool:
        """Whether layer ``index`` attends through an explicit ``[b, 1, s, s]`` mask.

        transformers lets SDPA apply causality itself (no mask, grouped-query attention without
        k/v copies) unless the layer slides and the sequence reaches its window.
        """
        return (
            self.hf
            and self.layer_kind(index) == SLIDING
            and self.sliding_window is not None
            and seq >= self.sliding_window
        )

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
        """Base (non-adapter) parameters of one decoder layer: 7 linears, biases, norms."""
        dims = self.linear_dims()
        n = sum(i * o for i, o in dims.values())
        n += sum(dims[name][1] for name in self.biases)
        norms = (4 if self.sandwich_norms else 2) * self.embed_dim
        return n + norms + (2 * self.head_dim if self.qk_norm else 0)

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
        if self.counted_params is not None:
            return self.counted_params
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

    def buffer_bytes(self, dtype_bytes: int) -> int:
        """Every buffer: the RoPE tables, and Gemma's embedding scale (a scalar in the model dtype)."""
        return self.rope_buffer_bytes() + (dtype_bytes if self.embed_scale else 0)

    def largest_layer_params(self) -> int:
        """Parameters of one decoder layer including adapters (an FSDP unit)."""
        return self.layer_base_params() + self.layer_lora_params()

    def rope_buffer_bytes(self) -> int:
        """RoPE cache + theta buffers (fp32; one module shared by all layers, or one per layer).

        Qwen2 caches ``cat([cos, sin])`` as ``[max_seq_len, 2 * head_dim]``; Llama caches
        ``[max_seq_len, head_dim // 2, 2]``. transformers keeps no cache, only ``inv_freq`` and
        ``original_inv_freq`` (fp32 ``[head_dim // 2]``) per rotary table.
        """
        hd = self.head_dim
        if self.hf:
            return self.rope_types * 2 * 4 * (hd // 2)
        cache = self.max_seq_len * hd * (2 if self.family == "qwen2" else 1)
        one = 4 * (cache + hd // 2)
        return one * (self.num_layers if self.rope_per_layer else 1)


@dataclass(frozen=True)
class Trainable:
    """Which parts of a decoder train: full weights, LoRA adapters, or nothing (teacher).

    Attributes:
        full: every weight trains (norm scales included).
        lora_linears: the layer linears (torchtune names) with adapters.
    """

    full: bool
    lora_linears: frozenset[str]

    def linear(self, name: str) -> bool:
        """Whether the linear's input is needed for a weight gradient (full or LoRA)."""
        return self.full or name in self.lora_linears


def trainable_parts(shape: ModelShape) -> Trainable:
    """What trains in ``shape``: everything, or its LoRA adapters."""
    if shape.lora is None:
        return Trainable(True, frozenset())
    return Trainable(False, frozenset(n for n in shape.linear_dims() if shape.lora.adapted(n)))


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


def shape_from_hf_config(path: str, *, key: str = "checkpointer.checkpoint_dir") -> ModelShape:
    """Shape from a Hugging Face ``config.json`` (Llama / Qwen2 style keys).

    Args:
        path: the ``config.json`` of a model folder (read by :func:`kd.folders.read_config_json`).
        key: the config key naming the folder, for errors.

    Raises:
        ShapeError: missing keys.
        KDUserError: the file is unreadable, not a JSON object, or asks for the folder's code.
    """
    cfg = folders.read_config_json(os.path.dirname(os.path.abspath(path)), key=key)
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


def int8_teacher_bytes_per_param(teacher: ModelShape, dtype_bytes: int) -> float:
    """Mean bytes per parameter of ``teacher`` with ``teacher_quantization: int8``: its
    decoder-layer linears in torchao int8 weight-only, the rest (embedding, norms, biases, an
    untied output) in the run's dtype (:func:`kd.teachers.quantize.quantize_int8`)."""
    total = teacher.total_params()
    linears = teacher.num_layers * sum(i * o for i, o in teacher.linear_dims().values())
    return (linears * INT8_BYTES_PER_PARAM + (total - linears) * dtype_bytes) / max(total, 1)
