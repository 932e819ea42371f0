"""Generated inputs: random mutations of a valid config and of the command line.

Every case either runs (exit 0; ``kd plan`` exits 1 when the plan does not fit) or exits 2 with
one ``kd: error: <key or file>: ...; <fix>`` line per problem. Never a traceback, never a changed
file outside ``output_dir`` (the tiny assets, the case's folder and the working directory are
compared before and after).

A seeded generator: case N is always the same input (its id is its seed; rerun one with
``-k "config and 123]"``), and a failure prints the input. The slow suite runs 600 config cases,
300 command-line cases and a few real ``kd run`` cases; the default suite a 30-case subset.
Most cases run in this process through ``kd.cli.main``; every 50th (and one of the default
subset) runs ``python -m kd.cli`` in a subprocess.

Not generated: in-range huge sizes of the model builders (``model.num_layers: 100000`` builds a
huge model on the meta device, slowly, before the memory plan; reported, not a crash), and
``trust_remote_components: true`` (an opted-in component may run anything by design).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kd import cli
from tests.conftest import make_config

FAST_CONFIG = range(0, 20)
FAST_CLI = range(0, 10)
SLOW_CONFIG = range(20, 620)
SLOW_CLI = range(10, 310)
SLOW_RUN = range(0, 6)
SUBPROCESS_EVERY = 50
BUILTIN = "qwen2_5/14B_to_3B_full_single_device"

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """A mutated ``dataset.source`` may name a Hub dataset: fail at once instead of retrying."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


# ----------------------------------------------------------------------------------- values


def values(tmp: Path) -> list[Any]:
    """Values put where another value was: every type, NaN, huge, negative, unicode, paths."""
    return [
        None,
        True,
        False,
        0,
        -1,
        1,
        3,
        2**63,
        -(2**63) - 1,
        10**30,
        0.5,
        -0.5,
        1e-300,
        1e308,
        NAN,
        INF,
        -INF,
        "",
        "abc",
        "ünïcödé 数据 🙂",
        "a\nb",
        "\u202e",
        "${nope}",
        "${oc.env:KD_NO_SUCH_VARIABLE}",
        "???",
        "~",
        "nan",
        "-inf",
        "1e3",
        "x" * 5000,
        "\0",
        [],
        [1, "a", None],
        {},
        {"_component_": "os.system", "command": f"touch {tmp / 'pwned'}"},
        {"_component_": "torch.optim.AdamW"},
        {"a": {"b": [1, 2]}},
        str(tmp / "nope.json"),
        str(tmp),
        "/dev/null",
    ]


def path_values(tmp: Path) -> list[str]:
    """Bad (and a few fine) values for keys that hold paths."""
    return [
        str(tmp / "nope"),
        str(tmp),
        str(tmp / "a_file"),
        str(tmp / "a_file" / "below"),
        str(tmp / ("x" * 300)),
        "x" * 5000,
        "train\0.json",
        "~kd_no_such_user/x",
        "",
        ".",
        "nope.json",
        str(tmp / "ünïcödé.json"),
        str(tmp / "cfg.yaml"),
        "/dev/null",
        "/proc/self/status",
    ]


NUMBERS: list[Any] = [NAN, INF, -INF, 2**63, -(2**63) - 1, 10**40, -1, 0, -(10**6), 1e-300, "nan"]
KEY_NAMES = ["kd_ration", "ünïcödé", "", "_component_", "a.b", "${x}", "1", "k" * 300, "0"]
COMPONENTS = [
    "a.b.c",
    "torch.optim.SGD",
    "torchtune.models.qwen2.qwen2_tokenizer",
    "kd.metrics.StdoutLogger",
    "",
    "os.system",
    "torch.nn.Linear",
    "torchtune.datasets.alpaca_dataset",
]
PATH_KEYS = (
    ("output_dir",),
    ("checkpointer", "checkpoint_dir"),
    ("teacher_checkpointer", "checkpoint_dir"),
    ("checkpointer", "checkpoint_files", 0),
    ("tokenizer", "path"),
    ("tokenizer", "merges_file"),
    ("dataset", "data_files"),
    ("dataset", "source"),
)
# Builder sizes: an in-range huge value builds slowly on the meta device (see the docstring).
SIZE_KEYS = frozenset(
    {"num_layers", "num_heads", "num_kv_heads", "embed_dim", "intermediate_dim", "vocab_size"}
)
PROTECTED = frozenset({"trust_remote_components"})


