"""What a user sees from `kd validate` / `kd plan` / `kd run` for common config mistakes: the key
meant, overrides anywhere after the flags, private builder paths, late value errors reported at
once, quiet validation, and every recipe named with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kd.cli import main
from kd.config import builtin as registry
from tests.conftest import make_config, write_config
from tests.unit.config.test_validate_speed import kd_main_subprocess
from tests.unit.test_config import tiny_config, write


@pytest.fixture
def config(tmp_path: Path) -> str:
    return write(tmp_path / "kd.yaml", tiny_config(tmp_path))


def _errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [x for x in capsys.readouterr().err.splitlines() if x.startswith("kd: error:")]


@pytest.mark.parametrize(
    ("mistake", "line"),
    [
        # a section's key with another tool's word in front, not the look-alike log_every_n_steps
        (
            "eval_every_n_steps=5",
            "eval_every_n_steps: unknown key; did you mean validation.every_n_steps?",
        ),
        ("run_val_every_n_steps=5", "did you mean validation.every_n_steps?"),
        ("budget_gib=8", "budget_gib: unknown key; did you mean memory.budget_gib?"),
        ("gkd_lmbda=0.5", "did you mean on_policy.lmbda?"),
        ("memory.budgt_gib=8", "memory.budgt_gib: unknown key; did you mean memory.budget_gib?"),
        ("memory.batch_size=8", "did you mean batch_size (a top-level key)?"),
        ("log_every_n_step=5", "did you mean log_every_n_steps?"),
        ("kd_ration=0.7", "did you mean kd_ratio?"),
    ],
)
def test_unknown_key_suggests_the_key_meant(config, capsys, mistake, line):
    assert main(["validate", "--config", config, mistake]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and line in errors[0], errors


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_overrides_after_flags(config, capsys, command):
    """Overrides anywhere after the flags, in order (the later one wins), as on `kd run`."""
    argv = [command, "--config", config, "memory.check=off", "--budget-gib", "8", "batch_size=abc"]
    assert main(argv) == 2
    assert _errors(capsys) == [
        "kd: error: batch_size: 'abc' is not an integer; set batch_size to an integer >= 1"
    ]
    assert main([command, "--config", config, "batch_size=2", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_overrides_after_flags_keep_their_order(config, capsys):
    argv = ["validate", "--config", config, "batch_size=abc", "--budget-gib", "8", "batch_size=0"]
    assert main(argv) == 2
    assert _errors(capsys) == [
        "kd: error: batch_size: 0 is below the minimum 1; set batch_size to an integer >= 1"
    ]


def test_private_builder_path_suggests_its_public_name(config, capsys):
    private = "torchtune.models.qwen2._component_builders.qwen2"
    assert main(["validate", "--config", config, f"model._component_={private}"]) == 2
    assert _errors(capsys) == [
        f"kd: error: model._component_: {private} is a private module path (a module whose name "
        "starts with _); use its public name torchtune.models.qwen2.qwen2"
    ]


@pytest.mark.parametrize(
    ("value", "shown"), [("5", "5"), ("[a]", "a list"), ("{a: 1}", "a mapping")]
)
def test_component_that_is_not_a_string(config, capsys, value, shown):
    assert main(["validate", "--config", config, f"optimizer._component_={value}"]) == 2
    errors = _errors(capsys)
    assert errors == [
        f"kd: error: optimizer._component_: {shown} is not a string; set it to a dotted path "
        "such as torch.optim.AdamW"
    ], errors


def test_late_value_error_comes_with_missing_files_and_without_torch(config):
    """`optimizer.lr=abc` is read from torch's source, not by importing torch: it is reported in
    the first pass, together with a missing file (not after it is fixed)."""
    argv = [
        "validate",
        "--config",
        config,
        "optimizer.lr=abc",
        "tokenizer.path=/nonexistent/v.json",
    ]
    code, imported, stderr = kd_main_subprocess(argv)
    assert code == 2
    assert imported == [], f"{imported} imported to report a value error"
    assert stderr[0].startswith(
        "kd: error: optimizer.lr: 'abc' is not a number (the default of torch.optim.AdamW's lr "
        "is 0.001); set optimizer.lr to a number"
    ), stderr
    assert stderr[1].startswith("kd: error: tokenizer.path: /nonexistent/v.json does not exist")
    assert len(stderr) == 2


def test_static_signatures_match_the_imported_ones():
    """The source reading agrees with inspect.signature on the targets configs use."""
    import importlib
    import inspect

    from kd.config.checks.signatures import NO_DEFAULT, NOT_LITERAL, static_signature

    for target in (
        "torch.optim.AdamW",
        "torch.optim.SGD",
        "torchtune.models.qwen2.qwen2",
        "torchtune.models.qwen2_5.lora_qwen2_5_3b",
        "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
        "torchtune.training.FullModelHFCheckpointer",
        "kd.hf.lora_causal_lm",
    ):
        module, _, name = target.rpartition(".")
        real = inspect.signature(getattr(importlib.import_module(module), name)).parameters
        read = static_signature(target)
        assert read is not None, target
        for param in read.parameters:
            expected = real[param.name].default
            if param.default is NO_DEFAULT:
                assert expected is inspect.Parameter.empty, (target, param.name)
            elif param.default is not NOT_LITERAL:
                assert param.default == expected, (target, param.name)
    assert static_signature("torch.optim.NoSuchOptimizer") is None
    assert static_signature("no_such_package.x") is None


def test_validate_prints_no_progress_bar(assets, tmp_path):
    """`kd validate` prints the plan and `config OK`; a data file prepared for the first time
    shows no progress bar (and torchao no notice) on stderr."""
    path = write_config(tmp_path / "c.yaml", make_config(assets, tmp_path / "out"))
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "fresh_cache")}
    result = subprocess.run(
        [sys.executable, "-m", "kd.cli", "validate", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "config OK"
    # Only kd's own lines (what the pre-load says, as under kd run): no bar, no library notice.
    lines = result.stderr.splitlines()
    assert all(line.startswith("kd: ") and "error" not in line for line in lines), lines
    assert "%|" not in result.stderr and "Skipping import" not in result.stderr
    assert (tmp_path / "fresh_cache").exists()  # the data file was prepared in this run


def test_every_recipe_is_named_with_one_line(capsys):
    """`kd run --help` names every recipe with one line; `kd ls` says what the recipes that run
    any config (kd, teacher_logits) do, on their row."""
    summaries = {r.name: r.summary for r in registry.list_recipes()}
    assert set(summaries) >= {"kd", "teacher_logits", "kd_single_device", "kd_distributed"}
    assert all(summaries.values()), summaries
    for argv, names in (
        (["run", "--help"], list(summaries)),
        (["ls"], ["kd", "teacher_logits"]),
    ):
        assert main(argv) == 0
        out = capsys.readouterr().out.splitlines()
        for name in names:
            lines = [x for x in out if x.split()[:1] == [name] and summaries[name] in x]
            assert len(lines) == 1, (argv, name, out)


# --- a model folder's config.json fields (kd.config.checks.model_config) -----------------------


def _config_json_lines(fields: dict) -> list[str]:
    from kd.config.checks.model_config import config_json_problems

    return [str(p) for p in config_json_problems("model.path", "/m/config.json", fields)]


_GOOD = {
    "vocab_size": 288,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "rope_scaling": None,
}


def test_config_json_good_fields_pass():
    assert _config_json_lines(_GOOD) == []
    assert (
        _config_json_lines({**_GOOD, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}) == []
    )
    assert _config_json_lines({**_GOOD, "head_dim": None, "max_position_embeddings": 256.0}) == []


@pytest.mark.parametrize(
    ("field", "value", "line"),
    [
        # the file's field and the fix in that file; not "use a torchtune builder", not the tokenizer
        (
            "max_position_embeddings",
            "abc",
            "model.path: /m/config.json: max_position_embeddings is 'abc', not a whole number >= 1; "
            "fix max_position_embeddings in that file (the model's source has the right value)",
        ),
        ("num_attention_heads", 0, "num_attention_heads is 0, not a whole number >= 1"),
        ("tie_word_embeddings", "yes", "tie_word_embeddings is 'yes', not true or false"),
        ("rope_theta", -1, "rope_theta is -1, not a number > 0"),
        (
            "rope_scaling",
            "garbage",
            "model.path: /m/config.json: rope_scaling is 'garbage', not a mapping such as "
            '{"rope_type": "linear", "factor": 8.0} (or null); fix rope_scaling in that file',
        ),
        (
            "rope_scaling",
            {"factor": 8.0},
            "rope_scaling is {'factor': 8.0} has no rope_type string",
        ),
        ("rope_scaling", {"type": "linear", "factor": "x"}, "has factor 'x'; the factor should be"),
    ],
)
def test_config_json_bad_field_is_named_in_its_file(field, value, line):
    lines = _config_json_lines({**_GOOD, field: value})
    assert len(lines) == 1 and line in lines[0], lines
    assert "torchtune" not in lines[0] and "tokenizer" not in lines[0]


def test_config_json_text_config_is_checked():
    lines = _config_json_lines({"text_config": {**_GOOD, "hidden_size": "big"}})
    assert lines == [
        "model.path: /m/config.json: text_config.hidden_size is 'big', not a whole number >= 1; "
        "fix text_config.hidden_size in that file (the model's source has the right value)"
    ]


def test_validate_tells_a_terminal_what_it_checks(assets, tmp_path, capsys, monkeypatch):
    """On a terminal, kd validate says first what the coming seconds (minutes, on a real model's
    data) go to (issue 42)."""
    from kd.cli import main

    path = write_config(tmp_path / "c.yaml", make_config(assets, tmp_path / "out"))
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["validate", "--config", str(path)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "kd: checking the folders, the tokenizer, the data and the memory plan (no weight is read)"
    )
