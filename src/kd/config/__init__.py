"""Config loading, validation and ``_component_`` instantiation.

Importing this package must not import torch or torchtune (``kd ls`` and ``kd --help`` stay fast);
``_component_`` targets are imported only when validated or instantiated.
"""

# Registers the built-in teacher kinds: their sections join the schema tables and the run config.
from kd.config import teacher_kinds  # noqa: F401
from kd.config.instantiate import instantiate
from kd.config.parse import load_config
from kd.config.validate import validate_config

__all__ = ["instantiate", "load_config", "validate_config"]
