"""kill -9 the tiny kd recipe at random moments; nothing it saved may ever be unreadable.

Each child process runs ``kd run kd_single_device`` on tiny HF-format Qwen2 models (the fixtures of
tests/conftest.py), saving a step checkpoint every step, and is killed with SIGKILL after a random
delay (during setup, training or a save), or (``--final-save-kills``) at a random moment of its
final save. After every kill this script checks that:

- ``find_latest_checkpoint`` returns the newest ``step_*`` folder (no incomplete folder is ever
  visible under a step name) and that folder loads: safetensors weights (all finite) and
  ``recipe_state.pt`` (``weights_only``), with the same step in the marker and the state;
- ``final/`` is absent or complete (its marker, every file at its recorded size, weights
  bit-identical to the uninterrupted run), never partial;
- the next child resumes (``resume_from_checkpoint=true``) from exactly that checkpoint; killed
  before its first checkpoint, it starts afresh with ``overwrite_output_dir=true`` (a plain fresh
  run into the killed run's ``metrics.jsonl`` is refused), which moves those outputs aside.

``--concurrent`` children get a second run on the same folder while they hold its lock: the first
is paused (SIGSTOP) from the moment it holds the lock until the second has exited, so the second
meets a held lock whatever the machine's load; it must exit 2 with the "in use by another kd run"
line and change no file, and the first then continues.

A child that reaches the end of training must leave ``final/`` weights bit-identical to an
uninterrupted run (``torch.equal``), no temporary folder and no lock file, however many times it
was killed on the way; then a new round starts in a fresh folder. The run ends after ``--kills``
timed kills and ``--final-save-kills`` (or ``--budget-s`` seconds) and finishes the last round
without killing it.

Children are forked from this process after torch/torchtune are imported (each start costs the
recipe's setup, not a 10 s import); ``--spawn`` starts ``python -m kd.cli`` instead, exactly as a
user would (slower).

Usage::

    python scripts/kill_test.py                                  # 25 + 6 kills, < 5 min
    python scripts/kill_test.py --kills 30 --final-save-kills 8 --concurrent 6 --seed 1 \
        --update-doc docs/reliability.md
"""

from __future__ import annotations

import argparse
import hashlib
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
    phase: str  # setup | train | save | final save | completed
    newest_step: int | None  # newest complete checkpoint after it ended
    ok: bool
    note: str = ""
    second: str = "-"  # the concurrent second run: "-" (none), "refused" or what went wrong


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

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.code


def in_final_save(out: Path, pid: int) -> bool:
    return any(out.glob(f".tmp_final_{pid}")) or any(out.glob(f".tmp_old_final_{pid}"))


def phase_now(out: Path, pid: int, log: Path) -> str:
    """What the child is doing: the final save or a step save (its temporary folder exists),
    training (its progress bar was drawn; the bar appears after setup, resume included) or still
    setting up."""
    if in_final_save(out, pid):
        return "final save"
    if any(out.glob(f".tmp_*_{pid}")):
        return "save"
    return "train" if _BAR.search(log.read_text(errors="replace")) else "setup"


def holds_lock(out: Path, pid: int) -> bool:
    """Whether ``pid`` holds out's lock (it writes its pid into the lock file once it has it)."""
    from kd.checkpoint import outputs

    try:
        return json.loads((out / outputs.LOCK_FILE).read_text()).get("pid") == pid
    except (OSError, ValueError, AttributeError):
        return False


