"""Read a config: YAML, torchtune compatibility, schema defaults, command-line overrides.

Order of operations in :func:`load_config`:

1. read the YAML (a built-in name or a path);
2. map torchtune keys and losses (:mod:`kd.config.compat`);
3. merge schema defaults under it (the sections, ``memory:``, ``fsdp:``, ``kd_loss:``,
   ``validation:``..., key by key when present; other nodes only when absent, since merging
   kwargs of a different ``_component_`` would be wrong);
4. apply ``key=value`` / ``~key`` overrides, then steps 2-3 again for what they changed;
5. resolve ``${...}`` interpolations.

``~key`` on a top-level key removes what the YAML set: a nullable key (``lr_scheduler``,
``seed``...) becomes ``null``, any other key goes back to its schema default, and a required
key stays absent so validation names it.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kd.config import schema
from kd.config.builtin import find_config
from kd.config.compat import apply_compat
from kd.errors import KDUserError, one_line

_KEY_RE = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*$")


def is_rank_zero() -> bool:
    """Whether this process should print (always true outside torchrun)."""
    return os.environ.get("RANK", "0") == "0"


def print_notices(notices: list[str]) -> None:
    """Print each distinct notice once as ``kd: notice: ...`` on stderr (rank 0 only).

    ``kd run --nproc_per_node`` prints them before launching torchrun and sets
    ``KD_NOTICES_SHOWN=1`` so the workers do not repeat them.
    """
    if not is_rank_zero() or os.environ.get("KD_NOTICES_SHOWN") == "1":
        return
    seen: set[str] = set()
    for line in notices:
        if line not in seen:
            seen.add(line)
            print(f"kd: notice: {line}", file=sys.stderr)


def read_yaml(config: str) -> DictConfig:
    """Load the YAML file a config argument names.

    Raises:
        KDUserError: no such file or built-in; malformed YAML (names file and line); not a mapping.
    """
    path = find_config(config)
    _check_text(path)
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise KDUserError(f"config {where}: malformed YAML ({problem}); fix the file") from e
    except OSError as e:
        raise KDUserError(
            f"config {one_line(str(path))}: cannot be read ({e.strerror}); check the path"
        ) from e
    except OmegaConfBaseException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KDUserError(f"config {one_line(str(path))}: {first}; fix the file") from e
    except ValueError as e:  # Python refuses to read an integer of more than 4300 digits
        raise KDUserError(f"config {one_line(str(path))}: {_value_error(e)}") from e
    if isinstance(cfg, ListConfig):
        raise KDUserError(
            f"config {one_line(str(path))}: top level is a list; it must be a mapping of keys"
        )
    return cfg


def _value_error(e: ValueError) -> str:
    """A ValueError met while YAML builds a value, as a message ending in the fix."""
    if "digits" in str(e):
        return "a number has too many digits to read; use a smaller one"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"a value cannot be read ({first}); fix it"


_MAX_CONFIG_BYTES = 16 << 20  # a YAML config is a few KiB; a bigger file is something else


def _check_text(path: Path) -> None:
    """Refuse a config file that is not UTF-8 text before YAML reads it (names file and line).

    Raises:
        KDUserError: the file cannot be read, is binary, or is not UTF-8.
    """
    try:
        with path.open("rb") as fh:
            raw = fh.read(_MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise KDUserError(
            f"config {one_line(str(path))}: cannot be read ({e.strerror}); check the path"
        ) from e
    if len(raw) > _MAX_CONFIG_BYTES:
        raise KDUserError(
            f"config {one_line(str(path))}: larger than {_MAX_CONFIG_BYTES >> 20} MiB, so not a "
            "config (a weights file?); pass the YAML config"
        )
    if b"\0" in raw:
        raise KDUserError(
            f"config {one_line(str(path))}: is a binary file, not YAML text; pass the YAML config"
        )
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise KDUserError(
            f"config {one_line(str(path))}:{line}: is not UTF-8 text (byte 0x{raw[e.start]:02x}); save the file "
            "as UTF-8"
        ) from e


def fill_defaults(cfg: DictConfig, cleared: set[str] | None = None) -> None:
    """Merge schema defaults under ``cfg`` in place.

    Args:
        cfg: the config.
        cleared: top-level keys removed with ``~key``; nullable ones become ``null``.
    """
    cleared = cleared or set()
    for name, key in schema.TOP_LEVEL.items():
        if key.default is schema.MISSING:
            continue
        if name not in cfg:
            cfg[name] = None if (name in cleared and key.nullable) else schema._copy(key.default)
            continue
        section = schema.SECTIONS.get(name)
        if section is None:
            continue
        node = cfg._get_node(name)
        if isinstance(node, DictConfig):
            for sub, sub_key in section.items():
                # A required key of a section (validation.dataset) stays absent: validation names it.
                if sub not in node and sub_key.default is not schema.MISSING:
                    node[sub] = schema._copy(sub_key.default)


def _shown(item: str, limit: int = 120) -> str:
    """An override as quoted in a message (a very long one shortened)."""
    return repr(item if len(item) <= limit else f"{item[: limit - 3]}...")


def _parse_value(item: str, raw: str) -> Any:
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))
    except ValueError as e:  # Python refuses to read an integer of more than 4300 digits
        raise KDUserError(f"override {_shown(item)}: {_value_error(e)}") from e
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        problem = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KDUserError(
            f"override {_shown(item)}: value cannot be parsed ({problem}); quote it"
        ) from e
    assert isinstance(parsed, dict)
    return parsed["v"]


def _suggest(cfg: DictConfig, dotted: str) -> str:
    import difflib

    parent_key, _, leaf = dotted.rpartition(".")
    parent = _select(cfg, parent_key) if parent_key else cfg
    names = [str(k) for k in parent] if isinstance(parent, DictConfig) else []
    close = difflib.get_close_matches(leaf, names, n=1)
    prefix = f"{parent_key}." if parent_key else ""
    return (
        f"did you mean ~{prefix}{close[0]}?"
        if close
        else "check the key (kd validate shows the config)"
    )


def _delete(cfg: DictConfig, item: str, cleared: set[str]) -> None:
    dotted = item[1:]
    if not _KEY_RE.match(dotted):
        what = "no key after '~'" if not dotted else f"{dotted!r} is not a config key"
        raise KDUserError(
            f"override {_shown(item)}: {what}; write ~key to delete a key, e.g. ~lr_scheduler"
        )
    parent_key, _, leaf = dotted.rpartition(".")
    parent = _select(cfg, parent_key) if parent_key else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent:
        raise KDUserError(
            f"override {_shown(item)}: no key {dotted} in the config; {_suggest(cfg, dotted)}"
        )
    del parent[leaf]
    if not parent_key:
        cleared.add(leaf)


def _set(cfg: DictConfig, item: str) -> None:
    dotted, _, raw = item.partition("=")
    dotted = dotted.strip()
    if not dotted:
        raise KDUserError(
            f"override {_shown(item)}: no key before '='; write key=value, e.g. batch_size=2"
        )
    if not _KEY_RE.match(dotted):
        raise KDUserError(
            f"override {_shown(item)}: {dotted!r} is not a config key; write key=value with a dotted key, "
            "e.g. optimizer.lr=1e-4"
        )
    if raw == "":
        raise KDUserError(
            f"override {_shown(item)}: no value after '='; write {dotted}=null to clear it"
        )
    value = _parse_value(item, raw)
    top = dotted.split(".", 1)[0]
    if dotted == "kd_loss" and isinstance(value, str):
        # Normalised now so a later `kd_loss.beta=...` merges into the mapping; a dotted path
        # (torchtune loss) is mapped by compat afterwards.
        cfg["kd_loss"] = {"_component_": value} if "." in value else {"divergence": value}
        return
    if "." not in dotted and isinstance(value, str) and top != "kd_loss":
        node = cfg._get_node(top) if top in cfg else None
        spec = schema.TOP_LEVEL.get(top)
        is_component = isinstance(node, DictConfig) and "_component_" in node
        if is_component or (
            node is None and spec is not None and spec.node and top not in schema.SECTIONS
        ):
            # torchtune shorthand: `model=torchtune.models.qwen2_5.qwen2_5_3b` swaps the builder
            # and keeps the node's other keys.
            if node is None or not isinstance(cfg.get(top), DictConfig):
                cfg[top] = {}
            cfg[top]["_component_"] = value
            return
    _check_list_indices(cfg, item, dotted)
    existing = _select(cfg, dotted)
    # Replacing a mapping by a scalar (e.g. `kd_loss=reverse_kl`, `lr_scheduler=null`).
    merge = not (isinstance(existing, DictConfig) and not isinstance(value, dict))
    try:
        OmegaConf.update(cfg, dotted, value, merge=merge)
    except (OmegaConfBaseException, ValueError, TypeError, KeyError, IndexError) as e:
        problem = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KDUserError(
            f"override {_shown(item)}: cannot set {dotted} ({problem}); check the key (kd validate "
            "shows the config)"
        ) from e


def _select(cfg: DictConfig, dotted: str) -> Any:
    """The value at ``dotted``, or None when there is none (or the path cannot be followed)."""
    try:
        return OmegaConf.select(cfg, dotted, throw_on_resolution_failure=False)
    except (OmegaConfBaseException, ValueError, TypeError, KeyError, IndexError):
        return None


def _check_list_indices(cfg: DictConfig, item: str, dotted: str) -> None:
    """Each part of ``dotted`` that follows a list must be an index inside it.

    Raises:
        KDUserError: an index that is not a number or is out of range; names the list and its
            length.
    """
    node: Any = cfg
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        if isinstance(node, ListConfig):
            n = len(node)
            whole = f"or set the whole list: {prefix}=[...]"
            if not re.fullmatch(r"-?\d+", part):
                raise KDUserError(
                    f"override {_shown(item)}: {prefix} is a list, so {part!r} is not an index; write "
                    f"{prefix}.0=... to set an entry {whole}"
                )
            index = int(part)
            if not -n <= index < n:
                valid = f"0 to {n - 1}" if n else "none: it is empty"
                raise KDUserError(
                    f"override {_shown(item)}: {prefix} has {n} entries, so index {index} is out of "
                    f"range (valid: {valid}); {whole.removeprefix('or ')}"
                )
            node = node._get_node(index)
            if node is not None and not isinstance(node, DictConfig | ListConfig):
                return
            continue
        if not isinstance(node, DictConfig) or part not in node:
            return  # a new key, or a scalar replaced by a mapping: validation judges the result
        node = node._get_node(part)


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> set[str]:
    """Apply ``key=value`` and ``~key`` overrides in order.

    Args:
        cfg: modified in place.
        overrides: command-line items.

    Returns:
        The top-level keys deleted with ``~key``.

    Raises:
        KDUserError: an item is neither ``key=value`` nor ``~key``, or deletes an absent key.
    """
    cleared: set[str] = set()
    for item in overrides:
        if item.startswith("~"):
            _delete(cfg, item, cleared)
        elif "=" in item:
            _set(cfg, item)
            cleared.discard(item.split("=", 1)[0].strip())
        elif item.startswith("-"):
            raise KDUserError(
                f"unknown option {_shown(item)}; only --config and key=value / ~key overrides are accepted"
            )
        else:
            raise KDUserError(
                f"override {_shown(item)}: expected key=value or ~key; write {item}=<value> to set it or "
                f"~{item} to delete it"
            )
    return cleared


def resolve(cfg: DictConfig) -> None:
    """Resolve ``${...}`` interpolations in place.

    Raises:
        KDUserError: an interpolation names a missing key or fails; names the key.
    """
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        msg = str(e).splitlines()[0]
        raise KDUserError(
            f"{one_line(str(key))}: interpolation cannot be resolved ({msg}); fix the ${{...}} "
            "reference"
        ) from e


def load_config(config: str, overrides: list[str]) -> DictConfig:
    """Read a config, map torchtune keys, merge defaults, apply overrides, resolve interpolations.

    Args:
        config: a built-in name (``qwen2_5/14B_to_3B_full_single_device``, ``.yaml`` optional)
            or a YAML path.
        overrides: ``key=value`` (OmegaConf dotlist values), ``~key`` (delete), and
            ``node=dotted.path`` (sets ``node._component_``).

    Returns:
        The resolved config; every schema key with a default is present.

    Raises:
        KDUserError: missing or malformed file, bad override, unresolvable interpolation.
    """
    cfg = read_yaml(config)
    notices: list[str] = []
    apply_compat(cfg, notices)
    fill_defaults(cfg)
    cleared = apply_overrides(cfg, list(overrides))
    apply_compat(cfg, notices)
    fill_defaults(cfg, cleared)
    resolve(cfg)
    _normalise_yaml_off(cfg)
    print_notices(notices)
    return cfg


def _normalise_yaml_off(cfg: DictConfig) -> None:
    """YAML 1.1 reads an unquoted ``off`` as False; ``memory.check: off`` means the string."""
    memory = cfg.get("memory")
    if isinstance(memory, DictConfig) and memory.get("check") is False:
        memory.check = "off"
