"""The ``kd`` command: ``ls``, ``cp``, ``init``, ``run``, ``validate``, ``generate`` (and ``plan``
/ ``demo`` when installed).

Examples::

    kd ls
    kd init --teacher DIR --student DIR --data train.jsonl --output-dir out --config-out my_kd.yaml
    kd cp qwen2_5/14B_to_3B_full_single_device ./my_kd.yaml
    kd validate --config ./my_kd.yaml
    kd run kd_single_device --config ./my_kd.yaml batch_size=2 ~lr_scheduler
    kd run --nproc_per_node 4 kd_distributed --config ./my_kd.yaml
    kd generate --model ./out/final --prompt "Hello" --chat

Every user mistake prints ``kd: error: <one line per problem>`` on stderr and exits with status 2;
``--debug`` (or ``KD_DEBUG=1``) shows the traceback instead. torch and torchtune are imported only
by the commands that need them, so ``kd ls`` and ``kd --help`` stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kd import __version__
from kd.errors import KDUserError, one_line
from kd.runtime.launch import (
    debug_requested,
    is_rank_zero,
    print_error,
    run_recipe,
    setup_logging,
    split_config_args,
    status,
)

__all__ = ["is_rank_zero", "main", "run_recipe"]

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from kd.config.builtin import Recipe

# Optional subcommands written elsewhere: (module, name). Each module defines
# add_parser(subparsers) and run(args) -> int | None.
_OPTIONAL_COMMANDS: tuple[tuple[str, str], ...] = (
    ("kd.scaffold.command", "init"),
    ("kd.cli.plan", "plan"),
    ("kd.demo", "demo"),
    ("kd.harness.command", "eval"),
)

_RUN_USAGE = "kd run [TORCHRUN-OPTIONS] <recipe> --config <name|path> [key=value ...] [~key ...]"
_RUN_EPILOG = textwrap.dedent(
    """\
    recipes:
    {recipes}

    torchrun options (before the recipe name) launch the recipe through torchrun, e.g.
      --nproc_per_node N  --nnodes N  --node_rank R  --master_addr A  --master_port P
      --rdzv_backend B  --rdzv_endpoint E  --standalone  (any option of `torchrun --help`)
    Without them the recipe runs in this process.

    overrides (after --config):
      key=value                 set a key (OmegaConf dotlist: optimizer.lr=1e-4, seed=null)
      ~key                      delete a key (a nullable key becomes null, others their default)
      model=dotted.path         shorthand for model._component_=dotted.path
      kd_loss=reverse_kl        choose the divergence

    examples:
      kd run kd_single_device --config ./my_kd.yaml batch_size=2
      kd run --nproc_per_node 4 kd_distributed --config ./my_kd.yaml

    {features}
    """
)


class _UsageError(Exception):
    """A command-line mistake found by argparse (printed as one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse lists the choices of a wrong one (a command, --backend...); name the one meant.
        match = re.search(r"invalid choice: '(.*)' \(choose from (.*)\)$", message)
        meant = None
        if match is not None:
            meant = _close_match(match[1], re.findall(r"'([^']*)'", match[2]))
        hint = f"did you mean {meant}? " if meant is not None else ""
        raise _UsageError(f"{message}; {hint}see {self.prog} --help")


def _close_match(word: str, choices: list[str]) -> str | None:
    """The one of ``choices`` that ``word`` most likely misspells, or None."""
    import difflib

    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.75)
    return close[0] if close else None


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for action in parser._actions for o in action.option_strings if o.startswith("--")]


def _misspelt_option(items: list[str], options: list[str], prog: str) -> _UsageError | None:
    """A ``--flag`` of ``items`` that is none of ``options`` (nor a prefix argparse accepts) but
    spelt like one: the error naming the flag meant, which argparse would not (it reports the
    flag as unrecognized, or a required flag the typo left out, without the one meant)."""
    for item in items:
        name = item.split("=", 1)[0]
        if not name.startswith("--") or name == "--" or any(o.startswith(name) for o in options):
            continue
        meant = _close_match(name, options)
        if meant is not None:
            return _UsageError(f"unknown option {name}; did you mean {meant}? see {prog} --help")
    return None


def _version_line() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for package in ("torch", "torchtune", "torchao"):
        try:
            parts.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            parts.append(f"{package} not installed")
    return f"kd {__version__} ({', '.join(parts)})"


