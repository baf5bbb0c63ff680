"""The engine's command-line flags, defined once for ``lqe generate``, ``lqe chat`` and ``lqe serve``.

Every flag defaults to ``None``: a flag left out is not passed, so the engine's own default (:class:`EngineConfig`)
applies, and the help text says in words what that is. :func:`engine_kwargs` gives ``LLM`` / ``EngineConfig`` the
flags that were given. Values are checked at parse time where argparse can (a positive count, a known name), and by
``EngineConfig`` otherwise, each with an error naming the flag.
"""
from __future__ import annotations

import argparse

# namespace attributes that are EngineConfig fields (the model and the seed are the caller's: ``lqe serve`` takes
# an engine seed, ``lqe generate`` a per-request one)
ENGINE_ARGS = ("quantization", "dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
               "num_kv_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization", "block_size",
               "enable_prefix_caching", "kv_cache_dtype", "kv_cache_key_rotation", "tokenizer", "revision",
               "trust_remote_code", "enforce_eager", "max_cudagraph_batch", "cudagraph_mode", "max_piecewise_tokens",
               "async_scheduling", "tensor_parallel_size", "allow_nonfinite_weights")


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def quant_name(text: str) -> str:
    from lqe.quant_layers.resolve import ALIASES

    if text.strip().lower() not in ALIASES:
        raise argparse.ArgumentTypeError(f"unknown quantization method {text!r}; choose one of {', '.join(sorted(ALIASES))}")
    return text


def kv_cache_dtype(value: str) -> str:
    from lqe.config import KV_CACHE_DTYPES

    if value not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"{value!r} is not a KV-cache dtype; choose one of {', '.join(KV_CACHE_DTYPES)} "
                                         "('auto' = the model's dtype, 'fp8' = 'fp8_e4m3')")
    return value


def cudagraph_mode(value: str) -> str:
    from lqe.config import CUDAGRAPH_MODES

    if value.upper() not in CUDAGRAPH_MODES:
        raise argparse.ArgumentTypeError(f"{value!r} is not a CUDA-graph mode; choose one of {', '.join(CUDAGRAPH_MODES)}")
    return value.upper()


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = parser.add_argument
    a("--quantization", "-q", default=None, type=quant_name,
      help="gptq | awq | compressed-tensors | w8a8 | fp8 | int8, or vLLM's gptq_marlin / awq_marlin / marlin "
           "(default: from the checkpoint); fp8 / int8 on a float checkpoint quantize it at load time")
    a("--dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"],
      help="activation dtype (default auto: fp32 on CPU, the checkpoint's fp16/bf16 on GPU)")
    a("--device", default=None, choices=["auto", "cpu", "cuda"], help="where to run (default auto: cuda when available)")
    a("--max-model-len", type=positive_int, default=None,
      help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    a("--max-num-seqs", type=positive_int, default=None, help="most sequences decoded together (default 64)")
    a("--max-num-batched-tokens", type=positive_int, default=None,
      help="most tokens in one step, prefill chunks included (default 2048)")
    a("--num-kv-blocks", type=positive_int, default=None,
      help="exact KV-cache block count, overriding the memory budgets (default: from the budget)")
    a("--kv-cache-memory-bytes", type=positive_int, default=None,
      help="KV-cache budget in bytes (default: 1 GiB on CPU, --gpu-memory-utilization on GPU)")
    a("--gpu-memory-utilization", type=float, default=None,
      help="fraction of GPU memory lqe may use, weights + KV cache (default 0.85)")
    a("--block-size", type=positive_int, default=None, help="KV-cache block size in tokens (default 16)")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
      help="reuse the KV blocks of shared prompt prefixes (default: on)")
    a("--kv-cache-dtype", type=kv_cache_dtype, default=None,
      help="KV-cache storage: auto | fp8 | fp8_e4m3 | fp8_e5m2; fp8 halves the cache of a 16-bit model, with "
           "per-layer scales from the checkpoint or the first prefill (default auto: the model's dtype, fp8 when "
           "the checkpoint declares a kv_cache_scheme)")
    a("--kv-cache-key-rotation", action=argparse.BooleanOptionalAction, default=None,
      help="fp8 cache: rotate each head's queries and keys by a Hadamard matrix before the keys are quantized, so "
           "q.k is unchanged and its fp8 error averages out (default: on)")
    a("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    a("--revision", default=None, help="hub revision of the model (default: the latest)")
    a("--trust-remote-code", action="store_true", default=None,
      help="let transformers run code shipped with the model's config/tokenizer (default: off)")
    a("--enforce-eager", action="store_true", default=None, help="CUDA: run every step eagerly, no CUDA graphs (default: off)")
    a("--max-cudagraph-batch", type=positive_int, default=None,
      help="largest decode batch replayed from a CUDA graph (default 256, capped by --max-num-seqs)")
    a("--cudagraph-mode", type=cudagraph_mode, default=None,
      help="CUDA graphs: FULL_DECODE_ONLY (decode steps), FULL_AND_PIECEWISE (also mixed and prefill steps, per "
           "token bucket) or NONE (default FULL_DECODE_ONLY)")
    a("--max-piecewise-tokens", type=positive_int, default=None,
      help="largest token bucket of the piecewise graphs (default: --max-num-batched-tokens)")
    a("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
      help="schedule and prepare the next step while the device runs this one (default: off)")
    a("--tensor-parallel-size", "-tp", type=positive_int, default=None,
      help="shard the model over N worker processes / GPUs (default 1)")
    a("--allow-nonfinite-weights", action="store_true", default=None,
      help="load a checkpoint whose scales / weights hold NaN, inf or non-positive scales, with a warning "
           "(default: off, such a checkpoint is refused)")
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags given on the command line, as ``EngineConfig`` keyword arguments."""
    return {k: getattr(args, k) for k in ENGINE_ARGS if getattr(args, k, None) is not None}