# ------------------------------------------------------------------------------ tree helpers


def paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into ``node`` (mapping keys and list indices), containers included."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        if key in PROTECTED:
            continue
        out.append((*prefix, key))
        if isinstance(value, dict | list):
            out += paths(value, (*prefix, key))
    return out


def get(node: Any, path: tuple) -> Any:
    for key in path:
        node = node[key]
    return node


def put(node: Any, path: tuple, value: Any) -> None:
    get(node, path[:-1])[path[-1]] = value


def remove(node: Any, path: tuple) -> None:
    parent = get(node, path[:-1])
    del parent[path[-1]]


def exists(node: Any, path: tuple) -> bool:
    try:
        get(node, path)
        return True
    except (KeyError, IndexError, TypeError):
        return False


# -------------------------------------------------------------------------------- mutations


def mutate_config(rng: random.Random, cfg: dict, tmp: Path, *, safe: bool = False) -> list[str]:
    """Apply 1 to 3 random mutations to ``cfg`` in place; returns what was done.

    ``safe``: only in-range changes and removals that keep ``output_dir`` and the paths (the
    ``kd run`` cases write into output_dir).
    """
    done = []
    for _ in range(rng.randint(1, 3)):
        candidates = [p for p in paths(cfg) if not (safe and _writes(p))]
        if not candidates:
            break
        path = rng.choice(candidates)
        kind = rng.choice(
            ["numbers", "delete", "insert"]
            if safe
            else [
                "retype",
                "retype",
                "delete",
                "insert",
                "nest",
                "path",
                "numbers",
                "list",
                "unicode",
                "component",
            ]
        )
        if kind == "retype":
            value = rng.choice(values(tmp))
            if path[-1] in SIZE_KEYS and isinstance(value, int) and abs(value) > 4096:
                value = 2**63  # beyond int64: refused before any build
            put(cfg, path, copy.deepcopy(value))
            done.append(f"{_dotted(path)} = {_short(value)}")
        elif kind == "delete":
            remove(cfg, path)
            done.append(f"delete {_dotted(path)}")
        elif kind == "insert":
            target = get(cfg, path[:-1])
            if not isinstance(target, dict):
                target, path = cfg, (path[0],)
            name = rng.choice(KEY_NAMES)
            value = rng.choice([1, "x", None, [1], {"k": 1}]) if safe else rng.choice(values(tmp))
            target[name] = copy.deepcopy(value)
            done.append(f"insert {_dotted((*path[:-1], name))} = {_short(value)}")
        elif kind == "nest":
            scalar = [
                k for k, v in cfg.items() if not isinstance(v, dict | list) and k not in PROTECTED
            ]
            nodes = [k for k, v in cfg.items() if isinstance(v, dict)]
            how = rng.choice(["move", "wrap", "unwrap"])
            if how == "move" and scalar and nodes:
                key, into = rng.choice(scalar), rng.choice(nodes)
                cfg[into][key] = cfg.pop(key)
                done.append(f"move {key} into {into}")
            elif how == "wrap":
                put(cfg, path, {"value": copy.deepcopy(get(cfg, path))})
                done.append(f"wrap {_dotted(path)}")
            else:
                value = get(cfg, path)
                inner = next(iter(value.values())) if isinstance(value, dict) and value else 1
                put(cfg, path, copy.deepcopy(inner))
                done.append(f"unwrap {_dotted(path)}")
        elif kind == "path":
            key = rng.choice([p for p in PATH_KEYS if exists(cfg, p[:-1])] or [("output_dir",)])
            value = rng.choice(path_values(tmp))
            target = get(cfg, key[:-1])
            if isinstance(target, list):
                index = key[-1] if isinstance(key[-1], int) else 0
                target[index : index + 1] = [value]
            elif isinstance(target, dict):
                target[key[-1]] = value
            done.append(f"{_dotted(key)} = {_short(value)}")
        elif kind == "numbers":
            numeric = [
                p
                for p in candidates
                if isinstance(get(cfg, p), int | float) and not isinstance(get(cfg, p), bool)
            ]
            path = rng.choice(numeric or [path])
            old = get(cfg, path)
            if safe:
                value = rng.choice([old, 1, 2, 0.25]) if isinstance(old, int | float) else old
            else:
                value = rng.choice(NUMBERS)
                if path[-1] in SIZE_KEYS and isinstance(value, int) and abs(value) > 4096:
                    value = 2**63
            put(cfg, path, value)
            done.append(f"{_dotted(path)} = {_short(value)}")
        elif kind == "list":
            value = get(cfg, path)
            new = value[0] if isinstance(value, list) and value else [value, value]
            put(cfg, path, copy.deepcopy(new))
            done.append(f"{_dotted(path)} = {_short(new)}")
        elif kind == "unicode":
            value = rng.choice(["ünïcödé", "数据集", "🙂", "\u202e\u0000", "a\tb\nc", "Ω" * 200])
            put(cfg, path, value)
            done.append(f"{_dotted(path)} = {_short(value)}")
        else:
            component = [p for p in paths(cfg) if p[-1] == "_component_"]
            path = rng.choice(component or [path])
            value = rng.choice(COMPONENTS)
            put(cfg, path, value)
            done.append(f"{_dotted(path)} = {value!r}")
    return done


