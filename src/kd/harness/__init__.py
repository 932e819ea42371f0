"""``kd eval``: model folders side by side on lm-evaluation-harness tasks (docs/eval.md).

- :mod:`kd.harness.tasks`: the user's own tasks, read from kd's small task spec (no torch, no
  lm_eval): every file and key checked, nothing in a task file runs, lm-eval configs generated.
- :mod:`kd.harness.evaluate`: the models loaded one at a time and scored by lm-eval's own
  ``simple_evaluate`` (its ``HFLM`` around the pre-loaded model), the table and ``eval.json``.
- :mod:`kd.harness.command`: the ``kd eval`` command line.
"""
