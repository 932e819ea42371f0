"""The README's commands that need no model weights run as written, and what it shows of their
output is what they print (issue 42: docs that run as written)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from kd.cli import main

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _tour() -> list[list[str]]:
    """The Tour's ``kd ls`` / ``kd cp`` / ``kd plan`` lines (validate and run need weights)."""
    block = README.split("## Tour", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("  #")[0].strip() for line in block.splitlines()]
    return [shlex.split(c)[1:] for c in commands if re.match(r"kd (ls|cp|plan)\b", c)]


def test_the_tour_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    commands = _tour()
    assert [c[0] for c in commands] == ["ls", "cp", "plan", "plan"]
    for argv in commands:
        # `kd plan --fit` exits 1 when the config does not fit the budget (it lists what would).
        assert main(argv) in ((0, 1) if "--fit" in argv else (0,)), argv
        assert "kd: error" not in capsys.readouterr().err
    assert (tmp_path / "my_kd.yaml").is_file()


def test_the_plan_shown_is_what_kd_plan_prints(capsys):
    shown = README.split("```\n$ kd plan ", 1)[1].split("```", 1)[0].splitlines()
    argv = ["plan", *shlex.split(shown[0])]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    for line in shown[1:]:
        if line.strip() == "...":
            continue
        if line.endswith("; ..."):  # cut short in the README
            assert any(p.startswith(line[: -len(" ...")]) for p in printed), line
        else:
            assert line in printed, line


# ----------------------------------------------- every doc's kd commands parse as written
REPO = Path(__file__).resolve().parents[2]
# An inline command complete enough to type: a command and the flag it cannot do without.
_INLINE = re.compile(
    r"`(kd (?:init --(?:teacher|self) |plan --config|validate --config|eval --model|generate "
    r"--model|run [a-z_]+ --config)[^`]*)`"
)


def _joined(block: str) -> list[str]:
    lines: list[str] = []
    for line in block.splitlines():
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1].rstrip() + " " + line.strip()
        else:
            lines.append(line)
    return lines


def doc_kd_commands(text: str) -> list[str]:
    """The ``kd`` commands a page tells the user to type: every ``kd`` line of a ``bash`` block,
    every ``$ kd`` line of an output block, and complete inline ones (``[--flag]`` optional
    parts kept as flags); comments cut off, commands with ``<placeholders>`` left out."""
    commands: list[str] = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        for line in _joined(block):
            line = line.strip()
            if lang in ("", "console") and line.startswith("$ kd "):
                line = line[2:]
            elif lang != "bash" or not line.startswith("kd "):
                continue
            commands.append(line.split(" #")[0].strip())
    inline = [" ".join(m.split()) for m in _INLINE.findall(text)]
    # kd init named with a flag or two (`kd init --self --lora`) is not a command to type.
    commands += [c for c in inline if not c.startswith("kd init") or " --student " in c]
    return [
        # [--flag] is a flag; CONFIG, K... stand for a value (1 is a value of every flag).
        re.sub(
            r"(?<= )[A-Z][A-Z_]*(?= |\]|$)", "1", re.sub(r"\[(--[^\]]+)\]", r"\1", c)
        ).removesuffix(" ...")
        for c in commands
        if "<" not in c and "..." not in c.removesuffix(" ...")
    ]


def _override_problem(item: str) -> str | None:
    """What is wrong with an override's key: a top-level key or a section's key kd does not
    have (a component's own arguments, ``optimizer.lr``, are checked by kd validate)."""
    from kd.config import schema

    key = item.removeprefix("~").split("=", 1)[0]
    head, _, rest = key.partition(".")
    if head not in schema.TOP_LEVEL:
        return f"{head}: no such key"
    section = schema.SECTIONS.get(head)
    if section is not None and rest and rest.split(".")[0] not in section:
        return f"{key}: no such key of {head}"
    return None


def _parse(command: str) -> list[str]:
    """The problems of one ``kd`` command, parsed as kd parses it (nothing runs)."""
    from kd import cli
    from kd.config.builtin import find_recipe
    from kd.runtime.launch import split_config_args

    argv = shlex.split(command)[1:]
    parser, _ = cli._build_parser()
    try:
        if argv[0] == "run":
            tokens = argv[1:]
            start = cli._split_torchrun_args(tokens)[1] if tokens[0].startswith("-") else 0
            find_recipe(tokens[start])
            cli._check_recipe_options(tokens[start + 1 :])
            overrides = split_config_args(tokens[start + 1 :])[1]
        else:
            overrides = getattr(cli._parse_with_overrides(parser, argv), "overrides", None) or []
    except (cli._UsageError, cli.KDUserError) as e:
        return [str(e)]
    return [p for p in map(_override_problem, overrides) if p is not None]


def test_every_docs_kd_command_parses():
    """Each ``kd`` command of README.md and docs/*.md has the flags its command takes (the
    required ones too) and override keys kd has; the README's deliberate mistake is the one
    exception. (kd init's example once lacked --output-dir and --config-out.)"""
    problems = []
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    commands = {(page.name, c) for page in pages for c in doc_kd_commands(page.read_text())}
    assert len(commands) > 60
    for page, command in sorted(commands):
        if page == "errors.md" or "kd_ration=" in command:
            continue  # commands that show a mistake
        problems += [f"{page}: {command}: {p}" for p in _parse(command)]
    assert not problems, "\n".join(problems)
