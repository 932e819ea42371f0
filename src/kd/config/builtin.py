"""Recipes `kd` ships and the built-in configs that belong to each.

A built-in config is a YAML file under the installed package's ``configs/`` folder, named by its
path relative to that folder without ``.yaml`` (``qwen2_5/14B_to_3B_full_single_device``). Every
config belongs to ``kd``, the one recipe; under torchtune's names, a config belongs to
``kd_single_device`` when its file name ends with ``_single_device.yaml`` and to ``kd_distributed``
when it ends with ``_distributed.yaml``.

This module must stay cheap to import (``kd ls`` and ``kd --help`` use it): no torch, no torchtune.
"""

from __future__ import annotations

import difflib
import importlib.resources
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kd.errors import KDUserError, one_line


@dataclass
class Recipe:
    """One runnable recipe.

    Attributes:
        name: what ``kd run <name>`` takes.
        module: dotted module that defines ``recipe_main(cfg)``.
        configs: built-in config names that belong to this recipe.
        supports_distributed: whether the recipe may be launched through torchrun.
        summary: what the recipe does, in one line (``kd ls`` and ``kd run --help``).
    """

    name: str
    module: str
    configs: list[str] = field(default_factory=list)
    supports_distributed: bool = False
    summary: str = ""

    def file_path(self) -> Path:
        """Path of the recipe's source file (what torchrun launches), without importing it.

        Raises:
            KDUserError: the recipe module is not installed.
        """
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            raise KDUserError(
                f"recipe {self.name}: module {self.module} is not installed; reinstall kd "
                "(pip install -e .)"
            )
        return Path(spec.origin)


# (name, module, config file suffix, supports_distributed, summary)
# `kd` is the one recipe (1..N ranks) and runs every config, so none is attached to it by name;
# the other two are torchtune's names for it and list the configs of their scale.
# `teacher_logits` runs the teacher of any KD config once and stores its top-k log-probs under
# `teacher_logits.path` (kd.teachers.store_format), for `kd run kd` to train from without the teacher.
_RECIPES: tuple[tuple[Any, ...], ...] = (
    (
        "kd",
        "kd.recipes.kd",
        None,
        True,
        "distil a teacher into a student (full or LoRA) on 1..N ranks",
    ),
    (
        "kd_single_device",
        "kd.recipes.kd_single_device",
        "_single_device",
        False,
        "kd on one device, under torchtune's name (configs *_single_device)",
    ),
    (
        "kd_distributed",
        "kd.recipes.kd_distributed",
        "_distributed",
        True,
        "kd under torchrun (FSDP2), under torchtune's name (configs *_distributed)",
    ),
    (
        "teacher_logits",
        "kd.recipes.teacher_logits",
        None,
        True,
        "store the teacher's top-k log-probs at teacher_logits.path (kd then trains without it)",
    ),
)


def configs_dir() -> Path:
    """The folder that holds the built-in YAML configs (may not exist in a bare checkout)."""
    return Path(str(importlib.resources.files("kd") / "configs"))


def _config_files() -> dict[str, Path]:
    root = configs_dir()
    if not root.is_dir():
        return {}
    files = {}
    for path in sorted(root.rglob("*.yaml")):
        name = path.relative_to(root).with_suffix("").as_posix()
        files[name] = path
    return files


def list_configs() -> list[str]:
    """Names of every built-in config, sorted."""
    return sorted(_config_files())


def list_recipes() -> list[Recipe]:
    """Every recipe with its built-in configs attached."""
    names = list_configs()
    return [
        Recipe(
            name,
            module,
            [c for c in names if suffix is not None and c.endswith(suffix)],
            distributed,
            *summary,  # optional (a test or a plugin may add a recipe without one)
        )
        for name, module, suffix, distributed, *summary in _RECIPES
    ]


def recipe_lines(indent: str = "  ") -> list[str]:
    """One line per recipe, ``<name>  <summary>`` (``kd ls`` and ``kd run --help``)."""
    recipes = list_recipes()
    width = max(len(r.name) for r in recipes) + 2
    return [f"{indent}{r.name:<{width}}{r.summary}".rstrip() for r in recipes]


def find_recipe(name: str) -> Recipe:
    """The recipe called ``name``.

    Raises:
        KDUserError: no such recipe; the message names the closest one.
    """
    recipes = list_recipes()
    for recipe in recipes:
        if recipe.name == name:
            return recipe
    known = [r.name for r in recipes]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]}?" if close else f"choose one of {', '.join(known)}"
    raise KDUserError(f"unknown recipe {name!r}; {hint} (kd ls lists recipes and configs)")


def torchtune_kd_configs() -> list[str]:
    """Names of the KD configs torchtune ships (``qwen2/1.5_to_0.5B_KD_lora_single_device``...),
    read from its installed file list: nothing is imported (torchtune would import torch)."""
    from importlib.metadata import PackageNotFoundError, files

    prefix = "recipes/configs/"
    try:
        listed = files("torchtune") or []
    except PackageNotFoundError:
        return []
    names = (str(f) for f in listed)
    return sorted(
        n[len(prefix) : -len(".yaml")]
        for n in names
        if n.startswith(prefix) and n.endswith(".yaml") and "_KD_" in n
    )


def torchtune_config_fix(name: str) -> str | None:
    """How to run torchtune's KD config ``name`` with kd (None: ``name`` is not one)."""
    name = name.removesuffix(".yaml")
    if name not in torchtune_kd_configs():
        return None
    recipe = "kd_distributed" if name.endswith("_distributed") else "kd_single_device"
    return (
        f"a torchtune KD config, not one of kd's; copy it with `tune cp {name} my_kd.yaml`, "
        f"then `kd run {recipe} --config my_kd.yaml` (set its paths in the file or as key=value)"
    )


def find_config(name_or_path: str) -> Path:
    """Resolve a config argument to a file.

    An existing file wins over a built-in of the same name, so a config copied with ``kd cp`` and
    edited in place is the one that runs.

    Args:
        name_or_path: a YAML path, or a built-in name with or without ``.yaml``.

    Returns:
        Path of the YAML file.

    Raises:
        KDUserError: neither a file nor a built-in config; names the closest built-in.
    """
    if not name_or_path.strip():
        raise KDUserError("--config is empty; pass --config <built-in name or path>")
    path = Path(name_or_path).expanduser()
    try:
        if path.is_file():
            return path
        exists = path.exists()
        folder = path.is_dir()
    except (OSError, ValueError) as e:  # a name too long, a NUL byte, a loop of links
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise KDUserError(
            f"config {name_or_path!r}: cannot be looked up ({reason}); pass the path of a YAML file"
        ) from e
    builtin = _config_files()
    name = name_or_path[: -len(".yaml")] if name_or_path.endswith(".yaml") else name_or_path
    if name in builtin:
        return builtin[name]
    if exists:
        what = "a folder" if folder else "not a regular file (a device or a pipe)"
        raise KDUserError(
            f"config {one_line(name_or_path)}: is {what}, not a YAML file; pass the file"
        )
    torchtune = torchtune_config_fix(name)
    if torchtune is not None:
        raise KDUserError(f"config {one_line(name_or_path)}: {torchtune}")
    close = difflib.get_close_matches(name, list(builtin), n=1)
    fix = f"did you mean the built-in {close[0]}?" if close else "check the path"
    raise KDUserError(
        f"config {one_line(name_or_path)}: no such file or built-in config; {fix} "
        "(kd ls lists built-in configs)"
    )
