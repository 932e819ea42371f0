"""A config is code someone else wrote: nothing outside what each key may build runs from it.

Each config key builds only the exact targets :mod:`kd.config.allowlist` lists for it; anything
else is refused (``kd validate`` exits 2 with one line naming the key and
``trust_remote_components``) before it is imported. Planted commands prove that refused targets
never run, and the same targets do run once the config opts in (so the checks can fail).
docs/security.md describes the threat model.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from test_config import tiny_config, write

from kd.cli import main
from kd.config import allowlist, instantiate, load_config, validate_config
from kd.config.instantiate import build_component
from kd.config.run import COMPONENT_KEYS
from kd.errors import ConfigError, KDUserError

# Every key a config may hold a component in: the top-level ones and the nested ones.
KEYS = (*COMPONENT_KEYS, "dataset.message_transform", "dataset.model_transform")

# Targets that load code, unpickle, import modules by name or run commands.
HOSTILE = (
    "torch.load",
    "torch.hub.load",
    "kd.cli.main",
    "torchtune.training.FullModelMetaCheckpointer",
    "torchtune.training.FullModelTorchTuneCheckpointer",
    "torchtune.training.DistributedCheckpointer",
    "os.system",
    "builtins.eval",
    "builtins.exec",
    "subprocess.run",
    "importlib.import_module",
    "torch.jit.load",
    "torch.package.PackageImporter",
    "pickle.loads",
    "torchtune.config.instantiate",
    "kd.config.instantiate.instantiate",
    "kd.config.instantiate.build_component",
    "torch.optim.lr_scheduler.LambdaLR",
    "torchao.optim.CPUOffloadOptimizer",
    "collections.OrderedDict",
)

TRUST = "set trust_remote_components: true only if you trust whoever wrote this config"


def _refusal(key: str, target: str) -> str:
    return f"{key}._component_: {target} is not something {key} may build (allowed: "


def _place(cfg: dict[str, Any], key: str, node: dict[str, Any]) -> None:
    """Put ``node`` at config key ``key`` (a nested key goes inside the dataset node)."""
    top, _, nested = key.partition(".")
    parent, name = (cfg[top], nested) if nested else (cfg, top)
    if isinstance(parent.get(name), dict):
        parent[name].update(node)  # keep its other keys: only the target is wrong
    else:
        parent[name] = node


# ------------------------------------------------------------------------------ the table


def test_every_allowed_target_exists_and_builds_what_its_key_needs():
    for key, rule in allowlist.ALLOWED.items():
        assert rule.example in rule.targets, key
        for target in sorted(rule.targets):
            module, _, name = target.rpartition(".")
            obj = getattr(importlib.import_module(module), name, None)
            assert obj is not None, f"{key}: {target} does not exist"
            assert callable(obj), target
    for target in allowlist.MODELS.targets | allowlist.TOKENIZERS.targets:
        module, _, name = target.rpartition(".")
        assert inspect.isfunction(getattr(importlib.import_module(module), name)), target
    for target in allowlist.PROMPT_TEMPLATES.targets:
        module, _, name = target.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name)), target


def test_every_key_that_builds_a_component_has_a_table():
    assert set(COMPONENT_KEYS) <= set(allowlist.ALLOWED)


def test_table_names_exact_targets_not_prefixes():
    for rule in allowlist.ALLOWED.values():
        for target in rule.targets:
            assert re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+", target), target


def test_list_indices_do_not_change_what_a_key_may_build():
    assert allowlist.rule_key("dataset[3].message_transform") == "dataset.message_transform"
    ok = "torchtune.datasets.instruct_dataset"
    assert allowlist.target_problem("dataset[1]", ok, trust=False) is None


# --------------------------------------------------------------- refused for every key


@pytest.mark.parametrize("target", HOSTILE)
@pytest.mark.parametrize("key", KEYS)
def test_hostile_target_refused_by_instantiate(key, target):
    with pytest.raises(KDUserError) as err:
        instantiate({"_component_": target}, key=key)
    message = str(err.value)
    assert message.startswith(_refusal(key, target)) and message.endswith(TRUST), message
    assert "\n" not in message


@pytest.mark.parametrize("target", HOSTILE)
@pytest.mark.parametrize("key", COMPONENT_KEYS)
def test_hostile_target_refused_by_build_component(key, target):
    with pytest.raises(KDUserError, match=re.escape(_refusal(key, target))):
        build_component(key, {"_component_": target}, trust=False, fix="fix it")


@pytest.mark.parametrize("key", KEYS)
def test_hostile_targets_refused_by_kd_validate(key, tmp_path, capsys):
    """Through the command: exit 2, one line per refused target, naming the key and the opt-in."""
    for target in HOSTILE:
        cfg = tiny_config(tmp_path)
        _place(cfg, key, {"_component_": target})
        config = write(tmp_path / "hostile.yaml", cfg)
        assert main(["validate", "--config", config]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1, err
        assert err[0].startswith("kd: error: " + _refusal(key, target)), err
        assert err[0].endswith(TRUST)


def test_refusal_answers_before_torch_is_imported(tmp_path):
    from test_fast_errors import kd_main_subprocess

    cfg = tiny_config(tmp_path, lr_scheduler={"_component_": "torch.hub.load"})
    config = write(tmp_path / "c.yaml", cfg)
    code, imported, stderr = kd_main_subprocess(["run", "kd_single_device", "--config", config])
    assert code == 2 and imported == [], (imported, stderr)
    assert stderr == [
        "kd: error: "
        + _refusal("lr_scheduler", "torch.hub.load")
        + allowlist.LR_SCHEDULERS.summary
        + f"); {TRUST}"
    ]


def _legit_targets() -> dict[str, str]:
    return {key: rule.example for key, rule in allowlist.ALLOWED.items()}


@pytest.mark.parametrize("key", KEYS)
def test_a_target_of_one_key_is_refused_for_another(key):
    rule = allowlist.ALLOWED[key]
    others = {t for k, t in _legit_targets().items() if t not in rule.targets}
    assert others, key
    for target in sorted(others):
        reason = allowlist.target_problem(key, target, trust=False)
        assert reason is not None and TRUST in reason, (key, target)
        with pytest.raises(KDUserError, match=re.escape(_refusal(key, target))):
            instantiate({"_component_": target}, key=key)


def test_optimizer_as_metric_logger_refused_by_validate(tmp_path):
    cfg = tiny_config(tmp_path, metric_logger={"_component_": "torch.optim.AdamW"})
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(write(tmp_path / "c.yaml", cfg), []))
    (problem,) = err.value.problems
    assert problem.key == "metric_logger._component_"
    assert problem.message.startswith("torch.optim.AdamW is not something metric_logger may build")


def test_typo_of_an_allowed_target_suggests_it():
    reason = allowlist.target_problem("optimizer", "torch.optim.AdamWW", trust=False)
    assert "did you mean torch.optim.AdamW?" in reason and reason.endswith(TRUST)


def test_nested_component_outside_its_table_is_refused():
    reason = allowlist.target_problem(
        "dataset.filter_fn", "torchtune.data.InputOutputToMessages", trust=False
    )
    assert "nested components are built only at dataset.message_transform" in reason


# ------------------------------------------------------------------ planted commands


@pytest.fixture
def planted(tmp_path, monkeypatch) -> tuple[Path, dict[str, dict[str, Any]]]:
    """A file path and, per hostile target, node arguments that would create that file."""
    pwned = tmp_path / "pwned.yaml"  # `kd cp` names its copy *.yaml
    touch = f"open({str(pwned)!r}, 'w').close()"
    # A module that creates the file when imported (the import itself must never happen).
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    (mod_dir / "kd_planted_module.py").write_text(f"{touch}\ndef go(**_):\n    pass\n")
    monkeypatch.syspath_prepend(str(mod_dir))
    monkeypatch.delitem(sys.modules, "kd_planted_module", raising=False)
    # A pickle that creates the file when unpickled.
    evil = tmp_path / "evil.pt"

    class Payload:
        def __reduce__(self):
            return (exec, (touch,))

    torch.save(Payload(), evil)
    # A torch.hub repository whose hubconf.py creates the file.
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "hubconf.py").write_text(f"{touch}\ndef entry(**_):\n    return None\n")
    nodes = {
        "os.system": {"command": f"touch {pwned}"},
        "subprocess.run": {"args": ["touch", str(pwned)]},
        "torch.load": {"f": str(evil), "weights_only": False},
        "torch.hub.load": {
            "repo_or_dir": str(hub),
            "model": "entry",
            "source": "local",
            "trust_repo": True,
        },
        "kd.cli.main": {"argv": ["cp", "qwen2_5/14B_to_3B_full_single_device", str(pwned)]},
        "importlib.import_module": {"name": "kd_planted_module"},
        "kd.config.instantiate.instantiate": {
            "node": {"_component_": "os.system", "command": f"touch {pwned}"},
            "key": "metric_logger",
            "trust": True,
        },
        "kd_planted_module.go": {},
    }
    return pwned, nodes


@pytest.mark.parametrize("key", KEYS)
def test_planted_commands_never_run(key, planted, tmp_path, capsys):
    pwned, nodes = planted
    for target, args in nodes.items():
        node = {"_component_": target, **args}
        with pytest.raises(KDUserError):
            instantiate(node, key=key)
        if "." not in key:
            with pytest.raises(KDUserError):
                build_component(key, node, trust=False, fix="fix it")
        cfg = tiny_config(tmp_path)
        _place(cfg, key, node)
        assert main(["validate", "--config", write(tmp_path / "c.yaml", cfg)]) == 2
        assert not pwned.exists(), f"{target} as {key} ran"
        assert "kd_planted_module" not in sys.modules, f"{target} as {key} was imported"
    capsys.readouterr()


@pytest.mark.parametrize(
    "target", ["os.system", "torch.load", "torch.hub.load", "kd.cli.main", "kd_planted_module.go"]
)
def test_planted_commands_do_run_when_trusted(target, planted):
    """The control: the same nodes do create the file once the config opts in."""
    pwned, nodes = planted
    instantiate({"_component_": target, **nodes[target]}, key="metric_logger", trust=True)
    assert pwned.exists()


def test_nested_planted_target_refused_before_the_outer_one_is_imported(planted):
    pwned, nodes = planted
    node = {
        "_component_": "torchtune.datasets.SFTDataset",
        "source": "json",
        "message_transform": {"_component_": "kd_planted_module.go"},
    }
    refusal = _refusal("dataset.message_transform", "kd_planted_module.go")
    with pytest.raises(KDUserError, match=re.escape(refusal)):
        instantiate(node, key="dataset")
    assert not pwned.exists() and "kd_planted_module" not in sys.modules


def test_prompt_template_string_is_allow_listed(planted, tmp_path, capsys):
    """torchtune imports and calls a tokenizer's string prompt_template."""
    pwned, _ = planted
    cfg = tiny_config(tmp_path)
    cfg["tokenizer"]["prompt_template"] = "kd_planted_module.go"
    assert main(["validate", "--config", write(tmp_path / "c.yaml", cfg)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "kd: error: tokenizer.prompt_template: kd_planted_module.go is not something "
        "tokenizer.prompt_template may name (allowed: "
    )
    assert line.endswith(TRUST)
    with pytest.raises(KDUserError, match="tokenizer.prompt_template"):
        instantiate(cfg["tokenizer"], key="tokenizer")
    assert not pwned.exists() and "kd_planted_module" not in sys.modules
    # torchtune's own templates and a mapping are fine.
    cfg["tokenizer"]["prompt_template"] = "torchtune.data.ChatMLTemplate"
    validate_config(load_config(write(tmp_path / "c.yaml", cfg), []), check_components=False)
    cfg["tokenizer"]["prompt_template"] = {"user": ["Q: ", "\n"]}
    validate_config(load_config(write(tmp_path / "c.yaml", cfg), []), check_components=False)


# ------------------------------------------------------------ allowed components build


def test_allowed_nested_components_build(tmp_path):
    from kd.testing import tokenizer_node, write_jsonl, write_tokenizer

    data = write_jsonl(tmp_path / "d.jsonl", [{"input": "1+1", "output": "2"}] * 3)
    node = {
        "_component_": "torchtune.datasets.SFTDataset",
        "source": "json",
        "data_files": str(data),
        "split": "train",
        "cache_dir": str(tmp_path / "cache"),
        "message_transform": {"_component_": "torchtune.data.InputOutputToMessages"},
        "model_transform": tokenizer_node(write_tokenizer(tmp_path / "tok"), 32),
    }
    dataset = instantiate(node, key="dataset")
    assert len(dataset) == 3 and "tokens" in dataset[0]


def test_trusted_config_builds_any_importable_target(tmp_path):
    cfg = tiny_config(
        tmp_path,
        metric_logger={"_component_": "collections.OrderedDict"},
        trust_remote_components=True,
    )
    validate_config(load_config(write(tmp_path / "c.yaml", cfg), []))
    assert instantiate(cfg["metric_logger"], key="metric_logger", trust=True) == {}


# ------------------------------------------------- ways to run code without _component_


def test_yaml_python_tags_do_not_execute(tmp_path, capsys):
    pwned = tmp_path / "pwned"
    cfg = tiny_config(tmp_path)
    text = yaml.safe_dump(cfg, sort_keys=False)
    text += f'seed: !!python/object/apply:os.system ["touch {pwned}"]\n'
    (tmp_path / "tag.yaml").write_text(text)
    assert main(["validate", "--config", str(tmp_path / "tag.yaml")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "tag.yaml" in err[0], err
    assert not pwned.exists()


def test_only_omegaconf_builtin_resolvers_are_registered():
    """kd, its recipe and torchtune register no resolver: ${oc.env:X} reads, nothing runs."""
    from omegaconf.basecontainer import BaseContainer

    import kd.recipes.kd  # noqa: F401 - imports torch, torchtune and every kd module it uses

    assert all(name.startswith("oc.") for name in BaseContainer._resolvers), sorted(
        BaseContainer._resolvers
    )
    cfg = OmegaConf.create({"a": "${oc.env:KD_SECURITY_TEST_VALUE,unset}"})
    assert cfg.a == "unset"


def test_kd_never_unpickles():
    """Every torch.load in kd reads with weights_only=True; nothing imports pickle or evals."""
    src = Path(__file__).parents[2] / "src" / "kd"
    for path in src.rglob("*.py"):
        text = path.read_text()
        for match in re.finditer(r"torch\.load\(([^)]*)\)", text):
            assert "weights_only=True" in match.group(1), f"{path}: {match.group(0)}"
        assert not re.search(r"^\s*(import pickle|from pickle|import dill)", text, re.M), path
        assert not re.search(r"yaml\.(unsafe_)?load\(|(?<![.\w])(eval|exec)\(", text), path


def test_torchtune_checkpointer_reads_pickle_formats_weights_only(tmp_path):
    """The allowed checkpointer reads .bin/.pt files (weights, adapter, recipe state) with
    torch.load(weights_only=True): a planted pickle fails to load and runs nothing."""
    from kd.testing import TinyModel, checkpointer_node, write_tiny_model

    pwned = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(pwned)!r}, 'w').close()",))

    shape = TinyModel(288, 2, 4, 2, 32, 64, max_seq_len=32)
    folder = write_tiny_model(tmp_path / "model", shape, seed=0)
    torch.save({"w": Payload()}, folder / "evil.bin")
    out = tmp_path / "out"
    out.mkdir()
    torch.save(Payload(), out / "evil.pt")
    node = checkpointer_node(folder, out, shape.model_type)
    as_bin = {**node, "checkpoint_files": ["evil.bin"]}
    ckpt = build_component("checkpointer", as_bin, trust=False, fix="-")
    with pytest.raises(ValueError, match="Unable to load checkpoint from .*evil.bin") as err:
        ckpt.load_checkpoint()
    assert isinstance(err.value.__cause__, pickle.UnpicklingError)
    resumed = {
        **node,
        "resume_from_checkpoint": True,
        "adapter_checkpoint": "evil.pt",
        "recipe_checkpoint": "evil.pt",
    }
    ckpt = build_component("checkpointer", resumed, trust=False, fix="-")
    with pytest.raises(ValueError, match="Unable to load checkpoint from .*evil.pt") as err:
        ckpt.load_checkpoint()
    assert isinstance(err.value.__cause__, pickle.UnpicklingError)
    assert not pwned.exists()
