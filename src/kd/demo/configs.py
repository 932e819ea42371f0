"""The demo's three training runs: model shapes, random-init models and ``kd_single_device`` configs.

Each run is a plain YAML under ``<output-dir>/configs/`` that ``kd run kd_single_device --config
<file>`` reruns unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kd.demo.task import DemoPlan
from kd.testing import TinyModel, checkpointer_node, tokenizer_node, write_tiny_model

MAX_SEQ_LEN = 64

# Tiny Qwen2 decoders with tied embeddings, like Qwen2.5-0.5B..3B. The teacher has a larger padded
# vocabulary than the student, as Qwen2.5-14B (152064) and 3B (151936) do.
TEACHER = TinyModel(320, 2, 4, 2, 128, 384, max_seq_len=MAX_SEQ_LEN)
STUDENT = TinyModel(288, 2, 4, 2, 64, 192, max_seq_len=MAX_SEQ_LEN)


@dataclass(frozen=True)
class DemoRun:
    """One training run of the demo: its config file, output folder, model shape and initial weights."""

    name: str
    config: Path
    run_dir: Path
    shape: TinyModel
    init_dir: Path


def dataset_node(data_file: Path, cache_dir: Path) -> dict[str, Any]:
    """The ``dataset:`` node of a demo json-lines file (answers labelled, questions masked)."""
    return {
        "_component_": "torchtune.datasets.instruct_dataset",
        "source": "json",
        "data_files": str(data_file),
        "split": "train",
        "train_on_input": False,
        "cache_dir": str(cache_dir),  # Hugging Face datasets cache, kept inside the demo folder
    }


def run_config(
    *,
    root: Path,
    run_dir: Path,
    model: TinyModel,
    model_dir: Path,
    data_file: Path,
    epochs: int,
    batch_size: int,
    save_every: int,
    lr: float,
    seed: int,
    kd_ratio: float = 0.0,
    teacher: TinyModel | None = None,
    teacher_dir: Path | None = None,
) -> dict[str, Any]:
    """A complete ``kd_single_device`` config (plain dict) for one demo run."""
    steps = _num_examples(data_file) // batch_size * epochs
    return {
        "output_dir": str(run_dir),
        "model": model.builder(),
        "teacher_model": teacher.builder() if teacher is not None else None,
        "tokenizer": tokenizer_node(root / "tokenizer", MAX_SEQ_LEN),
        "checkpointer": checkpointer_node(model_dir, run_dir, model.model_type),
        "teacher_checkpointer": (
            checkpointer_node(teacher_dir, run_dir, teacher.model_type)
            if teacher is not None and teacher_dir is not None
            else None
        ),
        "dataset": dataset_node(data_file, root / "cache"),
        "seed": seed,
        "shuffle": True,
        "batch_size": batch_size,
        "epochs": epochs,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": lr, "weight_decay": 0.01},
        "lr_scheduler": {
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 10,
        },
        "clip_grad_norm": 1.0,
        "kd_ratio": kd_ratio,
        "temperature": 1.0,
        "kd_loss": {"divergence": "forward_kl"},
        "device": "cpu",
        "dtype": "fp32",
        "log_every_n_steps": 1,
        "save_every_n_steps": save_every,
        "keep_last_n": steps // save_every + 1,  # keep every step checkpoint: they make the curves
        "metric_logger": {
            "_component_": "torchtune.training.metric_logging.DiskLogger",
            "log_dir": str(run_dir / "logs"),
        },
    }


def _num_examples(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def write_config(path: Path, cfg: dict[str, Any], header: str) -> Path:
    """Write ``cfg`` as YAML under a comment ``header`` and the command that reruns it."""
    from omegaconf import OmegaConf

    path.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    path.write_text(
        comment + f"# Rerun: kd run kd_single_device --config {path}\n" + OmegaConf.to_yaml(cfg)
    )
    return path


def write_runs(
    root: Path, plan: DemoPlan, seed: int, files: dict[str, Path], tokenizer_dir: Path
) -> dict[str, DemoRun]:
    """Random-init models and the three run configs (teacher, KD student, CE-only student)."""
    teacher_init = write_tiny_model(
        root / "models/teacher_init", TEACHER, seed=seed + 1, tokenizer_dir=tokenizer_dir
    )
    # Both students start from the same weights and see the same batches (same seed).
    student_init = write_tiny_model(
        root / "models/student_init", STUDENT, seed=seed + 2, tokenizer_dir=tokenizer_dir
    )
    runs = {
        name: DemoRun(name, root / f"configs/{name}.yaml", root / f"runs/{name}", shape, init)
        for name, shape, init in (
            ("teacher", TEACHER, teacher_init),
            ("kd_student", STUDENT, student_init),
            ("ce_student", STUDENT, student_init),
        )
    }
    common: dict[str, Any] = {"root": root, "lr": plan.lr, "seed": seed}
    teacher = runs["teacher"]
    cfg = run_config(
        **common,
        run_dir=teacher.run_dir,
        model=TEACHER,
        model_dir=teacher_init,
        data_file=files["teacher_train"],
        epochs=plan.teacher_epochs,
        batch_size=plan.teacher_batch_size,
        save_every=plan.teacher_save_every,
    )
    write_config(
        teacher.config,
        cfg,
        f"kd demo, step 2: train the teacher on {plan.teacher_examples} labelled examples\n"
        "(it has no teacher of its own: kd_ratio 0 is plain fine-tuning)",
    )
    student: dict[str, Any] = {
        **common,
        "model": STUDENT,
        "model_dir": student_init,
        "data_file": files["student_train"],
        "epochs": plan.student_epochs,
        "batch_size": plan.student_batch_size,
        "save_every": plan.student_save_every,
    }
    kd_run, ce_run = runs["kd_student"], runs["ce_student"]
    cfg = run_config(
        **student,
        run_dir=kd_run.run_dir,
        kd_ratio=plan.kd_ratio,
        teacher=TEACHER,
        teacher_dir=teacher.run_dir / "final",
    )
    write_config(
        kd_run.config,
        cfg,
        f"kd demo, step 3a: the student on {plan.student_examples} labelled examples, distilled\n"
        f"from the trained teacher (loss = {1 - plan.kd_ratio:.1f} * CE + {plan.kd_ratio} * KL)",
    )
    cfg = run_config(**student, run_dir=ce_run.run_dir, kd_ratio=0.0)
    write_config(
        ce_run.config,
        cfg,
        "kd demo, step 3b: the same student, data and steps, cross-entropy only (kd_ratio 0)",
    )
    return runs