def _writes(path: tuple) -> bool:
    return (
        path[0] == "output_dir"
        or "output_dir" in path
        or (
            len(path) > 1
            and path[1] in ("checkpoint_dir", "checkpoint_files", "path", "merges_file")
        )
    )


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def write_text_mutation(rng: random.Random, text: str, path: Path) -> str:
    """Write the config file with a mutation of its bytes; returns what was done."""
    kind = rng.choice(["truncate", "latin1", "utf16", "byte", "indent", "equals", "bom", "tab"])
    data = text.encode()
    if kind == "truncate":
        data = data[: rng.randrange(len(data))]
    elif kind == "latin1":
        data = (text + "\nnote: café\n").encode("latin-1")
    elif kind == "utf16":
        data = text.encode("utf-16")
    elif kind == "byte":
        at = rng.randrange(len(data))
        data = data[:at] + bytes([rng.randrange(256)]) + data[at:]
    elif kind in ("indent", "equals", "tab"):
        lines = text.splitlines()
        i = rng.randrange(len(lines))
        if kind == "indent":
            lines[i] = "   " + lines[i]
        elif kind == "equals":
            lines[i] = lines[i].replace(":", " =", 1)
        else:
            lines[i] = "\t" + lines[i]
        data = "\n".join(lines).encode()
    else:
        data = "\ufeff".encode() + data
    path.write_bytes(data)
    return f"file: {kind}"


# ----------------------------------------------------------------------------- command line

OVERRIDE_KEYS = [
    "batch_size",
    "kd_ratio",
    "temperature",
    "seed",
    "epochs",
    "dtype",
    "device",
    "clip_grad_norm",
    "memory.budget_gib",
    "memory.check",
    "memory.reserve_gib",
    "optimizer.lr",
    "optimizer._component_",
    "tokenizer.max_seq_len",
    "dataset.data_files",
    "checkpointer.checkpoint_files.0",
    "checkpointer.checkpoint_files.3",
    "model.lora_attn_modules.0",
    "kd_loss",
    "kd_loss.beta",
    "lr_scheduler",
    "fsdp.reduce_dtype",
    "gradient_accumulation_steps",
    "kd_ration",
    "ключ",
    "a..b",
    "model",
    "dataset.0.source",
]
VALUE_TEXTS = [
    "1",
    "0",
    "-1",
    "2",
    "0.5",
    "nan",
    ".nan",
    "inf",
    "-.inf",
    "1e400",
    "99999999999999999999",
    "9" * 5000,
    "abc",
    "null",
    "true",
    "[1,2]",
    "{a: 1}",
    "'quoted'",
    "${nope}",
    "[",
    "}",
    "=",
    "ünïcödé",
    "x" * 3000,
    "torch.optim.SGD",
]
BUDGETS = ["24", "16", "0", "-1", "nan", "inf", "-inf", "1e-9", "abc", "", "1e400", "0x10"]
WORLDS = ["1", "2", "0", "-3", "abc", "", "99999999999999999999", "1.5", "4"]
FLAGS = ["--unknown", "-x", "--budget", "--world", "--config=", "--json", "--fit", "--force"]
# Always refused: the `kd run` cases of the command-line fuzz must not start training.
BAD_OVERRIDES = ["kd_ratio=2", "batch_size=0", "~nokey", "=1", "seed=nan", "dtype=fp8", "a..b=1"]