def file_hashes(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def second_run(
    argv: list[str], out: Path, first: Child, log: Path, spawn: bool
) -> tuple[str, float]:
    """Run a second child on ``out`` while ``first`` (paused) holds the lock.

    Returns:
        ("refused", seconds paused) when the second exited 2 with the in-use line and changed no
        file, else what went wrong.
    """
    t0 = time.monotonic()
    os.kill(first.pid, signal.SIGSTOP)
    try:
        before = file_hashes(out)
        second = Child(argv, log, spawn)
        code = second.wait(timeout=300)
        if code is None:
            second.kill()
            return "second run still running after 300 s", time.monotonic() - t0
        text = log.read_text(errors="replace")
        changed = file_hashes(out) != before
    finally:
        os.kill(first.pid, signal.SIGCONT)
    if code == 2 and "is in use by another kd run" in text and not changed:
        return "refused", time.monotonic() - t0
    what = "changed files" if changed else f"exit {code}"
    return f"second run {what}, see {log}", time.monotonic() - t0


def check_final(out: Path, ref: Path) -> str:
    """ "" when final/ is absent, or complete and bit-identical to the reference; else the problem."""
    from kd import checkpoint

    final = out / checkpoint.FINAL_DIRNAME
    if not final.exists():
        return ""
    try:
        marker = checkpoint.read_checkpoint_marker(final)
    except (OSError, ValueError) as e:
        return f"partial final/: {type(e).__name__}"
    for name, entry in marker["files"].items():
        if not (final / name).is_file() or (final / name).stat().st_size != entry["size"]:
            return f"partial final/: {name}"
    return "" if same_weights(ref, final) else "final/ differs from the uninterrupted run"


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
    parser.add_argument("--kills", type=int, default=25, help="SIGKILLs after a random delay")
    parser.add_argument(
        "--final-save-kills", type=int, default=6, help="SIGKILLs during the final save"
    )
    parser.add_argument(
        "--concurrent", type=int, default=4, help="children that get a second run on their folder"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill delays")
    parser.add_argument("--min-delay", type=float, default=0.05, help="seconds after start")
    parser.add_argument(
        "--max-delay", type=float, default=None, help="default: the uninterrupted run's duration"
    )
    parser.add_argument("--epochs", type=int, default=8, help="epochs of 8 optimizer steps")
    parser.add_argument("--budget-s", type=float, default=360.0, help="stop killing after this")
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

    def cli_args(config: Path, resume: bool, overwrite: bool) -> list[str]:
        return [
            "run",
            "kd_single_device",
            "--config",
            str(config),
            f"resume_from_checkpoint={str(resume).lower()}",
            f"overwrite_output_dir={str(overwrite).lower()}",
        ]

    ref_out = work / "reference"
    ref_cfg = write_run_config(assets, work / "reference.yaml", ref_out, args.epochs)
    t_ref = time.monotonic()
    ref = Child(cli_args(ref_cfg, False, False), work / "reference.log", args.spawn)
    final_started: float | None = None
    final_s = 0.0  # how long the final save takes (from its temporary folder to final/)
    while ref.poll() is None:
        if final_started is None and in_final_save(ref_out, ref.pid):
            final_started = time.monotonic()
        if final_started is not None and not final_s and (ref_out / "final").exists():
            final_s = time.monotonic() - final_started
        time.sleep(0.002)
    ref_s = time.monotonic() - t_ref
    final_s = final_s or 0.05
    max_delay = args.max_delay if args.max_delay is not None else ref_s
    args.delays = (args.min_delay, max_delay, ref_s, final_s)  # for the report
    if ref.code != 0:
        print((work / "reference.log").read_text()[-3000:])
        return 1
    total_steps = 8 * args.epochs

    from kd import checkpoint
    from kd.checkpoint import outputs

    rng = random.Random(args.seed)
    rows: list[Row] = []
    timed_kills = final_kills = concurrent = 0
    round_no = 1
    out = work / f"round_{round_no}"
    config = write_run_config(assets, work / f"round_{round_no}.yaml", out, args.epochs)
    failures = 0
    while True:
        finishing = (
            timed_kills >= args.kills and final_kills >= args.final_save_kills
        ) or time.monotonic() - started > args.budget_s
        latest = checkpoint.find_latest_checkpoint(out)
        start_step = checkpoint.read_checkpoint_marker(latest)["step"] if latest else None
        overwrite = latest is None and bool(outputs.run_outputs(out))
        log = work / f"child_{len(rows) + 1:03d}.log"
        argv_child = cli_args(config, latest is not None, overwrite)
        child = Child(argv_child, log, args.spawn)
        # This child is killed after a random delay, or at a random moment of its final save.
        left_timed, left_final = args.kills - timed_kills, args.final_save_kills - final_kills
        at_final = not finishing and rng.random() < left_final / max(1, left_timed + left_final)
        delay = None if finishing or at_final else rng.uniform(args.min_delay, max_delay)
        final_delay = rng.uniform(0, 1.2 * final_s) if at_final else None
        with_second = not finishing and concurrent < args.concurrent and rng.random() < 0.5
        second = "-"
        t0 = time.monotonic()
        final_seen: float | None = None
        phase = "completed"
        while child.poll() is None:
            now = time.monotonic()
            if with_second and second == "-" and holds_lock(out, child.pid):
                second, paused = second_run(
                    argv_child, out, child, work / f"second_{len(rows) + 1:03d}.log", args.spawn
                )
                concurrent += 1
                t0 += paused  # the kill delay counts the first's running time only
                continue
            if at_final and final_seen is None and in_final_save(out, child.pid):
                final_seen = now
            due = (delay is not None and now - t0 >= delay) or (
                final_seen is not None and now - final_seen >= final_delay
            )
            if due:
                # Once final/ is renamed into place no temporary folder shows the final save.
                phase = "final save" if final_seen is not None else phase_now(out, child.pid, log)
                child.kill()
                if delay is not None:
                    timed_kills += 1
                else:
                    final_kills += 1
                break
            time.sleep(0.002)
        code = child.code
        newest, problem = check_checkpoints(out)
        notes = [problem] if problem else []
        final_problem = check_final(out, ref_out / "final")
        if final_problem:
            notes.append(final_problem)
            problem = problem or final_problem
        elif phase == "final save":
            notes.append("final/ complete" if (out / "final").exists() else "no final/")
        if overwrite:
            notes.append("fresh start moved the killed run's outputs aside")
        if phase == "completed":
            left = [p.name for p in out.glob(".tmp_*")] + [
                p.name for p in out.glob(outputs.LOCK_FILE)
            ]
            if code != 0:
                notes.append(f"exit {code}: see {log}")
            elif left:
                notes.append(f"left behind: {left}")
            elif not same_weights(ref_out / "final", out / "final"):
                notes.append("final weights differ from the uninterrupted run")
            else:
                notes.append(f"final/ bit-identical to the uninterrupted run ({total_steps} steps)")
        if not args.spawn and start_step is not None:
            got = resumed_step(log)
            if got is not None and got != start_step:
                notes.append(f"resumed from step {got}, expected {start_step}")
                problem = "bad resume"
            elif got is None and phase in ("train", "save", "final save", "completed"):
                notes.append("no 'resumed from' line")
                problem = "bad resume"
        ok = (
            not problem
            and second in ("-", "refused")
            and (phase != "completed" or notes[-1].startswith("final/ bit"))
        )
        failures += not ok
        rows.append(
            Row(
                len(rows) + 1,
                round_no,
                start_step,
                None if phase == "completed" else round(time.monotonic() - t0, 2),
                phase,
                newest,
                ok,
                "; ".join(n for n in notes if n),
                second,
            )
        )
        r = rows[-1]
        print(
            f"child {r.index:3d} round {r.round} from {r.resumed_from} killed@{r.delay_s} "
            f"{r.phase:10s} newest {r.newest_step} second {r.second} "
            f"{'ok' if r.ok else 'FAIL'} {r.note}",
            flush=True,
        )
        if phase == "completed":
            if finishing or code != 0:
                break
            round_no += 1
            out = work / f"round_{round_no}"
            config = write_run_config(assets, work / f"round_{round_no}.yaml", out, args.epochs)

    elapsed = time.monotonic() - started
    report = render(rows, args, failures, elapsed)
    print(report)
    if args.update_doc is not None:
        update_doc(args.update_doc, report)
    (work / "rows.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


def render(rows: list[Row], args: argparse.Namespace, failures: int, s: float) -> str:
    phases = {
        p: sum(r.phase == p and r.delay_s is not None for r in rows)
        for p in ("setup", "train", "save", "final save")
    }
    kills = sum(phases.values())
    finals = [r for r in rows if r.phase == "final save"]
    final_absent = sum("no final/" in r.note for r in finals)
    rounds = [r for r in rows if r.phase == "completed"]
    identical = sum(r.ok for r in rounds)
    seconds = [r for r in rows if r.second != "-"]
    refused = sum(r.second == "refused" for r in seconds)
    flags = (
        f" --kills {args.kills} --final-save-kills {args.final_save_kills}"
        f" --concurrent {args.concurrent} --seed {args.seed}" + (" --spawn" if args.spawn else "")
    )
    lo, hi, ref_s, final_s = args.delays
    lines = [
        f"Command: `python scripts/kill_test.py{flags}` "
        f"({'spawned' if args.spawn else 'forked'} children, {s:.0f} s).",
        "",
        f"{kills} kills (during setup {phases['setup']}, training {phases['train']}, a step save "
        f"{phases['save']}, the final save {phases['final save']}: {final_absent} left no "
        f"`final/`, {len(finals) - final_absent} a complete one, none a partial one); "
        f"{len(seconds)} second runs started on a folder in use, {refused} refused with exit 2 "
        f"and no file changed; {len(rounds)} runs reached the end, {identical} of them with "
        f"`final/` bit-identical to the uninterrupted run; {failures} failures. Timed kills "
        f"uniform in [{lo:.2f}, {hi:.2f}] s after the child starts (an uninterrupted run of "
        f"{8 * args.epochs} steps took {ref_s:.1f} s); final-save kills uniform in "
        f"[0, {1.2 * final_s:.3f}] s after its temporary folder appears (the final save took "
        f"{final_s:.3f} s).",
        "",
        "| child | round | resumed from step | killed after s | phase | newest readable step "
        "| second run | ok |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.index} | {r.round} | {'-' if r.resumed_from is None else r.resumed_from} | "
            f"{'-' if r.delay_s is None else r.delay_s} | {r.phase} | "
            f"{'-' if r.newest_step is None else r.newest_step} | {r.second} | "
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
