"""kill -9 the tiny kd recipe at random moments; nothing it saved may ever be unreadable.

Each child process runs ``kd run kd_single_device`` on tiny HF-format Qwen2 models (the fixtures of
tests/conftest.py), saving a step checkpoint every step, and is killed with SIGKILL after a random
delay (during setup, training or a save). After every kill this script checks that:

- ``find_latest_checkpoint`` returns the newest ``step_*`` folder (no incomplete folder is ever
  visible under a step name) and that folder loads: safetensors weights (all finite) and
  ``recipe_state.pt`` (``weights_only``), with the same step in the marker and the state;
- the next child resumes (``resume_from_checkpoint=true``) from exactly that checkpoint.

A child that reaches the end of training must leave ``final/`` weights bit-identical to an
uninterrupted run (``torch.equal``), however many times it was killed on the way; then a new round
starts in a fresh folder. The run ends after ``--kills`` kills (or ``--budget-s`` seconds) and
finishes the last round without killing it.

Children are forked from this process after torch/torchtune are imported (each start costs the
recipe's setup, not a 10 s import); ``--spawn`` starts ``python -m kd.cli`` instead, exactly as a
user would (slower).

Usage::

    python scripts/kill_test.py                                  # 25 kills, < 5 min
    python scripts/kill_test.py --kills 30 --seed 1 --update-doc docs/reliability.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread, same math everywhere
os.environ.setdefault("PYTHONWARNINGS", "ignore")

REPO = Path(__file__).resolve().parents[1]
DOC_BEGIN = "<!-- kill_test:begin -->"
DOC_END = "<!-- kill_test:end -->"
_BAR = re.compile(r"kd:\s+\d+%\|")  # the recipe's tqdm bar


@dataclass
class Row:
    """One child process."""

    index: int
    round: int
    resumed_from: int | None  # step of the checkpoint it was started from
    delay_s: float | None  # None: not killed
    phase: str  # setup | train | save | completed
    newest_step: int | None  # newest complete checkpoint after it ended
    ok: bool
    note: str = ""


def make_assets(root: Path) -> dict[str, Path]:
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import write_assets

    return write_assets(root)


def write_run_config(assets: dict[str, Path], path: Path, out: Path, epochs: int) -> Path:
    from conftest import make_config, write_config

    cfg = make_config(
        assets,
        out,
        shuffle=True,
        batch_size=4,
        gradient_accumulation_steps=2,
        epochs=epochs,
        max_steps_per_epoch=8,
        save_every_n_steps=1,
        keep_last_n=2,
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-3, "weight_decay": 0.01},
        lr_scheduler={
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 2,
        },
    )
    return write_config(path, cfg)


class Child:
    """A kd run in another process (forked from this one, or spawned)."""

    def __init__(self, argv: list[str], log: Path, spawn: bool):
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.pid = 0
        self.code: int | None = None
        if spawn:
            with open(log, "w") as f:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "kd.cli", *argv], stdout=f, stderr=subprocess.STDOUT
                )
            self.pid = self.proc.pid
            return
        self.pid = os.fork()
        if self.pid == 0:  # the child: run the CLI, never return into this script
            code = 99
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
                from kd import cli

                code = cli.main(argv)
            except BaseException:  # noqa: BLE001 - report anything, then exit
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def poll(self) -> int | None:
        if self.code is not None:
            return self.code
        if self.proc is not None:
            self.code = self.proc.poll()
            return self.code
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def kill(self) -> int:
        os.kill(self.pid, signal.SIGKILL)
        while self.poll() is None:
            time.sleep(0.005)
        return self.code


def phase_now(out: Path, pid: int, log: Path) -> str:
    """What the child is doing: a save (its temporary folder exists), training (its progress bar
    was drawn; the bar appears after setup, resume included) or still setting up."""
    if any(out.glob(f".tmp_*_{pid}")):
        return "save"
    return "train" if _BAR.search(log.read_text(errors="replace")) else "setup"


def check_checkpoints(out: Path) -> tuple[int | None, str]:
    """(newest complete step, problem or ""), loading that checkpoint fully."""
    import torch

    from kd import checkpoint

    step_dirs = sorted(p for p in out.glob("step_*") if p.is_dir())
    latest = checkpoint.find_latest_checkpoint(out)
    if latest is None:
        return None, "" if not step_dirs else f"no readable checkpoint among {step_dirs}"
    if latest != step_dirs[-1]:
        return None, f"newest folder {step_dirs[-1].name} is not readable"
    weights = checkpoint.load_hf_weights(latest)
    state = checkpoint.load_recipe_state(latest)
    step = checkpoint.read_checkpoint_marker(latest)["step"]
    if int(state["global_step"]) != step:
        return step, f"recipe_state step {state['global_step']} != marker step {step}"
    if not all(bool(torch.isfinite(t).all()) for t in weights.values()):
        return step, "non-finite weights"
    return step, ""


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def resumed_step(log: Path) -> int | None:
    """The step a child logged ``resumed from ... at step N`` (fork mode logs at INFO)."""
    for line in log.read_text(errors="replace").splitlines():
        if "resumed from" in line and " at step " in line:
            return int(line.rsplit(" at step ", 1)[1].split()[0])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=25, help="SIGKILLs to deliver")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill delays")
    parser.add_argument("--min-delay", type=float, default=0.05, help="seconds after start")
    parser.add_argument(
        "--max-delay", type=float, default=None, help="default: the uninterrupted run's duration"
    )
    parser.add_argument("--epochs", type=int, default=8, help="epochs of 8 optimizer steps")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop killing after this")
    parser.add_argument("--spawn", action="store_true", help="python -m kd.cli children")
    parser.add_argument("--workdir", type=Path, default=None, help="kept; default a temp folder")
    parser.add_argument("--update-doc", type=Path, default=None, help="rewrite the table in it")
    args = parser.parse_args(argv)

    started = time.monotonic()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kd_kill_test_"))
    work.mkdir(parents=True, exist_ok=True)
    assets = make_assets(work / "assets")
    if not args.spawn:
        # Import once here; forked children start with it loaded.
        import datasets  # noqa: F401

        import kd.cli  # noqa: F401
        import kd.recipes.kd_single_device  # noqa: F401

    def cli_args(config: Path, resume: bool) -> list[str]:
        return [
            "run",
            "kd_single_device",
            "--config",
            str(config),
            f"resume_from_checkpoint={str(resume).lower()}",
        ]

    ref_out = work / "reference"
    ref_cfg = write_run_config(assets, work / "reference.yaml", ref_out, args.epochs)
    t_ref = time.monotonic()
    ref = Child(cli_args(ref_cfg, False), work / "reference.log", args.spawn)
    while ref.poll() is None:
        time.sleep(0.01)
    ref_s = time.monotonic() - t_ref
    max_delay = args.max_delay if args.max_delay is not None else ref_s
    args.delays = (args.min_delay, max_delay, ref_s)  # for the report
    if ref.code != 0:
        print((work / "reference.log").read_text()[-3000:])
        return 1
    total_steps = 8 * args.epochs

    from kd import checkpoint

    rng = random.Random(args.seed)
    rows: list[Row] = []
    kills = 0
    round_no = 1
    out = work / f"round_{round_no}"
    config = write_run_config(assets, work / f"round_{round_no}.yaml", out, args.epochs)
    failures = 0
    while True:
        finishing = kills >= args.kills or time.monotonic() - started > args.budget_s
        latest = checkpoint.find_latest_checkpoint(out)
        start_step = checkpoint.read_checkpoint_marker(latest)["step"] if latest else None
        log = work / f"child_{len(rows) + 1:03d}.log"
        child = Child(cli_args(config, latest is not None), log, args.spawn)
        delay = None if finishing else rng.uniform(args.min_delay, max_delay)
        t0 = time.monotonic()
        phase = "completed"
        while child.poll() is None:
            if delay is not None and time.monotonic() - t0 >= delay:
                phase = phase_now(out, child.pid, log)
                child.kill()
                kills += 1
                break
            time.sleep(0.002)
        code = child.code
        newest, problem = check_checkpoints(out)
        notes = [problem] if problem else []
        if phase == "completed":
            if code != 0:
                notes.append(f"exit {code}: see {log}")
            elif not same_weights(ref_out / "final", out / "final"):
                notes.append("final weights differ from the uninterrupted run")
            else:
                notes.append(f"final/ bit-identical to the uninterrupted run ({total_steps} steps)")
        if not args.spawn and start_step is not None:
            got = resumed_step(log)
            if got is not None and got != start_step:
                notes.append(f"resumed from step {got}, expected {start_step}")
                problem = "bad resume"
            elif got is None and phase in ("train", "save", "completed"):
                notes.append("no 'resumed from' line")
                problem = "bad resume"
        ok = not problem and (phase != "completed" or notes[-1].startswith("final/ bit"))
        failures += not ok
        rows.append(
            Row(
                len(rows) + 1,
                round_no,
                start_step,
                None if delay is None or phase == "completed" else round(delay, 2),
                phase,
                newest,
                ok,
                "; ".join(n for n in notes if n),
            )
        )
        r = rows[-1]
        print(
            f"child {r.index:3d} round {r.round} from {r.resumed_from} killed@{r.delay_s} "
            f"{r.phase:9s} newest {r.newest_step} {'ok' if r.ok else 'FAIL'} {r.note}",
            flush=True,
        )
        if phase == "completed":
            if finishing or code != 0:
                break
            round_no += 1
            out = work / f"round_{round_no}"
            config = write_run_config(assets, work / f"round_{round_no}.yaml", out, args.epochs)

    elapsed = time.monotonic() - started
    report = render(rows, args, kills, failures, elapsed)
    print(report)
    if args.update_doc is not None:
        update_doc(args.update_doc, report)
    (work / "rows.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


def render(rows: list[Row], args: argparse.Namespace, kills: int, failures: int, s: float) -> str:
    phases = {
        p: sum(r.phase == p and r.delay_s is not None for r in rows)
        for p in ("setup", "train", "save")
    }
    rounds = [r for r in rows if r.phase == "completed"]
    identical = sum(r.ok for r in rounds)
    flags = f" --kills {args.kills} --seed {args.seed}" + (" --spawn" if args.spawn else "")
    lines = [
        f"Command: `python scripts/kill_test.py{flags}` "
        f"({'spawned' if args.spawn else 'forked'} children, {s:.0f} s).",
        "",
        f"{kills} kills (during setup {phases['setup']}, training {phases['train']}, a save "
        f"{phases['save']}); {len(rounds)} runs reached the end, {identical} of them with `final/` "
        f"bit-identical to the uninterrupted run; {failures} failures. Kill delays uniform in "
        f"[{args.delays[0]:.2f}, {args.delays[1]:.2f}] s after the child starts (an uninterrupted "
        f"run of {8 * args.epochs} steps took {args.delays[2]:.1f} s).",
        "",
        "| child | round | resumed from step | killed after s | phase | newest readable step | ok |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.index} | {r.round} | {'-' if r.resumed_from is None else r.resumed_from} | "
            f"{'-' if r.delay_s is None else r.delay_s} | {r.phase} | "
            f"{'-' if r.newest_step is None else r.newest_step} | "
            f"{'yes' if r.ok else 'NO: ' + r.note} |"
        )
    return "\n".join(lines)


def update_doc(path: Path, report: str) -> None:
    text = path.read_text()
    if DOC_BEGIN not in text or DOC_END not in text:
        raise SystemExit(f"{path}: no {DOC_BEGIN} ... {DOC_END} section to replace")
    head, rest = text.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    path.write_text(f"{head}{DOC_BEGIN}\n{report}\n{DOC_END}{tail}")


if __name__ == "__main__":
    sys.exit(main())
