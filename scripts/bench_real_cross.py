"""Issue 26's proof on a real model, offline, on this CPU: two studies on SmolLM2-135M-Instruct and
the Python reference text of scripts/bench_real_kd.py, each a set of real ``kd run kd`` runs at
equal steps, tokens and seed. Writes ``<work>/results_<study>_<steps>.json``.

``--study cross``: a teacher with another tokenizer. SmolLM2's tokenizer is retrained on the
training split with a smaller vocabulary (transformers' ``train_new_from_iterator``, ``--vocab``
tokens), and the block-pruned student (layers 19-28 of 30 dropped) gets it: its tied embedding is
re-initialised for the new vocabulary, each new token's row the mean of the old rows of its string
under the old tokenizer (vocabulary transfer). ``kd init --cross-tokenizer`` writes the config;
the runs are CE-only and cross-tokenizer KD (kd init's settings, and other hybrid weights).
Held-out loss is in nats per character (summed next-token NLL of each text after the BOS token,
over the text's characters), so models with either tokenizer, the teacher included, compare.

``--study routed``: two teachers specialised on the halves of the training rows split by a real
property of each row (``--split-by``: ``code``, rows holding a code example, an indented block or a
``>>>`` prompt, against prose-only rows; or ``reference``, Library Reference topics against
Language Reference topics), each a copy of the teacher fine-tuned with kd on its half (CE only,
``--teacher-steps``). The block-pruned student (same tokenizer) trains on the union with: CE only,
teacher A only, teacher B only, and ``teachers:`` routed by the rows' ``domain`` field. Held-out
loss: token-weighted next-token NLL on dev and test, on the union and on each half.

Runs that finished are reused; a run stopped part-way resumes from its newest step checkpoint
(``resume_from_checkpoint=true``; kd's resume is exact), so its numbers are an uninterrupted run's.

    python scripts/bench_real_cross.py --work /tmp/xkd --study cross
    python scripts/bench_real_cross.py --work /tmp/xkd --study routed
    python scripts/bench_real_cross.py --work /tmp/xkd --study routed --steps 2 --teacher-steps 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_real_hidden as hidden  # noqa: E402
import bench_real_kd as base  # noqa: E402

LR = 3e-4  # the best learning rate of bench_real_kd's study, for every student run here
TEACHER_LR = 1e-4  # fine-tuning the specialist teachers (an instruct model: a gentler step)
STEPS = {"cross": 100, "routed": 50}  # default steps per student run of each study
EVALS = 5  # in-training evaluations on dev (routed study; the cross study validates nothing)


@dataclass(frozen=True)
class Setting:
    """One student run: the keys changed from kd init's config.

    ``teacher``: ``None`` (CE only), ``"cross"`` (the other-tokenizer teacher), a specialist's
    name, or ``"route"`` (both specialists, routed by the ``domain`` field).
    """

    name: str
    kd_ratio: float
    teacher: str | None
    matched_weight: float | None = None


CROSS: tuple[Setting, ...] = (
    Setting("ce", 0.0, None),
    Setting("kd", 0.5, "cross"),  # kd init's settings (hybrid weight: the matched share)
    Setting("kd w=0.5", 0.5, "cross", matched_weight=0.5),
)


def routed_settings(halves: tuple[str, str]) -> tuple[Setting, ...]:
    a, b = halves
    return (
        Setting("ce", 0.0, None),
        Setting(f"kd {a} teacher", 0.5, a),
        Setting(f"kd {b} teacher", 0.5, b),
        Setting("kd routed", 0.5, "route"),
    )


# ----------------------------------------------------------------------------- running


def run_dir(work: Path, study: str, name: str, steps: int) -> Path:
    slug = name.replace(" ", "_").replace("=", "")
    return work / f"runs_{study}" / f"{slug}_{steps}"


def train(config: Path, out: Path) -> dict[str, float]:
    """``kd run kd`` of ``config`` into ``out`` unless it finished; a stopped run resumes
    (bench_real_hidden's runner); its step checkpoints go once it finished. Returns the run's
    wall and CPU seconds (summed over its starts)."""
    return hidden.train_resumable(config, out, drop_checkpoints=True)


def run_config(cfg: Any, paths: dict[str, Path], out: Path, steps: int, *, validate: bool) -> Path:
    """bench_real_kd's shared run knobs, learning rate, step checkpoints (for resuming) and,
    unless ``validate``, no in-training validation."""
    from omegaconf import OmegaConf

    cfg.output_dir = str(out)
    cfg.save_every_n_steps = max(steps // 4, 1)
    cfg.keep_last_n = 1
    path = base.save_run_config(cfg, paths, out, steps, evals=EVALS)
    if not validate:
        cfg.validation = None
        OmegaConf.save(cfg, path)
    return path


def train_summary(out: Path) -> dict[str, Any]:
    train_rows, val = base.read_metrics(out)
    return {
        "tokens": sum(r["num_tokens"] for r in train_rows),
        "tok_s": statistics.median(r["tokens_per_second"] for r in train_rows),
        "final_train_loss": train_rows[-1]["loss"],
        "val": val,
    }


def kd_init(work: Path, teacher: Path, student: Path, name: str, *extra: str) -> Path:
    """kd init's config for the pair (written once)."""
    config = work / f"{name}.yaml"
    if not config.is_file():
        cmd = ["kd", "init", "--teacher", str(teacher), "--student", str(student)]
        cmd += ["--data", str(work / "train.jsonl"), "--output-dir", str(work / "runs" / "init")]
        cmd += ["--config-out", str(config), "--max-seq-len", str(base.MAX_SEQ_LEN)]
        cmd += ["--device", "cpu", *extra]
        base.run(cmd, work / f"{name}.log")
    return config


def texts_of(path: Path, keep: Callable[[dict], bool] = lambda row: True) -> list[str]:
    rows = (json.loads(x) for x in path.read_text().splitlines() if x)
    return [r["text"] for r in rows if keep(r)]


# ----------------------------------------------------------------------------- cross tokenizer


def retrained_student(src: Path, dest: Path, texts: list[str], vocab: int) -> None:
    """``src`` (an HF folder) with SmolLM2's tokenizer retrained on ``texts`` to ``vocab`` tokens,
    its tied embedding re-initialised: each new token's row is the old row of the same token
    string, else the mean of the old rows of its text under the old tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    old = AutoTokenizer.from_pretrained(src)
    new = old.train_new_from_iterator(texts, vocab_size=vocab)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weight = model.get_input_embeddings().weight.detach().clone()
    old_vocab = old.get_vocab()
    rows, copied = [], 0
    for i in range(len(new)):
        token = new.convert_ids_to_tokens(i)
        if token in old_vocab:
            rows.append(weight[old_vocab[token]])
            copied += 1
            continue
        ids = old(new.decode([i]), add_special_tokens=False)["input_ids"]
        rows.append(weight[ids].mean(0) if ids else weight.mean(0))
    model.resize_token_embeddings(len(new))
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(torch.stack(rows))
    model.tie_weights()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, key, getattr(new, key))
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    new.save_pretrained(tmp)
    (tmp / "vocab_transfer.json").write_text(
        json.dumps({"vocab": len(new), "rows_copied": copied, "rows_averaged": len(new) - copied})
    )
    tmp.rename(dest)


def char_loss(folder: Path, texts: list[str], batch: int = 8) -> dict[str, float]:
    """Summed next-token NLL of each text under the HF folder, the BOS token before it (as kd's
    training rows start), every text token predicted; per character and per token.

    Texts are not truncated, so every model scores the same characters whatever its tokenizer.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = [[tok.bos_token_id, *tok(t, add_special_tokens=False)["input_ids"]] for t in texts]
    for x, t in zip(ids, texts, strict=True):  # the tokens spell the text, no more, no less
        assert tok.decode(x[1:]) == t, f"{folder}: tokens do not spell {t[:40]!r}"
    total, count = base.summed_nll(model, ids, batch)
    chars = sum(len(t) for t in texts)
    return {"nats_per_char": total / chars, "nats_per_token": total / count, "tokens": count}


def prepare_cross(work: Path, vocab: int) -> dict[str, Path]:
    """bench_real_kd's folders and data, the retrained-tokenizer student, kd init's config."""
    paths = base.prepare(work)
    student = work / f"student_cross_{vocab}"
    if not (student / "model.safetensors").is_file():
        retrained_student(paths["student_block"], student, texts_of(paths["train"]), vocab)
    paths["student_cross"] = student
    paths["base_cross"] = kd_init(
        work, paths["teacher"], student, f"base_cross_{vocab}", "--cross-tokenizer"
    )
    return paths


def cross_config(paths: dict[str, Path], setting: Setting, out: Path, steps: int) -> Path:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(paths["base_cross"])
    cfg.kd_ratio = setting.kd_ratio
    OmegaConf.update(cfg, "optimizer.lr", LR)
    if setting.teacher is None:
        cfg.teacher_model = None
        cfg.teacher_checkpointer = None
        cfg.cross_tokenizer = None
    else:
        cfg.cross_tokenizer.matched_weight = setting.matched_weight
    return run_config(cfg, paths, out, steps, validate=False)


def cross_study(args: argparse.Namespace) -> None:
    paths = prepare_cross(args.work, args.vocab)
    if args.prepare:
        return
    texts = {s: texts_of(paths[s]) for s in ("dev", "test")}
    results = []
    for setting in CROSS:
        if args.only is not None and setting.name != args.only:
            continue
        out = run_dir(args.work, f"cross{args.vocab}", setting.name, args.steps)
        timing = train(cross_config(paths, setting, out, args.steps), out)
        result = {
            "name": setting.name,
            "kd_ratio": setting.kd_ratio,
            "matched_weight": setting.matched_weight,
            **{s: char_loss(out / "final", t) for s, t in texts.items()},
            **train_summary(out),
            **timing,
        }
        results.append(result)
        print(
            f"{setting.name:12s} nats/char dev {result['dev']['nats_per_char']:.4f} "
            f"test {result['test']['nats_per_char']:.4f} tokens {result['tokens']}",
            flush=True,
        )
    if args.only is not None:
        return
    reference = {
        name: {s: char_loss(paths[key], t) for s, t in texts.items()}
        for name, key in (
            ("teacher", "teacher"),
            ("untrained (retrained tokenizer)", "student_cross"),
            ("untrained (teacher's tokenizer)", "student_block"),
        )
    }
    transfer = json.loads((paths["student_cross"] / "vocab_transfer.json").read_text())
    save(args, "cross", {"runs": results, "reference": reference, "vocab_transfer": transfer})


# ----------------------------------------------------------------------------- routed teachers


def has_code(row: dict) -> bool:
    """The row holds a code example: an indented block (how pydoc renders one) or a prompt."""
    return any(line.startswith(("   ", ">>>")) for line in row["text"].splitlines())


# Topics pydoc_data takes from the Library Reference (library/stdtypes.rst, string.rst, pdb.rst);
# every other topic is from the Language Reference ("types" is its standard type hierarchy).
LIBRARY = ("debugger", "formatstrings", "string-methods", "specialattrs", "truth")


def is_library(row: dict) -> bool:
    topic = row["topic"]
    stdtypes = topic.startswith(("bltin-", "types")) and topic != "types"
    return topic in LIBRARY or stdtypes


SPLITS: dict[str, tuple[tuple[str, str], Callable[[dict], bool]]] = {
    "code": (("code", "prose"), has_code),  # the predicate is True for the first half
    "reference": (("library", "language"), is_library),
}


def prepare_routed(work: Path, split_by: str) -> dict[str, Path]:
    """bench_real_kd's folders, and the rows with their ``domain`` in ``work/routed_<split>/``:
    the union (train, dev, test) and each half of train."""
    paths = base.prepare(work)
    (first, second), pred = SPLITS[split_by]
    folder = work / f"routed_{split_by}"
    folder.mkdir(exist_ok=True)
    rows = [json.loads(x) for x in base.DATA.read_text().splitlines()]
    for row in rows:
        row["domain"] = first if pred(row) else second
    files = {
        "train": [r for r in rows if r["split"] == "train"],
        "dev": [r for r in rows if r["split"] == "dev"],
        "test": [r for r in rows if r["split"] == "test"],
        **{
            f"train_{h}": [r for r in rows if r["split"] == "train" and r["domain"] == h]
            for h in (first, second)
        },
    }
    routed = dict(paths)
    for name, part in files.items():
        routed[name] = folder / f"{name}.jsonl"
        routed[name].write_text(
            "".join(json.dumps({"text": r["text"], "domain": r["domain"]}) + "\n" for r in part)
        )
    return routed


def specialist(
    paths: dict[str, Path], work: Path, half: str, split_by: str, steps: int
) -> tuple[Path, dict[str, Any]]:
    """The teacher fine-tuned by kd (CE only) on ``half``'s training rows: its ``final/``."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(paths["base"])  # kd init's teacher -> student config
    cfg.model = cfg.teacher_model  # the teacher is the model trained
    cfg.checkpointer.checkpoint_dir = str(paths["teacher"])
    cfg.tokenizer.path = str(paths["teacher"])
    cfg.teacher_model = None
    cfg.teacher_checkpointer = None
    cfg.kd_ratio = 0.0
    cfg.dataset.data_files = str(paths[f"train_{half}"])
    OmegaConf.update(cfg, "optimizer.lr", TEACHER_LR)
    out = run_dir(work, f"routed_{split_by}", f"teacher {half}", steps)
    timing = train(run_config(cfg, paths, out, steps, validate=True), out)
    return out / "final", {**train_summary(out), **timing}


def student_config(
    paths: dict[str, Path], setting: Setting, teachers: dict[str, Path], out: Path, steps: int
) -> Path:
    """kd init's teacher -> block-student config on the union, with the setting's teachers."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(paths["base"])
    cfg.checkpointer.checkpoint_dir = str(paths["student_block"])
    cfg.tokenizer.path = str(paths["student_block"])
    cfg.dataset.data_files = str(paths["train"])
    cfg.kd_ratio = setting.kd_ratio
    OmegaConf.update(cfg, "optimizer.lr", LR)
    member = OmegaConf.to_container(cfg.teacher_checkpointer)
    if setting.teacher is None:
        cfg.teacher_model, cfg.teacher_checkpointer = None, None
    elif setting.teacher == "route":
        cfg.teachers = {
            "combine": "route",
            "route_field": "domain",
            "members": [
                {
                    "name": name,
                    "teacher_model": OmegaConf.to_container(cfg.teacher_model),
                    "teacher_checkpointer": {**member, "checkpoint_dir": str(folder)},
                }
                for name, folder in teachers.items()
            ],
        }
        cfg.pop("teacher_model")  # `teachers:` stands in place of the one-teacher keys
        cfg.pop("teacher_checkpointer")
    else:
        cfg.teacher_checkpointer.checkpoint_dir = str(teachers[setting.teacher])
    return run_config(cfg, paths, out, steps, validate=True)


def routed_eval(folder: Path, paths: dict[str, Path], halves: tuple[str, str]) -> dict:
    """Token-weighted held-out loss on dev and test: the union and each half."""
    out: dict[str, float] = {}
    for split in ("dev", "test"):
        out[split] = base.heldout_loss(folder, texts_of(paths[split]))[0]
        for half in halves:
            texts = texts_of(paths[split], lambda r, h=half: r["domain"] == h)
            if texts:
                out[f"{split} {half}"], out[f"{split} {half} tokens"] = base.heldout_loss(
                    folder, texts
                )
    return out


def routed_study(args: argparse.Namespace) -> None:
    paths = prepare_routed(args.work, args.split_by)
    halves = SPLITS[args.split_by][0]
    if args.prepare:
        return
    teachers, fine_tunes = {}, {}
    for half in halves:
        teachers[half], fine_tunes[half] = specialist(
            paths, args.work, half, args.split_by, args.teacher_steps
        )
    results = []
    for setting in routed_settings(halves):
        if args.only is not None and setting.name != args.only:
            continue
        out = run_dir(args.work, f"routed_{args.split_by}", setting.name, args.steps)
        timing = train(student_config(paths, setting, teachers, out, args.steps), out)
        result = {
            "name": setting.name,
            "teacher": setting.teacher,
            **routed_eval(out / "final", paths, halves),
            **train_summary(out),
            **timing,
        }
        results.append(result)
        print(f"{setting.name:18s} test {result['test']:.4f} tokens {result['tokens']}", flush=True)
    if args.only is not None:
        return
    reference = {
        name: routed_eval(folder, paths, halves)
        for name, folder in (
            ("teacher", paths["teacher"]),
            *((f"{half} teacher", teachers[half]) for half in halves),
            ("untrained", paths["student_block"]),
        )
    }
    rows = {h: len(texts_of(paths[f"train_{h}"])) for h in halves}
    save(
        args,
        f"routed_{args.split_by}",
        {"runs": results, "reference": reference, "fine_tunes": fine_tunes, "train_rows": rows},
    )


def save(args: argparse.Namespace, study: str, body: dict) -> None:
    path = args.work / f"results_{study}_{args.steps}.json"
    body = {**body, "steps": args.steps, "date": time.strftime("%Y-%m-%d")}
    if study.startswith("routed"):
        body["teacher_steps"] = args.teacher_steps
    path.write_text(json.dumps(body, indent=1))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (models, runs)")
    parser.add_argument("--study", choices=("cross", "routed"), required=True)
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per student run (cross 100, routed 50)"
    )
    parser.add_argument(
        "--teacher-steps", type=int, default=40, help="routed: steps of each specialist's fine-tune"
    )
    parser.add_argument("--vocab", type=int, default=8192, help="cross: the retrained vocabulary")
    parser.add_argument("--split-by", choices=tuple(SPLITS), default="code", help="routed: halves")
    parser.add_argument("--only", default=None, help="run only this setting (by name)")
    parser.add_argument("--prepare", action="store_true", help="only make folders and configs")
    args = parser.parse_args()
    if args.steps is None:  # each study's runs take about 30 min on 2 idle cores
        args.steps = STEPS[args.study]
    (cross_study if args.study == "cross" else routed_study)(args)


if __name__ == "__main__":
    main()
