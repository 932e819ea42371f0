"""What kd reads from a model, tokenizer or checkpoint folder, and what it refuses there.

A folder is data someone else wrote (a download, a colleague's checkpoint), so nothing in it may
run code or make kd read a file outside it:

- **No remote code.** A ``config.json`` or ``tokenizer_config.json`` with an ``auto_map`` asks
  transformers to import the folder's own ``.py`` files; :func:`refuse_remote_code` refuses such a
  folder before anything is loaded (and every transformers/peft load passes
  ``trust_remote_code=False`` as well).
- **Only regular files inside the folder.** :func:`file_in` resolves ``folder/name``: a symlink
  whose target lies outside the folder, a named pipe (reading it blocks forever), a device or a
  socket is refused. The one exception is the Hugging Face hub cache, whose
  ``snapshots/<revision>/`` files are links into the same repository's ``blobs/`` folder.
- **Index files name files inside.** A ``model.safetensors.index.json`` whose ``weight_map``
  names ``../elsewhere.safetensors`` or an absolute path is refused (:func:`index_weight_files`).

:func:`read_config_json` is the one reader of a folder's ``config.json``; :func:`check_folder`
runs every check on a whole folder. Only the standard library is imported (``kd plan`` and the
config check call this before torch).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kd.errors import KDUserError, brief, one_line

CONFIG_JSON = "config.json"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
SAFETENSORS_INDEX_JSON = "model.safetensors.index.json"
# The files through which transformers would import a folder's own code (auto_map).
REMOTE_CODE_CONFIGS = (CONFIG_JSON, TOKENIZER_CONFIG_JSON)
# Hugging Face hub cache: <repo>/snapshots/<revision>/<file> -> ../../blobs/<sha>.
_HUB_SNAPSHOTS = "snapshots"
_HUB_BLOBS = "blobs"


class FolderError(KDUserError):
    """A folder or a file in it that kd refuses to read: ``key`` and ``detail`` (the fix last)."""

    def __init__(self, key: str, detail: str) -> None:
        """Args: key: the config key or flag naming the folder; detail: what and the fix."""
        self.key = key
        self.detail = detail
        super().__init__(f"{key}: {detail}")


def _where(path: Path) -> str:
    return one_line(str(path))


def allowed_roots(folder: Path) -> tuple[Path, ...]:
    """The resolved folders whose files ``folder``'s files may resolve to.

    The folder itself; for a hub cache snapshot (``<repo>/snapshots/<revision>``) also that
    repository's ``blobs/``, where the snapshot's links point.
    """
    root = Path(folder).expanduser().resolve()
    roots = [root]
    if root.parent.name == _HUB_SNAPSHOTS and (root.parent.parent / _HUB_BLOBS).is_dir():
        roots.append(root.parent.parent / _HUB_BLOBS)
    return tuple(roots)


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file or a folder)."""
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def file_in(folder: Path, name: str, *, key: str) -> Path | None:
    """``folder/name`` as a regular file whose resolved path lies inside ``folder``.

    Nothing is opened: a named pipe is recognised by its mode, never read.

    Args:
        folder: the model, tokenizer or checkpoint folder.
        name: a file name relative to ``folder`` (from a listing or an index file).
        key: the config key or flag naming the folder, first on the error line.

    Returns:
        The resolved path, or None when there is no such file (a dangling link included).

    Raises:
        KDUserError: the name or a link leads outside the folder, or the file is a named pipe, a
            device, a socket or a folder.
    """
    folder = Path(folder).expanduser()
    path = folder / name
    try:
        os.lstat(path)
        mode = os.stat(path).st_mode  # follows links; stat never opens (a FIFO does not block)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FolderError(
            key, f"cannot read {_where(path)} ({brief(e)}); fix the file's permissions"
        ) from e
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in allowed_roots(folder)):
        raise FolderError(
            key,
            f"{_where(path)} leads to {_where(resolved)}, outside {_where(folder)}; kd reads "
            "only files inside the folder: copy the real file into it",
        )
    kind = _kind(mode)
    if kind is not None or not stat.S_ISREG(mode):
        raise FolderError(
            key,
            f"{_where(path)} is {kind or 'a folder'}, not a regular file; replace it with the "
            "real file from the model's source",
        )
    return resolved


