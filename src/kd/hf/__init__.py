"""The transformers backend: models and tokenizers from local Hugging Face folders.

Config builders: ``kd.hf.causal_lm`` and ``kd.hf.lora_causal_lm`` (:mod:`kd.hf.model`), and
``kd.hf.tokenizer`` (:mod:`kd.hf.tokenization`).
"""

from kd.hf.model import causal_lm, lora_causal_lm
from kd.hf.tokenization import tokenizer

__all__ = ["causal_lm", "lora_causal_lm", "tokenizer"]
