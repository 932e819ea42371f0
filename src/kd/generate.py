"""``kd generate``: a quick look at a trained student, with transformers.

    kd generate --model out/final --prompt "12+30="
    kd generate --model out/final --prompt "What is 12+30?" --chat --max-new-tokens 32
    kd generate --model out/final --prompt "Once upon" --temperature 0.8 --seed 1

The folder is any Hugging Face causal-LM folder (``config.json``, weights, tokenizer files): kd's
``final/`` and ``step_*/`` folders, or a downloaded model. A kd folder of a LoRA student holds the
merged weights, and its PEFT adapter in ``adapter/``: ``--model out/final`` loads the merged
weights, ``--model out/final/adapter`` the adapter with peft on top of its base model folder
(``base_model_name_or_path``, a local folder). A foreign folder with an adapter next to its
weights loads the weights alone (the adapter is taken to be merged in them).
Nothing is downloaded. The new text alone is printed on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kd import folders
from kd.errors import KDUserError, brief, one_line
from kd.runtime.launch import status

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# A folder holds a tokenizer AutoTokenizer can build when it has one of these.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
DEFAULT_MAX_NEW_TOKENS = 64
_ADAPTER_FILE_PREFIX = "adapter_model."
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file; kd keeps its adapter in <folder>/adapter/


@dataclass(frozen=True)
class _Folder:
    """What a model folder holds, as far as loading it is concerned."""

    path: Path
    has_config: bool
    has_weights: bool
    has_adapter: bool
    has_tokenizer: bool


def _is_model_weight_file(name: str) -> bool:
    if name.startswith(_ADAPTER_FILE_PREFIX):
        return False
    return name.endswith(".safetensors") or (name.startswith("pytorch_model") and ".bin" in name)


def _inspect(path: Path, flag: str) -> _Folder:
    from kd.checkpoint.layout import HF_CONFIG_FILE

    if not path.exists():
        raise KDUserError(
            f"{flag}: folder {one_line(str(path))} does not exist; pass a Hugging Face model folder "
            "(e.g. the final/ folder of a kd run)"
        )
    if not path.is_dir():
        raise KDUserError(
            f"{flag}: {one_line(str(path))} is a file, not a folder; pass the model's folder"
        )
    names = {p.name for p in path.iterdir() if p.is_file()}
    return _Folder(
        path=path,
        has_config=HF_CONFIG_FILE in names,
        has_weights=any(_is_model_weight_file(n) for n in names),
        has_adapter=ADAPTER_CONFIG in names,
        has_tokenizer=any(n in names for n in TOKENIZER_FILES),
    )


def _check_model_folder(folder: _Folder, flag: str) -> None:
    """Refuse a folder that holds no loadable model (a PEFT adapter alone is fine)."""
    where = one_line(str(folder.path))
    if folder.has_adapter and not folder.has_weights:
        return
    if not folder.has_config:
        raise KDUserError(
            f"{flag}: {where} has no config.json; pass a Hugging Face model folder "
            "(config.json + *.safetensors), e.g. the final/ folder of a kd run"
        )
    if not folder.has_weights:
        raise KDUserError(
            f"{flag}: {where} has config.json but no model weights (*.safetensors or "
            "pytorch_model*.bin); wait for the weights to finish writing or pass the folder that "
            "holds them"
        )


def _adapter_base(folder: _Folder, flag: str) -> _Folder:
    """The base model folder of an adapter-only ``folder`` (``base_model_name_or_path``)."""
    config_path = folder.path / ADAPTER_CONFIG
    where = one_line(str(config_path))
    try:
        adapter_config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KDUserError(
            f"{flag}: cannot read {where} ({brief(e)}); restore the file or pass a folder with "
            "merged weights"
        ) from e
    base = (
        adapter_config.get("base_model_name_or_path") if isinstance(adapter_config, dict) else None
    )
    if not isinstance(base, str) or not base:
        raise KDUserError(
            f"{flag}: {where} names no base_model_name_or_path; set it to the base model's folder "
            "or pass a folder with merged weights"
        )
    base_path = Path(base).expanduser()  # a relative path is from the working folder, as in peft
    if not base_path.is_dir():
        raise KDUserError(
            f"{flag}: {one_line(str(folder.path))} holds only a LoRA adapter and its base model folder "
            f"{one_line(base)} (base_model_name_or_path in {where}) does not exist here; set it to "
            "the local base model folder (nothing is downloaded)"
        )
    base_folder = _inspect(base_path, f"{flag} (adapter base)")
    folders.check_folder(base_path, key=f"{flag} (adapter base)")
    if base_folder.has_adapter and not base_folder.has_weights:
        raise KDUserError(
            f"{flag}: the base model folder {one_line(str(base_path))} of the adapter holds "
            f"another adapter, not model weights; point base_model_name_or_path in {where} at a "
            "folder with model weights"
        )
    _check_model_folder(base_folder, f"{flag} (adapter base)")
    return base_folder


@contextlib.contextmanager
def _without_adapter(folder: Path) -> Iterator[Path]:
    """``folder`` as transformers should read its merged weights: without the adapter files.

    transformers' ``from_pretrained`` on a folder with ``config.json`` and ``adapter_config.json``
    loads the weights *and then* the adapter on top of them, which would apply a LoRA adapter twice
    to kd's merged weights. The other files are linked into a temporary folder instead.
    """
    with tempfile.TemporaryDirectory(prefix="kd-generate-") as tmp:
        for item in folder.iterdir():
            if item.name == ADAPTER_CONFIG or item.name.startswith(_ADAPTER_FILE_PREFIX):
                continue
            os.symlink(item.resolve(), Path(tmp) / item.name)
        yield Path(tmp)


def _from_pretrained(folder: Path, flag: str, *, shown: Path) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype="auto", trust_remote_code=False
        )
    except Exception as e:  # transformers, safetensors and torch raise many types for bad files
        raise KDUserError(
            f"{flag}: transformers cannot load the model in {one_line(str(shown))} "
            f"({brief(e)}); check config.json and the weight files"
        ) from e


def _load_weights(folder: _Folder, flag: str) -> PreTrainedModel:
    """The causal LM of a folder with weights (merged weights when an adapter lies next to them)."""
    if not folder.has_adapter:
        return _from_pretrained(folder.path, flag, shown=folder.path)
    with _without_adapter(folder.path) as merged:
        return _from_pretrained(merged, flag, shown=folder.path)


def _folders_and_tokenizer(
    model_dir: Path, flag: str
) -> tuple[_Folder, _Folder | None, PreTrainedTokenizerBase]:
    """A model folder checked, its adapter's base folder (None: it has weights) and its tokenizer."""
    folder = _inspect(Path(model_dir).expanduser(), flag)
    folders.check_folder(folder.path, key=flag)  # no auto_map, no link out, no named pipe
    _check_model_folder(folder, flag)
    base = _adapter_base(folder, flag) if folder.has_adapter and not folder.has_weights else None
    # An adapter's tokenizer: its own, else that of the kd folder holding it (<folder>/adapter/),
    # else its base model's.
    candidates = [folder]
    if base is not None:
        candidates += [_inspect(folder.path.parent, flag), base]
    tokenizer_folder = next((f for f in candidates if f.has_tokenizer), folder)
    if not tokenizer_folder.has_tokenizer:
        raise KDUserError(
            f"{flag}: {one_line(str(folder.path))} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
            "copy the tokenizer files of the student's original folder into it"
        )
    folders.check_folder(tokenizer_folder.path, key=flag)
    return folder, base, _load_tokenizer(tokenizer_folder.path, flag)


