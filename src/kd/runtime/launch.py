"""Running a recipe from ``--config X [key=value ...]``: what ``kd run`` and torchrun share.

``kd run <recipe>`` (in this process) and torchrun (each worker runs the recipe file, whose
``__main__`` calls :func:`run_recipe`) both come here, so the config is loaded, validated and
handed to the recipe one way, and a user mistake is one ``kd: error:`` line and exit 2 on either
path. Cheap to import: no torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kd.errors import KDUserError

if TYPE_CHECKING:
    from omegaconf import DictConfig


def is_rank_zero() -> bool:
    """Whether this process prints (always true outside torchrun)."""
    return os.environ.get("RANK", "0") == "0"


def print_error(err: Exception) -> None:
    if not is_rank_zero():
        return
    for line in str(err).splitlines() or ["unknown error"]:
        print(f"kd: error: {line}", file=sys.stderr)


def debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("KD_DEBUG", "") not in ("", "0")


def split_config_args(argv: list[str]) -> tuple[str, list[str]]:
    """Split ``--config X [overrides]`` into the config and the override items."""
    config: str | None = None
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        item = argv[i]
        if item == "--config" or item.startswith("--config="):
            if config is not None:
                raise KDUserError(
                    "--config given twice; pass one config and use key=value overrides"
                )
            if item == "--config":
                if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                    raise KDUserError(
                        "--config needs a value; pass --config <built-in name or path>"
                    )
                config = argv[i + 1]
                i += 2
                continue
            config = item.split("=", 1)[1]
        else:
            overrides.append(item)
        i += 1
    if not config:
        raise KDUserError(
            "missing --config; pass --config <built-in name or path> (kd ls lists them)"
        )
    return config, overrides


def setup_logging() -> None:
    """Show the recipes' INFO lines (plan, resume, saves) on stderr, once, on rank 0 only."""
    import logging

    logger = logging.getLogger("kd")
    if logger.handlers:
        return

    class _CurrentStderr(logging.StreamHandler):
        # Resolve sys.stderr at each record: it may be replaced after setup (pytest, notebooks).
        @property
        def stream(self):  # type: ignore[override]
            return sys.stderr

        @stream.setter
        def stream(self, value: Any) -> None:
            pass

    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter("kd: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)


def status(message: str, *args: Any) -> None:
    """Say what the coming seconds or minutes go to (``kd: <message>`` on the ``kd`` logger),
    when stderr is a terminal: piped or written to a file, a command's output stays what its
    tests and scripts read (``kd generate``'s answer, ``kd init``'s summary)."""
    if sys.stderr.isatty():
        import logging

        setup_logging()
        logging.getLogger("kd").info(message, *args)


def run_recipe(fn: Callable[[DictConfig], None], argv: list[str] | None = None) -> int:
    """Parse ``--config X [key=value ...] [~key ...]``, load and validate the config, call ``fn``.

    Args:
        fn: the recipe's ``recipe_main(cfg)``.
        argv: command-line items (default ``sys.argv[1:]``); ``--debug`` shows tracebacks.

    Returns:
        0 on success, 2 for a user mistake (config or inside the recipe), 130 on Ctrl-C.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    setup_logging()
    try:
        from kd.config import load_config, validate_config

        config, overrides = split_config_args(argv)
        cfg = load_config(config, overrides)
        validate_config(cfg)
        fn(cfg)
    except KDUserError as e:
        if debug:
            raise
        print_error(e)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    return 0
