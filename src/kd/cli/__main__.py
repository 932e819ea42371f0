"""``python -m kd.cli``: the ``kd`` command."""

import sys

from kd.cli import main

sys.exit(main())
