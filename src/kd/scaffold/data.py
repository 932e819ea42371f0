"""``kd init``'s data detection: the format of a data file from its first rows -> its ``dataset:``
node (a torchtune dataset builder and its arguments).

Chat rows are checked as ``kd run`` renders them: every message's role must be one a chat template
knows (:data:`kd.hf.tokenization.CHAT_ROLES`), named with its row number.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kd.errors import KDUserError, brief, one_line

# Rows read from the data file to detect its format.
SAMPLE_ROWS = 32
DATA_SUFFIXES: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}
ACCEPTED_COLUMNS = (
    "messages (chat, OpenAI style), conversations (chat, ShareGPT style), instruction/input/output "
    "or input/output (instruct), or text (text completion)"
)


@dataclass(frozen=True)
class DataFormat:
    """What a data file holds and the ``dataset:`` node that reads it.

    Attributes:
        kind: ``chat``, ``instruct`` or ``text``.
        description: a few words for the config comment and the summary.
        node: the ``dataset:`` node (a torchtune dataset builder and its arguments).
        columns: the columns of the first rows.
        conversations: chat rows only: the first rows' ``(role, content)`` messages (roles as
            the chat template sees them), for the student's template to render.
    """

    kind: str
    description: str
    node: dict[str, Any]
    columns: tuple[str, ...] = ()
    conversations: tuple[tuple[tuple[str, Any], ...], ...] = ()


def _read_rows(path: Path, source: str, flag: str) -> list[dict[str, Any]]:
    """The first :data:`SAMPLE_ROWS` rows of a data file, as dicts."""
    try:
        if source == "csv":
            with path.open(newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                return [dict(row) for _, row in zip(range(SAMPLE_ROWS), reader, strict=False)]
        if source == "parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as e:
                raise KDUserError(
                    f"{flag}: reading parquet needs pyarrow (pip install pyarrow), or convert "
                    f"{one_line(str(path))} to JSON lines"
                ) from e
            batches = pq.ParquetFile(str(path)).iter_batches(batch_size=SAMPLE_ROWS)
            batch = next(batches, None)
            return [] if batch is None else list(batch.to_pylist())
        return _read_json_rows(path, flag)
    except KDUserError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, csv.Error) as e:
        raise KDUserError(
            f"{flag}: cannot read {one_line(str(path))} ({brief(e)}); pass a readable {source} file"
        ) from e
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types
        raise KDUserError(
            f"{flag}: cannot read {one_line(str(path))} ({brief(e)}); pass a readable {source} file"
        ) from e


def _read_json_rows(path: Path, flag: str) -> list[dict[str, Any]]:
    """JSON lines, or a JSON array of objects (what Hugging Face's ``json`` loader reads)."""
    rows: list[Any] = []
    with path.open(encoding="utf-8") as f:
        first = ""
        for line in f:
            if line.strip():
                first = line
                break
        if not first:
            return []
        if not first.lstrip().startswith("["):
            try:
                rows.append(json.loads(first))
                for line in f:
                    if len(rows) >= SAMPLE_ROWS:
                        break
                    if line.strip():
                        rows.append(json.loads(line))
            except ValueError as e:
                raise KDUserError(
                    f"{flag}: {one_line(str(path))} is neither JSON lines (one object per line) "
                    f"nor a JSON array of objects ({brief(e)}); fix the file"
                ) from e
    if not rows:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise KDUserError(
                f"{flag}: {one_line(str(path))} is neither JSON lines nor a JSON array of "
                f"objects ({brief(e)}); fix the file"
            ) from e
        rows = data[:SAMPLE_ROWS] if isinstance(data, list) else [data]
    bad = next((r for r in rows if not isinstance(r, dict)), None)
    if bad is not None:
        raise KDUserError(
            f"{flag}: {one_line(str(path))} holds {type(bad).__name__} rows, not objects; write "
            "one JSON object per row with the columns " + ACCEPTED_COLUMNS
        )
    return rows


def _is_conversation(value: Any, keys: tuple[str, str]) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, Mapping) and keys[0] in m and keys[1] in m for m in value)
    )


# ShareGPT's speakers, as torchtune's ShareGPTToMessages maps them (any other is a KeyError).
SHAREGPT_ROLES: dict[str, str] = {"system": "system", "human": "user", "gpt": "assistant"}


