"""Model folders scored side by side by lm-evaluation-harness: its own ``simple_evaluate``.

Each model folder is loaded by :func:`kd.generate.load_model` (offline, ``trust_remote_code=False``,
kd's folder checks; a LoRA student's ``final/`` holds merged weights, an adapter-only folder is
merged by peft here), wrapped in lm-eval's ``HFLM`` and evaluated on every task, then freed before
the next model loads. The user's own tasks come from :mod:`kd.harness.tasks` as generated lm-eval
configs; lm-eval's built-in tasks are taken by name when their data is available locally.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kd.errors import KDUserError, brief, one_line
from kd.harness.tasks import TaskSpec, lm_eval_config, most_fewshot, read_task_folder

INSTALL_HINT = "install it with pip install 'kd[eval]' (lm_eval 0.4.13)"


@dataclass(frozen=True)
class ModelFolder:
    """A model to evaluate: the name its column shows and its folder."""

    name: str
    path: Path


@dataclass
class Tasks:
    """What ``--tasks`` asked for: kd task specs and lm-eval task names."""

    specs: list[TaskSpec] = field(default_factory=list)
    builtin: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return [s.name for s in self.specs] + list(self.builtin)


@dataclass(frozen=True)
class Settings:
    """How the tasks run (the same for every model)."""

    device: str = "cpu"
    batch_size: int = 8
    limit: int | None = None
    num_fewshot: int | None = None
    chat: bool = False
    bootstrap_iters: int = 1000


def resolve_tasks(values: Sequence[str], *, key: str) -> Tasks:
    """Task folders read and checked here (every file and row); other values lm-eval names.

    A value that exists, holds a ``/`` or starts with ``.`` is a folder; lm-eval names are checked
    by :func:`task_manager`.

    Raises:
        KDUserError: a task folder's problem, or two tasks of one name; the line starts with
            ``key``.
    """
    tasks = Tasks()
    for value in values:
        if not value.strip():  # Path("") is the current folder
            raise KDUserError(f"{key}: an empty value; name a task folder or an lm-eval task")
        path = Path(value).expanduser()
        if path.exists() or "/" in value or value.startswith("."):
            tasks.specs += read_task_folder(path, key=key)
        elif value not in tasks.builtin:
            tasks.builtin.append(value)
    seen: set[str] = set()
    for name in tasks.names():
        if name in seen:
            raise KDUserError(f"{key}: two tasks are named {one_line(name)}; rename one (task:)")
        seen.add(name)
    return tasks


def check_fewshot(tasks: Tasks, num_fewshot: int | None, *, key: str) -> None:
    """Each task's few-shot examples (``num_fewshot``, else the task file's own) fit its rows.

    lm-eval draws a row's examples from the task's other rows; asking more fails in lm-eval's
    sampler after the model has loaded.

    Raises:
        KDUserError: more examples than a task has other rows; names ``key`` (or the task file's
            ``num_fewshot``).
    """
    for spec in tasks.specs:
        shots = spec.num_fewshot if num_fewshot is None else num_fewshot
        if not shots:
            continue
        most = most_fewshot(spec)
        if shots > most:
            where = (
                key
                if num_fewshot is not None
                else f"num_fewshot: in {one_line(str(spec.spec_file))}"
            )
            raise KDUserError(
                f"{where}: {shots} few-shot examples, but task {spec.name} has {most} rows to "
                f"draw them from (its other rows than the one scored); ask at most {most} or add rows"
            )


def lm_eval_version() -> str:
    """The installed lm_eval's version.

    Raises:
        KDUserError: lm_eval is not installed.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        raise KDUserError(
            f"eval: kd eval runs lm-evaluation-harness, which is not installed; {INSTALL_HINT}"
        ) from None


@contextlib.contextmanager
def _quiet(level: int = logging.WARNING) -> Iterator[None]:
    """lm-eval's INFO lines (seeds, task configs) off: the output is the table. Nor does it ask
    git for the commit of the current folder (kd records none): outside a repository git printed
    ``fatal: not a git repository`` once per model."""
    import lm_eval.evaluator

    logger = logging.getLogger("lm_eval")
    saved = logger.level, getattr(lm_eval.evaluator, "get_git_commit_hash", None)
    logger.setLevel(level)
    if saved[1] is not None:
        lm_eval.evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        logger.setLevel(saved[0])
        if saved[1] is not None:
            lm_eval.evaluator.get_git_commit_hash = saved[1]