def _cmd_ls(args: argparse.Namespace) -> int:
    from kd.config.builtin import list_configs, list_recipes

    recipes = list_recipes()
    rows: list[tuple[str, str]] = []
    attached: set[str] = set()
    for recipe in recipes:
        # A recipe without configs of its own runs any config: its row says what it does.
        rows += [(recipe.name, c) for c in recipe.configs] or [
            (recipe.name, f"(any config below) {recipe.summary}")
        ]
        attached.update(recipe.configs)
    rows += [("-", c) for c in list_configs() if c not in attached]
    width = max(len("RECIPE"), *(len(r) for r, _ in rows)) + 4
    print(f"{'RECIPE':<{width}}CONFIG")
    previous = None
    for recipe_name, config in rows:
        shown = recipe_name if recipe_name != previous else ""
        previous = recipe_name
        print(f"{shown:<{width}}{config}".rstrip())
    from kd.cli.features import FEATURES_HEADING, feature_lines

    print(f"\n{FEATURES_HEADING}", *feature_lines(), sep="\n")
    return 0


def _cmd_cp(args: argparse.Namespace) -> int:
    from kd.config.builtin import configs_dir, list_configs, torchtune_config_fix

    name = args.config[: -len(".yaml")] if args.config.endswith(".yaml") else args.config
    builtin = list_configs()
    torchtune = torchtune_config_fix(name) if name not in builtin else None
    if torchtune is not None:
        raise KDUserError(f"cp: {one_line(args.config)} is {torchtune}")
    if name not in builtin:
        import difflib

        close = difflib.get_close_matches(name, builtin, n=1)
        hint = f"did you mean {close[0]}?" if close else "kd ls lists them"
        raise KDUserError(f"cp: {one_line(args.config)} is not a built-in config; {hint}")
    src = configs_dir() / f"{name}.yaml"
    dst = _cp_destination(args.destination, src.name)
    if dst.exists() and not args.force:
        raise KDUserError(f"cp: {one_line(str(dst))} already exists; pass --force to overwrite it")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    except OSError as e:
        raise KDUserError(
            f"cp: cannot write {one_line(str(dst))} ({e.strerror or e}); choose a destination you can write to"
        ) from e
    print(f"Copied {name} to {dst}")
    return 0


def _cp_destination(destination: str, file_name: str) -> Path:
    """The file ``kd cp`` writes: into a folder, or ``destination`` (``.yaml`` added if missing).

    Raises:
        KDUserError: the destination cannot be looked up or lies under a file.
    """
    from kd.config.validate import lookup_problem

    reason = lookup_problem(destination) if destination.strip() else "it is empty"
    if reason is not None:
        raise KDUserError(
            f"cp: {destination[:120]!r} is not a usable destination ({reason}); pass a file or "
            "folder path"
        )
    dst = Path(destination).expanduser()
    if dst.is_dir():
        dst = dst / file_name
    elif not dst.suffix:
        dst = dst.with_suffix(".yaml")
    parent = dst.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise KDUserError(
            f"cp: cannot write {one_line(str(dst))} because {one_line(str(parent))} is a file; choose another path"
        )
    if dst.is_dir():
        raise KDUserError(f"cp: {one_line(str(dst))} is a folder; choose another file name")
    return dst


def _cmd_validate(args: argparse.Namespace) -> int:
    """``kd validate``: exactly the pre-load phase of ``kd run`` (:meth:`KDRecipe.preload`)."""
    from kd.cli.commands import resolve_target

    target = resolve_target(args)  # a config mistake answers here, before torch is imported
    from kd.recipes.kd import KDRecipe
    from kd.runtime.distributed import WorldInfo

    # As rank 0 of the planned world: the same checks, nothing initialised, nothing written.
    world = WorldInfo(world_size=target.world_size, rank=0, local_rank=0)
    recipe = KDRecipe(target.run, world=world, config_name=args.config)
    setup_logging()  # the pre-load's lines, as kd run shows them (self_teacher's longest input)
    status("checking the folders, the tokenizer, the data and the memory plan (no weight is read)")
    with _quiet_libraries():
        recipe.preload()
    if recipe.plan is not None:
        print(recipe.plan.table())
    print("config OK")
    return 0


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """No progress bar (Hugging Face datasets preparing a data file) while ``kd validate``
    checks: its output is the plan and ``config OK`` (torchao's notice about its C++ extensions
    is filtered in kd/__init__.py)."""
    import datasets

    bars_were_off = datasets.is_progress_bar_enabled() is False
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()


