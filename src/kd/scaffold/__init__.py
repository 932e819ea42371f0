"""``kd init``, by job: :mod:`~kd.scaffold.inspection` (a model folder's config.json -> how kd builds
it), :mod:`~kd.scaffold.pairing` (what teacher and student must share), :mod:`~kd.scaffold.data`
(the data format of a file's first rows), :mod:`~kd.scaffold.render` (the commented YAML, validated
before it is written) and :mod:`~kd.scaffold.command` (the ``kd init`` subcommand).

Named ``scaffold`` rather than ``init`` so that no ``init.py`` sits beside an ``__init__.py``.
"""