def read_json_in(folder: Path, name: str, *, key: str) -> Any:
    """The parsed JSON file ``folder/name`` (:func:`file_in`), or None when there is none.

    Raises:
        KDUserError: as :func:`file_in`, or the file is not readable JSON.
    """
    path = file_in(folder, name, key=key)
    if path is None:
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FolderError(
            key,
            f"cannot read {_where(Path(folder) / name)} ({brief(e)}); restore it from the "
            "model's source",
        ) from e


def _auto_map_entry(auto_map: Any) -> str:
    """The first entry of an ``auto_map`` as ``AutoClass=module.Class`` (or its text)."""
    if isinstance(auto_map, dict) and auto_map:
        name, value = next(iter(auto_map.items()))
        if isinstance(value, (list, tuple)):
            value = next((v for v in value if v), value)
        return one_line(f"{name}={value}")[:200]
    if isinstance(auto_map, (list, tuple)) and auto_map:
        return one_line(str(next((v for v in auto_map if v), auto_map[0])))[:200]
    return one_line(str(auto_map))[:200]


def remote_code_problem(data: Any, path: Path, *, key: str) -> FolderError | None:
    """The refusal of a parsed ``config.json`` / ``tokenizer_config.json`` that asks for the
    folder's own code (an ``auto_map``), or None."""
    auto_map = data.get("auto_map") if isinstance(data, dict) else None
    if not auto_map:
        return None
    return FolderError(
        key,
        f"{_where(path)} asks to run code from the folder (auto_map {_auto_map_entry(auto_map)}); "
        "kd never runs a model's or tokenizer's own code: use a model that transformers supports "
        "natively, or remove auto_map if the folder needs none",
    )


def refuse_remote_code(folder: Path, *, key: str) -> None:
    """Refuse a folder whose ``config.json`` or ``tokenizer_config.json`` has an ``auto_map``.

    Raises:
        KDUserError: one line naming the file and its first ``auto_map`` entry (or a file that
            :func:`read_json_in` refuses).
    """
    for name in REMOTE_CODE_CONFIGS:
        data = read_json_in(folder, name, key=key)
        problem = remote_code_problem(data, Path(folder) / name, key=key)
        if problem is not None:
            raise problem


def read_config_json(folder: str | Path, *, key: str) -> dict[str, Any]:
    """A model folder's ``config.json`` as a dict: the one place kd reads it.

    Args:
        folder: the model folder.
        key: the config key or flag naming it (``model.path``, ``checkpointer.checkpoint_dir``,
            ``--teacher``), first on every error line.

    Raises:
        KDUserError: the folder or file is missing, the file is a link out of the folder or not a
            regular file, not a JSON object, or asks for the folder's own code (``auto_map``).
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise FolderError(
            key,
            f"{_where(folder)} {what}; point it at a local Hugging Face model folder "
            f"({CONFIG_JSON} + *.safetensors)",
        )
    data = read_json_in(folder, CONFIG_JSON, key=key)
    path = folder / CONFIG_JSON
    if data is None:
        raise FolderError(
            key,
            f"{_where(folder)} has no {CONFIG_JSON}; download the model's {CONFIG_JSON} and "
            "weights into it",
        )
    if not isinstance(data, dict):
        raise FolderError(
            key,
            f"{_where(path)} holds a JSON {type(data).__name__}, not an object of model "
            "settings; restore it from the model's source",
        )
    problem = remote_code_problem(data, path, key=key)
    if problem is not None:
        raise problem
    return data


def index_weight_files(folder: Path, *, key: str) -> list[str] | None:
    """The shard names a folder's ``model.safetensors.index.json`` lists (sorted, unique), or
    None without an index. Each name must be a plain relative name inside the folder; a shard
    that exists must be a regular file inside it (a missing one is left to the caller).

    Raises:
        KDUserError: an unreadable index, or a name that leads outside the folder.
    """
    data = read_json_in(folder, SAFETENSORS_INDEX_JSON, key=key)
    if data is None:
        return None
    index = Path(folder) / SAFETENSORS_INDEX_JSON
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FolderError(
            key,
            f"{_where(index)} has no weight_map of tensor names to file names; restore it from "
            "the model's source",
        )
    names = sorted(set(weight_map.values()))
    for name in names:
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts:
            raise FolderError(
                key,
                f"{_where(index)} names {one_line(name)!r} in its weight_map, outside "
                f"{_where(Path(folder))}; kd reads weights only from inside the folder: restore "
                "the index from the model's source",
            )
        file_in(folder, name, key=key)
    return names


def check_folder(folder: str | Path, *, key: str) -> None:
    """Every folder check: no ``auto_map``, every top-level file a regular file inside the folder,
    the index naming files inside. Hidden files and sub-folders are not read and not checked.

    Raises:
        KDUserError: the first problem, in one line naming ``key`` and the file.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return  # the caller reports a missing folder in its own words
    refuse_remote_code(folder, key=key)
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.is_dir():
            continue
        file_in(folder, entry.name, key=key)
    index_weight_files(folder, key=key)


