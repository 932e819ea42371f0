"""kd: knowledge-distillation fine-tuning for LLMs with an up-front memory plan."""

__version__ = "0.1.0"
