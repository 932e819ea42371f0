"""``kd init``: a runnable, commented config from two local Hugging Face folders and a data file.

    kd init --teacher /models/Qwen2.5-7B-Instruct --student /models/Qwen2.5-0.5B-Instruct \\
        --data train.jsonl --output-dir runs/first --config-out my_kd.yaml [--lora]

The command: it reads both folders (:mod:`kd.scaffold.inspection`), pairs them
(:mod:`kd.scaffold.pairing`: backends, length, the tokenizers' whole vocabularies and the student's
chat template), detects the data format (:mod:`kd.scaffold.data`), writes a YAML that
``kd run kd --config FILE`` runs unchanged (:mod:`kd.scaffold.render`) and prints the memory plan
for this device. Only ``config.json`` and the tokenizer files are read, so it works before the
weights finish downloading (``kd run`` needs them).

Importing this module is cheap: transformers (and with it torch) is imported by the tokenizer
check only, so ``kd --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from kd.errors import KDUserError, one_line
from kd.runtime.launch import status
from kd.scaffold.data import DataFormat, detect_data_format
from kd.scaffold.inspection import (
    BACKENDS,
    Backend,
    ModelChoice,
    check_transformers_config,
    choose_model,
)
from kd.scaffold.pairing import (
    DEFAULT_MAX_SEQ_LEN,
    check_tokenizers,
    max_seq_len,
    reconcile_backends,
)
from kd.scaffold.render import about, render_config, write_config
from kd.scaffold.self_teacher import CONTEXT_FIELDS, context_template

DEVICES: tuple[str, ...] = ("cpu", "cuda")


def _init_epilog() -> str:
    """What the written config can turn on, and where each feature is described."""
    from kd.cli.features import doc_of

    return "\n".join(
        [
            "the config it writes (walk-through: docs/your_own_models.md) has commented blocks and",
            "pointers, each naming its page:",
            f"  validation: keep_best: early_stopping:   {doc_of('validation')}",
            f"  teacher_logits: (stored teacher logits)  {doc_of('teacher_logits')}",
            f"  on_policy: (GKD)                         {doc_of('on_policy')}",
            f"  hidden_states:                           {doc_of('hidden_states')}",
            f"  teacher_server: (vLLM, SGLang)           {doc_of('teacher_server')}",
            f"  teachers: (several teachers)             {doc_of('teachers')}",
            "other teachers, by flag:",
            f"  --cross-tokenizer  cross_tokenizer:      {doc_of('cross_tokenizer')}",
            f"  --self             self_teacher:         {doc_of('self_teacher')}",
            "every feature: kd --help",
        ]
    )


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``init`` subcommand to ``kd``'s argparse subparsers."""
    p = subparsers.add_parser(
        "init",
        help="write a config for two local Hugging Face model folders and a data file",
        description="Write a commented config that `kd run kd --config FILE` runs unchanged: "
        "dimensions from both config.json files, torchtune builders where they fit and the "
        "transformers backend otherwise, the data format from the file's first rows, a "
        "tokenizer agreement check, and the memory plan for this device. Needs only config.json "
        "and the tokenizer files (the weights may still be downloading).",
        epilog=_init_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--teacher", metavar="DIR", help="teacher model folder (not with --self)")
    p.add_argument("--student", required=True, metavar="DIR", help="student model folder")
    p.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="training data: .jsonl/.json (or .csv/.parquet) with messages (or conversations), "
        "instruction/output, input/output or text columns",
    )
    p.add_argument("--output-dir", required=True, metavar="DIR", help="the run's output folder")
    p.add_argument("--config-out", required=True, metavar="FILE", help="the YAML to write")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters instead of all weights")
    p.add_argument(
        "--cross-tokenizer",
        action="store_true",
        help="accept a teacher whose tokenizer differs from the student's: write cross_tokenizer "
        "(GOLD's aligned loss; the teacher loads with transformers; docs/multi_teacher.md)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="auto: torchtune builders where torchtune 0.6.1 builds the model exactly, "
        "transformers otherwise (default auto)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="N",
        help=f"tokens per example (default {DEFAULT_MAX_SEQ_LEN}, at most the models' maximum)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="device of the run (default: cuda when this machine has one, else cpu)",
    )
    p.add_argument(
        "--budget-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="memory.budget_gib (default: the device's memory)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing --config-out")
    p.add_argument(
        "--self",
        dest="self_teacher",
        action="store_true",
        help="self-distillation: no --teacher, the student is its own teacher with a privileged "
        "context (docs/self_distillation.md)",
    )
    p.add_argument(
        "--context",
        metavar="TEMPLATE",
        default=None,
        help="with --self: the teacher's context, a template over the rows' fields "
        "(default: a reference/context/solution field when the rows have one)",
    )
    return p


def _check_flag_pairs(args: argparse.Namespace) -> None:
    """A flag read only beside another one is refused without it, not ignored."""
    if args.context is not None and not args.self_teacher:
        raise KDUserError(
            "--context: only read with --self (the self teacher's privileged context); add "
            "--self (and drop --teacher) for self-distillation, or drop --context"
        )
    if args.cross_tokenizer and args.self_teacher:
        raise KDUserError(
            "--cross-tokenizer: not with --self (the student is its own teacher, one tokenizer); "
            "drop --cross-tokenizer"
        )


def _config_out(value: str, *, force: bool) -> Path:
    dest = Path(value).expanduser()
    if dest.is_dir():
        raise KDUserError(
            f"--config-out: {one_line(value)} is a folder; pass a file name such as "
            f"{one_line(str(dest / 'kd.yaml'))}"
        )
    if dest.exists() and not force:
        raise KDUserError(
            f"--config-out: {one_line(value)} already exists; remove it or pass --force to "
            "overwrite it"
        )
    return dest


def _device(flag: str | None) -> str:
    if flag is not None:
        return flag
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _print_plan(config: Path) -> tuple[bool, bool]:
    """Print the memory plan of the written config as ``kd plan --fit`` does.

    Returns:
        Whether the plan fits, and (when it does not) whether a searched setting fits.
    """
    from kd.cli.commands import resolve_target
    from kd.memory.fit import format_options
    from kd.memory.plan import attach_fit, inputs_from_run, make_plan
    from kd.runtime.device import resolve_budget

    args = argparse.Namespace(config=str(config), overrides=[], budget_gib=None, world_size=None)
    target = resolve_target(args, for_plan=True)
    run = target.run
    inputs = inputs_from_run(run, world_size=target.world_size, config_name=str(config))
    budget = resolve_budget(budget_gib=run.memory.budget_gib, device=run.device)
    if budget.source != "memory.budget_gib":
        inputs.notes.append(f"budget = {budget.source}")
    plan = make_plan(inputs, budget.gib)
    print(plan.table())
    if plan.fits:
        return True, True
    note = attach_fit(plan, run)
    print(format_options(plan.fit, note=note))
    return False, any(not option.suggestion for option in plan.fit)


def _choices(args: argparse.Namespace, output_dir: Path) -> tuple[ModelChoice | None, ModelChoice]:
    """The teacher (None with ``--self``) and the student, read and paired; neither may hold the
    output folder."""
    backend: Backend = args.backend
    student = choose_model(Path(args.student), role="student", flag="--student", backend=backend)
    if args.self_teacher:  # --self: the student is the only model
        if args.teacher is not None:
            raise KDUserError(
                "--teacher: not with --self (the student is its own teacher); drop --teacher"
            )
        return None, student
    if args.teacher is None:
        raise KDUserError("--teacher: required (or --self for self-distillation)")
    teacher = choose_model(Path(args.teacher), role="teacher", flag="--teacher", backend=backend)
    teacher = reconcile_backends(teacher, student, backend=backend)
    for choice in (teacher, student):
        if choice is None:
            continue
        if output_dir == choice.folder or choice.folder in output_dir.parents:
            raise KDUserError(
                f"--output-dir: {one_line(str(output_dir))} is inside the {choice.role} folder "
                f"{one_line(str(choice.folder))}; pass a folder outside the model folders"
            )
    return teacher, student


def _output_dir(value: str) -> Path:
    from kd.config.validate import writable_dir_problem

    output_dir = Path(os.path.abspath(Path(value).expanduser()))
    problem = writable_dir_problem(str(output_dir))
    if problem is not None:
        raise KDUserError(f"--output-dir: {problem.split('; ')[0]}; pass another folder")
    return output_dir


def run(args: argparse.Namespace) -> int:
    """Run ``kd init``: write the config, print the plan; 0 also when the plan does not fit.

    Every check (folders, tokenizers, chat template, data) runs before the config is written, so a
    refusal writes nothing.
    """
    _check_flag_pairs(args)
    dest = _config_out(args.config_out, force=args.force)
    if args.budget_gib is not None:
        from kd.cli.commands import budget_flag

        budget_flag(args.budget_gib)
    output_dir = _output_dir(args.output_dir)
    teacher, student = _choices(args, output_dir)
    data = detect_data_format(Path(args.data))
    context = context_template(args.context, data) if teacher is None else None
    seq_len = max_seq_len(args.max_seq_len, teacher or student, student)
    from kd.hf.tokenizer_compare import TokenizersDiffer

    cross: str | None = None
    status("comparing the tokenizers (every token id) and rendering the data's first rows")
    try:
        check: Any = check_tokenizers(teacher or student, student, data)
    except TokenizersDiffer as e:  # a teacher with another tokenizer: GOLD's loss
        if teacher is None:
            raise
        if not args.cross_tokenizer:
            raise KDUserError(
                f"{e}, or pass --cross-tokenizer to distil across tokenizers (GOLD's aligned "
                "loss, docs/multi_teacher.md)"
            ) from e
        cross, check = str(e), None
        teacher = dataclasses.replace(
            teacher, torchtune=None, why_not_torchtune="its tokenizer differs from the student's"
        )
    status("reading both config.json files with transformers")
    check_transformers_config(student, flag="--student")
    if teacher is not None:
        check_transformers_config(teacher, flag="--teacher")
    text = render_config(
        self_context=context,
        teacher=teacher,
        student=student,
        data=data,
        output_dir=output_dir,
        max_seq_len=seq_len,
        device=_device(args.device),
        lora=args.lora,
        budget_gib=args.budget_gib,
        config_name=str(dest),
        cross_tokenizer=cross,
    )
    pending = [
        key
        for key, choice in (("checkpointer", student), ("teacher_checkpointer", teacher))
        if choice is not None and choice.torchtune is not None and not choice.weight_files
    ]
    status("validating %s as kd run will read it", dest)
    write_config(text, dest, weights_pending=pending)
    _print_summary(
        teacher, student, data, check, output_dir=output_dir, lora=args.lora, context=context
    )
    print(f"wrote {one_line(str(dest))}")
    fits, fixable = _print_plan(dest)
    _print_next(dest, fits=fits, fixable=fixable, lora=args.lora)
    return 0


def _print_summary(
    teacher: ModelChoice | None,
    student: ModelChoice,
    data: DataFormat,
    check: Any,
    *,
    output_dir: Path,
    lora: bool,
    context: str | None = None,
) -> None:
    """What kd init found: the models, the data, the tokenizer check and its notes."""
    print(f"teacher: {about(teacher)}" if teacher else "teacher: the student itself (self_teacher)")
    if teacher is None and not context:
        weights = "its base model" if lora else "a frozen copy of its initial weights"
        print(
            "note: self_teacher.context is empty (the rows have no "
            f"{'/'.join(CONTEXT_FIELDS)} field): the teacher sees what the student sees, so "
            f"the run only pulls the student toward {weights}; pass --context TEMPLATE naming "
            f"a field of the rows ({', '.join(data.columns)}) for a privileged context"
        )
    print(f"student: {about(student, lora=lora)}")
    print(f"data:    {one_line(str(data.node['data_files']))}: {data.description}")
    if check is None:
        print("tokenizers differ: wrote cross_tokenizer (the teacher scores its own tokens)")
    else:
        print(f"tokenizers agree ({check.summary})")
        for note in check.notes:
            print(f"note: {note}")
    if check is not None and data.kind == "chat" and not check.chat_template:
        print(
            f"note: the student's tokenizer in {one_line(str(student.folder))} has no chat "
            "template; kd.hf.tokenizer joins the messages as plain text"
        )
    for choice in (teacher, student):
        if choice is not None and not choice.weight_files:
            print(
                f"note: {one_line(str(choice.folder))} holds no *.safetensors yet; kd run needs "
                "the weights there"
            )
    if output_dir.is_dir() and any(output_dir.iterdir()):
        print(
            f"note: {one_line(str(output_dir))} is not empty; kd run refuses it unless "
            "overwrite_output_dir=true (or resume_from_checkpoint=true)"
        )


def _print_next(dest: Path, *, fits: bool, fixable: bool, lora: bool) -> None:
    config = one_line(str(dest))
    if fits:
        print(f"next: kd run kd --config {config}")
    elif fixable:
        print(
            f"the plan does not fit this device: add one of the settings above to `kd run kd "
            f"--config {config}` (or set them in {config})"
        )
    else:
        print(
            "the plan does not fit this device and no setting of kd does: pick a smaller "
            + ("student or teacher" if lora else "student or teacher, pass --lora")
            + ", or use a device with more memory (or several: kd run --nproc_per_node N kd)"
        )