def task_manager(tasks: Tasks, *, key: str = "--tasks") -> Any:
    """lm-eval's ``TaskManager``: its built-in task index only when a built-in task is named.

    The user's task folders are never given to it (``include_path``): lm-eval would read every
    YAML there with its own loader (``include`` of other files); kd hands it generated configs.

    Raises:
        KDUserError: a built-in name lm-eval does not know, or whose data is not available here.
    """
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_defaults=bool(tasks.builtin))
    for name in tasks.builtin:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=1)
            hint = (
                f"did you mean {close[0]}?"
                if close
                else "pass a task folder or a name lm-eval lists (lm-eval ls tasks)"
            )
            raise KDUserError(
                f"{key}: {one_line(name)} is not a task folder here nor a task lm-eval knows; {hint}"
            )
        try:
            with _quiet():
                manager.load([name])  # reads its data now: before any model loads
        except Exception as e:  # datasets raises many types for data it cannot reach
            raise KDUserError(
                f"{key}: lm-eval task {name} cannot read its data ({brief(e)}); its data must be "
                "available locally (the Hugging Face datasets cache, HF_DATASETS_OFFLINE=1) or use "
                "a task folder of your own"
            ) from e
    return manager


def check_chat_templates(models: Sequence[ModelFolder], *, key: str) -> None:
    """Every model's tokenizer has a chat template that renders a user turn (``--chat``), before
    any weight loads: lm-eval would fail with a traceback at its first prompt.

    Raises:
        KDUserError: a tokenizer without a chat template, or one that fails to render
            (:func:`kd.hf.tokenization.render_chat_template`: the sandbox, the time limit).
    """
    from kd.generate import load_tokenizer

    for model in models:
        _check_chat_template(load_tokenizer(model.path), where=one_line(str(model.path)), key=key)


def _check_chat_template(tokenizer: Any, *, where: str, key: str) -> None:
    """``tokenizer`` (of the folder ``where``) has a chat template that renders a user turn."""
    from kd.hf.tokenization import render_chat_template

    if not getattr(tokenizer, "chat_template", None):
        drop = f"drop {key}" if key.startswith("--") else f"set {key}=false"
        raise KDUserError(
            f"{key}: the tokenizer of {where} has no chat_template (tokenizer_config.json or "
            f"chat_template.jinja); {drop}, or copy the chat template of the model's original "
            "folder"
        )
    render_chat_template(
        tokenizer,
        [[{"role": "user", "content": "2+2="}]],
        where=f"{key}: the chat template of {where}",
        add_generation_prompt=True,
    )


def _load(model: ModelFolder, device: str) -> tuple[Any, Any]:
    from kd.generate import load_model

    loaded, tokenizer = load_model(model.path, device=device)
    if hasattr(loaded, "merge_and_unload"):  # an adapter-only folder: peft on its base model
        loaded = loaded.merge_and_unload()
    return loaded.eval(), tokenizer


