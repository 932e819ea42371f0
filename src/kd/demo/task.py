"""The demo's task, "continue the letters": a hidden random Markov chain over letters, and its data.

The answers follow a random Markov chain over 16 letters; each letter has 4 possible successors
with probabilities 0.5/0.25/0.15/0.10. A labelled answer shows one sampled successor per position,
while a teacher that learned from many examples knows the whole distribution, so KD has a real
advantage. The best possible held-out loss is the chain's entropy.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from kd.testing import write_jsonl

LETTERS = "abcdefghijklmnop"
SUCCESSOR_PROBS = (0.5, 0.25, 0.15, 0.10)
PROMPT_LETTERS = 3
ANSWER_LETTERS = 8


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
