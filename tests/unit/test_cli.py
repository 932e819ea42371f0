"""The `kd` command line: ls, cp, run, validate, --version, error handling."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

import kd
from kd.cli import main, run_recipe
from kd.config import builtin as registry
from kd.errors import KDUserError
from tests.conftest import make_config, write_config
from tests.unit.test_config import tiny_config, write


@pytest.fixture
def fake_configs(tmp_path, monkeypatch) -> Path:
    """A built-in configs folder with one config per recipe and one that belongs to none."""
    root = tmp_path / "configs"
    for name in ("fam/A_to_B_full_single_device", "fam/A_to_B_full_distributed", "misc/other"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / f"{name}.yaml").write_text(f"# {name}\nkd_ratio: 0.25\n")
    monkeypatch.setattr(registry, "configs_dir", lambda: root)
    return root


def kd_subprocess(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kd.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_registry_recipes_and_real_configs():
    recipes = {r.name: r for r in registry.list_recipes()}
    assert recipes["kd_single_device"].module == "kd.recipes.kd_single_device"
    assert recipes["kd_single_device"].supports_distributed is False
    assert recipes["kd_distributed"].supports_distributed is True
    # Whatever built-in configs exist are attached by suffix and resolve to files.
    for name in registry.list_configs():
        assert registry.find_config(name).is_file()
        assert registry.find_config(name + ".yaml") == registry.find_config(name)
        if name.endswith("_single_device"):
            assert name in recipes["kd_single_device"].configs
    with pytest.raises(KDUserError, match="did you mean kd_distributed"):
        registry.find_recipe("kd_distribute")


def test_registry_with_fake_configs(fake_configs, tmp_path):
    recipes = {r.name: r for r in registry.list_recipes()}
    assert recipes["kd_single_device"].configs == ["fam/A_to_B_full_single_device"]
    assert recipes["kd_distributed"].configs == ["fam/A_to_B_full_distributed"]
    assert registry.list_configs() == sorted(
        ["fam/A_to_B_full_distributed", "fam/A_to_B_full_single_device", "misc/other"]
    )
    assert registry.find_config("misc/other.yaml") == fake_configs / "misc/other.yaml"
    local = tmp_path / "mine.yaml"
    local.write_text("kd_ratio: 1\n")
    assert registry.find_config(str(local)) == local
    with pytest.raises(KDUserError, match="did you mean the built-in misc/other"):
        registry.find_config("misc/othr")


def test_ls(fake_configs, capsys):
    assert main(["ls"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["RECIPE", "CONFIG"]
    assert out[1].split()[0] == "kd" and "any config" in out[1]
    assert out[2].split() == ["kd_single_device", "fam/A_to_B_full_single_device"]
    assert out[3].split() == ["kd_distributed", "fam/A_to_B_full_distributed"]
    assert out[4].split()[0] == "teacher_logits" and "any config" in out[4]
    assert out[5].split() == ["-", "misc/other"]


def test_ls_real_configs(capsys):
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "kd_single_device" in out and "kd_distributed" in out
    for name in registry.list_configs():
        assert name in out


def test_cp(fake_configs, tmp_path, capsys):
    dest = tmp_path / "work" / "my_kd"
    assert main(["cp", "fam/A_to_B_full_single_device", str(dest)]) == 0
    copied = dest.with_suffix(".yaml")
    assert copied.read_text() == (fake_configs / "fam/A_to_B_full_single_device.yaml").read_text()
    assert main(["cp", "misc/other", str(copied)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main(["cp", "misc/other", str(copied), "--force"]) == 0
    assert "misc/other" in copied.read_text()
    assert main(["cp", "misc/other.yaml", str(tmp_path / "work")]) == 0  # into a folder
    assert (tmp_path / "work" / "other.yaml").is_file()
    assert main(["cp", "misc/othr", str(tmp_path / "x.yaml")]) == 2
    assert "did you mean misc/other?" in capsys.readouterr().err


def test_version_subprocess():
    result = kd_subprocess("--version")
    assert result.returncode == 0
    assert result.stdout.startswith(f"kd {kd.__version__} (torch ")
    assert "torchtune" in result.stdout


def test_a_pipe_closed_early_ends_quietly():
    # `kd ls | head`: the reader is gone before the listing is written (`true` reads nothing and
    # exits while Python starts); no BrokenPipeError traceback, the shell's status for it.
    cmd = f"{sys.executable} -m kd.cli ls | true; echo rc=${{PIPESTATUS[0]}}"
    result = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    assert result.stdout.strip() == "rc=141", result.stdout


def test_help_everywhere(capsys):
    for argv in (
        ["--help"],
        ["ls", "--help"],
        ["cp", "--help"],
        ["validate", "--help"],
        ["run", "--help"],
    ):
        assert main(argv) == 0, argv
        assert "usage:" in capsys.readouterr().out


def test_cli_modules_do_not_import_torch():
    code = (
        "import sys, kd.cli, kd.config.builtin, kd.config; kd.cli.main(['ls']); kd.cli.main(['--help']); "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip().splitlines()[-1] == "False", result.stderr


def test_optional_commands_delegate(capsys):
    import importlib.util

    for module, command in (("kd.cli.plan", "plan"), ("kd.demo", "demo")):
        if importlib.util.find_spec(module) is None:
            continue
        assert main([command, "--help"]) == 0
        assert f"usage: kd {command}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["nosuchcommand"], "invalid choice"),
        ([], "missing command"),
        (["ls", "--bogus"], "unrecognized arguments: --bogus"),
        (["run", "kd_single"], "did you mean kd_single_device?"),
        (["run", "kd_single_device"], "missing --config"),
        (
            ["run", "--nproc_per_node", "2", "kd_single_device", "--config", "x.yaml"],
            "use kd_distributed",
        ),
        (
            ["run", "--nproc_per_nod", "2", "kd_distributed", "--config", "x.yaml"],
            "unknown torchrun option",
        ),
        (["validate"], "the following arguments are required: --config"),
        (["validate", "--config", "no/such/config"], "no such file or built-in config"),
        # A misspelt flag or command names the one meant (argparse alone named none, or
        # reported the flag the typo left out as missing).
        (["pln", "--config", "x.yaml"], "did you mean plan? see kd --help"),
        (["plan", "--confg", "x.yaml"], "unknown option --confg; did you mean --config?"),
        (["plan", "--config", "x.yaml", "--budgt-gib", "8"], "did you mean --budget-gib?"),
        (["validate", "--config", "x.yaml", "--word-size", "2"], "did you mean --world-size?"),
        (["init", "--teachr", "T", "--student", "S"], "did you mean --teacher?"),
        (["init", "--backend", "transformer"], "did you mean transformers?"),
        (["generate", "--modle", "m", "--prompt", "p"], "did you mean --model?"),
        (["demo", "--quik"], "did you mean --quick?"),
        (["--verison"], "did you mean --version?"),
        (["--debgu", "run", "kd", "--config", "x.yaml"], "did you mean --debug?"),
        (["run", "kd", "--confg", "x.yaml"], "did you mean --config?"),
        (
            ["run", "--nproc_per_nod", "2", "kd", "--config", "x.yaml"],
            "did you mean --nproc_per_node?",
        ),
        (
            ["run", "kd", "--config", "x.yaml", "--nproc_per_node", "2"],
            "--nproc_per_node is a torchrun option; put it before the recipe name",
        ),
    ],
)
def test_user_errors_exit_2_with_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kd: error: "), err
    assert needle in err


def test_user_errors_subprocess_no_traceback(tmp_path):
    result = kd_subprocess("frobnicate")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("kd: error: ")
    bad = write(
        tmp_path / "bad.yaml", tiny_config(tmp_path, kd_ratio=1.5, temperature=0, kd_ration=1)
    )
    result = kd_subprocess("validate", "--config", bad, "batch_size=0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert all(line.startswith("kd: error: ") for line in lines), result.stderr
    assert {line.split(":")[2].strip() for line in lines} == {
        "kd_ratio",
        "temperature",
        "kd_ration",
        "batch_size",
    }


def test_debug_shows_the_exception(tmp_path):
    bad = write(tmp_path / "bad.yaml", tiny_config(tmp_path, kd_ratio=1.5))
    with pytest.raises(KDUserError, match="kd_ratio"):
        main(["--debug", "validate", "--config", bad])


def test_validate_ok(assets, tmp_path, capsys):
    path = str(write_config(tmp_path / "ok.yaml", make_config(assets, tmp_path / "out")))
    assert main(["validate", "--config", path, "memory.check=off"]) == 0
    assert capsys.readouterr().out.splitlines() == ["config OK"]
    assert not (tmp_path / "out").exists()  # validation creates nothing


def test_validate_prints_memory_plan(assets, tmp_path, capsys):
    path = str(write_config(tmp_path / "ok.yaml", make_config(assets, tmp_path / "out")))
    argv = ["validate", "--config", str(path), "memory.check=error", "memory.budget_gib=16"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "config OK" and len(out) > 2  # the plan table, then OK
    assert main([*argv, "memory.budget_gib=0.000001"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kd: error: memory:") and "Traceback" not in err
    # --budget-gib is memory.budget_gib, on validate as on plan
    assert main([*argv[:4], "--budget-gib", "0.000001"]) == 2
    assert capsys.readouterr().err.startswith("kd: error: memory:")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        # the tokenizer emits ids beyond a 64-row student: no weight is needed to know
        ("model.vocab_size=64", "tokenizer: emits ids up to"),
        ("gradient_accumulation_steps=64", "gradient_accumulation_steps:"),
        ("batch_size=65", "fewer than one batch"),
        ("device=cuda", "device: cuda is not available"),
    ],
)
def test_validate_makes_the_checks_run_makes_before_loading(
    assets, tmp_path, capsys, override, needle
):
    """`kd validate` is `kd run`'s pre-load phase: both refuse the same config with the same line."""
    if override == "device=cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = str(write_config(tmp_path / "c.yaml", make_config(assets, tmp_path / "out")))

    def errors() -> list[str]:  # `kd run` also logs the plan on stderr
        return [x for x in capsys.readouterr().err.splitlines() if x.startswith("kd: error:")]

    assert main(["validate", "--config", path, override]) == 2
    validate_err = errors()
    assert len(validate_err) == 1 and needle in validate_err[0], validate_err
    assert main(["run", "kd", "--config", path, override]) == 2
    assert errors() == validate_err
    assert not (tmp_path / "out").exists()


