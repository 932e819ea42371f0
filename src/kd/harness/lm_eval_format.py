"""lm-eval's own task YAML, in a subset that runs nothing, translated into kd's task spec.

Many users already describe their tasks in lm-evaluation-harness's format
(``lm_eval.api.task.TaskConfig``). kd accepts such a file when every key is one whose meaning is
data, not code:

* ``task``; ``dataset_path: json`` with ``dataset_kwargs: {data_files: FILE}`` (or ``{SPLIT:
  FILE}``), the file inside the task folder (kd's ``data:`` is taken too); ``test_split`` or
  ``validation_split`` (the split lm-eval evaluates);
* ``output_type``: ``multiple_choice`` or ``generate_until``;
* ``doc_to_text``, ``doc_to_target``, ``doc_to_choice``: a field name, or a template made only of
  literal text and ``{{field}}`` placeholders (no filter, expression, block or comment); the
  target and the choices name one field;
* ``target_delimiter``, ``fewshot_delimiter``, ``num_fewshot``, ``metadata``;
* ``generation_kwargs``: ``until``, ``max_gen_toks``, ``do_sample: false``, ``temperature: 0``;
* ``filter_list``: one filter of lm-eval's built-in ``regex`` (``group_select: 0``) and/or
  ``take_first``;
* ``metric_list``: lm-eval's built-in ``exact_match``, ``acc``, ``acc_norm`` with
  ``aggregation: mean``, ``higher_is_better: true``, ``ignore_case``, ``ignore_punctuation``.

Anything else (``!function``, ``class``, ``include``, ``process_docs``, ``process_results``,
custom metrics, aggregations or filters, another ``dataset_path``, Jinja beyond ``{{field}}``)
is refused in one line naming the key and the file, before anything loads. The translation is
kd's spec (:func:`to_kd_keys`), so the task runs exactly as the same task written with kd's keys:
kd writes the lm-eval config itself (:func:`kd.harness.tasks.lm_eval_config`).

Only the standard library: nothing here imports lm_eval or torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kd import folders
from kd.errors import KDUserError, one_line

FIX = "keep to the lm-eval keys kd accepts (docs/eval.md)"
# lm-eval's keys kd accepts, each with what it may hold.
LM_EVAL_KEYS: dict[str, str] = {
    "task": "the task's name",
    "dataset_path": "json",
    "dataset_kwargs": "{data_files: a JSON-lines file in the folder}",
    "data": "a JSON-lines file in the folder (kd's key)",
    "test_split": "the split evaluated",
    "validation_split": "the split evaluated when there is no test_split",
    "output_type": "multiple_choice or generate_until",
    "doc_to_text": "a field or literal text with {{field}}",
    "doc_to_target": "one field",
    "doc_to_choice": "one field holding the list of choices",
    "target_delimiter": "text",
    "fewshot_delimiter": "text",
    "num_fewshot": "a whole number",
    "generation_kwargs": "until, max_gen_toks, do_sample: false, temperature: 0",
    "filter_list": "lm-eval's regex and take_first",
    "metric_list": "exact_match, acc, acc_norm",
    "metadata": "plain values",
}
# lm-eval keys that always run Python or read other files, in either format.
CODE_KEYS: dict[str, str] = {
    "include": "reads another YAML file",
    "class": "names a Python class",
    "process_docs": "names Python code",
    "process_results": "names Python code",
    "custom_dataset": "names Python code",
    "unsafe_code": "runs generated code",
}
OUTPUT_TYPES = {"multiple_choice": "multiple_choice", "generate_until": "generate"}
METRICS = ("exact_match", "acc", "acc_norm")
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z][A-Za-z0-9_]*)\s*\}\}")
_FIELD = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,99}")
_JINJA = re.compile(r"\{\{|\}\}|\{%|%\}|\{#|#\}")


def is_lm_eval_format(data: Mapping[str, Any]) -> bool:
    """Whether a task file is lm-eval's format: its ``output_type``, not kd's ``type``."""
    return "output_type" in data and "type" not in data


def _refuse(key: str, path: Path, what: str, fix: str = FIX) -> KDUserError:
    return KDUserError(f"{key}: in {one_line(str(path))} {what}; {fix}")


def _string(data: Mapping[str, Any], key: str, path: Path) -> str:
    value = data[key]
    if not isinstance(value, str):
        raise _refuse(key, path, "must be text", f"write {LM_EVAL_KEYS[key]}")
    return value


def _template(value: str, key: str, path: Path, fields: frozenset[str]) -> str:
    """``value`` as kd's prompt (``{field}``): a field name, or literal text with ``{{field}}``."""
    if value in fields:
        return "{" + value + "}"
    literal = _PLACEHOLDER.sub("", value)
    if _JINJA.search(literal) or "{" in literal or "}" in literal:
        raise _refuse(
            key,
            path,
            f"{one_line(value)!r} is Jinja beyond {{{{field}}}} (a filter, expression, block or "
            "brace), which lm-eval renders unsandboxed",
            "write literal text and {{field}} placeholders only (docs/eval.md)",
        )
    return _PLACEHOLDER.sub(lambda m: "{" + m.group(1) + "}", value)