def _chat_format(
    rows: list[dict[str, Any]],
    base: dict[str, Any],
    columns: list[str],
    *,
    path: Path,
    flag: str,
) -> DataFormat:
    """Chat rows: OpenAI ``messages`` or ShareGPT ``conversations``, each message's role checked
    (the row number is the row of the file, 1-based)."""
    from kd.hf.tokenization import check_roles  # imports torch (kd.hf)

    column, style, keys = (
        ("messages", "openai", ("role", "content"))
        if "messages" in columns
        else ("conversations", "sharegpt", ("from", "value"))
    )
    if not all(_is_conversation(r[column], keys) for r in rows):
        raise KDUserError(
            f"{flag}: the {column} column of {one_line(str(path))} is not a list of "
            f"{{{keys[0]}, {keys[1]}}} messages in every row; fix the rows"
        )
    conversations = []
    for row, r in enumerate(rows, start=1):
        roles = [m[keys[0]] for m in r[column]]
        if style == "sharegpt":
            bad = next((i for i, x in enumerate(roles) if x not in SHAREGPT_ROLES), None)
            if bad is not None:
                raise KDUserError(
                    f"{flag}: row {row}, message {bad + 1} of {one_line(str(path))} is from "
                    f"{one_line(repr(roles[bad]))}; ShareGPT rows are from system, human or gpt: "
                    "rename it in that row"
                )
            roles = [SHAREGPT_ROLES[x] for x in roles]
        check_roles(roles, row=row, key=flag)
        conversations.append(
            tuple((role, m[keys[1]]) for role, m in zip(roles, r[column], strict=True))
        )
    node = {
        "_component_": "torchtune.datasets.chat_dataset",
        **base,
        "conversation_column": column,
        "conversation_style": style,
    }
    description = f"chat rows ({column}, {style} style)"
    return DataFormat("chat", description, node, tuple(columns), tuple(conversations))


def detect_data_format(path: Path, *, flag: str = "--data") -> DataFormat:
    """Detect the format of a data file from its first rows and build its ``dataset:`` node.

    Rows with ``messages`` (lists of ``{role, content}``) -> ``chat_dataset`` (OpenAI style);
    ``conversations`` (lists of ``{from, value}``) -> ``chat_dataset`` (ShareGPT style);
    ``instruction`` and ``output`` -> ``instruct_dataset`` with ``input: instruction``, or
    ``alpaca_dataset`` when rows also have a non-empty ``input`` (it joins instruction and input
    in one prompt); ``input`` and ``output`` -> ``instruct_dataset``; ``text`` ->
    ``text_completion_dataset``. Prompts are masked from the loss (``train_on_input: false``).
    Chat messages must have the roles ``kd run`` renders (system, user, assistant, tool; ShareGPT:
    system, human, gpt).

    Args:
        path: a ``.jsonl`` / ``.json`` (JSON lines or an array of objects), ``.csv`` or
            ``.parquet`` file.
        flag: the command-line flag naming the file, for errors.

    Raises:
        KDUserError: an unreadable, empty or unknown file; names ``flag`` and the accepted columns;
            a chat message of another role (names its row, 1-based, and message).
    """
    path = Path(os.path.abspath(path.expanduser()))
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise KDUserError(f"{flag}: {one_line(str(path))} {what}; pass a .jsonl data file")
    source = DATA_SUFFIXES.get(path.suffix.lower())
    if source is None:
        raise KDUserError(
            f"{flag}: {one_line(str(path))}: kd init reads .jsonl, .json, .csv and .parquet "
            "files; convert it to JSON lines (one object per line)"
        )
    rows = _read_rows(path, source, flag)
    if not rows:
        raise KDUserError(f"{flag}: {one_line(str(path))} has no rows; add training examples")
    # Columns every sampled row has (a column missing from some rows cannot be relied on).
    columns = [c for c in rows[0] if all(c in r for r in rows)]
    have = set(columns)
    base: dict[str, Any] = {"source": source, "data_files": str(path), "split": "train"}
    if "messages" in have or "conversations" in have:
        return _chat_format(rows, base, columns, path=path, flag=flag)
    if {"instruction", "output"} <= have:
        if "input" in have and any(r.get("input") for r in rows):
            node = {"_component_": "torchtune.datasets.alpaca_dataset", **base}
            description = "instruct rows (instruction + input -> output, Alpaca prompt)"
        else:
            node = {
                "_component_": "torchtune.datasets.instruct_dataset",
                **base,
                "column_map": {"input": "instruction", "output": "output"},
            }
            description = "instruct rows (instruction -> output)"
        node["train_on_input"] = False
        return DataFormat("instruct", description, node, tuple(columns))
    if {"input", "output"} <= have:
        node = {
            "_component_": "torchtune.datasets.instruct_dataset",
            **base,
            "train_on_input": False,
        }
        return DataFormat("instruct", "instruct rows (input -> output)", node, tuple(columns))
    if "text" in have:
        node = {"_component_": "torchtune.datasets.text_completion_dataset", **base}
        return DataFormat("text", "text rows (text completion)", node, tuple(columns))
    shown = ", ".join(columns[:8]) + (", ..." if len(columns) > 8 else "") or "none"
    raise KDUserError(
        f"{flag}: cannot tell the format of {one_line(str(path))} from its columns ({shown}); "
        f"kd init reads rows with {ACCEPTED_COLUMNS}: rename the columns"
    )
