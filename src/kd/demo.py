"""``kd demo``: knowledge distillation end to end on CPU in a few minutes, all through the real recipe.

Run it::

    kd demo                      # writes everything under ./kd_demo (about 3-5 minutes on 2 cores)
    kd demo --output-dir /tmp/d  # elsewhere
    kd demo --quick              # a smoke run (under a minute; too short to show KD's advantage)

What it does, all under one folder (nothing is downloaded):

1. Writes a Qwen2.5-style byte-level tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer.json``),
   a task, its data as json files, and random-init tiny Qwen2 models in Hugging Face format. The
   teacher has a larger padded vocabulary (320 rows) than the student (288), as Qwen2.5-14B (152064)
   and 3B (151936) do, so the vocab alignment of the KD loss runs.
2. Trains the teacher on many labelled examples (``kd run kd_single_device`` with ``kd_ratio: 0``).
3. Trains two identical students on the same few labelled examples for the same steps: one with KD
   from the trained teacher, one with cross-entropy only.
4. Evaluates all three on held-out data, prints a table, plots the curves and prints one line
   ``RESULT kd_student_heldout_loss=<x> ce_student_heldout_loss=<y> teacher_heldout_loss=<z>``.

The task ("continue the letters") is built so that KD has a real advantage, as in classic KD: the
answers follow a hidden random Markov chain over 16 letters; each letter has 4 possible successors
with probabilities 0.5/0.25/0.15/0.10. A labelled answer shows one sampled successor per position,
while the teacher, having learned from many examples, knows the whole distribution and passes it on
at every position of the student's few examples. The best possible held-out loss is the chain's
entropy, so the numbers have a floor to compare against.

Each training run is a plain YAML under ``<output-dir>/configs/`` that ``kd run kd_single_device
--config <file>`` reruns unchanged.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kd.errors import KDUserError

if TYPE_CHECKING:
    import torch
    from torch import nn

# A folder holding this file was made by `kd demo` and may be cleared by the next `kd demo`.
MARKER_FILE = "kd_demo.json"
# Sub-folders `kd demo` writes (and clears on a rerun into the same folder).
_OWNED = ("tokenizer", "data", "models", "configs", "runs", "eval", "cache")

LETTERS = "abcdefghijklmnop"
SUCCESSOR_PROBS = (0.5, 0.25, 0.15, 0.10)
PROMPT_LETTERS = 3
ANSWER_LETTERS = 8
MAX_SEQ_LEN = 64


@dataclass(frozen=True)
class ModelShape:
    """A tiny Qwen2 decoder (tied embeddings, like Qwen2.5-0.5B..3B)."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    max_seq_len: int = MAX_SEQ_LEN

    def builder(self) -> dict[str, Any]:
        """The ``model:`` / ``teacher_model:`` config node."""
        return {
            "_component_": "torchtune.models.qwen2.qwen2",
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "embed_dim": self.embed_dim,
            "intermediate_dim": self.intermediate_dim,
            "max_seq_len": self.max_seq_len,
            "norm_eps": 1e-6,
            "rope_base": 1_000_000.0,
            "tie_word_embeddings": True,
        }

    def hf_config(self) -> dict[str, Any]:
        """A Qwen2 ``config.json`` that torchtune's checkpointer and transformers both read."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.embed_dim,
            "intermediate_size": self.intermediate_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_seq_len,
            "max_window_layers": self.num_layers,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "use_cache": True,
            "bos_token_id": 256,  # <|endoftext|> in the demo tokenizer
            "eos_token_id": 258,  # <|im_end|>
            "torch_dtype": "float32",
        }


TEACHER = ModelShape(320, 2, 4, 2, 128, 384)
STUDENT = ModelShape(288, 2, 4, 2, 64, 192)


@dataclass(frozen=True)
class DemoPlan:
    """How much data and training each phase gets."""

    teacher_examples: int
    student_examples: int
    heldout_examples: int
    teacher_epochs: int
    student_epochs: int
    teacher_batch_size: int
    student_batch_size: int
    teacher_save_every: int
    student_save_every: int
    kd_ratio: float
    lr: float

    def teacher_steps(self) -> int:
        return self.teacher_examples // self.teacher_batch_size * self.teacher_epochs

    def student_steps(self) -> int:
        return self.student_examples // self.student_batch_size * self.student_epochs


FULL = DemoPlan(
    teacher_examples=4000,
    student_examples=64,
    heldout_examples=512,
    teacher_epochs=3,
    student_epochs=40,
    teacher_batch_size=32,
    student_batch_size=16,
    teacher_save_every=25,
    student_save_every=10,
    kd_ratio=0.9,
    lr=3e-3,
)
QUICK = DemoPlan(
    teacher_examples=640,
    student_examples=32,
    heldout_examples=64,
    teacher_epochs=1,
    student_epochs=4,
    teacher_batch_size=32,
    student_batch_size=16,
    teacher_save_every=10,
    student_save_every=4,
    kd_ratio=0.9,
    lr=3e-3,
)


# --------------------------------------------------------------------------------------- task
@dataclass(frozen=True)
class LetterChain:
    """The hidden rule of the task: a Markov chain over letters.

    Attributes:
        successors: letter -> its possible next letters, most likely first.
        probs: probability of each successor slot (the same for every letter).
    """

    successors: dict[str, list[str]]
    probs: tuple[float, ...]

    @classmethod
    def random(cls, rng: random.Random) -> LetterChain:
        return cls({c: rng.sample(LETTERS, len(SUCCESSOR_PROBS)) for c in LETTERS}, SUCCESSOR_PROBS)

    def sample(self, rng: random.Random) -> dict[str, str]:
        """One example: the first letters as the question, the next ones as the answer."""
        seq = [rng.choice(LETTERS)]
        for _ in range(PROMPT_LETTERS + ANSWER_LETTERS - 1):
            seq.append(rng.choices(self.successors[seq[-1]], weights=self.probs)[0])
        return {"input": "".join(seq[:PROMPT_LETTERS]), "output": "".join(seq[PROMPT_LETTERS:])}

    def most_likely_next(self, letter: str) -> str:
        return self.successors[letter][0]

    def most_likely_answer(self, prompt: str) -> str:
        """The answer a model that knows the chain produces greedily."""
        out, last = [], prompt[-1]
        for _ in range(ANSWER_LETTERS):
            last = self.most_likely_next(last)
            out.append(last)
        return "".join(out)

    def entropy(self) -> float:
        """Nats per answer letter: the least held-out loss any model can reach on the letters."""
        return -sum(p * math.log(p) for p in self.probs)


# ------------------------------------------------------------------------------------- assets
def write_tokenizer(dest: Path) -> Path:
    """A Qwen2.5-style byte-level tokenizer: 256 byte tokens + the 22 Qwen2.5 special tokens.

    Ids 0..255 are the bytes, 256..277 the special tokens (``<|endoftext|>`` = 256,
    ``<|im_start|>`` = 257, ``<|im_end|>`` = 258); no merges, so every letter is one token.
    """
    from kd import _torchtune as tt

    dest.mkdir(parents=True, exist_ok=True)
    b2u = tt.bytes_to_unicode()
    (dest / "vocab.json").write_text(
        json.dumps({b2u[b]: b for b in range(256)}, ensure_ascii=False)
    )
    (dest / "merges.txt").write_text("#version: 0.2\n")
    names = sorted(tt.QWEN2_5_SPECIAL_TOKENS, key=tt.QWEN2_5_SPECIAL_TOKENS.get)
    added = [{"id": 256 + i, "content": n, "special": True} for i, n in enumerate(names)]
    (dest / "tokenizer.json").write_text(json.dumps({"added_tokens": added}, indent=1))
    return dest


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_task(dest: Path, plan: DemoPlan, seed: int) -> tuple[LetterChain, dict[str, Path]]:
    """The chain and three disjointly sampled json-lines files: teacher, student and held-out."""
    rng = random.Random(seed)
    chain = LetterChain.random(rng)
    sizes = {
        "teacher_train": plan.teacher_examples,
        "student_train": plan.student_examples,
        "heldout": plan.heldout_examples,
    }
    files = {
        name: write_jsonl(dest / f"{name}.jsonl", [chain.sample(rng) for _ in range(n)])
        for name, n in sizes.items()
    }
    (dest / "task.json").write_text(
        json.dumps({"successors": chain.successors, "probs": list(chain.probs)}, indent=1)
    )
    return chain, files


def write_random_model(dest: Path, shape: ModelShape, *, seed: int, tokenizer_dir: Path) -> Path:
    """A random-init Qwen2 in Hugging Face format (``model.safetensors`` + ``config.json``)."""
    import torch
    from safetensors.torch import save_file

    from kd import _torchtune as tt
    from kd.checkpoint import tune_to_hf_state_dict

    dest.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = tt.qwen2(**_builder_kwargs(shape))
    # Hugging Face's Qwen2 init (normal, std 0.02; zero biases; unit norms): torchtune's builder
    # leaves embeddings at N(0, 1), which with tied embeddings starts the loss near 100 instead
    # of ln(vocab).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
            elif name.endswith("bias"):
                param.zero_()
    hf_config = shape.hf_config()
    hf_state = tune_to_hf_state_dict(model.state_dict(), model_type="QWEN2", hf_config=hf_config)
    save_file(
        {k: v.contiguous() for k, v in hf_state.items()},
        str(dest / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (dest / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        shutil.copyfile(tokenizer_dir / name, dest / name)
    return dest


def _builder_kwargs(shape: ModelShape) -> dict[str, Any]:
    return {k: v for k, v in shape.builder().items() if k != "_component_"}


# ------------------------------------------------------------------------------------ configs
def tokenizer_node(tokenizer_dir: Path, max_seq_len: int | None = MAX_SEQ_LEN) -> dict[str, Any]:
    """The ``tokenizer:`` node of the byte-level Qwen2.5 tokenizer written by the demo."""
    return {
        "_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer",
        "path": str(tokenizer_dir / "vocab.json"),
        "merges_file": str(tokenizer_dir / "merges.txt"),
        "special_tokens_path": str(tokenizer_dir / "tokenizer.json"),
        "max_seq_len": max_seq_len,
    }


def dataset_node(data_file: Path, cache_dir: Path) -> dict[str, Any]:
    return {
        "_component_": "torchtune.datasets.instruct_dataset",
        "source": "json",
        "data_files": str(data_file),
        "split": "train",
        "train_on_input": False,
        "cache_dir": str(cache_dir),  # Hugging Face datasets cache, kept inside the demo folder
    }


def checkpointer_node(model_dir: Path, output_dir: Path) -> dict[str, Any]:
    return {
        "_component_": "torchtune.training.FullModelHFCheckpointer",
        "checkpoint_dir": str(model_dir),
        "checkpoint_files": ["model.safetensors"],
        "model_type": "QWEN2",
        "output_dir": str(output_dir),
    }


def run_config(
    *,
    root: Path,
    run_dir: Path,
    model: ModelShape,
    model_dir: Path,
    data_file: Path,
    epochs: int,
    batch_size: int,
    save_every: int,
    lr: float,
    seed: int,
    kd_ratio: float = 0.0,
    teacher: ModelShape | None = None,
    teacher_dir: Path | None = None,
) -> dict[str, Any]:
    """A complete ``kd_single_device`` config (plain dict) for one demo run."""
    steps = _num_examples(data_file) // batch_size * epochs
    return {
        "output_dir": str(run_dir),
        "model": model.builder(),
        "teacher_model": teacher.builder() if teacher is not None else None,
        "tokenizer": tokenizer_node(root / "tokenizer"),
        "checkpointer": checkpointer_node(model_dir, run_dir),
        "teacher_checkpointer": (
            checkpointer_node(teacher_dir, run_dir) if teacher_dir is not None else None
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
    from omegaconf import OmegaConf

    path.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    path.write_text(
        comment + f"# Rerun: kd run kd_single_device --config {path}\n" + OmegaConf.to_yaml(cfg)
    )
    return path


def _quiet_step_checkpoints(record: logging.LogRecord) -> bool:
    # The demo saves a step checkpoint every few steps for its held-out curves; one line each
    # would bury the progress bar.
    return (
        not record.getMessage().startswith("saved checkpoint") or "step_" not in record.getMessage()
    )


def train(config_path: Path) -> None:
    """Run ``kd run kd_single_device --config <config_path>`` in this process."""
    from kd.cli import run_recipe
    from kd.recipes.kd_single_device import recipe_main

    log = logging.getLogger("kd")
    log.addFilter(_quiet_step_checkpoints)
    try:
        rc = run_recipe(recipe_main, ["--config", str(config_path)])
    finally:
        log.removeFilter(_quiet_step_checkpoints)
    if rc != 0:
        raise KDUserError(f"demo: training with {config_path} failed (exit status {rc}); see above")


# --------------------------------------------------------------------------------- evaluation
@dataclass
class EvalResult:
    """Held-out numbers of one model.

    Attributes:
        loss: mean cross-entropy over the labelled tokens of the held-out answers (nats/token).
        next_letter_acc: fraction of answer letters where the model's top guess (given the true
            previous letters) is the chain's most likely next letter.
        exact_match: fraction of prompts whose greedy 8-letter answer equals the chain's most
            likely answer.
    """

    loss: float
    next_letter_acc: float
    exact_match: float


class HeldOut:
    """Held-out examples tokenized exactly as the recipe tokenizes training data.

    Args:
        data_file: json-lines file with ``input`` / ``output``.
        tokenizer_cfg: the ``tokenizer:`` node of the runs.
        dataset_cfg: the ``dataset:`` node, pointed at ``data_file``.
    """

    def __init__(self, data_file: Path, tokenizer_cfg: dict[str, Any], dataset_cfg: dict[str, Any]):
        import torch
        from omegaconf import OmegaConf

        from kd import _torchtune as tt
        from kd.config import instantiate
        from kd.train import shift_labels

        self.tokenizer = instantiate(OmegaConf.create(tokenizer_cfg))
        dataset = instantiate(OmegaConf.create(dataset_cfg), self.tokenizer)
        self.rows = [
            json.loads(line) for line in data_file.read_text().splitlines() if line.strip()
        ]
        batch = tt.padded_collate_sft(
            [dataset[i] for i in range(len(dataset))],
            padding_idx=int(self.tokenizer.pad_id),
            ignore_idx=-100,
        )
        self.tokens = batch["tokens"]  # [n, s]
        self.labels = shift_labels(batch["labels"])  # [n, s]: position i predicts token i+1
        # Every prompt has the same length, so answers start at one position for all rows.
        prompts = [self._prompt_tokens(r["input"]) for r in self.rows]
        self.prompt_len = len(prompts[0])
        self.prompts = torch.tensor(prompts)  # [n, p]
        assert torch.equal(self.tokens[:, : self.prompt_len], self.prompts), "prompt tokens differ"
        answer_ids = [self._letter_ids(r["output"]) for r in self.rows]
        self.answers = torch.tensor(answer_ids)  # [n, ANSWER_LETTERS]
        self.last_prompt_letter = torch.tensor(
            [self._letter_ids(r["input"][-1]) for r in self.rows]
        )
        end = self.prompt_len + ANSWER_LETTERS
        assert torch.equal(self.tokens[:, self.prompt_len : end], self.answers), (
            "answer tokens differ"
        )

    def _prompt_tokens(self, text: str) -> list[int]:
        from kd import _torchtune as tt

        messages = [tt.Message("user", text, masked=True), tt.Message("assistant", "")]
        tokens, _ = self.tokenizer.tokenize_messages(messages, add_eos=False)
        return tokens

    def _letter_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=False, add_eos=False)

    def evaluate(
        self, model: nn.Module, chain: LetterChain, *, accuracy: bool = True
    ) -> EvalResult:
        """Held-out loss (and accuracies) of ``model``, a torchtune decoder returning logits."""
        import torch
        import torch.nn.functional as F

        with torch.inference_mode():
            logits = model(self.tokens).float()  # [n, s, v]
            loss = (
                F.cross_entropy(
                    logits.flatten(0, 1), self.labels.flatten(), ignore_index=-100, reduction="sum"
                )
                / (self.labels != -100).sum()
            )
            if not accuracy:
                return EvalResult(float(loss), math.nan, math.nan)
            p = self.prompt_len
            # Positions p-1 .. p+6 predict the 8 answer letters; the letter before each is the
            # last letter of the question, then the answer letters themselves.
            guesses = logits[:, p - 1 : p - 1 + ANSWER_LETTERS].argmax(-1)  # [n, 8]
            previous = torch.cat([self.last_prompt_letter, self.answers[:, :-1]], dim=1)
            best = self._best_next(previous, chain)
            next_letter_acc = float((guesses == best).float().mean())
            generated = self._greedy(model)  # [n, 8]
        wanted = [self._letter_ids(chain.most_likely_answer(r["input"])) for r in self.rows]
        exact = [g == w for g, w in zip(generated.tolist(), wanted, strict=True)]
        return EvalResult(float(loss), next_letter_acc, sum(exact) / len(exact))

    def _best_next(self, previous: torch.Tensor, chain: LetterChain) -> torch.Tensor:
        import torch

        table = torch.full((int(previous.max()) + 1,), -1, dtype=torch.long)
        for letter in LETTERS:
            table[self._letter_ids(letter)[0]] = self._letter_ids(chain.most_likely_next(letter))[0]
        return table[previous]

    def _greedy(self, model: nn.Module) -> torch.Tensor:
        import torch

        tokens = self.prompts
        for _ in range(ANSWER_LETTERS):
            nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)  # [n, 1]
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens[:, self.prompt_len :]


def load_hf_model(model_dir: Path, shape: ModelShape, scratch_dir: Path) -> nn.Module:
    """A trained HF folder (``final/`` or ``step_*``) as a torchtune decoder, via torchtune's checkpointer."""
    from kd import _torchtune as tt

    ckpt = tt.FullModelHFCheckpointer(
        checkpoint_dir=str(model_dir),
        checkpoint_files=["model.safetensors"],
        model_type="QWEN2",
        output_dir=str(scratch_dir),
    )
    model = tt.qwen2(**_builder_kwargs(shape))
    model.load_state_dict(ckpt.load_checkpoint()[tt.MODEL_KEY])
    return model.eval()