# Config keys whose value names a folder kd (or transformers) loads; see config_folder_problems.
_FOLDER_ARGS = ("checkpoint_dir",)
_HF_COMPONENT_PREFIX = "kd.hf."
_TOKENIZER_KEYS = ("tokenizer", "model_transform")
_TOKENIZER_FILE_ARGS = ("path", "merges_file", "special_tokens_path")


def _config_folders(node: Any, key: str) -> Iterator[tuple[str, Path, str | None]]:
    """``(config key, folder, file name or None)`` for every folder a config's plain values make
    kd read: a ``checkpoint_dir``, the ``path`` of a ``kd.hf.*`` component, and the folder of a
    tokenizer (``tokenizer``, a dataset's ``model_transform``: its ``path`` folder, or the folder
    of each file argument, with the file's name)."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _config_folders(item, f"{key}[{i}]")
        return
    if not isinstance(node, dict):
        return
    leaf = key.rsplit(".", 1)[-1].split("[", 1)[0]
    component = node.get("_component_")
    hf_component = isinstance(component, str) and component.startswith(_HF_COMPONENT_PREFIX)
    for arg, value in node.items():
        folder_arg = arg in _FOLDER_ARGS or (arg == "path" and hf_component)
        file_arg = leaf in _TOKENIZER_KEYS and arg in _TOKENIZER_FILE_ARGS
        if not isinstance(value, str) or not value.strip() or not (folder_arg or file_arg):
            continue
        try:
            path = Path(value).expanduser()
            is_dir = path.is_dir()
        except (OSError, ValueError, RuntimeError):  # ~unknown_user: the path checks report it
            continue
        named = f"{key}.{arg}" if key else arg
        if folder_arg:
            yield named, path, None
        elif not is_dir:
            yield named, path.parent, path.name
    for arg, value in node.items():
        if isinstance(value, (dict, list)):
            yield from _config_folders(value, f"{key}.{arg}" if key else arg)


def config_folder_problems(data: dict[str, Any]) -> list[FolderError]:
    """:func:`check_folder` on every folder a config (its plain values) names, and
    :func:`file_in` on every tokenizer file it names, for the config check that every command
    runs before anything is imported or loaded.

    Returns:
        One :class:`FolderError` per refused file or folder (a folder is checked once, under the
        first key naming it; missing folders are left to the path checks).
    """
    problems: list[FolderError] = []
    checked: set[Path] = set()
    for key, folder, name in _config_folders(data, ""):
        try:
            if name is not None:
                file_in(folder, name, key=key)
            if folder not in checked:
                checked.add(folder)
                check_folder(folder, key=key)
        except FolderError as e:
            checked.add(folder)
            if all(e.detail != p.detail for p in problems):  # one line per refused file
                problems.append(e)
        except (OSError, ValueError):
            continue  # an unusable path: the config's path checks report it
    return problems
