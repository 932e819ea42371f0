"""Files a config names: they exist (checkpoints, tokenizer, data, Hugging Face folders) and
``output_dir`` can be written. Nothing is created or read beyond a ``stat``."""

from __future__ import annotations

import errno
import glob
import os
import stat
from pathlib import Path
from typing import Any

from kd import folders
from kd.config import schema
from kd.config.checks.components import component_values
from kd.config.checks.teacher import is_hf_model_node
from kd.config.run import CHECKPOINTER_OF, DATASET_KEYS
from kd.config.schema import Problem

FILE_SOURCES: frozenset[str] = frozenset({"json", "csv", "text", "parquet", "arrow"})


def short(text: str, limit: int = 120) -> str:
    """``text`` cut to ``limit`` characters for a message."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def lookup_problem(text: str) -> str | None:
    """Why the path ``text`` cannot even be looked up, or None (a missing path is not a problem
    here): a NUL byte, a name too long for the file system, ``~user`` of an unknown user."""
    if "\0" in text:
        return "it contains a NUL byte"
    expanded = os.path.expanduser(text)
    if text.startswith("~") and expanded == text:
        return f"{text.split('/', 1)[0]} is not a user on this machine"
    try:
        os.stat(expanded)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
            return e.strerror.lower() if e.strerror else str(e)
        return None  # permissions and the like: the checks below name them
    except ValueError as e:
        return str(e)
    return None


def _path_ok(key: str, text: str, problems: list[Problem]) -> bool:
    """Report ``key`` when its path cannot be looked up; True when it can."""
    reason = lookup_problem(text)
    if reason is None:
        return True
    problems.append(Problem(key, f"{short(text)!r} is not a usable path ({reason}); fix the path"))
    return False


def check_files(data: dict[str, Any], problems: list[Problem]) -> None:
    """Every input file exists and ``output_dir`` can be written (names each key)."""
    output_dir = data.get("output_dir")
    if isinstance(output_dir, str) and output_dir.strip() and output_dir != schema.MISSING:
        message = writable_dir_problem(output_dir)
        if message:
            problems.append(Problem("output_dir", message))
    for name in ("checkpointer", "teacher_checkpointer"):
        node = data.get(name)
        if isinstance(node, dict):
            _check_checkpointer(name, node, problems)
    _check_hf_folders(data, problems)
    _check_tokenizer_files(data.get("tokenizer"), problems)
    for name, dataset in component_values(data):
        if name not in DATASET_KEYS:
            continue
        nodes = dataset if isinstance(dataset, list) else [dataset]
        for i, node in enumerate(nodes):
            if isinstance(node, dict):
                _check_dataset(
                    name if len(nodes) == 1 and not isinstance(dataset, list) else f"{name}[{i}]",
                    node,
                    problems,
                )


def _check_hf_folders(data: dict[str, Any], problems: list[Problem]) -> None:
    """A Hugging Face model node's ``path`` is a folder with a ``config.json``."""
    for name in CHECKPOINTER_OF:
        node = data.get(name)
        path = node.get("path") if is_hf_model_node(node) else None
        if isinstance(path, str) and path.strip() and _path_ok(f"{name}.path", path, problems):
            folder = Path(path).expanduser()
            if not (folder / folders.CONFIG_JSON).is_file():
                what = "does not exist" if not folder.exists() else "has no config.json"
                problems.append(
                    Problem(
                        f"{name}.path",
                        f"{path} {what}; point it at a local Hugging Face model folder "
                        "(config.json + *.safetensors)",
                    )
                )


def _check_tokenizer_files(tokenizer: Any, problems: list[Problem]) -> None:
    if not isinstance(tokenizer, dict):
        return
    for sub in ("path", "merges_file", "special_tokens_path"):
        path = tokenizer.get(sub)
        if not isinstance(path, str) or not _path_ok(f"tokenizer.{sub}", path, problems):
            continue
        if not Path(path).expanduser().exists():
            problems.append(
                Problem(
                    f"tokenizer.{sub}",
                    f"{path} does not exist; download the tokenizer or fix the path",
                )
            )


_MAX_SHARDS = 100_000  # checkpoint_files.max_filename beyond this is a typo, not a model


def checkpoint_file_names(files: Any) -> list[str] | None:
    """Entries of ``checkpoint_files``: a list, or torchtune's ``{filename_format, max_filename}``."""
    if isinstance(files, list):
        return [str(f) for f in files]
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict) and "filename_format" in files and "max_filename" in files:
        fmt, last = str(files["filename_format"]), str(files["max_filename"])
        if not (last.isascii() and last.isdigit()) or not 1 <= int(last) <= _MAX_SHARDS:
            return None
        try:
            return [fmt.format(str(i).zfill(len(last)), last) for i in range(1, int(last) + 1)]
        except (IndexError, KeyError, ValueError):
            return None  # not a format string of two positional fields
    return None


def _check_checkpointer(name: str, node: dict[str, Any], problems: list[Problem]) -> None:
    folder = node.get("checkpoint_dir")
    if not isinstance(folder, str):
        problems.append(
            Problem(
                f"{name}.checkpoint_dir",
                "missing; set it to the folder that holds the model's weights",
            )
        )
        return
    if not _path_ok(f"{name}.checkpoint_dir", folder, problems):
        return
    root = Path(folder).expanduser()
    if not root.is_dir():
        problems.append(
            Problem(
                f"{name}.checkpoint_dir",
                f"{folder} does not exist; download the model there or fix the path",
            )
        )
        return
    names = checkpoint_file_names(node.get("checkpoint_files"))
    if names is None:
        problems.append(
            Problem(
                f"{name}.checkpoint_files",
                "expected a list of file names or {filename_format, max_filename} (a format "
                "string with two {} fields and the number of the last shard); fix the entry",
            )
        )
        return
    for i, file_name in enumerate(names):
        if not _path_ok(f"{name}.checkpoint_files[{i}]", str(root / file_name), problems):
            continue
        path = root / file_name
        if not path.exists():  # a named pipe or a link out is refused by kd.folders
            problems.append(
                Problem(
                    f"{name}.checkpoint_files[{i}]",
                    f"{path} does not exist; fix the file name or re-download",
                )
            )


