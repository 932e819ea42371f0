"""``kd eval``: model folders side by side on lm-evaluation-harness tasks.

    kd eval --model student=out/final --model teacher=/models/T --model start=/models/S \\
        --tasks my_tasks/ --output out/eval.json

Everything the command line names is checked first (the task files and their data, every model
folder, the output file), then the models load one at a time. Importing this module is cheap.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

from kd.errors import KDUserError, brief, one_line

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/]{0,63}")
_GENERIC = ("final", "best", "adapter")  # kd's folder names: the run's folder names the column


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to ``kd``'s argparse subparsers."""
    p = subparsers.add_parser(
        "eval",
        help="score model folders side by side on lm-evaluation-harness tasks",
        description="Evaluate model folders (a run's final/ or best/, the teacher, the starting "
        "student) with lm-evaluation-harness, side by side: one table (task x model, with "
        "standard errors) and eval.json. Tasks: a folder of kd task files (multiple choice or "
        "generation over local JSON lines; nothing in them runs, docs/eval.md) or the name of a "
        "task lm-eval knows whose data is available locally.",
    )
    p.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="[NAME=]DIR",
        help="a model folder, repeatable; NAME heads its column (default: the folder's name, or "
        "its run's for final/ and best/)",
    )
    p.add_argument(
        "--tasks",
        action="append",
        required=True,
        metavar="FOLDER|NAME",
        help="a folder of kd task files, or an lm-eval task name; repeatable",
    )
    p.add_argument(
        "--output", default="eval.json", metavar="FILE", help="the results file (default eval.json)"
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing --output")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="batch size (default 8)")
    p.add_argument(
        "--limit", type=int, default=None, metavar="N", help="at most N examples per task"
    )
    p.add_argument("--num-fewshot", type=int, default=None, metavar="N", help="few-shot examples")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    return p


def model_folders(values: list[str]) -> list[Any]:
    """``--model`` values as named folders (``NAME=DIR`` or ``DIR``), names unique.

    Raises:
        KDUserError: a bad name, a missing folder, or two columns with one name.
    """
    from kd.harness.evaluate import ModelFolder

    models = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or Path(value).exists():
            name, path = "", value
        if not path.strip():  # Path("") is the current folder
            raise KDUserError(
                f"--model: {one_line(value)!r} names no folder; pass a Hugging Face model "
                "folder (e.g. a run's final/), as DIR or NAME=DIR"
            )
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise KDUserError(
                f"--model: {one_line(path)} is not a folder; pass a Hugging Face model folder "
                "(e.g. a run's final/)"
            )
        if not name:
            resolved = folder.resolve()
            name = (
                f"{resolved.parent.name}/{resolved.name}"
                if resolved.name in _GENERIC
                else resolved.name
            )
        if not _NAME.fullmatch(name):
            raise KDUserError(
                f"--model: {one_line(name)!r} is not a column name; use at most 64 letters, "
                "digits, _ . - / (NAME=DIR names a long folder)"
            )
        _check_folder(folder)
        if any(m.name == name for m in models):
            raise KDUserError(f"--model: two models are named {name}; name them: --model NAME=DIR")
        models.append(ModelFolder(name=name, path=folder))
    return models


def _check_folder(folder: Path) -> None:
    """What :func:`kd.generate.load_model` checks before reading a weight, for every model first."""
    from kd import folders
    from kd.generate import _check_model_folder, _inspect

    folders.check_folder(folder, key="--model")  # no auto_map, no link out, no named pipe
    _check_model_folder(_inspect(folder, "--model"), "--model")


def _check_output(output: Path) -> None:
    """``--output`` can be written, checked before hours of scoring: no file in the way of its
    folder, and a file can be made in the nearest folder that exists."""
    import tempfile

    where = one_line(str(output))
    if output.is_dir():
        raise KDUserError(f"--output: {where} is a folder; name a file")
    folder = output.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise KDUserError(
            f"--output: cannot write {where}: {one_line(str(folder))} is a file, not a folder; "
            "choose a path you can write to"
        )
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise KDUserError(
            f"--output: cannot write {where} ({brief(e)}); choose a path you can write to"
        ) from e


def _check_numbers(args: argparse.Namespace) -> None:
    from kd.generate import _check_device

    _check_device(args.device)
    if args.batch_size < 1:
        raise KDUserError(f"--batch-size: {args.batch_size} is not a batch size; pass 1 or more")
    if args.limit is not None and args.limit < 1:
        raise KDUserError(f"--limit: {args.limit} evaluates nothing; pass 1 or more")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise KDUserError(f"--num-fewshot: {args.num_fewshot} is negative; pass 0 or more")


def run(args: argparse.Namespace) -> int:
    """``kd eval``: check everything, evaluate, print the table, write the results file."""
    from kd.harness.evaluate import (
        Settings,
        check_chat_templates,
        check_fewshot,
        evaluate_models,
        lm_eval_version,
        resolve_tasks,
        table,
        task_manager,
        write_json,
    )

    _check_numbers(args)
    output = Path(args.output).expanduser()
    _check_output(output)
    if output.exists() and not args.force:
        raise KDUserError(
            f"--output: {one_line(str(output))} already exists; pass --force to overwrite it"
        )
    tasks = resolve_tasks(
        args.tasks, key="--tasks"
    )  # every task file and its data, before anything loads
    check_fewshot(tasks, args.num_fewshot, key="--num-fewshot")
    lm_eval_version()
    # Nothing is downloaded: lm-eval's tasks read their data from the local cache.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    manager = task_manager(tasks)  # lm-eval task names and their data
    models = model_folders(args.model)
    if args.chat:
        check_chat_templates(models, key="--chat")
    settings = Settings(
        device=args.device,
        batch_size=args.batch_size,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        chat=args.chat,
    )
    payload = evaluate_models(models, tasks, settings, manager=manager)
    print(table(payload))
    write_json(output, payload)
    print(f"wrote {output}")
    return 0