def random_override(rng: random.Random) -> str:
    key, value = rng.choice(OVERRIDE_KEYS), rng.choice(VALUE_TEXTS)
    return rng.choice(
        [f"{key}={value}"] * 6 + [f"~{key}", key, f"{key}=={value}", "=", "~", value, f"{key}="]
    )


@dataclass
class Case:
    """One generated input: the argv (``{cfg}`` is the config file) and where it may write."""

    argv: list[str]
    what: list[str] = field(default_factory=list)
    writes: list[Path] = field(default_factory=list)
    command: str = ""


def cli_case(rng: random.Random, tmp: Path) -> Case:
    """A random command line of run, validate, plan or cp (under ``tmp``)."""
    dest = tmp / "dest"
    command = rng.choice(["validate", "plan", "plan", "run", "cp"])
    if command == "cp":
        name = rng.choice(
            [BUILTIN, BUILTIN + ".yaml", "qwen2_5/14B_to_3B_full_singl", "", "../../etc/passwd"]
        )
        to = rng.choice(
            [
                dest / "my.yaml",
                dest / "my",
                dest,
                dest / "deep" / "er" / "x.yaml",
                tmp / "a_file" / "x.yaml",
                tmp / ("x" * 300),
                dest / "ünïcödé.yaml",
            ]
        )
        argv = ["cp", name, str(to)] + (["--force"] if rng.random() < 0.3 else [])
        # Where kd cp puts it: into a folder, or the path with .yaml added when it has no suffix.
        target = to / f"{Path(BUILTIN).name}.yaml" if to == dest else to
        target = target if target.suffix else target.with_suffix(".yaml")
        return Case(argv, writes=[target], command="cp")
    if command == "run":
        recipe = rng.choice(["kd_single_device", "kd_distributed", "kd", "kd_singel", ""])
        torchrun: list[str] = []
        if recipe != "kd_single_device" and rng.random() < 0.6:
            option, value = rng.choice(
                [
                    ("--nproc_per_node", rng.choice(["0", "-1", "abc", "", "1.5", "2"])),
                    ("--nnodes", rng.choice(["0", "2:1", "a:b", "1:2:3", "1"])),
                    ("--master_port", rng.choice(["abc", "-1", "29500"])),
                    ("--max_restarts", rng.choice(["-1", "x", "0"])),
                    ("--bogus", "1"),
                ]
            )
            torchrun = [option, value] if rng.random() < 0.8 else [f"{option}={value}"]
        rest = ["--config", "{cfg}", *(random_override(rng) for _ in range(rng.randint(0, 2)))]
        rest.insert(rng.randint(2, len(rest)), rng.choice(BAD_OVERRIDES))
        return Case(["run", *torchrun, recipe, *rest], command="run")
    argv = [command]
    config = rng.random()
    if config < 0.85:
        argv += ["--config", "{cfg}"]
    elif config < 0.9:
        argv += ["--config", rng.choice(["", str(tmp), str(tmp / "nope.yaml"), "ünï", "x" * 300])]
    writes: list[Path] = []
    for _ in range(rng.randint(0, 4)):
        pick = rng.random()
        if pick < 0.4:
            argv.append(random_override(rng))
        elif pick < 0.55:
            argv += ["--budget-gib", rng.choice(BUDGETS)]
        elif pick < 0.7:
            flag = rng.choice(["--world-size", "--nproc_per_node", "--nproc-per-node"])
            argv += [flag, rng.choice(WORLDS)]
        elif pick < 0.85 and command == "plan":
            plot = rng.choice(
                [
                    dest / "plan.png",
                    dest / "plan.svg",
                    dest / "sub" / "plan.png",
                    dest,
                    tmp / "a_file" / "plan.png",
                    dest / "plan.txt",
                    tmp / ("x" * 300 + ".png"),
                    dest / "ünïcödé.png",
                ]
            )
            writes.append(plot)
            argv += ["--plot", str(plot)]
        else:
            argv.append(rng.choice(FLAGS))
    return Case(argv, writes=writes, command=command)


