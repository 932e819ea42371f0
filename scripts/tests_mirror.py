#!/usr/bin/env python3
"""Which test files do not map to a module of src/kd (issue 36: ``tests/`` mirrors ``src/kd``).

A test file maps when its path under ``tests/unit`` (or ``tests/integration``), without the
``test_`` prefix, names a module or package of ``src/kd``: ``tests/unit/teachers/test_served.py``
-> ``kd/teachers/served.py``, ``tests/unit/test_losses.py`` -> ``kd/losses`` (a package); or
that name followed by ``_`` and an aspect (``tests/integration/teachers/test_served_teacher.py``
-> ``kd/teachers/served.py``; file names stay unique across tests/, as pytest needs). Tests of
the repository's own rules (``tests/guards``) and of ``scripts/`` (``tests/scripts``) map to no
module.
Prints one line per file that does not map (and, with ``--modules``, the modules no unit test
file maps to); exits 1 when any file does not map.

Usage: python scripts/tests_mirror.py [--root DIR] [--modules]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def source_modules(src: Path) -> set[tuple[str, ...]]:
    """Every module and package of ``src/kd`` as path parts below ``kd``."""
    out = set()
    for path in (src / "kd").rglob("*.py"):
        parts = path.relative_to(src / "kd").with_suffix("").parts
        out.add(parts[:-1] if parts[-1] == "__init__" else parts)
    return out


def target(test: Path, tests: Path) -> tuple[str, ...]:
    """The module parts a test file names: its folders below unit/ or integration/, then its
    name without ``test_``."""
    parts = test.relative_to(tests).with_suffix("").parts[1:]
    return (*parts[:-1], parts[-1].removeprefix("test_"))


def maps_to(parts: tuple[str, ...], modules: set[tuple[str, ...]]) -> tuple[str, ...] | None:
    """The module ``parts`` names: itself, or the longest module of its folder its name starts
    with followed by ``_`` (an aspect of that module's tests); None when none."""
    if parts in modules:
        return parts
    folder, name = parts[:-1], parts[-1]
    found = [m for m in modules if m[:-1] == folder and m and name.startswith(m[-1] + "_")]
    return max(found, key=lambda m: len(m[-1])) if found else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--modules", action="store_true", help="also list unmapped modules")
    args = parser.parse_args(argv)
    src, tests = args.root / "src", args.root / "tests"
    modules = source_modules(src)
    unmapped, mapped = [], set()
    for kind in ("unit", "integration"):
        for test in sorted((tests / kind).rglob("test_*.py")):
            parts = target(test, tests)
            hit = maps_to(parts, modules)
            if hit is not None:
                mapped.add(hit)
            else:
                unmapped.append(test.relative_to(args.root))
    for test in unmapped:
        print(f"{test}: no module kd/{'/'.join(target(args.root / test, tests))}")
    if args.modules:
        for parts in sorted(modules - mapped):
            if parts and not parts[-1].startswith("_"):
                print(f"kd/{'/'.join(parts)}: no test file maps to it")
    n = len(list(tests.glob("unit/**/test_*.py"))) + len(
        list(tests.glob("integration/**/test_*.py"))
    )
    print(f"{len(unmapped)} of {n} test files do not map to a module of src/kd", file=sys.stderr)
    return 1 if unmapped else 0


if __name__ == "__main__":
    sys.exit(main())