def _one_field(value: Any, key: str, path: Path) -> str:
    """A target or choices key: one field, bare or as ``{{field}}``."""
    if isinstance(value, str):
        m = _PLACEHOLDER.fullmatch(value.strip())
        name = m.group(1) if m else value
        if _FIELD.fullmatch(name):
            return name
    raise _refuse(
        key,
        path,
        f"{one_line(str(value))!r} is not one field",
        "name the rows' field, e.g. answer or {{answer}} (docs/eval.md)",
    )


def _data_file(data: Mapping[str, Any], path: Path) -> str:
    """The file of the evaluated split: ``data:``, or ``dataset_kwargs.data_files``."""
    if "dataset_path" in data and data["dataset_path"] != "json":
        raise _refuse(
            "dataset_path",
            path,
            f"{one_line(str(data['dataset_path']))!r} may name a dataset loading script or the Hub",
            "put the rows in a JSON-lines file in the folder: dataset_path: json with "
            "dataset_kwargs: {data_files: FILE} (docs/eval.md)",
        )
    if "test_split" in data and "validation_split" in data:
        raise _refuse("validation_split", path, "is given beside test_split", "keep one of them")
    split = data.get("test_split", data.get("validation_split"))
    if "data" in data:
        if "dataset_kwargs" in data or "dataset_path" in data:
            raise _refuse("data", path, "is given beside dataset_path", "keep one of them")
        return _string(data, "data", path)
    kwargs = data.get("dataset_kwargs")
    if data.get("dataset_path") != "json" or not isinstance(kwargs, Mapping):
        raise _refuse(
            "dataset_path",
            path,
            "is missing",
            "write dataset_path: json and dataset_kwargs: {data_files: FILE} (docs/eval.md)",
        )
    extra = [k for k in kwargs if k != "data_files"]
    if extra:
        raise _refuse(f"dataset_kwargs.{one_line(str(extra[0]))}", path, "is not data_files")
    files = kwargs.get("data_files")
    if isinstance(files, str):  # one file: the datasets library calls its split train
        if split not in (None, "train"):
            raise _refuse(
                "test_split", path, f"names {split!r}, but data_files has only train", FIX
            )
        return files
    if isinstance(files, Mapping) and split in files and isinstance(files[split], str):
        return files[split]
    raise _refuse(
        "dataset_kwargs.data_files",
        path,
        "must be one file, or {SPLIT: FILE} holding the split evaluated (test_split)",
    )


def _generation(data: Mapping[str, Any], path: Path) -> dict[str, Any]:
    kwargs = data.get("generation_kwargs", {})
    if not isinstance(kwargs, Mapping):
        raise _refuse("generation_kwargs", path, "is not a mapping")
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = f"generation_kwargs.{one_line(str(key))}"
        if key == "until":
            out["until"] = value
        elif key == "max_gen_toks":
            out["max_new_tokens"] = value
        elif key == "do_sample" and value is False or key == "temperature" and value == 0:
            continue
        else:
            raise _refuse(name, path, "is not greedy decoding's", "kd scores greedy completions")
    return out


def _extract(data: Mapping[str, Any], path: Path) -> str | None:
    filters = data.get("filter_list")
    if filters is None:
        return None
    if not isinstance(filters, list) or len(filters) != 1 or not isinstance(filters[0], Mapping):
        raise _refuse("filter_list", path, "must hold one filter", FIX)
    steps = filters[0].get("filter")
    if not isinstance(steps, list) or not all(isinstance(s, Mapping) for s in steps):
        raise _refuse("filter_list", path, "has no list of filter steps", FIX)
    pattern = None
    names = [s.get("function") for s in steps]
    if names not in (["take_first"], ["regex", "take_first"], ["regex"]):
        raise _refuse(
            "filter_list",
            path,
            f"uses {one_line(str(names))}; a function other than lm-eval's built-in regex then "
            "take_first would run code",
        )
    for step in steps:
        if step["function"] != "regex":
            if set(step) != {"function"}:
                raise _refuse("filter_list", path, "take_first takes no option")
            continue
        if (
            set(step) - {"function", "regex_pattern", "group_select"}
            or step.get("group_select", 0) != 0
        ):
            raise _refuse(
                "filter_list", path, "regex takes regex_pattern (and group_select: 0) only"
            )
        pattern = step.get("regex_pattern")
    return pattern


