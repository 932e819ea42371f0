"""A config is code someone else wrote: nothing outside what each key may build runs from it.

Each config key builds only the exact targets :mod:`kd.config.allowlist` lists for it; anything
else is refused (``kd validate`` exits 2 with one line naming the key and
``trust_remote_components``) before it is imported. Planted commands prove that refused targets
never run, and the same targets do run once the config opts in (so the checks can fail).
docs/security.md describes the threat model.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import pickle
import re
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from kd import folders
from kd.cli import main
from kd.config import allowlist, instantiate, load_config, validate_config
from kd.config.instantiate import build_component
from kd.config.run import COMPONENT_KEYS
from kd.errors import ConfigError, KDUserError
from tests.unit.test_config import tiny_config, write

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
    from tests.unit.config.test_validate_speed import kd_main_subprocess

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
    src = Path(__file__).parents[3] / "src" / "kd"
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


# ------------------------------------------------------------------ model and tokenizer folders
# kd.folders: nothing in a folder runs (auto_map), and only regular files inside it are read.


def _loader_calls() -> list[tuple[Path, ast.Call]]:
    """Every ``X.from_pretrained(...)`` / ``X.from_config(...)`` call in src/kd."""
    src = Path(__file__).parents[3] / "src" / "kd"
    calls = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("from_pretrained", "from_config")
            ):
                calls.append((path, node))
    return calls


def test_every_transformers_and_peft_load_refuses_remote_code():
    """Each transformers / peft load passes trust_remote_code=False itself (never left to
    transformers' interactive default, which asks on stdin)."""
    calls = _loader_calls()
    assert len(calls) >= 8, calls  # AutoConfig, AutoTokenizer x3, AutoModel x2, PeftModel, ...
    for path, call in calls:
        flags = {k.arg: k.value for k in call.keywords if k.arg}
        value = flags.get("trust_remote_code")
        assert isinstance(value, ast.Constant) and value.value is False, (
            f"{path}:{call.lineno}: pass trust_remote_code=False"
        )


def test_config_json_is_read_by_one_function():
    """kd.folders.read_config_json is the one reader of a folder's config.json, and the file name
    is defined once (kd.folders.CONFIG_JSON)."""
    src = Path(__file__).parents[3] / "src" / "kd"
    for path in src.rglob("*.py"):
        if path.name == "folders.py":
            continue
        text = path.read_text()
        for match in re.finditer(r'=\s*"config\.json"', text):
            raise AssertionError(f"{path}: {match.group(0)} (use kd.folders.CONFIG_JSON)")
        assert not re.search(r'"config\.json"\)\.read_text|/ "config\.json"', text), path


def _auto_map_folder(root: Path, name: str, auto_map: Any) -> Path:
    folder = root / "planted"
    folder.mkdir()
    (folder / name).write_text(json.dumps({"model_type": "llama", "auto_map": auto_map}))
    return folder


@pytest.mark.parametrize(
    ("name", "auto_map", "entry"),
    [
        ("config.json", {"AutoConfig": "custom.Config"}, "AutoConfig=custom.Config"),
        (
            "tokenizer_config.json",
            {"AutoTokenizer": [None, "custom.Fast"]},
            "AutoTokenizer=custom.Fast",
        ),
        ("tokenizer_config.json", ["custom.Slow", None], "custom.Slow"),
    ],
)
def test_auto_map_refused_naming_file_and_entry(tmp_path, name, auto_map, entry):
    folder = _auto_map_folder(tmp_path, name, auto_map)
    with pytest.raises(folders.FolderError) as err:
        folders.check_folder(folder, key="model.path")
    assert str(err.value) == (
        f"model.path: {folder / name} asks to run code from the folder (auto_map {entry}); kd "
        "never runs a model's or tokenizer's own code: use a model that transformers supports "
        "natively, or remove auto_map if the folder needs none"
    )
    if name == "config.json":
        with pytest.raises(folders.FolderError, match="asks to run code"):
            folders.read_config_json(folder, key="model.path")


def test_regular_files_inside_the_folder_are_read(tmp_path):
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.txt").write_text("a")
    os.symlink("sub/a.txt", folder / "inside.txt")  # a link that stays inside is fine
    (folder / "config.json").write_text('{"model_type": "llama"}')
    assert folders.file_in(folder, "inside.txt", key="k") == (folder / "sub" / "a.txt").resolve()
    assert folders.file_in(folder, "missing.txt", key="k") is None
    assert folders.read_config_json(folder, key="k") == {"model_type": "llama"}
    folders.check_folder(folder, key="k")


@pytest.mark.parametrize("kind", ["link_out", "dotdot", "fifo", "socket", "device", "device_link"])
def test_files_that_are_not_regular_files_inside_are_refused(tmp_path, kind):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret").write_text("secret")
    name = "merges.txt"
    if kind == "link_out":
        os.symlink("../secret", folder / name)
        detail = f"leads to {tmp_path / 'secret'}, outside {folder}"
    elif kind == "dotdot":
        name = "../secret"
        detail = f"leads to {tmp_path / 'secret'}, outside {folder}"
    elif kind == "fifo":
        os.mkfifo(folder / name)  # reading it would block forever; nothing opens it
        detail = "is a named pipe (FIFO), not a regular file"
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(folder / name))
        server.close()
        detail = "is a socket, not a regular file"
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("creating a device file needs root")
        os.mknod(folder / name, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # like /dev/zero
        detail = "is a device, not a regular file"
    else:
        os.symlink("/dev/zero", folder / name)
        detail = "leads to /dev/zero, outside"
    with pytest.raises(folders.FolderError) as err:
        folders.file_in(folder, name, key="tokenizer.path")
    assert str(err.value).startswith(f"tokenizer.path: {folder / name} ")
    assert detail in str(err.value)
    if kind != "dotdot":
        with pytest.raises(folders.FolderError, match=re.escape(detail)):
            folders.check_folder(folder, key="tokenizer.path")


def test_hub_cache_snapshot_links_into_blobs_are_inside(tmp_path):
    """The Hugging Face cache keeps a snapshot's files as links into the repository's blobs/."""
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "f00d").write_text('{"model_type": "llama"}')
    os.symlink("../../blobs/f00d", snapshot / "config.json")
    assert folders.read_config_json(snapshot, key="model.path") == {"model_type": "llama"}
    folders.check_folder(snapshot, key="model.path")
    (tmp_path / "elsewhere").write_text("x")
    os.symlink("../../../elsewhere", snapshot / "merges.txt")
    with pytest.raises(folders.FolderError, match="outside"):
        folders.check_folder(snapshot, key="model.path")


