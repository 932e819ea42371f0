"""Every feature is found from the command line: ``kd --help``, ``kd run --help``, ``kd ls`` and
``kd init --help`` name each config section and the page that describes it (issue 42)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kd.cli import main
from kd.cli.features import FEATURES, doc_of, feature_lines
from kd.config.schema import SECTIONS, TOP_LEVEL

REPO = Path(__file__).resolve().parents[3]


def _out(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 0, argv
    return capsys.readouterr().out


def test_every_config_section_is_reachable_from_the_cli(capsys):
    shown = {
        " ".join(argv): _out(argv, capsys)
        for argv in (["--help"], ["run", "--help"], ["ls"], ["init", "--help"])
    }
    for section in SECTIONS:
        # Each section is named where a newcomer looks first, beside its page.
        for where in ("--help", "run --help", "ls"):
            lines = [line for line in shown[where].splitlines() if f"{section}:" in line]
            assert lines, f"kd {where} never names the section {section}:"
            assert any(doc_of(section) in line for line in lines), (section, where)
    for section in ("teachers", "teacher_server", "self_teacher", "cross_tokenizer"):
        assert f"{section}:" in shown["init --help"] and doc_of(section) in shown["init --help"]


def test_the_features_newcomers_missed_are_on_kd_help(capsys):
    text = _out(["--help"], capsys)
    for words in (
        "several teachers",
        "served teacher",
        "on-policy distillation",
        "hidden-state distillation",
        "self-distillation",
        "docs/",
    ):
        assert words in text


def test_every_feature_page_exists_and_sections_are_declared():
    for feature in FEATURES:
        assert (REPO / feature.doc).is_file(), feature.doc
        for section in feature.sections:
            assert section in TOP_LEVEL, section  # no pointer to a key kd does not have


def test_the_commands_a_feature_names_take_what_it_gives_them():
    """A feature's ``kd <command> ...`` gives that command only flags it has, and a bare value
    only where the command takes one (``kd eval MODEL_DIR`` once stood for ``--model DIR``)."""
    from kd import cli

    commands = cli._subparsers(cli._build_parser()[0])
    for feature in FEATURES:
        for part in feature.how.split(";"):
            words = part.split()
            if words[:1] != ["kd"]:
                continue
            parser = commands[words[1]]
            flags = {o: a for a in parser._actions for o in a.option_strings}
            positionals = [a for a in parser._actions if not a.option_strings]
            value_due = False
            for word in words[2:]:
                if word.startswith("--"):
                    assert word in flags, (feature.name, word)
                    value_due = flags[word].nargs != 0
                elif word != "...":
                    assert value_due or positionals, (feature.name, word)
                    value_due = False


def test_a_narrow_terminal_gets_two_lines_a_feature_and_a_wide_one_the_table():
    wide = feature_lines(width=400)
    assert len(wide) == len(FEATURES)
    narrow = feature_lines(width=80)
    assert len(narrow) == 2 * len(FEATURES)
    for feature, (name, how) in zip(
        FEATURES, zip(narrow[::2], narrow[1::2], strict=True), strict=True
    ):
        assert name.strip() == feature.name
        assert feature.how in how and how.rstrip().endswith(feature.doc)
    # Only a way to turn a feature on longer than the terminal wraps there.
    assert all(len(line) <= 80 for line in narrow if len(line.strip()) < 70)


def test_help_piped_to_a_file_keeps_the_table(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    text = _out(["--help"], capsys)
    assert sum(feature.name in text and feature.doc in text for feature in FEATURES) == len(
        FEATURES
    )
    monkeypatch.setenv("COLUMNS", "80")
    narrow = _out(["--help"], capsys)
    assert f"  {FEATURES[0].name}\n" in narrow
