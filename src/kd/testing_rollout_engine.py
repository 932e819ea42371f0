"""The model behind :mod:`kd.testing_rollout_server`: a Hugging Face folder on the CPU that
samples completions of token-id prompts as vLLM and SGLang do (a logit bias, then temperature,
top-k and top-p; temperature below 1e-5 is greedy; a per-request seeded generator), loads PEFT
adapters with ``peft`` and reloads its weights from a folder's safetensors files.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["prompt_table", "SAMPLING_EPS", "RolloutEngine", "poison"]

SAMPLING_EPS = 1e-5  # vLLM and SGLang: a temperature below this is greedy


class RolloutEngine:
    """The served model: a base Hugging Face model, its adapters, and sampling.

    Args:
        folder: the model's folder (checked: no ``auto_map``, no link out of it).
        tokenizer_dir: the tokenizer of the texts sent beside the ids (None: no texts).
    """

    def __init__(self, folder: Path, tokenizer_dir: Path | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from kd import folders

        self.folder = Path(folder)
        folders.check_folder(self.folder, key="--model")  # no auto_map, no link out of it
        self.base = AutoModelForCausalLM.from_pretrained(
            str(self.folder), dtype=torch.float32, local_files_only=True, trust_remote_code=False
        ).eval()
        self.tokenizer = (
            AutoTokenizer.from_pretrained(
                str(tokenizer_dir), local_files_only=True, trust_remote_code=False
            )
            if tokenizer_dir is not None
            else None
        )
        self.adapters: dict[str, torch.nn.Module] = {}
        self.eos = self._eos_ids(self.folder)
        self.vocab = int(self.base.config.vocab_size)
        self.sees: Path | None = None  # the server's view of the disk (None: all of it)

    def _visible(self, path: str) -> bool:
        where = Path(path).resolve()
        return self.sees is None or where == self.sees or self.sees in where.parents

    @staticmethod
    def _eos_ids(folder: Path) -> set[int]:
        """The model's EOS ids, as vLLM reads them (generation_config.json, else config.json)."""
        for name in ("generation_config.json", "config.json"):
            path = folder / name
            if path.is_file():
                eos = json.loads(path.read_text()).get("eos_token_id")
                if eos is not None:
                    return {int(e) for e in (eos if isinstance(eos, list) else [eos])}
        return set()

    def load_adapter(self, path: str, *, max_rank: int) -> torch.nn.Module:
        """A PEFT adapter folder read by peft over a copy of the base model.

        Raises:
            FileNotFoundError: no adapter in the folder (``adapter_config.json`` and weights).
            ValueError: its rank is above ``max_rank``.
        """
        from peft import PeftModel

        folder = Path(path)
        config = folder / "adapter_config.json"
        present = config.is_file() and (folder / "adapter_model.safetensors").is_file()
        if not present or not self._visible(path):
            raise FileNotFoundError(f"No adapter found for {path}")
        rank = int(json.loads(config.read_text()).get("r", 0))
        if rank > max_rank:
            raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
        return PeftModel.from_pretrained(
            copy.deepcopy(self.base), str(folder), trust_remote_code=False
        ).eval()

    def reload(self, folder: str) -> None:
        """The base model's weights from a folder's safetensors files (every file, names as the
        model's state dict; a tied output weight may be absent).

        Raises:
            ValueError: no safetensors file, an unknown name, a shape that differs, or a weight of
                the model left unset.
        """
        from safetensors.torch import load_file

        seen = Path(folder).is_dir() and self._visible(folder)
        files = sorted(Path(folder).glob("*.safetensors")) if seen else []
        if not files:
            raise ValueError(f"Cannot find any model weights with `{folder}`")
        loaded: dict[str, torch.Tensor] = {}
        for f in files:
            loaded.update(load_file(str(f)))
        state = self.base.state_dict()
        unknown = sorted(set(loaded) - set(state))
        if unknown:
            raise ValueError(f"There is no module or parameter named '{unknown[0]}'")
        tied = bool(getattr(self.base.config, "tie_word_embeddings", False))
        missing = [k for k in state if k not in loaded and not (tied and k == "lm_head.weight")]
        if missing:
            raise ValueError(f"Following weights were not initialized from checkpoint: {missing}")
        for name, value in loaded.items():
            if tuple(value.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"Attempted to load weight ({tuple(value.shape)}) into parameter "
                    f"({tuple(state[name].shape)}) for {name}"
                )
        with torch.no_grad():
            self.base.load_state_dict(
                {k: v.to(state[k].dtype) for k, v in loaded.items()}, strict=False
            )
            if tied:
                self.base.tie_weights()

    @torch.no_grad()
    def drop_weights(self) -> None:
        """The base weights' memory "remapped empty" (a vLLM level-2 sleep woken without a
        reload): zeros, so what it samples then is not the model's."""
        for value in self.base.state_dict().values():
            value.zero_()

    @torch.no_grad()
    def sample(
        self,
        model: torch.nn.Module,
        prompt: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        stops: set[int],
        logit_bias: dict[int, float],
        generator: torch.Generator,
    ) -> tuple[list[int], int | None]:
        """One completion: its ids (the stop id included) and the id that stopped it (None when
        ``max_tokens`` did)."""
        ids = list(prompt)
        out: list[int] = []
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()  # [V]
            for token, bias in logit_bias.items():
                logits[token] += bias
            if temperature < SAMPLING_EPS:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if 0 < top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                if top_p < 1.0:
                    ordered, order = logits.sort(descending=True)
                    probs = ordered.softmax(-1)
                    drop = probs.cumsum(-1) - probs >= top_p
                    drop[0] = False
                    logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
                token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
            ids.append(token)
            out.append(token)
            if token in stops:
                return out, token
        return out, None


def prompt_table(model: torch.nn.Module, prompt: list[int], k: int) -> list[list[tuple]]:
    """Per position 1 .. n - 1 of ``prompt``: the actual token's ``(id, logprob, rank)`` first,
    then the other top-``k`` ones by rank, under ``model``
    (:func:`kd.testing_server.top_positions`)."""
    from kd.testing_server import top_positions

    with torch.no_grad():
        table = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    return top_positions(table, prompt, k)


def poison(payload: Any, token: int) -> None:
    """A generation answer with its first completion's first id replaced by ``token``."""
    if isinstance(payload, dict) and isinstance(payload.get("choices"), list):
        ids = payload["choices"][0].get("token_ids")
    else:
        first = payload[0] if isinstance(payload, list) else payload
        ids = first.get("output_ids") if isinstance(first, dict) else None
    if ids:
        ids[0] = token