def test_validate_world_size_flags_are_aliases(assets, tmp_path, capsys):
    """--world-size and --nproc_per_node (torchrun's spelling) are one flag on validate and plan;
    the plan is per rank, and a data set too small for N ranks is refused as run would."""
    path = str(write_config(tmp_path / "c.yaml", make_config(assets, tmp_path / "out")))
    for flag in ("--world-size", "--nproc_per_node", "--nproc-per-node"):
        assert main(["validate", "--config", path, flag, "2"]) == 0, capsys.readouterr().err
        assert "FSDP2 over 2 ranks" in capsys.readouterr().out
        assert main(["plan", "--config", path, flag, "2"]) == 0
        assert "FSDP2 over 2 ranks" in capsys.readouterr().out
    assert main(["validate", "--config", path, "--world-size", "64"]) == 2
    assert "fewer than one batch" in capsys.readouterr().err
    assert main(["validate", "--config", path, "--world-size", "0"]) == 2
    assert "--world-size" in capsys.readouterr().err


def test_validate_bad_override_and_malformed_yaml(tmp_path, capsys):
    path = write(tmp_path / "ok.yaml", tiny_config(tmp_path))
    assert main(["validate", "--config", path, "kd_ratio"]) == 2
    assert "write kd_ratio=<value>" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\n")
    assert main(["validate", "--config", str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"{broken}:" in err and err.count("\n") == 1


# --- run / run_recipe --------------------------------------------------------------------------


def test_run_recipe_success_error_and_interrupt(tmp_path, capsys, monkeypatch):
    path = write(tmp_path / "ok.yaml", tiny_config(tmp_path))
    seen = []
    assert run_recipe(seen.append, ["--config", path, "batch_size=3", "~lr_scheduler"]) == 0
    assert seen[0].batch_size == 3 and seen[0].lr_scheduler is None

    def fails(cfg):
        raise KDUserError("memory: over budget\nbatch_size: lower it")

    assert run_recipe(fails, [f"--config={path}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "kd: error: memory: over budget",
        "kd: error: batch_size: lower it",
    ]
    with pytest.raises(KDUserError):
        run_recipe(fails, ["--config", path, "--debug"])
    monkeypatch.setenv("RANK", "1")
    assert run_recipe(fails, ["--config", path]) == 2
    assert capsys.readouterr().err == ""  # only rank 0 prints

    def interrupted(cfg):
        raise KeyboardInterrupt

    assert run_recipe(interrupted, ["--config", path]) == 130


def test_run_recipe_reads_sys_argv(tmp_path, monkeypatch):
    path = write(tmp_path / "ok.yaml", tiny_config(tmp_path))
    monkeypatch.setattr(sys, "argv", ["recipe.py", "--config", path, "epochs=3"])
    seen = []
    assert run_recipe(seen.append) == 0
    assert seen[0].epochs == 3


def test_run_in_process_calls_recipe_main(tmp_path, monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("kd.recipes.kd_single_device")
    fake.recipe_main = seen.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kd.recipes.kd_single_device", fake)
    path = write(tmp_path / "ok.yaml", tiny_config(tmp_path))
    assert main(["run", "kd_single_device", "--config", path, "kd_loss=reverse_kl"]) == 0
    assert seen[0].kd_loss.divergence == "reverse_kl"
    assert main(["run", "kd_single_device", "--config", path, "kd_ratio=2"]) == 2
    assert "kd: error: kd_ratio: 2 is outside [0, 1]" in capsys.readouterr().err


def test_run_distributed_validates_before_torchrun(tmp_path, capsys):
    path = write(tmp_path / "bad.yaml", tiny_config(tmp_path, batch_size=0))
    argv = ["run", "--nproc_per_node", "2", "--standalone", "kd_distributed", "--config", path]
    assert main(argv) == 2
    assert "kd: error: batch_size" in capsys.readouterr().err


def test_cp_then_load(fake_configs, tmp_path):
    from kd.config import load_config

    dest = tmp_path / "c.yaml"
    assert main(["cp", "misc/other", str(dest)]) == 0
    assert yaml.safe_load(dest.read_text()) == {"kd_ratio": 0.25}
    assert load_config("misc/other", []).kd_ratio == 0.25


_FAKE_RECIPE = """
import os, sys
import kd.cli
from kd.errors import KDUserError

def recipe_main(cfg):
    if cfg.seed == 7:
        raise KDUserError("seed: 7 is unlucky; pick another")
    out = os.path.join(cfg.output_dir, "rank" + os.environ["RANK"])
    with open(out, "w") as f:
        f.write(f"{cfg.batch_size} {os.environ['WORLD_SIZE']}")

if __name__ == "__main__":
    sys.exit(kd.cli.run_recipe(recipe_main))
"""


@pytest.mark.slow
def test_run_hands_over_to_torchrun(tmp_path, monkeypatch, capfd):
    (tmp_path / "kd_fake_recipe.py").write_text(_FAKE_RECIPE)
    monkeypatch.syspath_prepend(str(tmp_path))
    # torchrun's workers run the recipe as a module (python -m): they find it on PYTHONPATH
    paths = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    fake = ("kd_fake", "kd_fake_recipe", "_fake", True)
    monkeypatch.setattr(registry, "_RECIPES", (*registry._RECIPES, fake))
    out = tmp_path / "out"
    out.mkdir()
    path = write(tmp_path / "ok.yaml", tiny_config(tmp_path, output_dir=str(out)))
    argv = ["run", "--nproc_per_node", "2", "kd_fake", "--config", path, "batch_size=3"]
    assert main(argv) == 0
    assert sorted(p.read_text() for p in out.glob("rank*")) == ["3 2", "3 2"]
    capfd.readouterr()
    assert main([*argv, "seed=7"]) == 2  # a worker's user error comes back as exit 2
    err = capfd.readouterr().err
    assert err.count("kd: error: seed: 7 is unlucky") == 1  # rank 0 only


@pytest.mark.parametrize(
    ("argv", "recipe"),
    [
        (
            ["run", "kd_single_device", "--config", "qwen2/1.5_to_0.5B_KD_lora_single_device"],
            "kd_single_device",
        ),
        (["validate", "--config", "llama3_2/8B_to_1B_KD_lora_distributed.yaml"], "kd_distributed"),
        (["cp", "qwen2/1.5_to_0.5B_KD_lora_single_device", "x.yaml"], "kd_single_device"),
    ],
)
def test_a_torchtune_kd_config_name_says_how_to_copy_it(
    argv, recipe, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    name = argv[argv.index("--config") + 1] if "--config" in argv else argv[1]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    name = name.removesuffix(".yaml")
    assert (
        f"a torchtune KD config, not one of kd's; copy it with `tune cp {name} my_kd.yaml`" in err
    )
    assert f"then `kd run {recipe} --config my_kd.yaml`" in err
    assert not (tmp_path / "x.yaml").exists()


def test_torchtune_kd_configs_are_read_from_its_file_list():
    names = registry.torchtune_kd_configs()
    assert "qwen2/1.5_to_0.5B_KD_lora_single_device" in names
    assert all("_KD_" in n for n in names)
    assert registry.torchtune_config_fix("llama3_2/8B_lora_single_device") is None  # not a KD one
