"""Knowledge distillation on N devices with FSDP2: torchtune's name for the ``kd`` recipe under torchrun.

There is one recipe. :mod:`kd.recipes.kd` serves world size 1 and N alike (step, loss, checkpoints
and resume are the same code); this module keeps torchtune's distributed name so existing configs
and launch commands work.

Launch on one machine (``kd run`` hands the torchrun options before the recipe name to torchrun)::

    kd run --nproc_per_node 8 kd_distributed --config llama3_1/8B_to_8B_full_distributed
    kd run --nproc_per_node 4 kd_distributed --config my.yaml batch_size=2 fsdp.cpu_offload=true

On several machines, run the same command on every node with a rendezvous endpoint (plain torchrun
works too: ``torchrun ... -m kd.recipes.kd_distributed --config ...``)::

    kd run --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node0:29500 \\
        --rdzv_id my_job kd_distributed --config my.yaml

What changes with N ranks (config keys under ``fsdp:``; defaults in kd/config/schema.py):
    - Student and teacher are sharded with FSDP2 ``fully_shard`` per decoder layer and at the root;
      the teacher is frozen and never gets gradients. ``fsdp.reshard_after_forward`` frees gathered
      layers after their forward, ``fsdp.reduce_dtype`` is the gradient reduce-scatter dtype,
      ``fsdp.cpu_offload`` keeps sharded parameters, gradients and optimizer states in CPU memory.
    - ``batch_size`` is per rank: the global batch is batch_size x ranks x gradient_accumulation_steps,
      and with ``shuffle: false`` it holds the same samples whatever the number of ranks, so the
      logged loss (the global token-weighted mean) matches a one-device run with the same global batch.
    - Rank 0 gathers and writes the HF-format checkpoints; the resume state holds the full (unsharded)
      optimizer state, so a run may resume on a different number of ranks. For several machines,
      ``output_dir`` must be on a file system every node sees.
"""

from __future__ import annotations

import sys

from kd.recipes.kd import recipe_main
from kd.runtime.launch import run_recipe

__all__ = ["recipe_main"]

if __name__ == "__main__":
    sys.exit(run_recipe(recipe_main))
