"""kd.config: YAML + overrides + torchtune compatibility, validation, instantiate allow-list."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from kd.config import instantiate, load_config, validate_config
from kd.config.parse import fill_defaults
from kd.config.validate import component_problems, writable_dir_problem
from kd.errors import ConfigError, KDUserError

_SHAPE = dict(
    vocab_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    embed_dim=16,
    intermediate_dim=32,
    max_seq_len=32,
)


def tiny_config(root: Path, **top: Any) -> dict[str, Any]:
    """A complete config whose files exist (empty placeholders: nothing is loaded here)."""
    for folder in ("student", "teacher", "tok"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for name in (
        "student/model.safetensors",
        "teacher/model.safetensors",
        "tok/vocab.json",
        "tok/merges.txt",
    ):
        (root / name).write_text("")
    (root / "train.json").write_text("[]")
    cfg: dict[str, Any] = {
        "output_dir": str(root / "out"),
        "model": {"_component_": "torchtune.models.qwen2.qwen2", **_SHAPE, "num_layers": 1},
        "teacher_model": {"_component_": "torchtune.models.qwen2.qwen2", **_SHAPE},
        "tokenizer": {
            "_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer",
            "path": str(root / "tok/vocab.json"),
            "merges_file": str(root / "tok/merges.txt"),
            "max_seq_len": 32,
        },
        "checkpointer": {
            "_component_": "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": str(root / "student"),
            "checkpoint_files": ["model.safetensors"],
            "output_dir": "${output_dir}",
            "model_type": "QWEN2",
        },
        "teacher_checkpointer": {
            "_component_": "torchtune.training.FullModelHFCheckpointer",
            "checkpoint_dir": str(root / "teacher"),
            "checkpoint_files": ["model.safetensors"],
            "output_dir": "${output_dir}",
            "model_type": "QWEN2",
        },
        "dataset": {
            "_component_": "torchtune.datasets.instruct_dataset",
            "source": "json",
            "data_files": str(root / "train.json"),
        },
        # Explicit so the test does not depend on kd.metrics existing.
        "metric_logger": {
            "_component_": "torchtune.training.metric_logging.DiskLogger",
            "log_dir": "${output_dir}/logs",
        },
        "device": "cpu",
        "dtype": "fp32",
        "memory": {"check": "off"},
    }
    cfg.update(top)
    return cfg


def write(path: Path, cfg: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


@pytest.fixture
def cfg_path(tmp_path: Path) -> str:
    return write(tmp_path / "kd.yaml", tiny_config(tmp_path))


def problems_of(cfg, **kw) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, **kw)
    return {p.key: p.message for p in err.value.problems}


# --- parsing and overrides -------------------------------------------------------------------


def test_load_merges_defaults_and_resolves(cfg_path, tmp_path):
    cfg = load_config(cfg_path, [])
    assert cfg.kd_ratio == 0.5 and cfg.temperature == 1.0 and cfg.batch_size == 4
    # section defaults merged key by key under the YAML's `memory: {check: off}`
    assert cfg.memory.check == "off" and cfg.memory.budget_gib is None
    assert cfg.kd_loss == {"divergence": "forward_kl", "beta": 0.5, "skew_alpha": 0.1}
    assert cfg.checkpointer.output_dir == str(tmp_path / "out")
    assert cfg.loss is None and "loss" in cfg
    validate_config(cfg)


def test_overrides_set_delete_and_shorthand(cfg_path):
    cfg = load_config(
        cfg_path,
        [
            "batch_size=2",
            "optimizer.lr=1e-4",
            "memory.budget_gib=40",
            "~lr_scheduler",
            "~model.num_layers",
            "model=torchtune.models.qwen2.lora_qwen2",
            "seed=null",
            "~temperature",
            "new_section.a=1",
        ],
    )
    assert cfg.batch_size == 2
    assert (
        cfg.optimizer.lr == pytest.approx(1e-4) and cfg.optimizer._component_ == "torch.optim.AdamW"
    )
    assert cfg.memory.budget_gib == 40 and cfg.memory.check == "off"
    assert cfg.lr_scheduler is None  # nullable key deleted -> null
    assert cfg.temperature == 1.0  # non-nullable key deleted -> schema default
    assert cfg.model._component_ == "torchtune.models.qwen2.lora_qwen2"
    assert "num_layers" not in cfg.model and cfg.model.vocab_size == 64
    assert cfg.seed is None
    assert cfg.new_section.a == 1


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("kd_loss=reverse_kl", "reverse_kl"),
        ("kd_loss=torchtune.modules.loss.SymmetricKLWithChunkedOutputLoss", "symmetric_kl"),
        ("kd_loss.divergence=jsd", "jsd"),
    ],
)
def test_kd_loss_forms(cfg_path, override, expected):
    cfg = load_config(cfg_path, [override, "kd_loss.beta=0.3"])
    assert cfg.kd_loss == {"divergence": expected, "beta": 0.3, "skew_alpha": 0.1}


def test_kd_loss_string_in_yaml(tmp_path):
    cfg = load_config(write(tmp_path / "c.yaml", tiny_config(tmp_path, kd_loss="tvd")), [])
    assert cfg.kd_loss == {"divergence": "tvd", "beta": 0.5, "skew_alpha": 0.1}


def test_torchtune_losses_and_ignored_keys_mapped_with_notices(tmp_path, capsys):
    raw = tiny_config(
        tmp_path,
        loss={"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        kd_loss={
            "_component_": "torchtune.modules.loss.ReverseKLWithChunkedOutputLoss",
            "num_output_chunks": 8,
        },
        profiler={"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
        fsdp_cpu_offload=True,
    )
    cfg = load_config(write(tmp_path / "c.yaml", raw), [])
    err = capsys.readouterr().err
    assert cfg.loss is None and "loss" in cfg
    assert cfg.kd_loss.divergence == "reverse_kl"
    assert "profiler" not in cfg
    assert cfg.fsdp.cpu_offload is True and cfg.fsdp.reduce_dtype == "fp32"
    lines = err.splitlines()
    assert all(line.startswith("kd: notice: ") for line in lines)
    for word in (
        "CEWithChunkedOutputLoss",
        "reverse_kl",
        "profiler",
        "fsdp.cpu_offload",
    ):
        assert sum(word in line for line in lines) == 1, (word, err)
    validate_config(cfg)


def test_notices_only_on_rank_zero(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    load_config(write(tmp_path / "c.yaml", tiny_config(tmp_path, profiler={"enabled": False})), [])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("foo", "write foo=<value> to set it or ~foo to delete it"),
        ("=3", "no key before '='"),
        ("batch_size=", "write batch_size=null"),
        ("a b=1", "is not a config key"),
        ("~no_such_keyy", "no key no_such_keyy"),
        ("~kd_ratioo", "did you mean ~kd_ratio?"),
        ("--lr", "unknown option"),
    ],
)
def test_bad_overrides(cfg_path, override, needle):
    with pytest.raises(KDUserError) as err:
        load_config(cfg_path, [override])
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("output_dir: /tmp/x\nmodel:\n  _component_: a\n bad_indent: [1, 2\n")
    with pytest.raises(KDUserError) as err:
        load_config(str(path), [])
    assert f"{path}:" in str(err.value) and "malformed YAML" in str(err.value)
    line = int(str(err.value).split(f"{path}:")[1].split(":")[0])
    assert 3 <= line <= 5


def test_missing_config_file(tmp_path):
    with pytest.raises(KDUserError) as err:
        load_config(str(tmp_path / "nope.yaml"), [])
    assert str(tmp_path / "nope.yaml") in str(err.value)


def test_unresolvable_interpolation_names_key(tmp_path):
    raw = tiny_config(tmp_path)
    raw["checkpointer"]["output_dir"] = "${no_such}"
    with pytest.raises(KDUserError) as err:
        load_config(write(tmp_path / "c.yaml", raw), [])
    assert "checkpointer.output_dir" in str(err.value)


# --- validation --------------------------------------------------------------------------------


def test_all_type_and_range_problems_reported_together(cfg_path):
    cfg = load_config(
        cfg_path,
        [
            "kd_ratio=1.5",
            "temperature=0",
            "batch_size=0",
            "epochs=true",
            "dtype=fp16",
            "memory.check=loud",
            "kd_loss.divergence=forward_kll",
            "kd_ration=0.3",
            "memory.budjet_gib=3",
            "fsdp=null",
        ],
    )
    found = problems_of(cfg)
    assert found["kd_ratio"] == "1.5 is outside [0, 1]; set kd_ratio to a value between 0 and 1"
    assert "set temperature to a number greater than 0" in found["temperature"]
    assert "set batch_size to an integer >= 1" in found["batch_size"]
    assert "True is not an integer" in found["epochs"]
    assert "set dtype to one of bf16, fp32" in found["dtype"]
    assert "one of error, warn, off" in found["memory.check"]
    assert "did you mean forward_kl?" in found["kd_loss.divergence"]
    assert found["kd_ration"] == "unknown key; did you mean kd_ratio?"
    assert found["memory.budjet_gib"] == "unknown key; did you mean memory.budget_gib?"
    assert "null is not allowed; set fsdp to a mapping" in found["fsdp"]
    assert len(found) == 10


def test_missing_required_keys(tmp_path):
    raw = tiny_config(tmp_path)
    del raw["teacher_model"], raw["dataset"]
    found = problems_of(load_config(write(tmp_path / "c.yaml", raw), []))
    assert set(found) == {"teacher_model", "dataset"}
    assert all("required key is missing" in m for m in found.values())
    # output_dir is interpolated by the checkpointers, so its absence shows at load time.
    del raw["output_dir"]
    with pytest.raises(KDUserError, match="Interpolation key 'output_dir' not found"):
        load_config(write(tmp_path / "c.yaml", raw), [])


def test_teacher_null_only_with_kd_ratio_zero(cfg_path):
    found = problems_of(load_config(cfg_path, ["teacher_model=null", "teacher_checkpointer=null"]))
    assert list(found) == ["teacher_model"] and "kd_ratio=0" in found["teacher_model"]
    validate_config(
        load_config(cfg_path, ["teacher_model=null", "teacher_checkpointer=null", "kd_ratio=0"])
    )
    found = problems_of(load_config(cfg_path, ["teacher_checkpointer=null"]))
    assert list(found) == ["teacher_checkpointer"]


def test_components_import_and_bind(cfg_path):
    # Targets outside the allow-list are refused by the schema pass; trusted, they are imported
    # and reported with the signature problems.
    cfg = load_config(
        cfg_path,
        [
            "model.num_layrs=2",
            "teacher_model=torchtune.models.qwen2.qwen2_nope",
            "optimizer=torch.optim.NoSuchOpt",
            "checkpointer.bogus=1",
            "trust_remote_components=true",
        ],
    )
    # The arguments their source declares are refused with the schema, before any import.
    assert set(problems_of(cfg)) == {"model.num_layrs", "checkpointer.bogus"}
    # The component pass, which imports the targets, finds them too, with the rest.
    data = OmegaConf.to_container(cfg, resolve=True)
    found = {p.key: p.message for p in component_problems(data)}
    assert "did you mean model.num_layers?" in found["model.num_layrs"]
    assert "torchtune.models.qwen2 has no qwen2_nope" in found["teacher_model._component_"]
    assert "torch.optim has no NoSuchOpt" in found["optimizer._component_"]
    assert (
        "not an argument of torchtune.training.FullModelHFCheckpointer"
        in found["checkpointer.bogus"]
    )
    assert len(found) == 4


def test_unsupported_loss_and_kd_loss_components(cfg_path):
    cfg = load_config(
        cfg_path, ["loss._component_=torch.nn.MSELoss", "kd_loss=torchtune.modules.loss.Unknown"]
    )
    found = problems_of(cfg)
    assert "set loss to null" in found["loss"]
    assert "set kd_loss to one of forward_kl" in found["kd_loss._component_"]


def test_missing_files_named_by_key(tmp_path):
    raw = tiny_config(tmp_path)
    raw["checkpointer"]["checkpoint_files"] = ["model.safetensors", "missing.safetensors"]
    raw["teacher_checkpointer"]["checkpoint_dir"] = str(tmp_path / "no_teacher")
    raw["tokenizer"]["merges_file"] = str(tmp_path / "no_merges.txt")
    raw["tokenizer"]["special_tokens_path"] = str(tmp_path / "no_tok.json")
    raw["dataset"]["data_files"] = [str(tmp_path / "train.json"), str(tmp_path / "no.json")]
    raw["output_dir"] = str(tmp_path / "tok" / "vocab.json" / "out")  # under a file
    cfg = load_config(write(tmp_path / "c.yaml", raw), [])
    found = problems_of(cfg)
    assert (
        str(tmp_path / "student" / "missing.safetensors")
        in found["checkpointer.checkpoint_files[1]"]
    )
    assert str(tmp_path / "no_teacher") in found["teacher_checkpointer.checkpoint_dir"]
    assert str(tmp_path / "no_merges.txt") in found["tokenizer.merges_file"]
    assert str(tmp_path / "no_tok.json") in found["tokenizer.special_tokens_path"]
    assert str(tmp_path / "no.json") in found["dataset.data_files"]
    assert "is a file" in found["output_dir"]
    assert len(found) == 6
    validate_config(cfg, check_paths=False)  # everything else is fine


def test_formatted_checkpoint_files_and_hub_dataset(tmp_path):
    raw = tiny_config(tmp_path)
    for i in (1, 2):
        (tmp_path / "teacher" / f"model-0000{i}-of-00002.safetensors").write_text("")
    raw["teacher_checkpointer"]["checkpoint_files"] = {
        "filename_format": "model-{}-of-{}.safetensors",
        "max_filename": "00002",
    }
    raw["dataset"] = {"_component_": "torchtune.datasets.alpaca_cleaned_dataset", "packed": False}
    validate_config(load_config(write(tmp_path / "c.yaml", raw), []))
    (tmp_path / "teacher" / "model-00002-of-00002.safetensors").unlink()
    found = problems_of(load_config(write(tmp_path / "c.yaml", raw), []))
    assert list(found) == ["teacher_checkpointer.checkpoint_files[1]"]


def test_output_dir_writable_check_creates_nothing(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    assert writable_dir_problem(str(target)) is None
    assert not (tmp_path / "a").exists()
    (tmp_path / "f").write_text("")
    assert "is a file" in writable_dir_problem(str(tmp_path / "f"))
    if os.geteuid() != 0:  # root can write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        assert "not writable" in writable_dir_problem(str(ro / "x"))


def test_remote_components_refused_unless_trusted(cfg_path):
    cfg = load_config(cfg_path, ["metric_logger._component_=collections.OrderedDict"])
    found = problems_of(cfg)
    assert "trust_remote_components: true" in found["metric_logger._component_"]
    cfg = load_config(
        cfg_path,
        ["metric_logger._component_=collections.OrderedDict", "trust_remote_components=true"],
    )
    validate_config(cfg)


# --- instantiate -------------------------------------------------------------------------------


def test_instantiate_builds_with_kwargs_and_runtime_args():
    import torch

    params = [torch.nn.Parameter(torch.zeros(2))]
    node = OmegaConf.create({"optimizer": {"_component_": "torch.optim.SGD", "lr": 0.1}}).optimizer
    opt = instantiate(node, params, momentum=0.5)
    assert isinstance(opt, torch.optim.SGD)
    assert opt.defaults["lr"] == 0.1 and opt.defaults["momentum"] == 0.5
    assert instantiate(None) is None


def test_instantiate_allow_list_and_errors():
    node = OmegaConf.create(
        {"metric_logger": {"_component_": "collections.OrderedDict", "a": 1}}
    ).metric_logger
    with pytest.raises(KDUserError) as err:
        instantiate(node)
    assert str(err.value).startswith(
        "metric_logger._component_: collections.OrderedDict is not something metric_logger may "
        "build (allowed: "
    )
    assert "trust_remote_components: true" in str(err.value)
    assert instantiate(node, trust=True) == {"a": 1}
    with pytest.raises(KDUserError, match="did you mean lr"):
        instantiate({"_component_": "torch.optim.SGD", "lrr": 0.1}, key="optimizer")
    with pytest.raises(KDUserError, match="_component_: missing"):
        instantiate({"lr": 0.1}, key="optimizer")
    with pytest.raises(TypeError, match="pass key="):
        instantiate({"_component_": "torch.optim.SGD", "lr": 0.1})


def test_fill_defaults_does_not_merge_into_other_components():
    cfg = OmegaConf.create({"optimizer": {"_component_": "torchao.optim.AdamW8bit", "lr": 1e-4}})
    fill_defaults(cfg)
    assert cfg.optimizer == {"_component_": "torchao.optim.AdamW8bit", "lr": 1e-4}


# --- torchtune's own KD configs ------------------------------------------------------------------


def _torchtune_kd_configs() -> list[Path]:
    import importlib.util

    spec = importlib.util.find_spec("torchtune")
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent.parent / "recipes" / "configs"
    return sorted(p for family in ("qwen2", "llama3_2") for p in (root / family).glob("*KD*.yaml"))


def test_torchtune_kd_configs_load_with_only_missing_path_problems(capsys):
    files = _torchtune_kd_configs()
    assert len(files) >= 4
    for path in files:
        cfg = load_config(str(path), ["output_dir=/tmp/kd_test_unused"])
        err = capsys.readouterr().err
        assert "kd_loss: torchtune.modules.loss.ForwardKLWithChunkedOutputLoss mapped" in err
        assert "loss: torchtune.modules.loss.CEWithChunkedOutputLoss dropped" in err
        assert all(line.startswith("kd: notice: ") for line in err.splitlines())
        assert cfg.loss is None and cfg.kd_loss.divergence == "forward_kl"
        validate_config(cfg, check_paths=False)
        found = problems_of(cfg)
        assert found, path
        for key, message in found.items():
            assert key.split(".")[0] in ("checkpointer", "teacher_checkpointer", "tokenizer"), (
                key,
                message,
            )
            assert "does not exist" in message, (key, message)


def test_memory_check_off_unquoted_in_yaml(tmp_path):
    from kd.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("output_dir: /tmp/x\nmemory:\n  check: off\n")
    assert load_config(str(path), []).memory.check == "off"
    assert load_config(str(path), ["memory.check=off"]).memory.check == "off"


# --- numbers, lists, paths: inputs no key can hold ------------------------------------------


def _number_keys() -> list[tuple[str, Any]]:
    from kd.config import schema

    keys = [*schema.TOP_LEVEL.items()]
    keys += [
        (f"{s}.{k}", key) for s, section in schema.SECTIONS.items() for k, key in section.items()
    ]
    keys += list(schema.COMPONENT_ARGS.items())
    return [(name, key) for name, key in keys if int in key.types]


@pytest.mark.parametrize(("dotted", "key"), _number_keys(), ids=[n for n, _ in _number_keys()])
def test_every_number_key_refuses_nan_inf_and_beyond_int64(dotted, key):
    from kd.config.validate import check_value

    for bad in (float("nan"), float("inf"), float("-inf"), "nan", "-inf", 2**63, -(2**63) - 1):
        message = check_value(dotted, bad, key)
        assert message is not None, (dotted, bad)
        assert f"; set {dotted} to " in message, message  # names the key and the fix
    if float in key.types:
        assert "not a finite number" in check_value(dotted, float("nan"), key)
        assert "not a finite number" in check_value(dotted, "inf", key)


def test_nan_and_huge_numbers_in_component_nodes(cfg_path):
    cfg = load_config(cfg_path, ["optimizer.lr=.nan", "model.vocab_size=99999999999999999999"])
    found = problems_of(cfg)
    assert found["optimizer.lr"].startswith("nan is not a finite number")
    assert found["model.vocab_size"].startswith("99999999999999999999 is beyond the 64-bit")
    # Text where a builder takes a number: caught before anything is built.
    found = problems_of(load_config(cfg_path, ["optimizer.lr=fast"]))
    assert found == {
        "optimizer.lr": "'fast' is not a number (the default of torch.optim.AdamW's lr is 0.001); "
        "set optimizer.lr to a number"
    }
    found = problems_of(
        load_config(cfg_path, ["tokenizer.max_seq_len=abc"]), check_components=False
    )
    assert found["tokenizer.max_seq_len"].startswith("'abc' is not an integer")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("checkpointer.checkpoint_files.5=x", "checkpoint_files has 1 entries, so index 5 is out"),
        ("checkpointer.checkpoint_files.-2=x", "index -2 is out of range (valid: 0 to 0)"),
        ("checkpointer.checkpoint_files.x=y", "is a list, so 'x' is not an index"),
        ("~", "no key after '~'"),
        ("~a..b", "'a..b' is not a config key"),
        ("seed=" + "9" * 5000, "a number has too many digits"),
    ],
    ids=["out_of_range", "negative", "not_a_number", "tilde", "tilde_bad_key", "long_number"],
)
def test_overrides_that_cannot_be_applied(cfg_path, override, needle):
    with pytest.raises(KDUserError, match=None) as err:
        load_config(cfg_path, [override])
    assert needle in str(err.value) and len(str(err.value)) < 400


def test_list_index_override_inside_the_list(cfg_path):
    cfg = load_config(cfg_path, ["checkpointer.checkpoint_files.0=other.safetensors"])
    assert list(cfg.checkpointer.checkpoint_files) == ["other.safetensors"]


def test_config_file_not_utf8_or_binary(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"seed: 1\nnote: caf\xe9\n")
    with pytest.raises(KDUserError, match=r"latin.yaml:2: is not UTF-8 text \(byte 0xe9\)"):
        load_config(str(latin), [])
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"\x00\x01\x02seed: 1")
    with pytest.raises(KDUserError, match="is a binary file, not YAML text"):
        load_config(str(binary), [])
    huge = tmp_path / "weights.safetensors"
    with huge.open("wb") as fh:
        fh.truncate(17 << 20)  # sparse: nothing is written
    with pytest.raises(KDUserError, match="larger than 16 MiB, so not a config"):
        load_config(str(huge), [])
    with pytest.raises(KDUserError, match="is not a regular file"):
        load_config("/dev/null", [])


def test_unusable_paths_are_named_not_raised(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg["dataset"]["data_files"] = "train\0.json"
    cfg["tokenizer"]["path"] = str(tmp_path / ("x" * 300))
    cfg["checkpointer"]["checkpoint_dir"] = "~kd_no_such_user/model"
    cfg["output_dir"] = "a\nb/" + "y" * 5000
    found = problems_of(load_config(write(tmp_path / "kd.yaml", cfg), []))
    assert "(it contains a NUL byte)" in found["dataset.data_files"]
    assert "(file name too long)" in found["tokenizer.path"]
    assert "~kd_no_such_user is not a user on this machine" in found["checkpointer.checkpoint_dir"]
    assert "file name too long" in found["output_dir"]
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(write(tmp_path / "kd.yaml", cfg), []))
    assert len(str(err.value).splitlines()) == len(err.value.problems)  # one line per problem
    assert "output_dir: 'a\\nb/yyy" in str(err.value)


def test_dataset_list(tmp_path):
    from kd.config.run import run_config

    cfg = tiny_config(tmp_path)
    (tmp_path / "more.json").write_text("[]")
    cfg["dataset"] = [cfg["dataset"], dict(cfg["dataset"], data_files=str(tmp_path / "more.json"))]
    loaded = load_config(write(tmp_path / "kd.yaml", cfg), [])
    validate_config(loaded, check_components=False)
    run = run_config(loaded)
    assert [node.data_files for node in run.components["dataset"]] == [
        str(tmp_path / "train.json"),
        str(tmp_path / "more.json"),
    ]
    bad = load_config(
        write(tmp_path / "kd.yaml", cfg), ["dataset.1.data_files=/nope.json", "dataset.0.sourc=x"]
    )
    found = problems_of(bad)
    assert set(found) == {"dataset[1].data_files"}  # the schema pass answers first
    assert problems_of(load_config(write(tmp_path / "kd.yaml", dict(cfg, dataset=[])), [])) == {
        "dataset": "an empty list; set dataset to a node with _component_, or a list of them"
    }
    found = problems_of(load_config(write(tmp_path / "kd.yaml", dict(cfg, dataset=[1])), []))
    assert found == {"dataset[0]": "expected a mapping with _component_; fix the list entry"}


@pytest.mark.parametrize(
    "extra,line",
    [
        ({"device": "cpu"}, "needs device: cuda (device is cpu)"),
        ({"compile": True}, "and compile: true are two ways of one decode step"),
        ({"on_policy": {"sampler": "served"}}, "a served sampler's server runs its own CUDA"),
        ({"on_policy": {"batch_rollouts": False}}, "replays the fast local decode"),
        ({"on_policy": {"async_steps": 1}}, "set on_policy.async_steps=0, or"),
        ({"device": "cuda"}, None),
    ],
)
def test_cuda_graphs_apply_to_the_fast_local_decode_on_cuda(extra, line):
    from kd.config.checks.features import check_on_policy

    data = {
        "device": "cuda",
        "on_policy": {"batch_rollouts": True, "cuda_graphs": True, **extra.get("on_policy", {})},
        **{k: v for k, v in extra.items() if k != "on_policy"},
    }
    problems: list = []
    check_on_policy(data, problems)
    found = [p for p in problems if p.key == "on_policy.cuda_graphs"]
    if line is None:
        assert found == []
    else:
        assert (
            len(found) == 1 and line in found[0].message and "cuda_graphs=false" in found[0].message
        )


@pytest.mark.parametrize("batch_rollouts", [None, False, True])
def test_rollout_batch_size_needs_batch_rollouts(batch_rollouts):
    """on_policy.rollout_batch_size groups batch_rollouts' one generation per step; without it
    nothing reads it (it was silently ignored, and planned as ignored)."""
    from kd.config.checks.features import check_on_policy

    node = {"rollout_batch_size": 4}
    if batch_rollouts is not None:
        node["batch_rollouts"] = batch_rollouts
    problems: list = []
    check_on_policy({"on_policy": node}, problems)
    found = [p for p in problems if p.key == "on_policy.rollout_batch_size"]
    if batch_rollouts:
        assert found == []
    else:
        assert len(found) == 1 and "on_policy.batch_rollouts=true" in found[0].message
