"""Check a loaded config completely before any weight is loaded; report every problem at once.

Two passes: the schema pass imports neither torch nor torchtune, so a mistake in keys, values or
files answers in a fraction of a second; the component pass (signature binding) runs only when the
schema pass is clean. The checks live in :mod:`kd.config.checks`, one module per job:

- :mod:`~kd.config.checks.values`: one value against its :class:`~kd.config.schema.Key`;
- :mod:`~kd.config.checks.keys`: unknown keys (with the key meant), missing keys, values;
- :mod:`~kd.config.checks.components`: ``_component_`` targets, families, signatures;
- :mod:`~kd.config.checks.paths`: files and ``output_dir``;
- :mod:`~kd.config.checks.teacher`: the models (Hugging Face folder or builder + checkpointer);
- :mod:`~kd.config.checks.features`: rules between keys, one function per feature.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kd import folders
from kd.config import schema
from kd.config import teacher_kinds as kinds
from kd.config.checks.components import (
    check_component_targets,
    check_families,
    check_static_arguments,
    component_problems,
)
from kd.config.checks.features import (
    check_device,
    check_on_policy,
    check_output_dir,
    check_validation,
)
from kd.config.checks.keys import (
    check_component_args,
    check_component_numbers,
    check_kd_loss_component,
    check_keys,
    check_loss,
)
from kd.config.checks.model_config import model_folder_problems
from kd.config.checks.paths import (
    check_files,
    checkpoint_file_names,
    lookup_problem,
    writable_dir_problem,
)
from kd.config.checks.teacher import hf_checkpointers, is_hf_model_node
from kd.config.checks.values import check_value
from kd.config.schema import Problem
from kd.errors import ConfigError

# Re-exported: what other modules import from here.
__all__ = [
    "check_value",
    "checkpoint_file_names",
    "component_problems",
    "is_hf_model_node",
    "lookup_problem",
    "schema_problems",
    "validate_config",
    "writable_dir_problem",
]


def validate_config(
    cfg: DictConfig, *, check_paths: bool = True, check_components: bool = True
) -> None:
    """Check keys, types, ranges, choices, components and files of a loaded config.

    Nothing is built and no weight is read. The checks run in two passes so a mistake answers
    fast: :func:`schema_problems` (keys, values, ``_component_`` paths against what each key may
    build, model families, files) imports neither torch nor torchtune and raises first; only when it is
    clean does :func:`component_problems` import the ``_component_`` targets to bind their
    signatures (every problem of that pass is then reported together).

    Args:
        cfg: a config from :func:`kd.config.load_config` (defaults merged, interpolations resolved).
        check_paths: also check that input files exist and ``output_dir`` is writable.
        check_components: also import the ``_component_`` targets and bind their signatures
            (imports torch and torchtune); False keeps validation free of those imports.

    Raises:
        ConfigError: with every problem of the first pass that found any, each naming the key
            and the fix.
    """
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raise ConfigError(
            [Problem(str(key), f"cannot be resolved ({e}); fix the reference")]
        ) from e
    assert isinstance(data, dict)
    problems = schema_problems(data, check_paths=check_paths)
    if not problems and check_components:
        problems = component_problems(data) + kinds.nested_problems(data, component_problems)
    if problems:
        raise ConfigError(problems)


def schema_problems(data: dict[str, Any], *, check_paths: bool = True) -> list[Problem]:
    """Problems a config's values show by themselves, without importing any ``_component_``.

    Unknown and missing keys, types, ranges and choices, unsupported loss nodes, a null teacher
    with ``kd_ratio`` above 0, the device, ``_component_`` entries that are missing or that their
    key may not build (:mod:`kd.config.allowlist`), models of different tokenizer families and
    (with ``check_paths``) missing input files and an unusable ``output_dir``; always, model and
    tokenizer folders that ask to run their own code or hold files kd refuses
    (:func:`kd.folders.config_folder_problems`). Imports neither
    torch nor torchtune.

    Args:
        data: the resolved config as plain containers (``OmegaConf.to_container``).
        check_paths: also check that input files exist and ``output_dir`` is writable.

    Returns:
        Every problem found, each naming the key and the fix.
    """
    problems: list[Problem] = []
    optional = hf_checkpointers(data, problems)
    if kinds.replacing_sections(data):  # a kind's section is the teacher (kd.config.teacher_kinds)
        optional |= {"teacher_model", "teacher_checkpointer"}
    check_keys(data, schema.TOP_LEVEL, "", problems, optional=optional)
    check_component_numbers(data, problems)
    for name, section in schema.SECTIONS.items():
        node = data.get(name)
        if isinstance(node, dict):
            check_kd_loss_component(name, node, problems)
            check_keys(node, section, f"{name}.", problems)
    check_component_args(data, problems)
    check_loss(data.get("loss"), problems)
    check_validation(data, problems)
    check_on_policy(data, problems)
    kinds.schema_checks(data, problems)  # each teacher kind's own checks
    if not problems:  # the members of teachers:, each a one-teacher config
        problems += kinds.nested_problems(
            data, lambda d: schema_problems(d, check_paths=check_paths)
        )
    check_output_dir(data, problems)
    check_device(data, problems)
    check_component_targets(data, problems)
    check_static_arguments(data, problems)
    check_families(data, problems)
    if check_paths:
        check_files(data, problems)
    # Nothing in a model or tokenizer folder may run or lead outside it (kd.folders); kd plan too.
    problems += [Problem(e.key, e.detail) for e in folders.config_folder_problems(data)]
    # A model folder's config.json fields, named in that file (not as a builder or tokenizer
    # problem further on).
    problems += model_folder_problems(data)
    return problems