def _is_local_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or (
        lookup_problem(source) is None and os.path.exists(source)
    )


def _dataset_base(dotted: str, node: dict[str, Any], problems: list[Problem]) -> Path | None:
    """The folder a dataset node's ``data_files`` are relative to, or None when there is nothing
    local to check (a hub name, no files) or a problem was reported."""
    source = node.get("source")
    if not isinstance(source, str):
        return None
    files = node.get("data_files")
    if source in FILE_SOURCES:
        if files is None:
            problems.append(
                Problem(
                    f"{dotted}.data_files",
                    f"missing; {dotted}.source is {source}, so set {dotted}.data_files to the file(s)",
                )
            )
            return None
        return Path(".")
    if not _is_local_path(source):
        return None  # a hub dataset name; nothing local to check
    if not _path_ok(f"{dotted}.source", source, problems):
        return None
    base = Path(source).expanduser()
    if not base.exists():
        problems.append(Problem(f"{dotted}.source", f"{source} does not exist; fix the path"))
        return None
    kind = not_a_data_file(base, folder_ok=True)
    if kind is not None:
        problems.append(
            Problem(
                f"{dotted}.source",
                f"{source} is {kind}, not a data folder or file; set {dotted}.source to a folder "
                "of data files, or to the format (json, csv, parquet...) with the files in "
                f"{dotted}.data_files",
            )
        )
        return None
    if files is None:
        return None
    return base.parent if base.is_file() else base


def _data_file_entries(files: Any) -> list[str]:
    """``data_files`` as a list: a name, a list, or a mapping of splits to either."""
    if isinstance(files, str):
        return [files]
    if isinstance(files, list):
        return [str(f) for f in files]
    entries: list[str] = []
    if isinstance(files, dict):
        for split_files in files.values():
            entries += (
                [split_files]
                if isinstance(split_files, str)
                else [str(f) for f in split_files or []]
            )
    return entries


def _check_dataset(dotted: str, node: dict[str, Any], problems: list[Problem]) -> None:
    base = _dataset_base(dotted, node, problems)
    if base is None:
        return
    for entry in _data_file_entries(node.get("data_files")):
        if "://" in entry:
            continue  # remote file; load_dataset fetches it
        if not _path_ok(f"{dotted}.data_files", entry, problems):
            continue
        path = Path(entry).expanduser()
        path = path if path.is_absolute() else base / path
        if not _path_ok(f"{dotted}.data_files", str(path), problems):
            continue
        pattern = any(c in entry for c in "*?[")
        matches = [Path(m) for m in glob.glob(str(path))] if pattern else [path]
        if not (matches if pattern else path.exists()):
            problems.append(Problem(f"{dotted}.data_files", f"{path} does not exist; fix the path"))
            continue
        if pattern and all(m.is_dir() for m in matches):
            problems.append(
                Problem(
                    f"{dotted}.data_files",
                    f"{path} matches only folders ({matches[0]}...), no data file; match the "
                    f"files in them (e.g. {matches[0]}/*.jsonl)",
                )
            )
            continue
        for match in matches:
            kind = not_a_data_file(match, folder_ok=pattern)
            if kind is not None:
                problems.append(
                    Problem(
                        f"{dotted}.data_files",
                        f"{match} is {kind}, not a data file; {_data_file_fix(dotted, kind, match)}",
                    )
                )
                break


def not_a_data_file(path: Path, *, folder_ok: bool = False) -> str | None:
    """What ``path`` is when it is not a regular file a dataset builder can read (a folder, a
    named pipe, a device, a socket), or None. A named pipe or a device never ends (``/dev/zero``)
    or waits for a writer; the datasets library hashes and reads data files whole. A folder
    matched by a pattern is skipped by the builder (``folder_ok``)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # missing or unreadable: reported by the checks above or the builder
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return None if folder_ok else "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket" if stat.S_ISSOCK(mode) else "not a regular file"


def _data_file_fix(dotted: str, kind: str, path: Path) -> str:
    if kind == "a folder":
        return (
            f"set {dotted}.data_files to the files in it (e.g. {path}/*.jsonl), or "
            f"{dotted}.source to the folder"
        )
    return f"save the rows to a regular file and set {dotted}.data_files to it"


def writable_dir_problem(folder: str) -> str | None:
    """Why ``folder`` cannot be used as an output folder, or None. Creates nothing.

    Walks up to the first existing ancestor and checks it is a writable directory.
    """
    reason = lookup_problem(folder)
    if reason is not None:
        return (
            f"{short(folder)!r} is not a usable path ({reason}); set output_dir to another folder"
        )
    path = Path(folder).expanduser()
    if path.exists():
        if not path.is_dir():
            return f"{folder} is a file; set output_dir to a folder"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{folder} is not writable; set output_dir to a folder you can write to"
        return None
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{folder} cannot be created because {parent} is a file; set output_dir to another folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{folder} cannot be created in {parent} (not writable); set output_dir to a folder you can write to"
    return None
