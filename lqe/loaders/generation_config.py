"""Default sampling parameters from a checkpoint's ``generation_config.json`` (vLLM's rule)."""
from __future__ import annotations

import json
import logging
import os

from lqe.sampling_params import SamplingParams

logger = logging.getLogger("lqe")

_GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_defaults(model_dir: str) -> dict:
    """The SamplingParams fields set by ``generation_config.json`` (``{}`` when it is absent or sets none).

    As in vLLM, ``do_sample`` is not consulted. Values SamplingParams refuses are
    dropped with a warning naming them instead of making every default request fail."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s: %s", path, str(e))
        return {}
    out = {dst: gen[src] for src, dst in _GENERATION_FIELDS.items() if gen.get(src) is not None}
    for key, value in list(out.items()):
        try:
            SamplingParams(**{key: value})
        except (TypeError, ValueError) as e:
            logger.warning("generation_config.json: ignoring %s=%r (%s)", key, value, str(e))
            del out[key]
    if out:
        logger.info("default sampling params from generation_config.json: %s (pass SamplingParams to override)",
                    ", ".join(f"{k}={v}" for k, v in out.items()))
    return out
