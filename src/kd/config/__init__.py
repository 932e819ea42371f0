"""Config loading, validation and ``_component_`` instantiation.

Importing this package must not import torch or torchtune (``kd ls`` and ``kd --help`` stay fast);
``_component_`` targets are imported only when validated or instantiated.
"""

from kd.config.instantiate import instantiate
from kd.config.parse import load_config
from kd.config.validate import validate_config

__all__ = ["instantiate", "load_config", "validate_config"]