def _metrics(data: Mapping[str, Any], path: Path, kind: str) -> dict[str, Any]:
    metrics = data.get("metric_list")
    if metrics is None:
        return {}
    if not isinstance(metrics, list):
        raise _refuse("metric_list", path, "is not a list")
    out: dict[str, Any] = {}
    allowed = ("acc", "acc_norm") if kind == "multiple_choice" else ("exact_match",)
    for entry in metrics:
        if not isinstance(entry, Mapping) or entry.get("metric") not in allowed:
            name = entry.get("metric") if isinstance(entry, Mapping) else entry
            raise _refuse(
                "metric_list",
                path,
                f"names {one_line(str(name))!r}, not one of lm-eval's built-in "
                f"{', '.join(allowed)} (a custom metric would run code)",
            )
        for key, value in entry.items():
            if key == "metric" or (key, value) in (
                ("aggregation", "mean"),
                ("higher_is_better", True),
            ):
                continue
            if key in ("ignore_case", "ignore_punctuation") and entry["metric"] == "exact_match":
                if not isinstance(value, bool):
                    raise _refuse(f"metric_list.{key}", path, "must be true or false")
                out[key] = value
                continue
            raise _refuse(
                f"metric_list.{one_line(str(key))}",
                path,
                f"{one_line(str(value))!r} is not a plain option of {entry['metric']} "
                "(aggregation: mean, higher_is_better: true, ignore_case, ignore_punctuation)",
            )
    return out


def _fields(folder: Path, data_name: str) -> frozenset[str]:
    """The first row's fields (a ``doc_to_text`` naming one is that field, as in lm-eval)."""
    file = folders.file_in(folder, data_name, key="data")
    if file is None:
        return frozenset()
    with file.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    return frozenset()  # the row check names the line
                return frozenset(row) if isinstance(row, dict) else frozenset()
    return frozenset()


def _shared_extra(data: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The delimiters and the few-shot count (TaskSpec fields kd's keys lack)."""
    extra: dict[str, Any] = {}
    for key in ("target_delimiter", "fewshot_delimiter"):
        if key in data:
            extra[key] = _string(data, key, path)
    if "num_fewshot" in data:
        shots = data["num_fewshot"]
        if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
            raise _refuse("num_fewshot", path, "must be a whole number, 0 or more")
        extra["num_fewshot"] = shots
    return extra


def _generate_keys(
    data: Mapping[str, Any],
    path: Path,
    out: dict[str, Any],
    extra: dict[str, Any],
    target: str | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A generate_until task's kd keys: reference, generation, extraction, comparison."""
    kind = "generate"
    if target is not None:
        out["reference"] = target
    # lm-eval's defaults: until the few-shot delimiter, HFLM's 256 new tokens at most.
    out |= {"until": [extra.get("fewshot_delimiter", "\n\n")], "max_new_tokens": 256}
    out |= _generation(data, path)
    extract = _extract(data, path)
    if extract is not None:
        out["extract"] = extract
    metrics = _metrics(data, path, kind)
    if "ignore_case" in metrics:
        out["ignore_case"] = metrics["ignore_case"]
    if "ignore_punctuation" in metrics:
        extra["ignore_punctuation"] = metrics["ignore_punctuation"]
    extra.setdefault("target_delimiter", " ")
    return out, extra


def to_kd_keys(
    data: Mapping[str, Any], path: Path, folder: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """An lm-eval task file as kd's keys (checked by :func:`kd.harness.tasks.read_task_file`) and
    the :class:`~kd.harness.tasks.TaskSpec` fields kd's keys lack (delimiters, few-shot).

    Raises:
        KDUserError: a key outside :data:`LM_EVAL_KEYS`, or a value outside the subset.
    """
    for key in data:
        if key in CODE_KEYS:
            raise _refuse(
                one_line(str(key)), path, f"{CODE_KEYS[key]}; kd runs nothing from a task file"
            )
        if key not in LM_EVAL_KEYS:
            raise _refuse(
                one_line(str(key)),
                path,
                "is not in the lm-eval subset kd accepts (it may run code or read other files)",
                f"the keys are {', '.join(LM_EVAL_KEYS)} (docs/eval.md)",
            )
    output_type = data.get("output_type")
    if output_type not in OUTPUT_TYPES:
        raise _refuse(
            "output_type",
            path,
            f"{one_line(str(output_type))!r} is not multiple_choice or generate_until",
            "use one of them (docs/eval.md)",
        )
    kind = OUTPUT_TYPES[output_type]
    data_name = _data_file(data, path)
    fields = _fields(folder, data_name)
    out: dict[str, Any] = {"type": kind, "data": data_name}
    if "task" in data:
        out["task"] = data["task"]
    if "doc_to_text" in data:
        out["prompt"] = _template(_string(data, "doc_to_text", path), "doc_to_text", path, fields)
    target = (
        _one_field(data["doc_to_target"], "doc_to_target", path)
        if "doc_to_target" in data
        else None
    )
    extra = _shared_extra(data, path)
    if kind == "multiple_choice":
        for key in ("generation_kwargs", "filter_list"):
            if key in data:
                raise _refuse(key, path, "does not apply to a multiple_choice task", "remove it")
        if "doc_to_choice" in data:
            out["choices"] = _one_field(data["doc_to_choice"], "doc_to_choice", path)
        if target is not None:
            out["answer"] = target
        _metrics(data, path, kind)
        return out, extra
    if "doc_to_choice" in data:
        raise _refuse("doc_to_choice", path, "does not apply to generate_until", "remove it")
    return _generate_keys(data, path, out, extra, target)
