"""How a config key is declared once: as a field of the typed settings it fills.

A field declared with :func:`setting` *is* the config key: its name in the YAML, default, range,
resume policy and help text sit beside the attribute it lands in and that attribute's type.
:mod:`kd.config.schema` derives its key tables (what validation checks, what ``kd init``
writes, what a resumed run compares) from these fields (:func:`declared_keys`), and
:func:`kd.config.run.run_config` fills the dataclasses from a config by reading the same fields
(:func:`build`), so adding a key is one declaration in :mod:`kd.config.run` or the module of its
section (:mod:`kd.config.on_policy_settings`, a teacher kind's module in
:mod:`kd.config.teacher_kinds`).

Fields declared with :func:`derived` are computed from the config (``seq_len_source``,
``components``...) and fields declared with :func:`group` hold another settings dataclass.

Defaults here are the defaults of the config: :func:`kd.config.load_config` merges them under the
user's YAML, and the dataclasses use them when a test or a tracer builds one by hand.

This module imports no torch: ``kd plan`` and the config checks stay fast.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

# Key.resume values.
MUST_MATCH = "must_match"
MAY_CHANGE = "may_change"

# A required key's default (also OmegaConf's spelling of an unset value).
MISSING = "???"


@dataclass(frozen=True)
class Key:
    """One config key.

    Attributes:
        default: value used when the YAML does not set the key (``MISSING`` = required).
        types: accepted Python types of the resolved value (``None`` is accepted iff ``nullable``).
        help: one line for ``kd validate`` and the docs.
        nullable: whether ``null`` is allowed.
        choices: allowed values, if the key is an enumeration.
        min: inclusive lower bound for numbers.
        max: inclusive upper bound for numbers.
        min_exclusive: exclusive lower bound for numbers (``temperature > 0``).
        node: the key holds a mapping (a ``_component_`` node or a section).
        node_list: the key may also hold a non-empty list of such mappings (torchtune's
            concatenated datasets).
        resume: ``must_match``: a run resumed from a checkpoint must have the checkpoint's value,
            because the key changes the training trajectory; ``may_change``: it may differ (paths,
            logging, saving, memory knobs). For a node, ``may_change`` covers all its leaves.
    """

    default: Any
    types: tuple[type, ...] = ()
    help: str = ""
    nullable: bool = False
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    max: float | None = None
    min_exclusive: float | None = None
    node: bool = False
    node_list: bool = False
    resume: str = MUST_MATCH

    def __post_init__(self) -> None:
        assert self.resume in (MUST_MATCH, MAY_CHANGE), self.resume


# `field.metadata` entries.
_KEY = "kd_key"  # (dotted config key, partial Key arguments, reader or None)
_DERIVE = "kd_derive"  # function of the config
_GROUP = "kd_group"  # function of the config: whether the group is present

Reader = Callable[[DictConfig, Any], Any]
_SAME = object()  # setting(field_default=...) not given: the key's default


def _field_default(default: Any) -> dict[str, Any]:
    if default is MISSING:
        return {}
    if isinstance(default, dict | list):
        return {"default_factory": lambda: _copy(default)}
    return {"default": default}


def setting(
    config_key: str,
    default: Any,
    help: str,
    *,
    resume: str,
    field_default: Any = _SAME,
    read: Reader | None = None,
    **key_args: Any,
) -> Any:
    """A dataclass field that is the config key ``config_key``.

    The key's accepted types come from the field's annotation (``float`` accepts integers,
    ``Path`` a string, ``tuple[str, ...]`` a list; ``X | None`` makes the key nullable unless
    ``nullable`` says otherwise).

    Args:
        config_key: dotted key in the config (``kd_ratio``, ``memory.budget_gib``,
            ``model.lora_rank``).
        default: the key's default (``MISSING``: required).
        help: one line: what the key does (and its trade-off).
        resume: :data:`MUST_MATCH` or :data:`MAY_CHANGE`.
        field_default: the dataclass field's default when it differs from the key's
            (``MISSING``: none).
        read: ``(cfg, value) -> field value`` when the field is not just the converted value.
        **key_args: further :class:`Key` arguments (``min``, ``choices``, ``nullable``, ``node``...).
    """
    meta = {_KEY: (config_key, dict(default=default, help=help, resume=resume, **key_args), read)}
    return dataclasses.field(
        metadata=meta, **_field_default(default if field_default is _SAME else field_default)
    )


def derived(fn: Callable[[DictConfig], Any], default: Any = MISSING) -> Any:
    """A dataclass field computed from the whole config by ``fn`` (not a config key itself)."""
    return dataclasses.field(metadata={_DERIVE: fn}, **_field_default(default))


def group(present: Callable[[DictConfig], bool] | None = None) -> Any:
    """A dataclass field holding a settings dataclass (its annotation), or None when ``present``
    says the config has none (``validation: null``)."""
    return dataclasses.field(metadata={_GROUP: present})


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


# ---- reading a config into the dataclasses ---------------------------------------------------


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _split_optional(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; ``X`` -> ``(X, False)``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        return (args[0] if len(args) == 1 else hint), optional
    return hint, False


def _accepted_types(base: Any) -> tuple[type, ...]:
    """The YAML value types a field of type ``base`` is read from."""
    if base is float:
        return (int, float)
    if base is Path:
        return (str,)
    if typing.get_origin(base) in (tuple, list):
        return (list,)
    if base in (int, bool, str):
        return (base,)
    return ()  # a node


def key_of(field: dataclasses.Field[Any], hint: Any) -> tuple[str, Key] | None:
    """The config key a :func:`setting` field declares, or None for other fields."""
    declared = field.metadata.get(_KEY)
    if declared is None:
        return None
    name, args, _ = declared
    base, optional = _split_optional(hint)
    args = {"types": _accepted_types(base), "nullable": optional, **args}
    return name, Key(**args)


def declared_keys(cls: type) -> dict[str, Key]:
    """Every config key declared by ``cls`` and the settings groups it holds, in field order."""
    out: dict[str, Key] = {}
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        if _GROUP in field.metadata:
            out.update(declared_keys(_split_optional(hints[field.name])[0]))
            continue
        found = key_of(field, hints[field.name])
        if found is not None:
            out[found[0]] = found[1]
    return out


def raw_value(cfg: DictConfig, dotted: str, default: Any) -> Any:
    """The value of ``dotted`` in ``cfg``: ``default`` when absent, unset (``???``) or under a null
    section (``validation: null``)."""
    node: Any = cfg
    for part in dotted.split("."):
        # `in` is False for an unset (???) value
        if not isinstance(node, DictConfig) or part not in node:
            return default
        node = node.get(part)
    return node


def frozen_node(node: Any) -> DictConfig | ListConfig | None:
    """A read-only copy of a component node (a list of nodes stays a list: ``dataset``)."""
    if node is None:
        return None
    copy = OmegaConf.create(OmegaConf.to_container(node, resolve=True))
    OmegaConf.set_readonly(copy, True)
    return copy


def base_url(cfg: DictConfig, raw: Any) -> str:
    """Reader of a server's base URL key (``setting(read=...)``): without a trailing ``/``."""
    return str(raw).rstrip("/")