def _optional_module(name: str) -> Any:
    """Import ``name`` if it exists; None if that module itself is absent."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            return None
        raise


def _split_torchrun_args(tokens: list[str]) -> tuple[list[str], int]:
    """Split the torchrun options before the recipe name, using torchrun's own parser.

    Returns:
        The torchrun tokens and the index of the recipe name in ``tokens``.
    """
    from torch.distributed.run import get_args_parser

    takes_value: dict[str, bool] = {}
    for action in get_args_parser()._actions:
        for option in action.option_strings:
            takes_value[option] = action.nargs != 0
    i = 0
    while i < len(tokens) and tokens[i].startswith("-"):
        option = tokens[i].split("=", 1)[0]
        if option in ("-h", "--help") or option not in takes_value:
            meant = _close_match(option, list(takes_value))
            hint = f"did you mean {meant}? " if meant is not None and option != "--config" else ""
            raise KDUserError(
                f"run: unknown torchrun option {option}; {hint}see torchrun --help (kd options go "
                "after the recipe: --config and key=value)"
            )
        i += 2 if takes_value[option] and "=" not in tokens[i] else 1
    return tokens[:i], i


def _torchrun_args(torchrun_tokens: list[str], launch: list[str]) -> Any:
    """torchrun's parsed options, checked as torchrun would check them before starting anything.

    Args:
        torchrun_tokens: the options before the recipe name.
        launch: what torchrun starts (``--module <recipe module> <recipe args>``).

    Raises:
        KDUserError: a value torchrun's parser or its launcher refuses (``--nproc_per_node 0``
            or ``abc``, ``--nnodes 2:1``, ``--master_port abc``...); names the option.
    """
    from torch.distributed.run import config_from_args, determine_local_world_size, get_args_parser

    parser = get_args_parser()

    def error(message: str) -> NoReturn:
        raise KDUserError(f"run: torchrun {message}; see torchrun --help")

    parser.error = error  # type: ignore[method-assign]  # argparse would print usage and exit
    args = parser.parse_args([*torchrun_tokens, *launch])
    nproc = str(args.nproc_per_node)
    try:
        count = determine_local_world_size(nproc)
    except ValueError as e:
        raise KDUserError(
            f"run: --nproc_per_node {nproc!r} is not a process count ({e}); pass a number >= 1 "
            "(or gpu, cpu, auto)"
        ) from e
    if count < 1:
        raise KDUserError(f"run: --nproc_per_node {nproc} starts no process; pass a number >= 1")
    try:
        config_from_args(args)
    except (ValueError, RuntimeError, AssertionError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KDUserError(
            f"run: torchrun options {' '.join(torchrun_tokens)}: {reason}; see torchrun --help"
        ) from e
    return args


# The handlers torchrun's agent replaces (TORCHELASTIC_SIGNALS_TO_HANDLE's default).
_TORCHRUN_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
_SIGNALS_OPTIONS = ("--signals-to-handle", "--signals_to_handle")


@contextlib.contextmanager
def _torchrun_signal_handlers(args: argparse.Namespace, tokens: list[str]) -> Iterator[None]:
    """Run torchrun in this process without losing Ctrl-C, and let its workers save on a stop.

    SIGTERM and SIGINT go on to the workers (:class:`kd.runtime.interrupts.WorkerForwarder`):
    they finish the step, save and exit 0, and so does the launcher. torchrun's agent keeps
    SIGHUP and SIGQUIT (its ``--signals-to-handle``, unless the user chose them); its handlers
    raise ``SignalException`` and were never put back: afterwards, Ctrl-C in the same process (a
    test session calling ``kd run --nproc_per_node 2`` in-process) raised an ordinary exception
    that the caller reported and went on from. Here the previous handlers come back when torchrun
    returns, and a ``SignalException`` for Ctrl-C is a ``KeyboardInterrupt`` (the agent has
    stopped the workers by then).
    """
    import signal
    import threading

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from kd.runtime.interrupts import FORWARDED, WorkerForwarder

    def raise_now(signum: int) -> None:
        sig = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)

    saved: dict[signal.Signals, Any] = {}
    env_key = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # torchrun sets it and leaves it set
    env_before = os.environ.get(env_key)
    if threading.current_thread() is threading.main_thread():
        for name in _TORCHRUN_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                saved[sig] = signal.getsignal(sig)
        chosen = any(t.split("=")[0] in _SIGNALS_OPTIONS for t in tokens)
        if not chosen and "PET_SIGNALS_TO_HANDLE" not in os.environ:  # torchrun's env form
            kept = [n for n in _TORCHRUN_SIGNALS if n not in FORWARDED and hasattr(signal, n)]
            args.signals_to_handle = ",".join(kept)
            forward = WorkerForwarder(raise_now)
            for name in FORWARDED:
                signal.signal(getattr(signal, name), forward)
    try:
        yield
    except SignalException as e:
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from e
        raise
    finally:
        if env_before is None:
            os.environ.pop(env_key, None)
        else:
            os.environ[env_key] = env_before
        for sig, handler in saved.items():
            # getsignal() gives None for a handler installed from C: SIG_DFL is the closest.
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _launch_torchrun(torchrun_tokens: list[str], recipe: Recipe, recipe_args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from kd.config import load_config, validate_config

    recipe.file_path()  # a missing recipe module is one clear line, not a failure per worker
    # Workers run the recipe as a module (`python -m kd.recipes.<name>`): run as a file, the
    # recipes folder would come first on sys.path and `kd.py` there would shadow the kd package.
    args = _torchrun_args(torchrun_tokens, ["--module", recipe.module, *recipe_args])
    # Check the config here so a mistake is one clean error, not one per worker plus torchrun's
    # failure report; the workers load it again (without repeating the notices).
    config, overrides = split_config_args(recipe_args)
    validate_config(load_config(config, overrides))
    if not args.rdzv_endpoint and str(args.nnodes) in ("1", "1:1"):
        # A single-node run without an endpoint: standalone picks a free port, so several jobs
        # can share a machine (as torchtune does).
        args.standalone = True
    previous = os.environ.get("KD_NOTICES_SHOWN")
    os.environ["KD_NOTICES_SHOWN"] = "1"  # inherited by the workers
    try:
        with _torchrun_signal_handlers(args, torchrun_tokens):
            run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values() if f.exitcode]
        # A worker ended by a signal has a negative exit code: the shell's 128 + signal number.
        return (codes[0] if codes[0] > 0 else 128 - codes[0]) if codes else 1
    except SignalException as e:  # SIGHUP, SIGQUIT, or a stop before any worker started
        print(f"kd: received {e.sigval.name}; the workers were stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        if previous is None:
            os.environ.pop("KD_NOTICES_SHOWN", None)
        else:
            os.environ["KD_NOTICES_SHOWN"] = previous
    return 0


def _check_recipe_options(recipe_args: list[str]) -> None:
    """After the recipe name only ``--config`` is an option: a misspelt ``--config`` and a
    torchrun option put after the recipe get a line naming what was meant."""
    for item in recipe_args:
        option = item.split("=", 1)[0]
        if not option.startswith("--") or option == "--config":
            continue
        if _close_match(option, ["--config"]) is not None:
            raise KDUserError(f"run: unknown option {option}; did you mean --config?")
        from torch.distributed.run import get_args_parser

        torchrun = {o for a in get_args_parser()._actions for o in a.option_strings}
        if option in torchrun:
            raise KDUserError(
                f"run: {option} is a torchrun option; put it before the recipe name "
                f"(kd run {option} ... <recipe> --config ...)"
            )


def _cmd_run(tokens: list[str], run_parser: argparse.ArgumentParser, debug: bool) -> int:
    from kd.config.builtin import find_recipe

    if not tokens or tokens[0] in ("-h", "--help"):
        if not tokens:
            raise _UsageError(f"run: missing recipe; usage: {_RUN_USAGE}")
        run_parser.print_help()
        return 0
    torchrun_tokens: list[str] = []
    start = 0
    if tokens[0].startswith("-"):
        torchrun_tokens, start = _split_torchrun_args(tokens)
    if start >= len(tokens):
        raise _UsageError(f"run: missing recipe after the torchrun options; usage: {_RUN_USAGE}")
    recipe = find_recipe(tokens[start])
    recipe_args = tokens[start + 1 :]
    if "-h" in recipe_args or "--help" in recipe_args:
        run_parser.print_help()
        return 0
    if torchrun_tokens:
        if not recipe.supports_distributed:
            raise KDUserError(
                f"run: {recipe.name} runs on one device and cannot take torchrun options "
                f"({' '.join(torchrun_tokens)}); use kd_distributed, or drop the options"
            )
        return _launch_torchrun(torchrun_tokens, recipe, recipe_args)
    _check_recipe_options(recipe_args)
    split_config_args(recipe_args)  # a missing --config is reported before importing torch

    def recipe_main(cfg: DictConfig) -> None:
        # The recipe module imports torch and torchtune: only once the config is valid, so a
        # config mistake answers without those imports.
        module = _optional_module(recipe.module)
        if module is None:
            raise KDUserError(
                f"run: recipe module {recipe.module} is not installed; reinstall kd "
                "(pip install -e .)"
            )
        module.recipe_main(cfg)

    return run_recipe(recipe_main, [*recipe_args, *(["--debug"] if debug else [])])


def _build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    from kd.cli.features import FEATURES_HEADING, feature_lines
    from kd.config.builtin import recipe_lines

    features_text = "\n".join([FEATURES_HEADING, *feature_lines()])
    parser = _Parser(
        prog="kd",
        description="Knowledge-distillation fine-tuning for LLMs that checks the memory budget "
        "before loading a weight.",
        epilog=features_text,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print versions and exit")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="<command>", parser_class=_Parser)

    sub.add_parser(
        "ls",
        help="list recipes and their built-in configs",
        description="List recipes and their built-in configs.",
    ).set_defaults(func=_cmd_ls)

    cp = sub.add_parser(
        "cp",
        help="copy a built-in config to edit it",
        description="Copy a built-in config to a file.",
    )
    cp.add_argument("config", help="built-in config name (see kd ls)")
    cp.add_argument("destination", help="file or folder to copy to (.yaml is added if missing)")
    cp.add_argument("--force", action="store_true", help="overwrite an existing file")
    cp.set_defaults(func=_cmd_cp)

    run = sub.add_parser(
        "run",
        help="run a recipe (torchrun options before the recipe launch it distributed)",
        usage=_RUN_USAGE,
        description="Run a recipe with a config and overrides.",
        epilog=_RUN_EPILOG.format(recipes="\n".join(recipe_lines()), features=features_text),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("recipe", help="a recipe name (below; kd ls lists them with their configs)")

    validate = sub.add_parser(
        "validate",
        help="check a config (keys, types, files, components, memory plan) without loading weights",
        description="Check a config completely without loading any weight.",
    )
    from kd.cli.commands import add_target_arguments

    add_target_arguments(validate)
    validate.set_defaults(func=_cmd_validate)

    from kd import generate

    generate.add_parser(sub).set_defaults(func=generate.run)

    for module_name, command in _OPTIONAL_COMMANDS:
        module = _optional_module(module_name)
        if module is None:
            continue
        module.add_parser(sub)
        if command in sub.choices:
            sub.choices[command].set_defaults(func=lambda a, _m=module: _m.run(a) or 0)
    return parser, run


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kd`` console script.

    Args:
        argv: command-line items (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 for a user mistake, 130 on Ctrl-C, 141 when stdout
        was closed (``| head``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    try:
        parser, run_parser = _build_parser()
        command_index = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
        if command_index < len(argv) and argv[command_index] == "run":
            typo = _misspelt_option(argv[:command_index], _options(parser), "kd")
            if typo is not None:
                raise typo
            parser.parse_args(argv[:command_index])  # global options before `run`
            return _cmd_run(argv[command_index + 1 :], run_parser, debug)
        args = _parse_with_overrides(parser, argv)
        if args.version:
            print(_version_line())
            return 0
        if args.command is None:
            raise _UsageError(
                "missing command; choose one of " + ", ".join(_commands(parser)) + "; see kd --help"
            )
        return int(args.func(args) or 0)
    except (KDUserError, _UsageError) as e:
        if debug:
            raise
        print_error(e)
        return 2
    except SystemExit as e:  # argparse --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kd ... | head` closed the pipe: stop quietly, as `ls | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush too
        return 141


def _parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; a command with ``overrides`` takes them anywhere, also after its flags.

    argparse fills a ``nargs="*"`` positional once, so ``--config x a=1 --budget-gib 8 b=2``
    would leave ``b=2`` unrecognised; ``kd run`` takes overrides anywhere after the recipe, and
    so do ``kd validate`` and ``kd plan``.

    Raises:
        _UsageError: an unknown option, or arguments the command does not take.
    """
    command_index = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    commands = _subparsers(parser)
    typo = _misspelt_option(argv[:command_index], _options(parser), "kd")
    if typo is None and command_index < len(argv) and argv[command_index] in commands:
        sub = commands[argv[command_index]]
        typo = _misspelt_option(argv[command_index + 1 :], _options(sub), sub.prog)
    if typo is not None:
        raise typo
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides"):
        flags = [item for item in extra if item.startswith("-")]
        if not flags:
            args.overrides = [*args.overrides, *extra]  # argparse keeps their order
            return args
        extra = flags
    if extra:
        prog = f"kd {args.command}" if getattr(args, "command", None) else "kd"
        raise _UsageError(f"unrecognized arguments: {' '.join(extra)}; see {prog} --help")
    return args


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    return list(_subparsers(parser))
