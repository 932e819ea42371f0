"""torchtune's name for the one-device KD recipe: the ``kd`` recipe (:mod:`kd.recipes.kd`).

    kd run kd_single_device --config qwen2_5/14B_to_3B_full_single_device

A torchtune KD config runs here with only path changes. The same recipe serves N ranks under
torchrun as ``kd`` or ``kd_distributed``; this name stays one-device, as in torchtune.
"""

from __future__ import annotations

import sys

from kd.recipes.kd import KDRecipe, recipe_main

__all__ = ["KDRecipe", "recipe_main"]

if __name__ == "__main__":
    from kd.runtime.launch import run_recipe

    sys.exit(run_recipe(recipe_main))