@pytest.mark.parametrize("name", ["../outside/model.safetensors", "/abs/model.safetensors"])
def test_index_naming_files_outside_the_folder_is_refused(tmp_path, name):
    folder = tmp_path / "model"
    folder.mkdir()
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": name, "v": "model-1.safetensors"}}))
    with pytest.raises(folders.FolderError) as err:
        folders.index_weight_files(folder, key="model.path")
    assert str(err.value) == (
        f"model.path: {index} names {name!r} in its weight_map, outside {folder}; kd reads "
        "weights only from inside the folder: restore the index from the model's source"
    )
    index.write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
    assert folders.index_weight_files(folder, key="model.path") == ["model-1.safetensors"]


def test_safetensors_header_problems(tmp_path):
    """Offsets past the end of the file (truncated) and integer weights are refused; a sound file
    has no problem."""
    from safetensors.torch import save_file

    from kd.checkpoint.hf_folder import safetensors_header_problems

    def problems(path: Path) -> list[str]:
        return safetensors_header_problems([path], key="model", folder=tmp_path)

    where = f"model: cannot load the weights in {tmp_path}"
    good = tmp_path / "good.safetensors"
    save_file({"a.weight": torch.ones(4, 4), "a.bias": torch.zeros(4)}, str(good))
    assert problems(good) == []
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-8])
    (problem,) = problems(cut)
    assert problem.startswith(f"{where} (cut.safetensors is truncated: tensor ")
    assert problem.endswith("); re-download the truncated or damaged file")
    ints = tmp_path / "int.safetensors"
    save_file({"a.weight": torch.ones(4, 4, dtype=torch.int8)}, str(ints))
    assert problems(ints) == [
        f"{where} (int.safetensors stores the weight a.weight as integers (I8), which would be "
        "cast into the floating parameters as raw numbers); use the model's unquantized "
        "(float16, bfloat16 or float32) safetensors"
    ]
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x10\x00")
    assert problems(short) == [
        f"{where} (short.safetensors: ValueError: 2 bytes, too short for a safetensors header); "
        "re-download the truncated or damaged file"
    ]


def test_write_hf_folder_never_copies_a_link_out_of_the_source(tmp_path):
    """Copying the student's files into final/ and step_*/ refuses a link out of its folder."""
    from kd.checkpoint.hf_folder import write_hf_folder

    source = tmp_path / "student"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "qwen2"}')
    (source / "tokenizer.json").write_text("{}")
    (tmp_path / "secret").write_text("secret")
    os.symlink("../secret", source / "merges.txt")
    dest = tmp_path / "final"
    dest.mkdir()
    with pytest.raises(folders.FolderError, match="merges.txt leads to .*secret, outside"):
        write_hf_folder(dest, {"w": torch.ones(2)}, source_dir=source)
    assert not (dest / "merges.txt").exists()


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("http://u:pw@host:8000/v1", "http://***@host:8000/v1"),
        ("https://u:p@ss@host/x", "https://***@host/x"),  # a raw @ in the password
        ("see http://a:b@h1 and ftp://c@h2/", "see http://***@h1 and ftp://***@h2/"),
        ("http://host/path?mail=a@b", "http://host/path?mail=a@b"),  # no user information
        ("Bearer tok-123 rejected", "Bearer *** rejected"),
    ],
)
def test_redact_hides_url_credentials_and_secrets(text, shown):
    from kd.errors import redact

    assert redact(text, ["tok-123"]) == shown
