"""lqe: an inference engine for quantized LLMs (GPTQ, AWQ, W8A8) on a paged-attention continuous-batching engine."""
from lqe.logger import init_logger

init_logger()

from lqe.config import EngineConfig  # noqa: E402
from lqe.engine.llm_engine import LLMEngine  # noqa: E402
from lqe.inputs import PromptType, TextPrompt, TokensPrompt  # noqa: E402
from lqe.llm import LLM  # noqa: E402
from lqe.outputs import CompletionOutput, RequestOutput  # noqa: E402
from lqe.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "PromptType",
           "TextPrompt", "TokensPrompt", "StructuredOutputsParams", "GuidedDecodingParams"]
__version__ = "0.1.0"
