"""kd.config.builtin against what ships: every recipe imports and has ``recipe_main``, every built-in
config resolves, loads and validates, unknown names point at the closest one, and ``kd ls`` lists
them all."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from kd.cli import main
from kd.config import builtin as registry
from kd.config import load_config, validate_config
from kd.errors import KDUserError

RECIPES = registry.list_recipes()
CONFIGS = registry.list_configs()


def test_something_is_registered():
    assert {r.name for r in RECIPES} == {
        "kd",
        "kd_single_device",
        "kd_distributed",
        "teacher_logits",
    }
    # one recipe: torchtune's two names run the module of `kd`
    kd = registry.find_recipe("kd")
    assert kd.supports_distributed and kd.configs == []
    main_fn = importlib.import_module(kd.module).recipe_main
    for alias in ("kd_single_device", "kd_distributed"):
        assert importlib.import_module(registry.find_recipe(alias).module).recipe_main is main_fn
    assert len(CONFIGS) >= 5  # the shipped Qwen2.5 / Llama 3.x configs
    assert registry.configs_dir() == Path(registry.__file__).parents[1] / "configs"  # kd/configs


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_recipe_module_imports_with_recipe_main(recipe):
    module = importlib.import_module(recipe.module)
    assert callable(module.recipe_main)
    assert list(inspect.signature(module.recipe_main).parameters) == ["cfg"]
    # The file torchrun launches is the module's own file, found without importing it.
    assert recipe.file_path() == Path(module.__file__)
    assert recipe.file_path().is_file()


def test_recipe_file_path_of_missing_module():
    ghost = registry.Recipe("ghost", "kd.recipes.no_such_recipe")
    with pytest.raises(KDUserError, match=r"^recipe ghost: module kd.recipes.no_such_recipe is"):
        ghost.file_path()


def test_every_builtin_config_belongs_to_exactly_one_recipe():
    owners = {name: [r.name for r in RECIPES if name in r.configs] for name in CONFIGS}
    assert all(len(o) == 1 for o in owners.values()), owners
    for recipe in RECIPES:
        if recipe.name in ("kd", "teacher_logits"):
            continue  # they run every config; none is attached to them by name
        assert recipe.configs, f"{recipe.name} has no built-in config"
        assert recipe.configs == sorted(recipe.configs)
        # Only the distributed recipe takes torchrun options; its configs are the _distributed ones.
        assert recipe.supports_distributed == all(
            c.endswith("_distributed") for c in recipe.configs
        )


@pytest.mark.parametrize("name", CONFIGS)
def test_builtin_config_resolves_loads_and_validates(name, capsys):
    path = registry.find_config(name)
    assert path.is_file() and path.suffix == ".yaml"
    assert path == registry.configs_dir() / f"{name}.yaml"
    assert registry.find_config(f"{name}.yaml") == path
    cfg = load_config(str(path), [])
    assert capsys.readouterr().err == ""  # a built-in needs no torchtune-compat notice
    # Schema-wise: keys, types, ranges, choices, components bound to their signatures; the model
    # and data files are downloads the user makes, so their paths are not checked.
    validate_config(cfg, check_paths=False)
    # The run command in the header names the recipe the config belongs to.
    (recipe,) = [r for r in RECIPES if name in r.configs]
    run_lines = re.findall(r"^#\s+kd run .*$", path.read_text(), flags=re.MULTILINE)
    assert run_lines, f"{path} has no `kd run` line in its header"
    assert all(f" {recipe.name} --config {name}" in line for line in run_lines), run_lines


def test_find_config_prefers_an_existing_file(tmp_path, monkeypatch):
    name = CONFIGS[0]
    local = tmp_path / f"{name}.yaml"
    local.parent.mkdir(parents=True)
    local.write_text("kd_ratio: 1\n")
    monkeypatch.chdir(tmp_path)
    assert registry.find_config(f"{name}.yaml") == Path(f"{name}.yaml")
    assert registry.find_config(name) == registry.configs_dir() / f"{name}.yaml"


@pytest.mark.parametrize(
    ("typo", "closest"),
    [
        ("kd_single_devices", "kd_single_device"),
        ("kd_single", "kd_single_device"),
        ("kd-distributed", "kd_distributed"),
    ],
)
def test_find_recipe_unknown_names_closest(typo, closest):
    with pytest.raises(KDUserError) as err:
        registry.find_recipe(typo)
    msg = str(err.value)
    assert msg.startswith(f"unknown recipe {typo!r}; did you mean {closest}?")
    assert "kd ls" in msg and "\n" not in msg


def test_find_recipe_far_off_lists_all():
    with pytest.raises(
        KDUserError, match="choose one of kd, kd_single_device, kd_distributed, teacher_logits"
    ):
        registry.find_recipe("zzz")
    assert registry.find_recipe("kd_distributed").supports_distributed


def test_find_config_unknown_names_closest():
    for name in CONFIGS:
        typo = name.replace("single_device", "single_devise").replace("_to_", "-to-")
        with pytest.raises(KDUserError) as err:
            registry.find_config(typo)
        msg = str(err.value)
        assert msg.startswith(f"config {typo}: no such file or built-in config")
        assert f"did you mean the built-in {name}?" in msg, msg
    with pytest.raises(KDUserError) as err:
        registry.find_config("zzzzzz.yaml")
    assert "did you mean" not in str(err.value) and "kd ls" in str(err.value)


def test_find_config_folder_is_an_error(tmp_path):
    with pytest.raises(KDUserError, match="is a folder, not a YAML file"):
        registry.find_config(str(tmp_path))


def test_kd_ls_lists_every_recipe_and_config(capsys):
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    # The table, then (after a blank line) the features and their pages (kd.cli.features).
    table, features = out.split("\n\n", 1)
    assert features.startswith("features ")
    lines = table.splitlines()
    assert lines[0].split() == ["RECIPE", "CONFIG"]
    listed: dict[str, str] = {}
    current = ""
    assert lines[1].split()[0] == "kd" and "any config" in lines[1]
    for line in lines[2:]:
        if "(any config below" in line:  # a recipe that takes any config (teacher_logits)
            continue
        cells = line.split()
        if len(cells) == 2:
            current = cells[0]
        listed[cells[-1]] = current
    assert listed == {c: r.name for r in RECIPES for c in r.configs}
    assert sorted(listed) == CONFIGS
