"""The transformers backend: models and tokenizers from local Hugging Face folders."""

from kd.hf.model import causal_lm, lora_causal_lm

__all__ = ["causal_lm", "lora_causal_lm"]
