"""Memory planner: peak memory per device of a KD training step, before any weight is loaded.

Fast path (no torch, no torchtune): shapes from a builder table, kwargs or ``config.json``
(:mod:`kd.memory.shapes`; transformers-backend folders: :mod:`kd.memory.hf_config`), closed-form
bytes per phase (:mod:`kd.memory.estimate`, transformers' layers in :mod:`kd.memory.hf_terms`), the
plan and the recipe check (:mod:`kd.memory.plan`), the knob search (:mod:`kd.memory.fit`). The trace
path (:mod:`kd.memory.trace`) runs the real step under FakeTensorMode to check the estimate.
"""

from kd.memory.estimate import Estimate, estimate
from kd.memory.fit import FitOption, fit_options, format_options
from kd.memory.hf_config import shape_of_folder
from kd.memory.knobs import OptimizerSpec, TrainKnobs
from kd.memory.plan import (
    MemoryPlan,
    PlanInputs,
    check_memory,
    inputs_from_run,
    make_plan,
    plan_from_config,
)
from kd.memory.shapes import LoraSpec, ModelShape, shape_from_component, shape_from_hf_config

__all__ = [
    "Estimate",
    "FitOption",
    "LoraSpec",
    "MemoryPlan",
    "ModelShape",
    "OptimizerSpec",
    "PlanInputs",
    "TrainKnobs",
    "check_memory",
    "estimate",
    "fit_options",
    "format_options",
    "inputs_from_run",
    "make_plan",
    "plan_from_config",
    "shape_from_component",
    "shape_from_hf_config",
    "shape_of_folder",
]