def load_tokenizer(model_dir: Path, *, flag: str = "--model") -> PreTrainedTokenizerBase:
    """The tokenizer :func:`load_model` would load with ``model_dir``, no weight read.

    Raises:
        KDUserError: what :func:`load_model` raises about the folder and its tokenizer.
    """
    return _folders_and_tokenizer(model_dir, flag)[2]


def load_model(
    model_dir: Path, *, device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a model folder and its tokenizer for generation, offline, in eval mode on ``device``.

    Args:
        model_dir: a Hugging Face causal-LM folder (kd's ``final/`` or ``step_*/``, a downloaded
            model), or a folder with only a PEFT adapter whose ``base_model_name_or_path`` is a
            local folder. Weights load in the dtype ``config.json`` records.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).

    Returns:
        The model (a ``peft.PeftModel`` for an adapter-only folder) and the tokenizer (the
        adapter folder's own, else its parent's (kd's ``final/adapter/``), else its base
        folder's).

    Raises:
        KDUserError: a missing folder, config.json, weights or tokenizer files, an adapter whose
            base folder is missing, an unreadable file, or CUDA requested where there is none;
            names the ``--model`` / ``--device`` flag and the fix.
    """
    flag = "--model"
    _check_device(device)
    folder, base, tokenizer = _folders_and_tokenizer(model_dir, flag)
    if base is None:
        model = _load_weights(folder, flag)
    else:
        from peft import PeftModel

        base_model = _load_weights(base, f"{flag} (adapter base)")
        try:
            model = PeftModel.from_pretrained(
                base_model, str(folder.path), local_files_only=True, trust_remote_code=False
            )
        except Exception as e:  # peft raises ValueError, KeyError, OSError... for a bad adapter
            raise KDUserError(
                f"{flag}: peft cannot load the adapter in {one_line(str(folder.path))} on "
                f"{one_line(str(base.path))} ({brief(e)}); check adapter_config.json and adapter_model.safetensors"
            ) from e
    return model.to(device).eval(), tokenizer


def _load_tokenizer(folder: Path, flag: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # tokenizers and transformers raise many types for bad files
        raise KDUserError(
            f"{flag}: AutoTokenizer cannot load the tokenizer in {one_line(str(folder))} "
            f"({brief(e)}); copy tokenizer.json and tokenizer_config.json of the student's "
            "original folder into it"
        ) from e


def _check_device(device: str) -> None:
    if device != "cpu" and device != "cuda" and not device.startswith("cuda:"):
        raise KDUserError(f"--device: {one_line(device)!r} is not cpu or cuda; pass one of them")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise KDUserError(
                f"--device {device}: no CUDA device is available on this machine; pass --device cpu"
            )


# torch.manual_seed takes a 64-bit unsigned seed.
_MAX_SEED = 2**64 - 1


def _check_options(max_new_tokens: int, temperature: float, seed: int = 0) -> None:
    if not 0 <= seed <= _MAX_SEED:
        raise KDUserError(
            f"--seed: {seed} is not a seed (torch takes 64 bits); pass an integer from 0 to "
            f"{_MAX_SEED}"
        )
    if max_new_tokens < 1:
        raise KDUserError(
            f"--max-new-tokens: {max_new_tokens} generates nothing; pass a number >= 1"
        )
    if not math.isfinite(temperature) or temperature < 0:
        raise KDUserError(
            f"--temperature: {temperature} is not a temperature; pass 0 (greedy) or a positive "
            "number such as 0.7"
        )


def _check_prompt(prompt: str) -> None:
    """Refuse a prompt that is not text: bytes of another encoding than UTF-8 reach Python's
    ``sys.argv`` as lone surrogates (``\udcff``), which no tokenizer encodes."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(prompt[e.start])  # surrogateescape keeps byte b as U+DC00 + b
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise KDUserError(
            f"--prompt: the prompt is not UTF-8 text ({what} at character {e.start}); pass "
            "UTF-8 (convert it, e.g. iconv -f latin1 -t utf-8, or set the terminal's locale to "
            "UTF-8)"
        ) from None


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, *, chat: bool) -> list[int]:
    """The token ids ``generate`` feeds the model for ``prompt``.

    Args:
        tokenizer: the model's tokenizer.
        prompt: the text.
        chat: render ``prompt`` as one user message with the tokenizer's chat template and the
            assistant's turn opened (``add_generation_prompt=True``); otherwise encode it as is
            (with the tokenizer's usual special tokens, such as a BOS).

    Raises:
        KDUserError: ``chat`` and the tokenizer has no chat template, or one that fails to
            render (:func:`kd.hf.tokenization.render_chat_template`: the sandbox, the template's
            own error, the time limit); the prompt is not UTF-8 text or encodes to nothing.
    """
    _check_prompt(prompt)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise KDUserError(
                "--chat: the tokenizer has no chat_template (tokenizer_config.json or "
                "chat_template.jinja); drop --chat, or copy the chat template of the student's "
                "original folder"
            )
        from kd.hf.tokenization import render_chat_template

        # Training's rendering: jinja2's sandbox, the time limit, one line blaming the template.
        folder = one_line(str(getattr(tokenizer, "name_or_path", "") or "the model folder"))
        text = render_chat_template(
            tokenizer,
            [[{"role": "user", "content": prompt}]],
            where=f"--chat: the chat template of {folder}",
            add_generation_prompt=True,
        )[0]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise KDUserError(
                f"--chat: the chat template of {folder} renders the prompt as no text; fix or "
                "replace the folder's chat_template (tokenizer_config.json or "
                "chat_template.jinja), or drop --chat"
            )
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise KDUserError("--prompt: the prompt is empty; pass some text")
    return list(ids)


def generate(
    model_dir: Path,
    prompt: str,
    *,
    chat: bool = False,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    device: str = "cpu",
    temperature: float = 0.0,
    seed: int = 0,
) -> str:
    """Continue ``prompt`` with the model in ``model_dir`` and return only the new text.

    Args:
        model_dir: the model folder (see :func:`load_model`).
        prompt: the text to continue.
        chat: render ``prompt`` as one user message with the tokenizer's chat template.
        max_new_tokens: the most tokens to generate (fewer when the model ends its answer).
        device: ``"cpu"`` or ``"cuda"``.
        temperature: 0 picks the likeliest token each step (greedy, deterministic); above 0
            samples with this temperature.
        seed: seeds torch's RNG before sampling.

    Returns:
        The generated text, special tokens left out.

    Raises:
        KDUserError: a bad option or folder (see :func:`load_model`), or a prompt plus
            ``max_new_tokens`` longer than the model's ``max_position_embeddings``.
    """
    _check_options(max_new_tokens, temperature, seed)
    status("loading %s on %s", model_dir, device)  # a large model takes minutes
    model, tokenizer = load_model(model_dir, device=device)
    ids = prompt_ids(tokenizer, prompt, chat=chat)
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and len(ids) + max_new_tokens > limit:
        raise KDUserError(
            f"--max-new-tokens: the prompt ({len(ids)} tokens) plus {max_new_tokens} new tokens "
            f"exceed the model's {limit} positions (max_position_embeddings); lower "
            "--max-new-tokens or shorten --prompt"
        )
    import torch

    input_ids = torch.tensor([ids], device=device)
    options: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        options = {"do_sample": True, "temperature": temperature}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(seed)
    status("generating up to %d tokens after a %d-token prompt", max_new_tokens, len(ids))
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            **options,
        )
    return tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)


# ------------------------------------------------------------------------------------ command
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to ``kd``'s argparse subparsers."""
    p = subparsers.add_parser(
        "generate",
        help="generate text with a trained student (a quick look; transformers, offline)",
        description="Generate text with a Hugging Face model folder (kd's final/ or step_*/), "
        "offline. Prints only the new text.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="the model folder")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument(
        "--chat",
        action="store_true",
        help="render the prompt as a user message with the tokenizer's chat template",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        metavar="N",
        help=f"the most tokens to generate (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default cpu")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 (default): greedy, the same text every time; above 0: sample",
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed for sampling (default 0)")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``kd generate``: print the generated text on stdout."""
    _check_options(args.max_new_tokens, args.temperature, args.seed)  # before the slow imports
    _check_prompt(args.prompt)
    # (torchao's notice about its C++ extensions is filtered in kd/__init__.py.)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # stdout and stderr carry only the answer or one error line
    hf_logging.disable_progress_bar()
    # (A terminal is told what the minutes go to: kd.runtime.launch.status.)
    text = generate(
        Path(args.model),
        args.prompt,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        temperature=args.temperature,
        seed=args.seed,
    )
    print(text)
    return 0