def _metrics(task_results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """``{"acc,none": v, "acc_stderr,none": s}`` -> ``{"acc": {"value": v, "stderr": s}}``."""
    out: dict[str, dict[str, float | None]] = {}
    for key, value in task_results.items():
        if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
            continue
        metric, filter_name = key.split(",", 1)
        name = metric if filter_name in ("none", "extract") else f"{metric} ({filter_name})"
        stderr = task_results.get(f"{metric}_stderr,{filter_name}")
        ok = isinstance(stderr, (int, float)) and math.isfinite(stderr)
        out[name] = {"value": float(value), "stderr": float(stderr) if ok else None}
    return out


def evaluate_models(
    models: Sequence[ModelFolder], tasks: Tasks, settings: Settings, *, manager: Any = None
) -> dict[str, Any]:
    """Every model on every task, one model in memory at a time.

    Args:
        models: the model folders, in column order.
        tasks: the checked task specs and lm-eval task names.
        settings: how the tasks run.
        manager: lm-eval's ``TaskManager`` from :func:`task_manager` (built here if None).

    Returns:
        The ``eval.json`` payload: the models, tasks, settings and
        ``results[task][metric][model] = {"value", "stderr"}``.

    Raises:
        KDUserError: lm_eval missing, a task lm-eval cannot load, or a model folder
            :func:`kd.generate.load_model` refuses.
    """
    version = lm_eval_version()
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from kd import __version__

    manager = task_manager(tasks) if manager is None else manager
    configs: list[Any] = [lm_eval_config(s) for s in tasks.specs] + list(tasks.builtin)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for model in models:
        gc.collect()  # what the caller (or the previous model) let go of leaves the device first
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        loaded, tokenizer = _load(model, settings.device)
        # HFLM warns that it is handed a loaded model (kd's choice: its folder checks).
        with _quiet(logging.ERROR):
            lm = HFLM(
                pretrained=loaded,
                tokenizer=tokenizer,
                batch_size=settings.batch_size,
                device=settings.device,
            )
        with _quiet():
            out = simple_evaluate(
                model=lm,
                tasks=configs,
                task_manager=manager,
                limit=settings.limit,
                num_fewshot=settings.num_fewshot,
                apply_chat_template=settings.chat,
                bootstrap_iters=settings.bootstrap_iters,
                log_samples=False,
            )
        for task, task_results in (out or {}).get("results", {}).items():
            for metric, value in _metrics(task_results).items():
                results.setdefault(task, {}).setdefault(metric, {})[model.name] = value
        del lm, loaded
    return {
        "kd_version": __version__,
        "lm_eval_version": version,
        "models": [{"name": m.name, "path": str(m.path)} for m in models],
        "tasks": [{"name": s.name, "file": str(s.spec_file), "rows": s.rows} for s in tasks.specs]
        + [{"name": n, "lm_eval": True} for n in tasks.builtin],
        "settings": {
            "device": settings.device,
            "batch_size": settings.batch_size,
            "limit": settings.limit,
            "num_fewshot": settings.num_fewshot,
            "chat": settings.chat,
        },
        "results": results,
    }


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "-"
    if entry["stderr"] is None:
        return f"{entry['value']:.4f}"
    return f"{entry['value']:.4f} ± {entry['stderr']:.4f}"


def table(payload: dict[str, Any]) -> str:
    """One row per task and metric, one column per model: ``value ± standard error``."""
    names = [m["name"] for m in payload["models"]]
    rows = [["task", "metric", *names]]
    for task, metrics in payload["results"].items():
        for metric, by_model in metrics.items():
            rows.append([task, metric, *(_cell(by_model.get(n)) for n in names)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def metrics_row(payload: dict[str, Any], model: str) -> dict[str, float]:
    """``{"eval/<task>/<metric>": value, ..._stderr}`` of one model (a metrics.jsonl row)."""
    row: dict[str, float] = {}
    for task, metrics in payload["results"].items():
        for metric, by_model in metrics.items():
            entry = by_model.get(model)
            if entry is None:
                continue
            row[f"eval/{task}/{metric}"] = entry["value"]
            if entry["stderr"] is not None:
                row[f"eval/{task}/{metric}_stderr"] = entry["stderr"]
    return row


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` written to ``path`` whole or not at all (a temporary file renamed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # a partial temporary file is litter
        raise KDUserError(
            f"--output: cannot write {one_line(str(path))} ({brief(e)}); choose a path you can write to"
        ) from e


class FinalEvaluation:
    """The run's ``eval:`` (the recipe's component): tasks checked before any weight loads,
    ``final/`` scored at the end of training on rank 0.

    Args:
        settings: the run's :class:`kd.config.run.EvalSettings`.
        device: the run's device.
        student: the run's :class:`kd.runtime.checkpoints.StudentSource`: with ``eval.chat``,
            the chat template ``final/`` will carry is checked now (:meth:`check_chat`).

    Raises:
        KDUserError: lm_eval missing, or a task :func:`resolve_tasks` / :func:`task_manager`
            refuses (named ``eval.tasks``).
    """

    KEY = "eval.tasks"

    def __init__(self, settings: Any, *, device: str, student: Any = None) -> None:
        lm_eval_version()
        self.tasks = resolve_tasks(settings.tasks, key=self.KEY)
        self.settings = Settings(
            device=device,
            batch_size=settings.batch_size,
            limit=settings.limit,
            num_fewshot=settings.num_fewshot,
            chat=settings.chat,
        )
        check_fewshot(self.tasks, settings.num_fewshot, key="eval.num_fewshot")
        self.manager = task_manager(self.tasks, key=self.KEY)
        if student is not None:
            self.check_chat(student)

    def check_chat(self, student: Any) -> None:
        """``eval.chat``: the chat template ``final/`` will carry renders, checked before training
        (a run of hours must not end in this line). ``final/`` takes the tokenizer files of the
        student's folder, else the run's, by name (``student``: the run's
        :class:`kd.runtime.checkpoints.StudentSource`, what its checkpoints copy)."""
        import shutil
        import tempfile

        from kd.generate import _load_tokenizer
        from kd.models import HF_TOKENIZER_FILES

        if not self.settings.chat:
            return
        source_dir, tokenizer_files = Path(student.source_dir), student.tokenizer_files
        where = one_line(str(source_dir))
        with tempfile.TemporaryDirectory(prefix="kd_chat_") as tmp:
            for name in HF_TOKENIZER_FILES:
                path = source_dir / name if (source_dir / name).is_file() else None
                path = path or tokenizer_files.get(name)
                if path is not None and path.is_file():
                    shutil.copyfile(path, Path(tmp) / name)
            try:
                tokenizer = _load_tokenizer(Path(tmp), "eval.chat")
            except KDUserError:
                raise KDUserError(
                    f"eval.chat: the student's tokenizer files ({where}) do not load with "
                    "AutoTokenizer, so final/ could not be scored with its chat template; set "
                    "eval.chat=false, or give the student folder its tokenizer files"
                ) from None
            _check_chat_template(tokenizer, where=where, key="eval.chat")

    def run(self, final_dir: Path, *, output_dir: Path) -> dict[str, float]:
        """Score ``final_dir``; print the table, write ``output_dir/eval.json``.

        Returns:
            The metrics row of the model (:func:`metrics_row`) for metrics.jsonl.
        """
        model = ModelFolder(name="final", path=final_dir)
        if self.settings.chat:
            check_chat_templates([model], key="eval.chat")
        payload = evaluate_models([model], self.tasks, self.settings, manager=self.manager)
        print(table(payload))
        write_json(output_dir / "eval.json", payload)
        return metrics_row(payload, model.name)
