"""The ``lqe`` logger: INFO to stderr by default (start-up summary: device, dtype, quantization paths, weight
and KV-cache memory), like vLLM. ``LQE_LOG_LEVEL`` changes the level; an application that configures logging
itself can attach its own handlers to ``logging.getLogger("lqe")``."""
from __future__ import annotations

import logging
import os


def init_logger() -> logging.Logger:
    logger = logging.getLogger("lqe")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[lqe %(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("LQE_LOG_LEVEL", "INFO").upper())
    return logger
