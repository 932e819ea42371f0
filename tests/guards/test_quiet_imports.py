"""torchao's notice about its C++ extensions is dropped wherever kd imports it; its other
warnings still show (issue 42)."""

from __future__ import annotations

import os
import subprocess
import sys

NOTICE = "Skipping import of cpp extensions"


def _stderr(code: str) -> str:
    # torchao logs the notice on every import with this set, whatever the torch version.
    env = {**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_the_cpp_extension_notice_is_dropped_and_real_warnings_show():
    assert NOTICE in _stderr("import torchao")  # what a user saw on every command
    # peft imports torchao before kd ever imports torchtune (a LoRA student of kd.hf).
    err = _stderr(
        "import kd.cli, peft, logging; logging.getLogger('torchao').warning('a real problem')"
    )
    assert NOTICE not in err
    assert "a real problem" in err
    assert NOTICE not in _stderr("from kd import _torchtune")
