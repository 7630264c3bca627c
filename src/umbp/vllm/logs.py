"""umbp's log records in vLLM's log: same handlers, format and level.

vLLM configures only its own ``vllm`` logger (handler, format, ``VLLM_LOGGING_LEVEL``) and stops it from
propagating. umbp logs under ``umbp``, which then has no handler, so its INFO lines (connector up, kernels
ready, what the SSD tier found at start-up) went nowhere and only WARNINGs reached stderr through Python's
last-resort handler, in another format. Attaching vLLM's handlers puts umbp's lines in the operator's log,
in order with vLLM's.
"""

from __future__ import annotations

import logging


def attach_to_vllm_logging() -> bool:
    """Give the ``umbp`` logger vLLM's handlers and level. Leaves it alone if the application configured it
    (it has handlers of its own) or vLLM's logging is off (``VLLM_CONFIGURE_LOGGING=0``: the application
    owns logging then). Returns whether it attached. Idempotent."""
    umbp_logger = logging.getLogger("umbp")
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return False
    if umbp_logger.handlers:
        return all(h in vllm_logger.handlers for h in umbp_logger.handlers)
    for handler in vllm_logger.handlers:
        umbp_logger.addHandler(handler)
    umbp_logger.setLevel(vllm_logger.level)
    umbp_logger.propagate = False
    return True
