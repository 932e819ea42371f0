"""The run's plumbing, below the teachers and the training step: the device and its budget
(``device``), torch.distributed and FSDP2 (``distributed``), model preparation (``prepare``),
activation offloading (``offload``), the run's context (``run_context``), the student's
save and restore at any world size (``checkpoints``, ``run_checkpointer``), SIGTERM / SIGINT
(``interrupts``) and a recipe's process entry (``launch``).

Nothing here imports :mod:`kd.teachers`, :mod:`kd.training`, :mod:`kd.memory`'s tracers or
:mod:`kd.recipes` (``tests/guards/test_layers.py``). Importing this package imports no torch.
"""
