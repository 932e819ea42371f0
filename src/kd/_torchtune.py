"""The one place `kd` imports torchtune.

torchtune 0.6.1 is no longer maintained; every name `kd` uses from it is re-exported here so a
replacement touches one module. Import from ``kd._torchtune``, never from ``torchtune`` directly.
"""

from __future__ import annotations

import warnings

# torchao's notice about its C++ extensions is filtered in kd/__init__.py.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torchtune
    from torchtune import modules as tt_modules
    from torchtune import training as tt_training
    from torchtune.data import Message, padded_collate_sft
    from torchtune.datasets import ConcatDataset
    from torchtune.datasets._sft import SFTTransform
    from torchtune.generation import generate as generate_tokens
    from torchtune.generation import (
        get_causal_mask_from_padding_mask,
        get_position_ids_from_padding_mask,
    )
    from torchtune.models.convert_weights import _FROM_HF as HF_TO_TUNE_KEYS
    from torchtune.models.convert_weights import (
        get_mapped_key,
        hf_to_tune,
        tune_to_hf,
        tune_to_peft_adapter_config,
    )
    from torchtune.models.llama3 import llama3, lora_llama3
    from torchtune.models.llama3_1 import Llama3ScaledRoPE
    from torchtune.models.qwen2 import lora_qwen2, qwen2, qwen2_hf_to_tune, qwen2_tune_to_hf
    from torchtune.models.qwen2._convert_weights import _FROM_HF as QWEN2_HF_TO_TUNE_KEYS
    from torchtune.models.qwen2._tokenizer import bytes_to_unicode
    from torchtune.models.qwen2_5._tokenizer import QWEN2_5_SPECIAL_TOKENS
    from torchtune.modules import TransformerDecoder, TransformerSelfAttentionLayer
    from torchtune.modules.common_utils import local_kv_cache
    from torchtune.modules.loss import (
        CEWithChunkedOutputLoss,
        ForwardKLLoss,
        ForwardKLWithChunkedOutputLoss,
        ReverseKLLoss,
        ReverseKLWithChunkedOutputLoss,
        SymmetricKLLoss,
        SymmetricKLWithChunkedOutputLoss,
    )
    from torchtune.modules.peft import (
        LoRALinear,
        disable_adapter,
        get_adapter_params,
        get_adapter_state_dict,
        get_lora_module_names,
        get_merged_lora_ckpt,
        set_trainable_params,
        validate_missing_and_unexpected_for_lora,
    )
    from torchtune.modules.tied_linear import TiedLinear
    from torchtune.training import FullModelHFCheckpointer, ModelType
    from torchtune.training._activation_offloading import OffloadActivations
    from torchtune.training.activations import apply_selective_activation_checkpointing
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

TORCHTUNE_VERSION: str = torchtune.__version__
MODEL_KEY: str = tt_training.MODEL_KEY
ADAPTER_KEY: str = tt_training.ADAPTER_KEY
ADAPTER_CONFIG_KEY: str = tt_training.ADAPTER_CONFIG

__all__ = [
    "Message",
    "ADAPTER_CONFIG_KEY",
    "ADAPTER_KEY",
    "CEWithChunkedOutputLoss",
    "ConcatDataset",
    "ForwardKLLoss",
    "ForwardKLWithChunkedOutputLoss",
    "FullModelHFCheckpointer",
    "LoRALinear",
    "Llama3ScaledRoPE",
    "MODEL_KEY",
    "QWEN2_5_SPECIAL_TOKENS",
    "ModelType",
    "OffloadActivations",
    "ReverseKLLoss",
    "ReverseKLWithChunkedOutputLoss",
    "SFTTransform",
    "SymmetricKLLoss",
    "SymmetricKLWithChunkedOutputLoss",
    "TORCHTUNE_VERSION",
    "TiedLinear",
    "TransformerDecoder",
    "TransformerSelfAttentionLayer",
    "apply_selective_activation_checkpointing",
    "bytes_to_unicode",
    "disable_adapter",
    "get_adapter_params",
    "get_adapter_state_dict",
    "generate_tokens",
    "get_causal_mask_from_padding_mask",
    "get_cosine_schedule_with_warmup",
    "get_position_ids_from_padding_mask",
    "get_lora_module_names",
    "get_mapped_key",
    "get_merged_lora_ckpt",
    "padded_collate_sft",
    "set_trainable_params",
    "tt_modules",
    "tt_training",
    "validate_missing_and_unexpected_for_lora",
    "HF_TO_TUNE_KEYS",
    "QWEN2_HF_TO_TUNE_KEYS",
    "hf_to_tune",
    "llama3",
    "local_kv_cache",
    "lora_llama3",
    "lora_qwen2",
    "qwen2",
    "qwen2_hf_to_tune",
    "qwen2_tune_to_hf",
    "tune_to_hf",
    "tune_to_peft_adapter_config",
]
