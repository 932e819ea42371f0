"""The user's own evaluation tasks: kd's task spec, read and checked before anything loads.

A task folder holds one ``*.yaml`` file per task and the JSON-lines files they name::

    # tasks/arith.yaml                     # tasks/arith.jsonl
    task: arith                            {"question": "2+2=", "choices": ["4", "5"], "answer": 0}
    type: multiple_choice
    data: arith.jsonl
    prompt: "Question: {question}\\nAnswer:"

A task file is code someone else wrote, so nothing in it runs. lm-eval's own task YAML can name
Python (``!function`` tags, ``class``, ``process_docs``, ``process_results``, custom metric
functions), read other files (``include``, ``dataset_path`` loader scripts) and render Jinja
templates, which lm-eval does not sandbox. kd reads its spec with PyYAML's safe loader, refuses any
YAML tag and any key outside :data:`KEYS` in one line (key, file, fix), builds the prompt from
plain field names (``{question}``: no attribute, index or filter), reads data files only from
inside the folder (:func:`kd.folders.file_in`: no link out), checks every row, and generates the
lm-eval task config itself (:func:`lm_eval_config`): kd's functions of the row for the prompt,
target and choices (no Jinja), built-in filters and metrics only.

Only the standard library and PyYAML are imported: a bad task file answers before torch loads.
"""

from __future__ import annotations

import functools
import json
import re
import string
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kd import folders
from kd.errors import KDUserError, brief, one_line
from kd.harness import lm_eval_format

TASK_TYPES = ("multiple_choice", "generate")
DEFAULT_PROMPT = "{question}"
DEFAULT_UNTIL = ("\n\n",)
DEFAULT_MAX_NEW_TOKENS = 64
SPEC_SUFFIXES = (".yaml", ".yml")
FIX = "describe the task with kd's keys (docs/eval.md)"
# kd's keys, each with what it holds (the error line of an unknown key lists them).
KEYS: dict[str, str] = {
    "task": "the task's name",
    "type": "multiple_choice or generate",
    "data": "a JSON-lines file inside the folder",
    "prompt": "the text before the answer, fields in braces",
    "choices": "multiple_choice: the field holding the list of choices",
    "answer": "multiple_choice: the field holding the right choice's index",
    "reference": "generate: the field holding the reference answer",
    "extract": "generate: a regular expression; its first group (or match) is compared",
    "until": "generate: the strings that end a completion",
    "max_new_tokens": "generate: the most tokens generated",
    "ignore_case": "generate: compare without case",
}
# lm-eval task keys that run Python, render unsandboxed Jinja or read other files: each gets its
# own refusal rather than "unknown key".
CODE_KEYS: dict[str, str] = lm_eval_format.CODE_KEYS | {
    "metric_list": "may name Python metric functions",
    "filter_list": "may name Python filters",
    "doc_to_text": "is a Jinja template, which lm-eval renders unsandboxed",
    "doc_to_target": "is a Jinja template, which lm-eval renders unsandboxed",
    "doc_to_choice": "is a Jinja template, which lm-eval renders unsandboxed",
    "dataset_path": "may name a dataset loading script",
    "dataset_kwargs": "may name a dataset loading script",
}
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,99}")
_FIELD = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,99}")
_STANDARD_TAG = "tag:yaml.org,2002:"
# Names Jinja gives a meaning of its own (keywords, literals, the template's own variables): a
# field of that name would not be the row's value.
_JINJA_NAMES = frozenset(
    "and or not in is if else elif for endfor recursive block extends import include from with "
    "without context as set macro call filter raw endraw true false none True False None self "
    "loop varargs kwargs caller".split()
)


def _plain_field(name: str) -> bool:
    return bool(_FIELD.fullmatch(name)) and name not in _JINJA_NAMES