# ------------------------------------------------------------------------------- checking


def snapshot(folder: Path, skip: tuple[Path, ...] = ()) -> dict[str, str]:
    """Every file and folder under ``folder`` (but ``skip``) with a hash of its bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if any(p == s or s in p.parents for s in skip):
            continue
        out[p.relative_to(folder).as_posix()] = (
            "dir" if p.is_dir() else hashlib.sha1(p.read_bytes()).hexdigest()
        )
    return out


@dataclass
class World:
    """What must not change: the assets, the case's folder (but output_dir), the working dir."""

    assets: dict[str, str]
    tmp: dict[str, str]
    cwd: list[str]


def world(assets_root: Path, tmp: Path, skip: tuple[Path, ...]) -> World:
    return World(snapshot(assets_root), snapshot(tmp, skip), sorted(os.listdir(os.getcwd())))


def check(code: Any, out: str, err: str, case: Case, what: str) -> None:
    """Exit 0 (or 1 for plan), or 2 with one `kd: error:` line per problem; no traceback."""
    context = (
        f"{what}\nargv: {[_short(a, 200) for a in case.argv]}\nexit {code}\nstderr:\n{err[-3000:]}"
    )
    assert "Traceback" not in err and "Traceback" not in out, context
    assert not any(line.startswith('  File "') for line in err.splitlines()), context
    errors = [line for line in err.splitlines() if line.startswith("kd: error:")]
    if code == 0 or (code == 1 and case.command == "plan"):
        assert not errors, context
        return
    assert code == 2, context
    assert errors, context
    if errors[0].startswith("kd: error: memory: the plan needs"):
        return  # the plan table follows, line by line
    assert len(errors) == len(set(errors)), f"a problem reported twice\n{context}"
    for line in errors:
        body = line.removeprefix("kd: error: ")
        assert body.strip() and "; " in body, f"not '<what>: <problem>; <fix>': {line}\n{context}"


