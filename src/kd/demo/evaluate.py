"""Held-out evaluation of the demo's models: loss, next-letter accuracy, greedy exact match, curves.

The held-out loss, the divergence to the teacher and the top-1 agreement come from
:func:`kd.training.evaluate.evaluate`, the code that computes ``validation:`` metrics during training (fed
by :func:`kd.data.build_eval_loader`, as the recipe feeds it); only the letter accuracies are the
demo's own.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kd.demo.configs import DemoRun
from kd.demo.task import ANSWER_LETTERS, LETTERS, LetterChain
from kd.testing import TinyModel, load_tiny_model

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kd.config.run import LossSettings
    from kd.training.evaluate import ValStats

# Held-out examples per evaluation batch (the numbers do not depend on it).
EVAL_BATCH_SIZE = 64


@dataclass
class EvalResult:
    """Held-out numbers of one model.

    Attributes:
        loss: cross-entropy per labelled token of the held-out examples (nats/token):
            ``val_ce_loss``.
        next_letter_acc: fraction of answer letters where the model's top guess (given the true
            previous letters) is the chain's most likely next letter.
        exact_match: fraction of prompts whose greedy 8-letter answer equals the chain's most
            likely answer.
        kd_loss: the divergence to the trained teacher per labelled token (``val_kd_loss``, the
            KD student's divergence and temperature); None for the teacher itself.
        top1_agreement: fraction of labelled tokens where the model's and the trained teacher's
            top guesses agree (``val_top1_agreement``); None for the teacher itself.
    """

    loss: float
    next_letter_acc: float
    exact_match: float
    kd_loss: float | None = None
    top1_agreement: float | None = None


@contextlib.contextmanager
def _hidden_output(*modules: nn.Module | None) -> Iterator[None]:
    """The models return final-norm hidden states inside (what :mod:`kd.training.evaluate` takes, as the
    recipe prepares them), logits again after."""
    from kd import models

    present = [m for m in modules if m is not None]
    for m in present:
        models.set_hidden_output(m)
    try:
        yield
    finally:
        for m in present:
            models.set_hidden_output(m, False)


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
        from kd import data
        from kd.config import instantiate
        from kd.training.train import shift_labels

        self.tokenizer = instantiate(OmegaConf.create(tokenizer_cfg), key="tokenizer")
        dataset = instantiate(OmegaConf.create(dataset_cfg), self.tokenizer, key="dataset")
        # The held-out batches of kd.training.evaluate, as the recipe's validation reads them.
        self.loader = data.build_eval_loader(
            dataset,
            batch_size=EVAL_BATCH_SIZE,
            max_batches=None,
            pad_id=data.pad_id_of(self.tokenizer),
        )
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

    def validation(
        self, model: nn.Module, teacher: nn.Module | None, *, settings: LossSettings
    ) -> ValStats:
        """``kd.training.evaluate``'s metrics of ``model`` (against ``teacher``) on the held-out set: what
        ``validation:`` would log for them during training.

        Args:
            model: a torchtune decoder returning logits.
            teacher: the trained teacher (same kind), or None.
            settings: the loss settings (the KD student's run's).
        """
        import torch

        from kd.training.evaluate import evaluate

        with _hidden_output(model, teacher):
            return evaluate(
                model, teacher, self.loader, settings=settings, device=torch.device("cpu")
            )

    def evaluate(
        self,
        model: nn.Module,
        chain: LetterChain,
        *,
        settings: LossSettings,
        teacher: nn.Module | None = None,
        accuracy: bool = True,
    ) -> EvalResult:
        """Held-out loss (and accuracies) of ``model``, a torchtune decoder returning logits; with
        ``teacher``, also its divergence to the teacher and their top-1 agreement."""
        import torch

        stats = self.validation(model, teacher, settings=settings)
        if not accuracy:
            return EvalResult(stats.ce_loss, math.nan, math.nan)
        with torch.inference_mode():
            logits = model(self.tokens).float()  # [n, s, v]
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
        return EvalResult(
            stats.ce_loss,
            next_letter_acc,
            sum(exact) / len(exact),
            kd_loss=stats.kd_loss if teacher is not None else None,
            top1_agreement=stats.top1_agreement,
        )

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


def heldout_curve(
    run_dir: Path,
    init_dir: Path,
    shape: TinyModel,
    heldout: HeldOut,
    scratch: Path,
    *,
    settings: LossSettings,
) -> list[tuple[int, float]]:
    """Held-out loss of the initial model and of every step checkpoint of a run: ``[(step, loss)]``."""
    folders = [(0, init_dir)] + sorted(
        (int(p.name.split("_")[1]), p) for p in run_dir.glob("step_*") if p.is_dir()
    )
    curve = []
    for step, folder in folders:
        model = load_tiny_model(folder, shape, scratch)
        curve.append((step, heldout.validation(model, None, settings=settings).ce_loss))
    return curve


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evaluate_runs(
    runs: dict[str, DemoRun],
    heldout: HeldOut,
    chain: LetterChain,
    scratch: Path,
    say: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Final held-out results, held-out curve and training metrics of every run; the students
    are also compared with the trained teacher, with the KD student's loss settings. ``say``
    gets one line as each run's evaluation starts (the longest part of the demo)."""
    from kd.config import load_config
    from kd.config.run import run_config

    settings = run_config(load_config(str(runs["kd_student"].config), [])).loss
    teacher = load_tiny_model(runs["teacher"].run_dir / "final", runs["teacher"].shape, scratch)
    out = {}
    for i, (name, run) in enumerate(runs.items(), start=1):
        if say is not None:
            steps = sum(1 for p in run.run_dir.glob("step_*") if p.is_dir())
            say(
                f"      {name} ({i}/{len(runs)}): its final model, then its initial weights and "
                f"{steps} step checkpoints"
            )
        final = load_tiny_model(run.run_dir / "final", run.shape, scratch)
        against = None if name == "teacher" else teacher
        out[name] = {
            "final": heldout.evaluate(final, chain, settings=settings, teacher=against),
            "curve": heldout_curve(
                run.run_dir, run.init_dir, run.shape, heldout, scratch, settings=settings
            ),
            "metrics": read_metrics(run.run_dir),
        }
    return out