def optional_base_url(cfg: DictConfig, raw: Any) -> str | None:
    """Reader of a nullable server base URL key: null stays None, else :func:`base_url`."""
    return None if raw is None else base_url(cfg, raw)


def _convert(value: Any, hint: Any) -> Any:
    """``value`` as the field type ``hint`` (a node is frozen)."""
    base, _ = _split_optional(hint)
    if value is None:
        return None
    if base is Path:
        return Path(str(value)).expanduser()
    if typing.get_origin(base) is tuple:
        return tuple(str(v) for v in value)
    if base in (int, float, bool, str):
        return base(value)
    return frozen_node(value)


def build(cls: type, cfg: DictConfig) -> Any:
    """Fill the settings dataclass ``cls`` (and its groups) from a loaded config.

    Args:
        cls: a dataclass whose fields are :func:`setting`, :func:`derived` or :func:`group`.
        cfg: a loaded config (defaults merged).

    Returns:
        The frozen instance.
    """
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if _GROUP in meta:
            present = meta[_GROUP]
            sub = _split_optional(hints[field.name])[0]
            values[field.name] = build(sub, cfg) if present is None or present(cfg) else None
        elif _DERIVE in meta:
            values[field.name] = meta[_DERIVE](cfg)
        elif _KEY in meta:
            name, args, read = meta[_KEY]
            default = args["default"] if args["default"] is not MISSING else None
            value = raw_value(cfg, name, default)
            values[field.name] = read(cfg, value) if read else _convert(value, hints[field.name])
    return cls(**values)


def settings(cls: type) -> type:
    """Class decorator: a frozen dataclass whose docstring lists each field's config key and help
    (the attributes are documented where they are declared)."""
    # Keyword-only: fields with and without defaults mix in declaration order.
    cls = dataclass(frozen=True, kw_only=True)(cls)
    hints = _hints(cls)
    lines = []
    for field in dataclasses.fields(cls):
        found = key_of(field, hints[field.name])
        if found is not None:
            lines.append(f"    {field.name}: ``{found[0]}``: {found[1].help}")
    if lines:
        cls.__doc__ = f"{cls.__doc__ or ''}\n\nConfig keys:\n" + "\n".join(lines)
    return cls
