"""``kd demo``: knowledge distillation end to end on CPU in a few minutes, all through the real recipe.

Run it::

    kd demo                      # writes everything under ./kd_demo (about 3-5 minutes on 2 cores)
    kd demo --output-dir /tmp/d  # elsewhere
    kd demo --quick              # a smoke run (under a minute; too short to show KD's advantage)

What it does, all under one folder (nothing is downloaded):

1. Writes a Qwen2.5-style byte-level tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer.json``),
   a task, its data as json files, and random-init tiny Qwen2 models in Hugging Face format, all
   with :mod:`kd.testing`. The teacher has a larger padded vocabulary (320 rows) than the student
   (288), as Qwen2.5-14B (152064) and 3B (151936) do, so the vocab alignment of the KD loss runs.
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

Modules: :mod:`~kd.demo.task` (the letter chain, its data and the plan), :mod:`~kd.demo.configs`
(model shapes, initial weights, run configs), :mod:`~kd.demo.evaluate` (held-out numbers and
curves), :mod:`~kd.demo.report` (table, plot, ``results.json``, RESULT line),
:mod:`~kd.demo.app` (the orchestration and the ``kd demo`` command).
"""

from kd.demo.app import MARKER_FILE, add_parser, run, run_demo
from kd.demo.configs import STUDENT, TEACHER
from kd.demo.evaluate import EvalResult
from kd.demo.report import DemoResult

__all__ = [
    "MARKER_FILE",
    "STUDENT",
    "TEACHER",
    "DemoResult",
    "EvalResult",
    "add_parser",
    "run",
    "run_demo",
]
