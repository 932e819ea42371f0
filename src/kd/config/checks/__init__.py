"""The checks of :func:`kd.config.validate_config`, one module per job (see its docstring)."""
