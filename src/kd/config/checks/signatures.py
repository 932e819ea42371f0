"""The parameters of a ``_component_`` target, read from its source file without importing it.

Importing ``torch.optim.AdamW`` to learn that ``lr`` is a number costs seconds (torch); reading
``torch/optim/adamw.py`` with :mod:`ast` costs milliseconds and runs nothing. The schema pass uses
it so that a value of the wrong type (``optimizer.lr: abc``) is reported at once, together with
missing files, instead of after them. Only plain cases are followed (a ``def`` or a class's
``__init__`` in the module, reached through ``from x import name`` re-exports); anything else
answers None and the component pass, which imports the target, checks it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NO_DEFAULT = object()  # a parameter without a default
_NOT_LITERAL = object()  # a default that is an expression, not a literal

_MAX_HOPS = 8  # re-exports followed at most (a cycle of imports ends here)


@dataclass(frozen=True)
class Parameter:
    """One parameter of a callable, as its source declares it.

    Attributes:
        name: the parameter's name.
        default: its literal default, ``NO_DEFAULT`` or ``NOT_LITERAL``.
        keyword: it can be passed by keyword (not ``*args``, ``**kwargs`` or positional-only).
    """

    name: str
    default: Any
    keyword: bool = True


NO_DEFAULT = _NO_DEFAULT
NOT_LITERAL = _NOT_LITERAL


@dataclass(frozen=True)
class Signature:
    """The parameters of a callable and whether it takes ``**kwargs`` (any keyword binds)."""

    parameters: tuple[Parameter, ...]
    var_keyword: bool

    def get(self, name: str) -> Parameter | None:
        """The keyword parameter ``name``, or None."""
        return next((p for p in self.parameters if p.name == name and p.keyword), None)


def _module_file(module: str) -> Path | None:
    """The source file of ``module``, found without importing it or its parents."""
    parts = module.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if len(parts) == 1:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    for root in spec.submodule_search_locations or []:
        base = Path(root).joinpath(*parts[1:])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


@functools.lru_cache(maxsize=256)
def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_self: bool) -> Signature:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[Any] = [_NO_DEFAULT] * (len(positional) - len(args.defaults))
    defaults += [_literal(d) for d in args.defaults]
    params = [
        Parameter(a.arg, d, keyword=i >= len(args.posonlyargs))
        for i, (a, d) in enumerate(zip(positional, defaults, strict=True))
    ]
    params += [
        Parameter(a.arg, _NO_DEFAULT if d is None else _literal(d))
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if drop_self and params:
        params = params[1:]
    return Signature(tuple(params), var_keyword=args.kwarg is not None)


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's statements, with those inside ``try`` / ``if`` blocks (guarded imports)."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.Try):
            out += _statements(stmt.body)
        elif isinstance(stmt, ast.If):
            out += _statements(stmt.body) + _statements(stmt.orelse)
    return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _resolve(module: str, name: str, hops: int) -> Signature | None:
    path = _module_file(module)
    tree = _parse(path) if path is not None else None
    if tree is None or hops > _MAX_HOPS:
        return None
    for stmt in reversed(_statements(tree.body)):  # the last definition wins
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
            return _signature(stmt, drop_self=False)
        if isinstance(stmt, ast.ClassDef) and stmt.name == name:
            for item in stmt.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return _signature(item, drop_self=True)
            return None  # inherited __init__: not followed
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    source = _absolute(module, path.name == "__init__.py", stmt)
                    return _resolve(source, alias.name, hops + 1)
        if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.Import):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else []
            if isinstance(stmt, ast.AnnAssign):
                targets = [stmt.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return None  # bound to an expression: not followed
    return None


def static_signature(target: str) -> Signature | None:
    """The signature of the callable the dotted path ``target`` names, from source, or None.

    Nothing is imported or executed: the target's package is located with
    :func:`importlib.util.find_spec` of its top-level name and its files are parsed.

    Args:
        target: a ``_component_`` path (``torch.optim.AdamW``).

    Returns:
        The signature, or None when it cannot be read without importing (C extensions,
        assignments, inherited constructors...).
    """
    module, _, name = target.rpartition(".")
    return _resolve(module, name, 0) if module and name else None
