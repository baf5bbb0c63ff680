"""lqe: an inference engine for quantized LLMs (GPTQ, AWQ, W8A8) on a paged-attention continuous-batching engine."""
from lqe.config import EngineConfig
from lqe.engine.llm_engine import LLMEngine
from lqe.llm import LLM
from lqe.outputs import CompletionOutput, RequestOutput
from lqe.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