def heldout_curve(
    run_dir: Path,
    init_dir: Path,
    shape: ModelShape,
    heldout: HeldOut,
    chain: LetterChain,
    scratch: Path,
) -> list[tuple[int, float]]:
    """Held-out loss of the initial model and of every step checkpoint of a run: ``[(step, loss)]``."""
    folders = [(0, init_dir)] + sorted(
        (int(p.name.split("_")[1]), p) for p in run_dir.glob("step_*") if p.is_dir()
    )
    curve = []
    for step, folder in folders:
        model = load_hf_model(folder, shape, scratch)
        curve.append((step, heldout.evaluate(model, chain, accuracy=False).loss))
    return curve


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------- the plot
def plot_curves(dest: Path, runs: dict[str, dict[str, Any]], plan: DemoPlan, floor: float) -> Path:
    """Training and held-out loss curves of the three runs, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    colors = {"teacher": "tab:green", "kd_student": "tab:blue", "ce_student": "tab:red"}
    labels = {
        "teacher": f"teacher ({plan.teacher_examples} labelled examples)",
        "kd_student": f"KD student ({plan.student_examples} labelled + teacher)",
        "ce_student": f"CE-only student ({plan.student_examples} labelled)",
    }
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = [
        (axes[0], ["teacher"], "teacher"),
        (axes[1], ["kd_student", "ce_student"], "students"),
    ]
    for ax, names, title in panels:
        for name in names:
            run = runs[name]
            steps = [row["step"] for row in run["metrics"]]
            ax.plot(
                steps,
                [row["ce_loss"] for row in run["metrics"]],
                color=colors[name],
                alpha=0.35,
                lw=1,
                label=f"{labels[name]}: training CE",
            )
            xs, ys = zip(*run["curve"], strict=True)
            ax.plot(
                xs,
                ys,
                color=colors[name],
                lw=2,
                marker="o",
                ms=3,
                label=f"{labels[name]}: held-out",
            )
        if title == "students":
            ax.axhline(
                runs["teacher"]["final"].loss,
                color=colors["teacher"],
                ls="--",
                lw=1.5,
                label="trained teacher: held-out",
            )
        ax.axhline(floor, color="gray", ls=":", lw=1, label="best possible (chain entropy)")
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss per labelled token (nats)")
        # Log scale: step 0 (random init) sits near ln(vocab), far above the rest.
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(FixedLocator([0.3, 0.4, 0.5, 0.6, 0.8, 1, 1.5, 2, 3, 4, 6]))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(
        "kd demo: knowledge distillation on 'continue the letters' (held-out = unseen prompts)"
    )
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest


# ---------------------------------------------------------------------------------- the demo
@dataclass
class DemoResult:
    """What ``kd demo`` measured (also written to ``<output-dir>/results.json``).

    Attributes:
        teacher, kd_student, ce_student: held-out results of the three final models.
        heldout_floor: the least held-out loss any model can reach (the chain's entropy per token).
        gap_closed: ``(ce - kd) / (ce - teacher)`` of the held-out losses.
        seconds: wall time of the whole demo.
        plot: path of the PNG.
    """

    teacher: EvalResult
    kd_student: EvalResult
    ce_student: EvalResult
    heldout_floor: float
    gap_closed: float
    seconds: float
    plot: str

    def result_line(self) -> str:
        return (
            f"RESULT kd_student_heldout_loss={self.kd_student.loss:.4f} "
            f"ce_student_heldout_loss={self.ce_student.loss:.4f} "
            f"teacher_heldout_loss={self.teacher.loss:.4f}"
        )


@dataclass(frozen=True)
class _Run:
    """One training run of the demo: its config file, output folder, model shape and initial weights."""

    name: str
    config: Path
    run_dir: Path
    shape: ModelShape
    init_dir: Path


def _prepare_output_dir(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise KDUserError(f"--output-dir: {root} is a file; pass a folder")
    if root.is_dir() and any(root.iterdir()):
        if not (root / MARKER_FILE).exists():
            raise KDUserError(
                f"--output-dir: {root} is not empty and was not made by kd demo; "
                "pass a new or empty folder"
            )
        for name in _OWNED:
            shutil.rmtree(root / name, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER_FILE).write_text(json.dumps({"made_by": "kd demo"}) + "\n")


def _say(msg: str) -> None:
    print(msg, flush=True)


def write_runs(
    root: Path, plan: DemoPlan, seed: int, files: dict[str, Path], tokenizer_dir: Path
) -> dict[str, _Run]:
    """Random-init models and the three run configs (teacher, KD student, CE-only student)."""
    teacher_init = write_random_model(
        root / "models/teacher_init", TEACHER, seed=seed + 1, tokenizer_dir=tokenizer_dir
    )
    # Both students start from the same weights and see the same batches (same seed).
    student_init = write_random_model(
        root / "models/student_init", STUDENT, seed=seed + 2, tokenizer_dir=tokenizer_dir
    )
    runs = {
        "teacher": _Run(
            "teacher", root / "configs/teacher.yaml", root / "runs/teacher", TEACHER, teacher_init
        ),
        "kd_student": _Run(
            "kd_student",
            root / "configs/kd_student.yaml",
            root / "runs/kd_student",
            STUDENT,
            student_init,
        ),
        "ce_student": _Run(
            "ce_student",
            root / "configs/ce_student.yaml",
            root / "runs/ce_student",
            STUDENT,
            student_init,
        ),
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


def evaluate_runs(
    runs: dict[str, _Run], heldout: HeldOut, chain: LetterChain, scratch: Path
) -> dict[str, dict[str, Any]]:
    """Final held-out results, held-out curve and training metrics of every run."""
    out = {}
    for name, run in runs.items():
        final = load_hf_model(run.run_dir / "final", run.shape, scratch)
        out[name] = {
            "final": heldout.evaluate(final, chain),
            "curve": heldout_curve(run.run_dir, run.init_dir, run.shape, heldout, chain, scratch),
            "metrics": read_metrics(run.run_dir),
        }
    return out


def run_demo(output_dir: Path, *, quick: bool = False, seed: int = 0) -> DemoResult:
    """Build the tiny task, train teacher and both students through the recipe, evaluate, plot.

    Args:
        output_dir: folder for everything (created; a previous demo folder is cleared first).
        quick: a short smoke run (the numbers then do not show KD's advantage).
        seed: seeds the task, the data, the initial weights and the training runs.

    Returns:
        The evaluation of the three models and where the plot is.

    Raises:
        KDUserError: the folder is not usable, or a training run failed.
    """
    import torch

    root = Path(output_dir).resolve()
    _prepare_output_dir(root)
    plan = QUICK if quick else FULL
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        # Tiny models: one intra-op thread is as fast as two on an idle 2-core machine and ~20x
        # faster when the cores are busy (the threads spin-wait for each other).
        torch.set_num_threads(1)
    try:
        return _run_demo(root, plan, seed)
    finally:
        torch.set_num_threads(threads)


def _run_demo(root: Path, plan: DemoPlan, seed: int) -> DemoResult:
    start = time.perf_counter()

    _say(f"[1/4] writing tokenizer, task data, random-init models and configs under {root}")
    tokenizer_dir = write_tokenizer(root / "tokenizer")
    chain, files = write_task(root / "data", plan, seed)
    runs = write_runs(root, plan, seed, files, tokenizer_dir)

    t0 = time.perf_counter()
    _say(
        f"[2/4] training the teacher ({_describe(TEACHER)}) on {plan.teacher_examples} labelled "
        f"examples, {plan.teacher_steps()} steps:\n      kd run kd_single_device --config "
        f"{runs['teacher'].config}"
    )
    train(runs["teacher"].config)
    _say(f"      done in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    _say(
        f"[3/4] training two students ({_describe(STUDENT)}) on the same {plan.student_examples} "
        f"labelled examples, {plan.student_steps()} steps each"
    )
    for name, what in (
        ("kd_student", "with KD from the teacher"),
        ("ce_student", "cross-entropy only"),
    ):
        _say(f"      {what}: kd run kd_single_device --config {runs[name].config}")
        train(runs[name].config)
    _say(f"      done in {time.perf_counter() - t0:.0f} s")

    t0 = time.perf_counter()
    _say(
        f"[4/4] evaluating on {plan.heldout_examples} held-out examples (and every step checkpoint)"
    )
    heldout = HeldOut(
        files["heldout"],
        tokenizer_node(tokenizer_dir),
        dataset_node(files["heldout"], root / "cache"),
    )
    results = evaluate_runs(runs, heldout, chain, root / "eval" / "checkpointer")
    _say(f"      done in {time.perf_counter() - t0:.0f} s")
    # Per labelled token: the answer letters carry the chain's entropy, the other labelled tokens
    # (the assistant header) are predictable.
    labelled_per_row = float((heldout.labels != -100).sum()) / len(heldout.rows)
    floor = chain.entropy() * ANSWER_LETTERS / labelled_per_row
    t, k, c = (results[n]["final"] for n in ("teacher", "kd_student", "ce_student"))
    closed = (c.loss - k.loss) / (c.loss - t.loss) if c.loss > t.loss else math.nan
    plot = plot_curves(root / "kd_demo.png", results, plan, floor)
    result = DemoResult(t, k, c, floor, closed, time.perf_counter() - start, str(plot))
    _write_results(root, result, results, plan, seed, runs)
    _print_table(result, plan)
    _say(f"plot: {plot}")
    _say(f"configs: {root / 'configs'}   runs: {root / 'runs'}   numbers: {root / 'results.json'}")
    _say(f"time: {result.seconds:.0f} s")
    _say(result.result_line())
    return result


def _describe(shape: ModelShape) -> str:
    return f"{shape.num_layers} layers, dim {shape.embed_dim}, vocab {shape.vocab_size}"


def _write_results(
    root: Path,
    result: DemoResult,
    results: dict[str, dict[str, Any]],
    plan: DemoPlan,
    seed: int,
    runs: dict[str, _Run],
) -> None:
    out = {
        "seed": seed,
        "plan": asdict(plan),
        "teacher_shape": asdict(TEACHER),
        "student_shape": asdict(STUDENT),
        "heldout_floor": result.heldout_floor,
        "gap_closed": result.gap_closed,
        "seconds": result.seconds,
        "configs": {name: str(run.config) for name, run in runs.items()},
        "models": {
            name: {**asdict(r["final"]), "heldout_curve": r["curve"]} for name, r in results.items()
        },
    }
    (root / "results.json").write_text(json.dumps(out, indent=1) + "\n")


def _print_table(result: DemoResult, plan: DemoPlan) -> None:
    rows = [
        ("teacher", f"{plan.teacher_examples}", plan.teacher_steps(), result.teacher),
        (
            "KD student",
            f"{plan.student_examples} + teacher",
            plan.student_steps(),
            result.kd_student,
        ),
        ("CE-only student", f"{plan.student_examples}", plan.student_steps(), result.ce_student),
    ]
    head = (
        f"{'model':<16} {'labelled examples':>18} {'steps':>6} {'held-out loss':>14} "
        f"{'next-letter acc':>16} {'greedy exact match':>19}"
    )
    _say("")
    _say(head)
    _say("-" * len(head))
    for name, data, steps, r in rows:
        _say(
            f"{name:<16} {data:>18} {steps:>6} {r.loss:>14.4f} {r.next_letter_acc:>16.3f} "
            f"{r.exact_match:>19.3f}"
        )
    _say(
        f"{'best possible':<16} {'':>18} {'':>6} {result.heldout_floor:>14.4f} {1.0:>16.3f} {1.0:>19.3f}"
    )
    _say(
        f"KD closed {100 * result.gap_closed:.0f}% of the held-out loss gap between the CE-only "
        "student and the teacher: (ce - kd) / (ce - teacher)"
    )
    _say("")


# -------------------------------------------------------------------------------------- CLI
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``kd demo`` to the ``kd`` command's subparsers."""
    p = subparsers.add_parser(
        "demo",
        help="distil a tiny teacher into a tiny student on CPU in a few minutes",
        description="Train a tiny teacher, then two students on a few labelled examples (one with "
        "KD, one without), all through kd run; print held-out results and plot the curves.",
    )
    p.add_argument(
        "--output-dir", default="./kd_demo", help="folder for everything (default ./kd_demo)"
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run (under a minute)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task, data, weights and runs")


def run(args: argparse.Namespace) -> int:
    """``kd demo``: run the demo; returns the exit status."""
    run_demo(Path(args.output_dir), quick=bool(args.quick), seed=int(args.seed))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kd.demo")
    add_parser(parser.add_subparsers())
    sys.exit(run(parser.parse_args(["demo", *sys.argv[1:]])))
