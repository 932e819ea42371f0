"""Student checkpoints: Hugging Face format weights, atomic step checkpoints, resume.

Layout under ``output_dir``::

    step_000010/                 one folder per save; complete iff kd_checkpoint.json exists
      model.safetensors          HF key names (transformers loads the folder)
      config.json, tokenizer...  copied from the student's checkpoint_dir
      adapter_model.safetensors  LoRA only: PEFT key names ...
      adapter_config.json        ... and PEFT config
      recipe_state.pt            optimizer, LR scheduler, dataloader, RNG, counters (weights_only)
      config.yaml                resolved config snapshot
      kd_checkpoint.json         written last: step, epoch, file sizes / sha256, config hash
    final/                       the same HF files at the end of training, no recipe_state.pt
    best/                        keep_best: the same HF files at the best validation step; its
                                 marker also holds {"best": {"metric", "value", "mode"}}

Nothing is unpickled on load: weights come from safetensors, recipe state from
``torch.load(weights_only=True)``.

Modules, by concern:

- ``layout``: file and folder names, readers of the marker and the config snapshot;
- ``convert``: state-dict names torchtune <-> HF <-> PEFT, q/k RoPE row permutation;
- ``hf_folder``: write the student as an HF folder (merged LoRA + PEFT adapter), read weights,
  check a config.json (or a checkpointer's files) against its safetensors headers;
- ``recipe_state``: weights_only-safe recipe state (tensor subclasses, RNG);
- ``resume``: which config keys must match on resume (schema flags) and their hash, and whether
  a checkpoint's step fits the run's epochs;
- ``store``: atomic step folders, keep_last_n, recovering from a save killed midway;
- ``outputs``: one run per output_dir (lock, fresh-run refusal, moving another run's outputs
  aside), the metrics file;
- ``resume_point``: where a run starts (the one module that finds it): finished, the newest
  complete and intact step folder and its snapshot, or fresh.
"""

from kd.checkpoint.convert import (
    hf_to_tune_state_dict,
    peft_to_tune_adapter_state_dict,
    tune_to_hf_state_dict,
    tune_to_peft_adapter_state_dict,
)
from kd.checkpoint.hf_folder import (
    checkpoint_config_problems,
    hf_config_problems,
    load_adapter_weights,
    load_hf_weights,
    read_hf_config,
    safetensors_shapes,
    save_hf_model,
)
from kd.checkpoint.layout import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_MODEL_FILE,
    BEST_DIRNAME,
    CONFIG_SNAPSHOT_FILE,
    FINAL_DIRNAME,
    HF_CONFIG_FILE,
    MARKER_FILE,
    MODEL_FILE,
    MODEL_INDEX_FILE,
    RECIPE_STATE_FILE,
    load_checkpoint_config,
    read_checkpoint_marker,
    step_dirname,
)
from kd.checkpoint.recipe_state import (
    capture_rng_state,
    check_weights_only,
    decode_tensor_subclasses,
    encode_tensor_subclasses,
    load_recipe_state,
    restore_rng_state,
)
from kd.checkpoint.resume import (
    check_resume_compatible,
    check_resume_position,
    check_schedule_change,
    config_hash,
)
from kd.checkpoint.resume_point import find_latest_checkpoint
from kd.checkpoint.store import recover_interrupted_saves, save_checkpoint

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_MODEL_FILE",
    "BEST_DIRNAME",
    "CONFIG_SNAPSHOT_FILE",
    "FINAL_DIRNAME",
    "HF_CONFIG_FILE",
    "MARKER_FILE",
    "MODEL_FILE",
    "MODEL_INDEX_FILE",
    "RECIPE_STATE_FILE",
    "capture_rng_state",
    "check_resume_compatible",
    "check_resume_position",
    "check_schedule_change",
    "check_weights_only",
    "checkpoint_config_problems",
    "config_hash",
    "decode_tensor_subclasses",
    "encode_tensor_subclasses",
    "find_latest_checkpoint",
    "hf_config_problems",
    "hf_to_tune_state_dict",
    "load_adapter_weights",
    "load_checkpoint_config",
    "load_hf_weights",
    "load_recipe_state",
    "peft_to_tune_adapter_state_dict",
    "read_checkpoint_marker",
    "read_hf_config",
    "recover_interrupted_saves",
    "restore_rng_state",
    "safetensors_shapes",
    "save_checkpoint",
    "save_hf_model",
    "step_dirname",
    "tune_to_hf_state_dict",
    "tune_to_peft_adapter_state_dict",
]