def run_in_process(argv: list[str], capsys, what: str) -> tuple[Any, str, str]:
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except BaseException as e:  # noqa: BLE001 - any escape is the failure this test looks for
        out, err = capsys.readouterr()
        raise AssertionError(
            f"kd.cli.main raised {type(e).__name__}: {e}\n{what}\nargv: {argv}\n{err[-2000:]}"
        ) from e
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(argv: list[str]) -> tuple[Any, str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "kd.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return proc.returncode, proc.stdout, proc.stderr


def prepare(tmp: Path) -> None:
    (tmp / "a_file").write_text("not a folder")
    (tmp / "dest").mkdir()


def execute(case: Case, cfg_path: Path, assets: dict, tmp: Path, capsys, subprocess_: bool) -> None:
    argv = [a.replace("{cfg}", str(cfg_path)) for a in case.argv]
    skip = (tmp / "run", tmp / "dest")
    root = Path(assets["data"]).parent
    before = world(root, tmp, skip)
    dest_before = snapshot(tmp / "dest")
    what = "; ".join(case.what) or "command line"
    code, out, err = run_subprocess(argv) if subprocess_ else run_in_process(argv, capsys, what)
    check(code, out, err, case, what)
    after = world(root, tmp, skip)
    assert after.assets == before.assets, f"the assets changed\n{what}\n{argv}"
    assert after.tmp == before.tmp, f"a file outside output_dir changed\n{what}\n{argv}"
    assert after.cwd == before.cwd, f"the working directory changed\n{what}\n{argv}"
    assert not (tmp / "pwned").exists()
    # Under dest only what the command was asked to write, and only when it succeeded.
    new = set(snapshot(tmp / "dest")) - set(dest_before)
    allowed = {
        p.relative_to(tmp / "dest").as_posix()
        for w in case.writes
        for p in (w, *w.parents)
        if (tmp / "dest") in p.parents
    }
    assert new <= allowed, f"unexpected files {new - allowed}\n{what}\n{argv}"
    if code == 2:
        assert not any((tmp / "dest" / n).is_file() for n in new), (
            f"wrote despite the error\n{argv}"
        )


# ---------------------------------------------------------------------------------- tests


def config_case(n: int, assets: dict, tmp: Path, capsys) -> None:
    rng = random.Random(f"config-{n}")
    prepare(tmp)
    cfg = make_config(assets, tmp / "run")
    what = mutate_config(rng, cfg, tmp)
    cfg_path = tmp / "cfg.yaml"
    text = yaml.safe_dump(cfg, sort_keys=False, allow_unicode=rng.random() < 0.5)
    if rng.random() < 0.15:
        what.append(write_text_mutation(rng, text, cfg_path))
    else:
        cfg_path.write_text(text, encoding="utf-8")
    command = rng.choice(["validate", "plan"])
    argv = [command, "--config", "{cfg}"]
    if rng.random() < 0.3:
        argv.append(random_override(rng))
    case = Case(argv, what=what, command=command)
    execute(case, cfg_path, assets, tmp, capsys, subprocess_=n % SUBPROCESS_EVERY == 7)


def command_line_case(n: int, assets: dict, tmp: Path, capsys) -> None:
    rng = random.Random(f"cli-{n}")
    prepare(tmp)
    cfg_path = tmp / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(make_config(assets, tmp / "run"), sort_keys=False))
    case = cli_case(rng, tmp)
    execute(case, cfg_path, assets, tmp, capsys, subprocess_=n % SUBPROCESS_EVERY == 3)


@pytest.mark.parametrize("n", FAST_CONFIG)
def test_config_mutation(n, assets, tmp_path, capsys):
    config_case(n, assets, tmp_path, capsys)


@pytest.mark.parametrize("n", FAST_CLI)
def test_command_line(n, assets, tmp_path, capsys):
    command_line_case(n, assets, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("n", SLOW_CONFIG)
def test_config_mutation_slow(n, assets, tmp_path, capsys):
    config_case(n, assets, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("n", SLOW_CLI)
def test_command_line_slow(n, assets, tmp_path, capsys):
    command_line_case(n, assets, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("n", SLOW_RUN)
def test_run_mutation(n, assets, tmp_path, capsys):
    """``kd run`` of a config changed within its ranges (or with a key removed or added): it
    trains one step, or refuses with one line per problem."""
    rng = random.Random(f"run-{n}")
    prepare(tmp_path)
    cfg = make_config(assets, tmp_path / "run", max_steps_per_epoch=1)
    what = mutate_config(rng, cfg, tmp_path, safe=True)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    case = Case(["run", "kd_single_device", "--config", "{cfg}"], what=what, command="run")
    execute(case, cfg_path, assets, tmp_path, capsys, subprocess_=n == 0)
    if (tmp_path / "run" / "metrics.jsonl").exists():
        rows = [
            json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        ]
        assert all(math.isfinite(r["loss"]) for r in rows), rows


def test_generator_is_deterministic(tmp_path, assets):
    """A case id names one input: the same seed makes the same mutations and command line."""
    for n in (0, 7, 123):
        first = make_config(assets, tmp_path / "run")
        second = copy.deepcopy(first)
        assert mutate_config(random.Random(f"config-{n}"), first, tmp_path) == mutate_config(
            random.Random(f"config-{n}"), second, tmp_path
        )
        assert yaml.safe_dump(first) == yaml.safe_dump(second)
        assert (
            cli_case(random.Random(f"cli-{n}"), tmp_path).argv
            == cli_case(random.Random(f"cli-{n}"), tmp_path).argv
        )