@dataclass(frozen=True)
class TaskSpec:
    """One task of a task folder, checked.

    Attributes:
        name: the task's name (unique among the tasks evaluated).
        type: ``multiple_choice`` or ``generate``.
        spec_file: the task's YAML file.
        data_file: the resolved JSON-lines file (inside the folder).
        prompt: the prompt as ``(literal text, field or None)`` pieces.
        choices: the field with the choices (multiple_choice).
        answer: the field with the right choice's index (multiple_choice).
        reference: the field with the reference answer (generate).
        extract: the extraction pattern (generate), or None to compare the whole completion.
        until: the strings that end a completion (generate).
        max_new_tokens: the most tokens generated (generate).
        ignore_case: compare without case (generate).
        rows: the number of rows of the data file.
        target_delimiter: lm-eval's text between the prompt and the answer (a choice, or a
            few-shot example's reference).
        fewshot_delimiter: lm-eval's text after each few-shot example.
        num_fewshot: the task's own few-shot examples (None: lm-eval's default, none).
        ignore_punctuation: compare without punctuation (generate; lm-eval's exact_match option).
    """

    name: str
    type: str
    spec_file: Path
    data_file: Path
    prompt: tuple[tuple[str, str | None], ...]
    choices: str = "choices"
    answer: str = "answer"
    reference: str = "answer"
    extract: str | None = None
    until: tuple[str, ...] = DEFAULT_UNTIL
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    ignore_case: bool = False
    rows: int = 0
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    num_fewshot: int | None = None
    ignore_punctuation: bool = False

    def fields(self) -> tuple[str, ...]:
        """The data fields every row must hold."""
        named = tuple(f for _, f in self.prompt if f is not None)
        extra = (self.choices, self.answer) if self.type == "multiple_choice" else (self.reference,)
        return tuple(dict.fromkeys(named + extra))


def _where(path: Path) -> str:
    return one_line(str(path))


def _refuse_tags(
    node: yaml.Node, path: Path, key: str = "(top)", seen: set[int] | None = None
) -> None:
    """Refuse any YAML tag that is not a plain standard type (``!function``, ``!!python/...``).

    A node an alias repeats is walked once (``seen``): an alias inside its own anchor, or aliases
    of aliases, would otherwise recurse without end or take exponential time.
    """
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if node.tag and not node.tag.startswith(_STANDARD_TAG):
        raise KDUserError(
            f"{key}: {_where(path)} uses the YAML tag {one_line(node.tag)}, which would make "
            f"lm-eval run Python; kd runs nothing from a task file: {FIX}"
        )
    if node.tag.startswith(_STANDARD_TAG + "python"):
        raise KDUserError(
            f"{key}: {_where(path)} uses the YAML tag {one_line(node.tag)}; kd runs nothing "
            f"from a task file: {FIX}"
        )
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            name = key_node.value if isinstance(key_node, yaml.ScalarNode) else key
            _refuse_tags(key_node, path, str(name), seen)
            _refuse_tags(value_node, path, str(name), seen)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_tags(item, path, key, seen)


