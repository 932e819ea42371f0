"""kd: knowledge-distillation fine-tuning for LLMs with an up-front memory plan."""

import logging

__version__ = "0.1.0"

# torchao logs "Skipping import of cpp extensions ..." (a warning) on import whenever torch is newer
# than the build its wheel was made for; kd uses none of those extensions. torchtune, peft and kd
# import torchao by several roads, so the one notice is dropped here, on torchao's logger, before
# any of them: its other warnings and errors still show.
_TORCHAO_NOTICE = "Skipping import of cpp extensions"


def _not_the_cpp_extension_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_TORCHAO_NOTICE)


logging.getLogger("torchao").addFilter(_not_the_cpp_extension_notice)
