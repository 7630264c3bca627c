"""The harness hides vLLM's always-failing chat-template warmup traceback (token-id prompts, no tokenizer)
and nothing else."""

import logging

from umbp.tools import vllm_harness


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_chat_warmup_failure_is_filtered_and_other_records_pass():
    logger = logging.getLogger("vllm.renderers.base")  # the handler sits on it: vLLM may stop propagation
    saved, level, seen = list(logger.filters), logger.level, _Collect()
    logger.addHandler(seen)
    logger.setLevel(logging.DEBUG)
    try:
        vllm_harness.quiet_chat_warmup()
        vllm_harness.quiet_chat_warmup()  # once per process, however many engines
        assert logger.filters.count(vllm_harness._NO_CHAT_WARMUP_FAILURE) == 1
        try:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
        except ValueError:
            logger.warning("Chat template warmup failed", exc_info=True)
        logger.warning("something else failed")
        assert seen.messages == ["something else failed"]
    finally:
        logger.removeHandler(seen)
        logger.filters[:] = saved
        logger.setLevel(level)
