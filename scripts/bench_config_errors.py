"""Benchmark: wall time of a config mistake through the real ``kd`` entry point.

Each case runs ``python -m kd.cli <command> ... <mistake>`` in a fresh subprocess with
``PYTHONPATH=<repo>/src`` and measures the wall clock from start to exit (one unmeasured warm-up
run, then ``--repeats`` timed runs: median, min, max). Every case must exit with status 2 and print
exactly one ``kd: error:`` line; the table says whether it did. ``python -c "import torch"`` and
``python -c "import torchtune"`` (and an empty interpreter) are timed the same way as reference
points.

The config is a built-in one (``--config``) whose files are redirected by overrides to empty
placeholder files in a temporary folder, so the only problem is the mistake under test:

- unknown key: ``kd_ration=0.7``
- bad value: ``kd_ratio=2``
- missing file: ``tokenizer.path=/nonexistent``

Usage::

    python scripts/bench_config_errors.py --repo ../kd-before --label before \\
        --save-json /tmp/before.json --out docs/config_errors.md
    python scripts/bench_config_errors.py --repo . --label after --baseline /tmp/before.json \\
        --out docs/config_errors.md

The machine's load average (``os.getloadavg()``) before and after the runs is recorded with the
table: other processes on the machine inflate every number alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MISTAKES: tuple[tuple[str, str], ...] = (
    ("unknown key", "kd_ration=0.7"),
    ("bad value", "kd_ratio=2"),
    ("missing file", "tokenizer.path=/nonexistent"),
)

REFERENCES: tuple[tuple[str, str], ...] = (
    ("python -c pass", "pass"),
    ('python -c "import torch"', "import torch"),
    ('python -c "import torchtune"', "import torchtune"),
)


@dataclass
class Result:
    """Timings of one case (seconds) and whether it answered as a config mistake should."""

    name: str
    argv: list[str]
    times: list[float]
    exit_code: int
    error_lines: list[str]
    expect_error: bool
    stderr_tail: str

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def ok(self) -> bool:
        if not self.expect_error:
            return self.exit_code == 0
        return self.exit_code == 2 and len(self.error_lines) == 1


def placeholder_files(root: Path) -> list[str]:
    """Empty files where the built-in Qwen2.5 14B -> 3B config expects weights and tokenizer;
    returns the overrides that point the config at them."""
    student, teacher, tok = root / "student", root / "teacher", root / "tok"
    for folder in (student, teacher, tok):
        folder.mkdir(parents=True, exist_ok=True)
    for i in (1, 2):
        (student / f"model-0000{i}-of-00002.safetensors").write_text("")
    for i in range(1, 9):
        (teacher / f"model-0000{i}-of-00008.safetensors").write_text("")
    (tok / "vocab.json").write_text("{}")
    (tok / "merges.txt").write_text("")
    return [
        f"output_dir={root / 'out'}",
        f"checkpointer.checkpoint_dir={student}",
        f"teacher_checkpointer.checkpoint_dir={teacher}",
        f"tokenizer.path={tok / 'vocab.json'}",
        f"tokenizer.merges_file={tok / 'merges.txt'}",
    ]


def time_case(
    name: str, argv: list[str], env: dict[str, str], cwd: Path, repeats: int, expect_error: bool
) -> Result:
    times: list[float] = []
    proc = None
    for i in range(repeats + 1):  # the first run warms the file cache and is not counted
        t0 = time.perf_counter()
        proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
        elapsed = time.perf_counter() - t0
        if i > 0:
            times.append(elapsed)
    assert proc is not None
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kd: error:")]
    return Result(name, argv, times, proc.returncode, errors, expect_error, proc.stderr[-2000:])


def git_state(repo: Path) -> str:
    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return out.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    branch = git("rev-parse", "--abbrev-ref", "HEAD")
    return f"{commit} ({branch}){dirty}"


def run_all(args: argparse.Namespace) -> dict:
    repo = Path(args.repo).resolve()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo / "src")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("KD_DEBUG", None)
    py = args.python
    started = datetime.datetime.now().isoformat(timespec="seconds")
    load_before = os.getloadavg()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="kd_bench_errors_") as tmp:
        base = placeholder_files(Path(tmp))
        for command in args.commands.split(","):
            for label, mistake in MISTAKES:
                if command == "run":
                    head = ["run", "kd_single_device"]
                else:
                    head = [command]
                argv = [py, "-m", "kd.cli", *head, "--config", args.config, *base, mistake]
                results.append(
                    time_case(f"{command}: {label}", argv, env, repo, args.repeats, True)
                )
                print(f"{results[-1].name}: {results[-1].median:.2f} s", file=sys.stderr)
        for label, code in REFERENCES:
            argv = [py, "-c", code]
            results.append(time_case(label, argv, env, repo, args.repeats, False))
            print(f"{label}: {results[-1].median:.2f} s", file=sys.stderr)
    load_after = os.getloadavg()
    return {
        "label": args.label,
        "repo": str(repo),
        "git": git_state(repo),
        "date": started,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
        "repeats": args.repeats,
        "config": args.config,
        "command_line": shlex.join(["python", *sys.argv]),
        "results": [{**asdict(r), "median": r.median, "ok": r.ok, "argv": r.argv} for r in results],
    }


def markdown(data: dict, baseline: dict | None) -> str:
    lines = [
        f"## {data['label']}",
        "",
        f"- source: `{data['repo']}` at {data['git']}; python {data['python']}, "
        f"{data['cpus']} CPUs; {data['date']}",
        f"- load average (1, 5, 15 min) before: {data['load_before']}, after: {data['load_after']}",
        f"- {data['repeats']} timed runs per case after one warm-up run; config "
        f"`{data['config']}` with its files redirected to empty placeholders",
        f"- command: `{data['command_line']}`",
        "",
    ]
    before = {r["name"]: r for r in baseline["results"]} if baseline else {}
    head = "| case | median s | min s | max s | exit 2 + one `kd: error:` line |"
    rule = "|---|---:|---:|---:|---|"
    if before:
        head += f" {baseline['label']} median s | ratio |"
        rule += "---:|---:|"
    lines += [head, rule]
    for r in data["results"]:
        if r["expect_error"]:
            check = (
                "yes" if r["ok"] else f"NO (exit {r['exit_code']}, {len(r['error_lines'])} lines)"
            )
        else:
            check = "(reference)"
        row = (
            f"| {r['name']} | {r['median']:.2f} | {min(r['times']):.2f} | "
            f"{max(r['times']):.2f} | {check} |"
        )
        if before:
            old = before.get(r["name"])
            row += (
                f" {old['median']:.2f} | {old['median'] / r['median']:.1f}x |"
                if old
                else " - | - |"
            )
        lines.append(row)
    errors = [(r["name"], r["error_lines"]) for r in data["results"] if r["expect_error"]]
    lines += ["", "Error lines printed:", ""]
    seen: set[str] = set()
    for name, errs in errors:
        for line in errs:
            if line not in seen:
                seen.add(line)
                lines.append(f"- {name}: `{line}`")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", required=True, help="source tree to time (PYTHONPATH=REPO/src)")
    parser.add_argument("--label", default="measurement", help="section title")
    parser.add_argument("--config", default="qwen2_5/14B_to_3B_full_single_device")
    parser.add_argument(
        "--commands", default="run,validate", help="comma-separated kd commands to time"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case")
    parser.add_argument("--python", default=sys.executable, help="interpreter to run")
    parser.add_argument("--out", help="markdown file: the section is appended (created if absent)")
    parser.add_argument("--save-json", help="write the raw numbers here")
    parser.add_argument("--baseline", help="JSON from an earlier run: adds its medians and ratios")
    args = parser.parse_args()
    data = run_all(args)
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    text = markdown(data, baseline)
    print(text)
    if args.save_json:
        Path(args.save_json).write_text(json.dumps(data, indent=2))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        sep = "\n" if out.exists() and out.stat().st_size else ""
        with out.open("a") as f:
            f.write(sep + text)
    failed = [r["name"] for r in data["results"] if not r["ok"]]
    for r in data["results"]:
        if not r["ok"]:
            print(f"{r['name']}: not answered as a config mistake; stderr:", file=sys.stderr)
            print(r["stderr_tail"], file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