def _read_yaml(path: Path, key: str) -> dict[str, Any]:
    where = _where(path)
    try:
        text = path.read_text(encoding="utf-8")
        node = yaml.compose(text, Loader=yaml.SafeLoader)  # nodes only: nothing constructed yet
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise KDUserError(f"{key}: cannot read {where} ({brief(e)}); fix the YAML") from e
    if node is None:
        raise KDUserError(f"{key}: {where} is empty; {FIX}")
    _refuse_tags(node, path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:  # a key that is a list or mapping ("found unhashable key")
        problem = one_line(str(getattr(e, "problem", "") or brief(e)))
        raise KDUserError(f"{key}: cannot read {where} ({problem}); fix the YAML") from e
    if not isinstance(data, dict):
        raise KDUserError(f"{key}: {where} is not a mapping of keys; {FIX}")
    return data


def _check_keys(data: Mapping[str, Any], path: Path) -> None:
    where = _where(path)
    for key in data:
        if key in KEYS:
            continue
        name = one_line(str(key))
        if key in CODE_KEYS:
            raise KDUserError(
                f"{name}: in {where} {CODE_KEYS[key]}; kd runs nothing from a task file: {FIX}"
            )
        raise KDUserError(
            f"{name}: unknown key in {where}; the keys are {', '.join(KEYS)} (docs/eval.md)"
        )


def _text(data: Mapping[str, Any], key: str, path: Path, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or not value:
        raise KDUserError(f"{key}: in {_where(path)} must be a non-empty string ({KEYS[key]})")
    return value


def _field(data: Mapping[str, Any], key: str, path: Path, default: str) -> str:
    value = _text(data, key, path, default)
    if not _plain_field(value):
        raise KDUserError(
            f"{key}: {one_line(value)!r} in {_where(path)} is not a field name; use letters, digits "
            "and _ (the key of the rows' JSON objects), not a Jinja word (self, loop, not...)"
        )
    return value


def parse_prompt(prompt: str, path: Path) -> tuple[tuple[str, str | None], ...]:
    """``prompt`` as ``(literal, field)`` pieces: braces only around a plain field name.

    Literal text holds no brace at all (``{{`` and ``}}`` neither): the prompt is literal text
    and field names only (:func:`lm_eval_config` fills it in with kd's own function, no template).

    Raises:
        KDUserError: a malformed template, a field that is not a plain name (attribute, index,
            conversion, format), or a brace in the text.
    """
    where = _where(path)
    try:
        pieces = list(string.Formatter().parse(prompt))
    except ValueError as e:
        raise KDUserError(
            f"prompt: {one_line(prompt)!r} in {where} is not a template ({e}); put field names "
            "in braces, e.g. 'Question: {question}'"
        ) from e
    out: list[tuple[str, str | None]] = []
    for literal, field, spec, conversion in pieces:
        if "{" in literal or "}" in literal:
            raise KDUserError(
                f"prompt: in {where} has a brace outside a field; braces may only surround a "
                "field name ({question})"
            )
        if field is not None and (spec or conversion or not _plain_field(field)):
            raise KDUserError(
                f"prompt: {{{one_line(field)}}} in {where} is not a plain field name; write "
                "{name} with letters, digits and _ only, not a Jinja word (self, loop, not...)"
            )
        out.append((literal, field))
    return tuple(out)


def _generate_options(data: Mapping[str, Any], path: Path) -> dict[str, Any]:
    where = _where(path)
    options: dict[str, Any] = {"reference": _field(data, "reference", path, "answer")}
    extract = data.get("extract")
    if extract is not None:
        if not isinstance(extract, str) or not extract:
            raise KDUserError(f"extract: in {where} must be a regular expression (a string)")
        try:
            re.compile(extract)
        except re.error as e:
            raise KDUserError(
                f"extract: {one_line(extract)!r} in {where} is not a regular expression ({e}); "
                "fix it, e.g. '(-?[0-9]+)'"
            ) from e
        options["extract"] = extract
    until = data.get("until", list(DEFAULT_UNTIL))
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, list) or not until or not all(isinstance(u, str) and u for u in until):
        raise KDUserError(f"until: in {where} must be a list of non-empty strings")
    options["until"] = tuple(until)
    new = data.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not isinstance(new, int) or isinstance(new, bool) or not 1 <= new <= 4096:
        raise KDUserError(f"max_new_tokens: in {where} must be a whole number from 1 to 4096")
    options["max_new_tokens"] = new
    ignore_case = data.get("ignore_case", False)
    if not isinstance(ignore_case, bool):
        raise KDUserError(f"ignore_case: in {where} must be true or false")
    options["ignore_case"] = ignore_case
    return options


def _check_rows(spec: TaskSpec) -> int:
    """Every row of the data file: a JSON object with the task's fields, of the right types."""
    where = _where(spec.data_file)
    count = 0
    try:
        with spec.data_file.open(encoding="utf-8") as f:
            lines = list(f)
    except (OSError, UnicodeDecodeError) as e:
        raise KDUserError(f"data: cannot read {where} ({brief(e)}); fix the file") from e
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise KDUserError(
                f"data: {where} line {number} is not JSON ({brief(e)}); one JSON object a line"
            ) from e
        if not isinstance(row, dict):
            raise KDUserError(f"data: {where} line {number} is not a JSON object")
        missing = [f for f in spec.fields() if f not in row]
        if missing:
            raise KDUserError(
                f"data: {where} line {number} has no {', '.join(missing)} (task {spec.name}); "
                "add the field or name another in the task file"
            )
        for field, _ in ((f, None) for _, f in spec.prompt if f is not None):
            if not isinstance(row[field], (str, int, float)):
                raise KDUserError(f"data: {where} line {number}: {field} must be text")
        if spec.type == "multiple_choice":
            choices, answer = row[spec.choices], row[spec.answer]
            if (
                not isinstance(choices, list)
                or len(choices) < 2
                or not all(isinstance(c, str) for c in choices)
            ):
                raise KDUserError(
                    f"data: {where} line {number}: {spec.choices} must be a list of at least two "
                    "strings"
                )
            if not isinstance(answer, int) or isinstance(answer, bool):
                raise KDUserError(
                    f"data: {where} line {number}: {spec.answer} must be the index of the right "
                    f"choice (0 to {len(choices) - 1})"
                )
            if not 0 <= answer < len(choices):
                raise KDUserError(
                    f"data: {where} line {number}: {spec.answer} {answer} is not an index of the "
                    f"{len(choices)} choices; use 0 to {len(choices) - 1}"
                )
        elif not isinstance(row[spec.reference], (str, int, float)):
            raise KDUserError(f"data: {where} line {number}: {spec.reference} must be text")
        count += 1
    if count == 0:
        raise KDUserError(f"data: {where} has no rows; add JSON lines")
    return count


def _rows(spec: TaskSpec) -> Iterator[dict[str, Any]]:
    """The rows of a checked task's data file (:func:`_check_rows` has read every one)."""
    with spec.data_file.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def most_fewshot(spec: TaskSpec) -> int:
    """The most few-shot examples each row of a checked task can get: lm-eval draws them from the
    task's rows other than the one scored (a row equal to it counts as it)."""
    # The fields lm-eval's documents hold (_rows_as_written), as text.
    keys = [json.dumps([str(r[name]) for name in spec.fields()]) for r in _rows(spec)]
    return len(keys) - max(Counter(keys).values())


def prompt_text(spec: TaskSpec, row: Mapping[str, Any]) -> str:
    """The prompt of ``row`` as lm-eval renders ``spec``'s template (fields as text)."""
    return _row_prompt(spec.prompt, row)


def row_texts(spec: TaskSpec, *, limit: int | None = None) -> list[tuple[str, list[str]]]:
    """The first ``limit`` rows of a checked task (:func:`read_task_file`) as text: each row's
    prompt and its answers (the choices; the reference)."""
    out: list[tuple[str, list[str]]] = []
    for row in _rows(spec):
        if limit is not None and len(out) >= limit:
            break
        answers = (
            [str(c) for c in row[spec.choices]]
            if spec.type == "multiple_choice"
            else [str(row[spec.reference])]
        )
        out.append((prompt_text(spec, row), answers))
    return out


def read_task_file(path: Path, folder: Path, *, key: str = "--tasks") -> TaskSpec:
    """One task file of ``folder``, checked with its data file.

    Raises:
        KDUserError: one line naming the key and the file, and the fix.
    """
    data = _read_yaml(path, key)
    extra: dict[str, Any] = {}
    if lm_eval_format.is_lm_eval_format(
        data
    ):  # lm-eval's own keys, in the subset that runs nothing
        data, extra = lm_eval_format.to_kd_keys(data, path, folder)
    _check_keys(data, path)
    where = _where(path)
    name = _text(data, "task", path)
    if not _NAME.fullmatch(name):
        raise KDUserError(
            f"task: {one_line(name)!r} in {where} is not a task name; use letters, digits, _ . -"
        )
    kind = _text(data, "type", path)
    if kind not in TASK_TYPES:
        raise KDUserError(
            f"type: {one_line(kind)!r} in {where} is not one of {', '.join(TASK_TYPES)}"
        )
    wrong = [k for k in data if k in ("choices", "answer") and kind == "generate"] + [
        k for k in data if k in _GENERATE_ONLY and kind == "multiple_choice"
    ]
    if wrong:
        raise KDUserError(f"{wrong[0]}: in {where} does not apply to a {kind} task; remove it")
    data_name = _text(data, "data", path)
    data_file = folders.file_in(folder, data_name, key="data")
    if data_file is None:
        raise KDUserError(
            f"data: {one_line(data_name)} (in {where}) is not a file in {_where(folder)}; put the "
            "JSON-lines file in the task folder"
        )
    prompt = parse_prompt(_text(data, "prompt", path, DEFAULT_PROMPT), path)
    options: dict[str, Any]
    if kind == "multiple_choice":
        options = {
            "choices": _field(data, "choices", path, "choices"),
            "answer": _field(data, "answer", path, "answer"),
        }
    else:
        options = _generate_options(data, path) | {"target_delimiter": ""}
    spec = TaskSpec(
        name=name, type=kind, spec_file=path, data_file=data_file, prompt=prompt, **options | extra
    )
    return TaskSpec(**{**spec.__dict__, "rows": _check_rows(spec)})


_GENERATE_ONLY = ("reference", "extract", "until", "max_new_tokens", "ignore_case")


def read_task_folder(folder: Path, *, key: str = "--tasks") -> list[TaskSpec]:
    """Every task file (``*.yaml``, ``*.yml``) directly in ``folder``, checked.

    Args:
        folder: the task folder.
        key: the flag or config key that named it (``--tasks``, ``eval.tasks``).

    Raises:
        KDUserError: no task file, a file that links out of the folder or is not regular, or any
            problem of :func:`read_task_file`.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise KDUserError(f"{key}: {_where(folder)} is not a folder; pass a task folder")
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(SPEC_SUFFIXES))
    if not names:
        raise KDUserError(
            f"{key}: {_where(folder)} holds no task file (*.yaml); write one per task "
            "(docs/eval.md)"
        )
    specs = []
    for name in names:
        path = folders.file_in(folder, name, key=key)
        if path is None:  # a dangling link
            raise KDUserError(f"{key}: {_where(folder / name)} is a broken link; remove it")
        specs.append(read_task_file(folder / name, folder, key=key))
    return specs


# lm-eval's doc_to_text / doc_to_target / doc_to_choice, as kd's own functions of the row. A
# Jinja template there would be reparsed after rendering: lm-eval turns an all-digit text into an
# int (a multiple-choice prompt "12" becomes a "multiple input" index: every row scored wrong) and
# a bracketed target into a list ("[1, 2]": compared as the list's items, or retyped).
def _row_prompt(pieces: tuple[tuple[str, str | None], ...], doc: Mapping[str, Any]) -> str:
    return "".join(literal + (str(doc[field]) if field else "") for literal, field in pieces)


def _row_text(field: str, doc: Mapping[str, Any]) -> str:
    return str(doc[field])


def _row_index(field: str, doc: Mapping[str, Any]) -> int:
    return int(doc[field])


def _row_choices(field: str, doc: Mapping[str, Any]) -> list[str]:
    return [str(c) for c in doc[field]]


def _rows_as_written(spec: TaskSpec, dataset: Any) -> Any:
    """lm-eval's ``process_docs``: the task's rows as kd read them, not as the ``datasets`` JSON
    loader typed them (a column of ints and floats is all floats there: 1 would be "1.0")."""
    import datasets

    rows = []
    for row in _rows(spec):
        doc = {name: str(row[name]) for name in spec.fields()}
        if spec.type == "multiple_choice":
            doc[spec.choices] = [str(c) for c in row[spec.choices]]
            doc[spec.answer] = int(row[spec.answer])
        rows.append(doc)
    return datasets.Dataset.from_list(rows)


def lm_eval_config(spec: TaskSpec) -> dict[str, Any]:
    """The lm-eval task config of ``spec``: JSON data, kd's functions of the row (no template),
    built-in metrics.

    Returns:
        A dict for ``lm_eval``'s ``TaskManager.load`` / ``simple_evaluate(tasks=[...])``.
    """
    config: dict[str, Any] = {
        "task": spec.name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(spec.data_file)}},
        "test_split": "test",
        # Few-shot examples come from the rows too: named as the split evaluated, lm-eval leaves
        # the row being scored out of its own examples (without it, a row may be shown its answer).
        "fewshot_split": "test",
        "process_docs": functools.partial(_rows_as_written, spec),
        "doc_to_text": functools.partial(_row_prompt, spec.prompt),
        "target_delimiter": spec.target_delimiter,
        "fewshot_delimiter": spec.fewshot_delimiter,
        "metadata": {"version": 1, "kd_task_file": str(spec.spec_file)},
    }
    if spec.num_fewshot is not None:
        config["num_fewshot"] = spec.num_fewshot
    if spec.type == "multiple_choice":
        return config | {
            "output_type": "multiple_choice",
            "doc_to_choice": functools.partial(_row_choices, spec.choices),
            "doc_to_target": functools.partial(_row_index, spec.answer),
            "metric_list": [
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
            ],
        }
    steps: list[dict[str, Any]] = []
    if spec.extract is not None:
        steps.append({"function": "regex", "regex_pattern": spec.extract, "group_select": 0})
    steps.append({"function": "take_first"})
    return config | {
        "output_type": "generate_until",
        "doc_to_target": functools.partial(_row_text, spec.reference),
        "generation_kwargs": {
            "until": list(spec.until),
            "max_gen_toks": spec.max_new_tokens,
            "do_sample": False,
        },
        "filter_list": [{"name": "extract" if spec.extract else "none", "filter": steps}],
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": spec.ignore_case,
                "ignore_punctuation": spec.ignore_punctuation,
            }
        ],
    }
