"""Model registry keyed by the ``architectures`` entry of ``config.json``."""
from __future__ import annotations

from torch import nn

from lqe.loaders.hf_config import ModelConfig
from lqe.models.llama import LlamaForCausalLM
from lqe.models.qwen2 import Qwen2ForCausalLM
from lqe.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(cfg: ModelConfig) -> type[nn.Module]:
    for arch in cfg.architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    found = ", ".join(cfg.architectures) or "(config.json has no 'architectures')"
    raise ValueError(f"unsupported architecture {found}; lqe supports: {', '.join(sorted(MODEL_REGISTRY))}")
