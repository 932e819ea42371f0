"""The transformers backend: models and tokenizers from local Hugging Face folders."""

from kd.hf.tokenizer import tokenizer

__all__ = ["tokenizer"]
