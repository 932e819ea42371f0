"""Build objects from ``_component_`` nodes, limited to what each config key may build.

``_component_: dotted.path`` runs code named by a config file, so a config written by someone else
could execute anything importable. Each key may build only the targets
:mod:`kd.config.allowlist` lists for it (an ``optimizer`` builds optimizers); anything else is
refused, before it is imported, unless the config opts in with ``trust_remote_components: true``
(docs/security.md).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kd.config.allowlist import allowed, target_problem, tree_problems
from kd.errors import KDUserError


def _quiet_import(name: str) -> Any:
    # torchao's notice about its C++ extensions is filtered in kd/__init__.py.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def locate_target(target: Any, *, key: str, trust: bool) -> tuple[Any, str | None]:
    """Import the object ``key``'s ``_component_`` names, if ``key`` may build it.

    The allow-list is checked first (:func:`kd.config.allowlist.target_problem`), so a refused
    target is never imported.

    Args:
        target: dotted path, e.g. ``torchtune.models.qwen2_5.qwen2_5_3b``.
        key: the config key whose allow-list applies (``optimizer``, ``dataset.message_transform``).
        trust: the config's ``trust_remote_components``: any importable target is allowed.

    Returns:
        ``(object, None)`` on success, or ``(None, message)`` where the message says what is
        wrong and ends with the fix (without the key, which the caller knows).
    """
    reason = target_problem(key, target, trust=trust)
    if reason is not None:
        return None, reason
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = _quiet_import(module_name)
        except ModuleNotFoundError as e:
            # Only "this prefix is not a module" means: try a shorter prefix. A module that
            # exists but fails to import its own dependency is a real error.
            if e.name is not None and (
                module_name == e.name or module_name.startswith(e.name + ".")
            ):
                continue
            return None, f"importing {module_name} failed ({e}); install the missing package"
        except Exception as e:  # noqa: BLE001 - any import-time failure is reported, not raised
            return (
                None,
                f"importing {module_name} failed ({type(e).__name__}: {e}); fix that module",
            )
        for j in range(i, len(parts)):
            attr = parts[j]
            if not hasattr(obj, attr):
                where = ".".join(parts[:j])
                close = difflib.get_close_matches(
                    attr, [n for n in dir(obj) if not n.startswith("_")], n=1
                )
                fix = f"did you mean {where}.{close[0]}?" if close else "fix the dotted path"
                return None, f"{target} not found: {where} has no {attr}; {fix}"
            obj = getattr(obj, attr)
        return obj, None
    return None, f"{target} not found: no module named {parts[0]}; fix the dotted path"


def unknown_kwargs(obj: Any, kwargs: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """Keyword arguments that do not bind to ``obj``'s signature.

    Args:
        obj: a callable (function or class).
        kwargs: the node's keys other than ``_component_``.

    Returns:
        ``(name, closest valid name or None)`` for each argument that does not bind; empty when
        the signature cannot be inspected or takes ``**kwargs``.
    """
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    try:
        sig.bind_partial(**kwargs)
        return []
    except TypeError:
        pass
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [n for n, p in sig.parameters.items() if p.kind in kinds]
    out = []
    for name in kwargs:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            out.append((name, close[0] if close else None))
    return out


def _node_key(node: Any) -> str:
    if isinstance(node, DictConfig):
        key = node._get_full_key(None)
        if key:
            return str(key)
    return "<node>"


def instantiate(
    node: Any, *args: Any, key: str | None = None, trust: bool = False, **kwargs: Any
) -> Any:
    """Build ``node._component_`` with the node's other keys plus ``kwargs`` as keyword arguments.

    Every target in the node (its own and its nested nodes') is checked against what its key may
    build before anything is imported. Nested mappings that have their own ``_component_`` are
    built first, with their nested key (``dataset.message_transform``), so a dataset node can
    carry, e.g., a message transform.

    Args:
        node: a ``DictConfig`` or mapping with ``_component_``; ``None`` returns ``None`` (an
            optional component such as ``lr_scheduler: null``).
        *args: positional runtime arguments, e.g. ``model.parameters()`` for an optimizer.
        key: the node's config key (``optimizer``, ``dataset``...): it decides what the node
            may build and is named in messages. Default: the full key of a ``DictConfig`` node
            inside a config; a node without one needs ``key``.
        trust: the config's ``trust_remote_components``: any importable target is allowed.
        **kwargs: runtime keyword arguments; they override the node's keys.

    Returns:
        Whatever the component returns.

    Raises:
        KDUserError: the node has no ``_component_``, a target is refused or does not import,
            or a node key is not an argument of its target.
        TypeError: ``key`` is missing for a node that does not carry its own.
    """
    if node is None:
        return None
    key = key or _node_key(node)
    if key == "<node>":
        raise TypeError("instantiate: pass key= (the config key whose allow-list applies)")
    if isinstance(node, DictConfig):
        data = OmegaConf.to_container(node, resolve=True)
    elif isinstance(node, Mapping):
        data = dict(node)
    else:
        raise KDUserError(
            f"{key}: expected a mapping with _component_, got {node!r}; fix the config"
        )
    assert isinstance(data, dict)
    if "_component_" in data:
        refused = tree_problems(key, data, trust=trust)
        if refused:
            dotted, message = refused[0]
            raise KDUserError(f"{dotted}: {message}")
    return _build(data, key, args, kwargs, trust)


def _build(
    data: dict[str, Any], key: str, args: tuple[Any, ...], kwargs: dict[str, Any], trust: bool
) -> Any:
    target = data.pop("_component_", None)
    if target is None:
        rule = allowed(key)
        example = f" such as {rule.example}" if rule is not None else ""
        raise KDUserError(f"{key}._component_: missing; set it to a dotted path{example}")
    obj, reason = locate_target(target, key=key, trust=trust)
    if reason is not None:
        raise KDUserError(f"{key}._component_: {reason}")
    bad = unknown_kwargs(obj, data)
    if bad:
        name, close = bad[0]
        fix = f"did you mean {close}?" if close else "remove it"
        raise KDUserError(f"{key}.{name}: not an argument of {target}; {fix}")
    for name, value in data.items():
        if isinstance(value, Mapping) and "_component_" in value:
            data[name] = _build(dict(value), f"{key}.{name}", (), {}, trust)
    data.update(kwargs)
    return obj(*args, **data)


def build_component(key: str, node: Any, *args: Any, trust: bool, fix: str, **kwargs: Any) -> Any:
    """Build the config node ``key`` (what ``key`` may build); any failure is one line naming it.

    The one way recipes build what a config names: the allow-list (``trust`` is the config's
    ``trust_remote_components``) and the error wording live here.

    Args:
        key: the config key (``dataset``, ``optimizer``...), named in every error.
        node: the key's node (``None`` builds nothing and returns ``None``).
        *args: positional runtime arguments of the component.
        trust: the config's ``trust_remote_components``: allow any importable target.
        fix: the end of the error message (what the user should check).
        **kwargs: runtime keyword arguments of the component.

    Raises:
        KDUserError: the target is refused, a key is not an argument, or the component itself
            raised (its message, shortened, is quoted).
    """
    from kd.errors import brief

    if node is None:
        return None
    try:
        return instantiate(node, *args, key=key, trust=trust, **kwargs)
    except KDUserError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the user's component raises is reported
        target = node.get("_component_") if isinstance(node, Mapping | DictConfig) else node
        if key.split("[")[0] == "dataset" and "corresponds to no data" in str(e):
            # Hugging Face's words for a data file without rows (key: dataset or dataset[i]).
            files = node.get("data_files") if isinstance(node, Mapping | DictConfig) else None
            raise KDUserError(
                f"{key}: {files or 'the data'} has no examples; point {key}.data_files at "
                "a file with examples"
            ) from e
        raise KDUserError(f"{key}: {target} failed ({brief(e)}); {fix}") from e
