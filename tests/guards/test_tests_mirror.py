"""scripts/tests_mirror.py: which test files do not map to a module of src/kd."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tests_mirror.py"


def _load():
    spec = importlib.util.spec_from_file_location("tests_mirror", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_it_names_each_test_file_without_a_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sources = ("src/kd/__init__.py", "src/kd/losses/__init__.py", "src/kd/teachers/served.py")
    for name in (*sources, "src/kd/models.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    for name in (
        "tests/unit/test_losses.py",
        "tests/unit/teachers/test_served.py",
        "tests/unit/test_served.py",
        "tests/integration/test_resume.py",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert _load().main(["--root", str(tmp_path), "--modules"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "tests/unit/test_served.py: no module kd/served",
        "tests/integration/test_resume.py: no module kd/resume",
        "kd/models: no test file maps to it",
    ]


def test_an_aspect_of_a_module_maps_to_it(tmp_path: Path) -> None:
    """``test_<module>_<aspect>.py`` in the module's folder maps to it; another folder does not."""
    for name in ("src/kd/__init__.py", "src/kd/teachers/served.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "tests/unit").mkdir(parents=True)
    (tmp_path / "tests/integration/teachers").mkdir(parents=True)
    (tmp_path / "tests/integration/teachers/test_served_teacher.py").write_text("")
    assert _load().main(["--root", str(tmp_path)]) == 0
    (tmp_path / "tests/integration/test_served_teacher.py").write_text("")
    assert _load().main(["--root", str(tmp_path)]) == 1


def test_tests_mirror_src() -> None:
    """Every unit and integration test file of this repository maps to a module of src/kd."""
    assert _load().main([]) == 0
