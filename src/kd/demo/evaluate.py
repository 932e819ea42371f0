"""Held-out evaluation of the demo's models: loss, next-letter accuracy, greedy exact match, curves."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kd.demo.configs import DemoRun
from kd.demo.task import ANSWER_LETTERS, LETTERS, LetterChain
from kd.testing import TinyModel, load_tiny_model

if TYPE_CHECKING:
    import torch
    from torch import nn


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

        self.tokenizer = instantiate(OmegaConf.create(tokenizer_cfg), key="tokenizer")
        dataset = instantiate(OmegaConf.create(dataset_cfg), self.tokenizer, key="dataset")
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


def heldout_curve(
    run_dir: Path,
    init_dir: Path,
    shape: TinyModel,
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
        model = load_tiny_model(folder, shape, scratch)
        curve.append((step, heldout.evaluate(model, chain, accuracy=False).loss))
    return curve


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evaluate_runs(
    runs: dict[str, DemoRun], heldout: HeldOut, chain: LetterChain, scratch: Path
) -> dict[str, dict[str, Any]]:
    """Final held-out results, held-out curve and training metrics of every run."""
    out = {}
    for name, run in runs.items():
        final = load_tiny_model(run.run_dir / "final", run.shape, scratch)
        out[name] = {
            "final": heldout.evaluate(final, chain),
            "curve": heldout_curve(run.run_dir, run.init_dir, run.shape, heldout, chain, scratch),
            "metrics": read_metrics(run.run_dir),
        }
    return out
