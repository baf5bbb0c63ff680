"""EngineConfig: the user's knobs, frozen and validated once.

Unknown keyword arguments are an error that names the offending key and the closest valid one, so a typo
such as ``max_num_seq=8`` never silently falls back to a default.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, fields

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names; fp8 = fp8_e4m3
# vLLM's CUDAGraphMode names: decode-only steps from full graphs, mixed / prefill steps from piecewise graphs
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "NONE")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None
    quantization: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    seed: int = 0
    gpu_memory_utilization: float = 0.85
    kv_cache_memory_bytes: int | None = None  # CPU budget (default 1 GiB); on GPU overrides the utilization
    num_kv_blocks: int | None = None  # exact block count, overrides both budgets (tests use it)
    enforce_eager: bool = False  # CUDA: no decode graphs (every step eager)
    max_cudagraph_batch: int = 256  # largest decode batch replayed from a CUDA graph (capped by max_num_seqs)
    # CUDA graphs (CUDA, one rank): FULL_AND_PIECEWISE = decode graphs + piecewise graphs of mixed / prefill steps
    # per token bucket (lqe.engine.piecewise); FULL_DECODE_ONLY = decode graphs only; NONE = like enforce_eager.
    # The default stays FULL_DECODE_ONLY until the piecewise capture has run and been measured on a GPU (issue 26:
    # `bash benchmarks/run_gpu.sh --engine`); FULL_AND_PIECEWISE opts in.
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    max_piecewise_tokens: int | None = None  # largest piecewise token bucket (default and cap: max_num_batched_tokens)
    # vLLM's async scheduling: schedule and prepare step N+1 while the device runs step N (one rank; steps that need
    # the previous tokens on the host -- penalties, structured output, prompt logprobs -- wait for them first)
    async_scheduling: bool = False
    allow_nonfinite_weights: bool = False  # load NaN/inf weights or non-positive scales with a warning (else an error)
    revision: str | None = None
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1  # ranks (processes, one device each) the model is sharded over
    # KV-cache storage: "auto" = the model dtype (fp8 when the checkpoint declares a kv_cache_scheme); "fp8" /
    # "fp8_e4m3" / "fp8_e5m2" store K/V in 8 bits with per-layer scales (the checkpoint's, else the first prefill's)
    kv_cache_dtype: str = "auto"
    # fp8 cache: rotate each head's queries and keys by a randomized Hadamard matrix before the keys are quantized
    # (q.k unchanged; the fp8 error of a score averages over head_dim products). False = vLLM's plain fp8 keys
    kv_cache_key_rotation: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty string: a local directory, 'smollm2-135m-instruct' or a hub id")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose one of {', '.join(_DTYPES)}")
        if self.device not in _DEVICES:
            raise ValueError(f"device={self.device!r} is not supported; choose one of {', '.join(_DEVICES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)} ('auto' keeps the model's dtype, 'fp8' = 'fp8_e4m3')")
        if not isinstance(self.kv_cache_key_rotation, bool):
            raise ValueError(f"kv_cache_key_rotation={self.kv_cache_key_rotation!r} must be True or False")
        if not isinstance(self.cudagraph_mode, str) or self.cudagraph_mode.upper() not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode={self.cudagraph_mode!r} is not supported; choose one of "
                             f"{', '.join(CUDAGRAPH_MODES)} (FULL_DECODE_ONLY turns the piecewise graphs of mixed and "
                             "prefill steps off, NONE every graph)")
        object.__setattr__(self, "cudagraph_mode", self.cudagraph_mode.upper())
        if self.max_piecewise_tokens is not None:
            _positive("max_piecewise_tokens", self.max_piecewise_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        _positive("max_cudagraph_batch", self.max_cudagraph_batch)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        for key in kwargs:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"unknown engine option {key!r}.{hint} Valid options: {', '.join(sorted(known - {'model'}))}")
        return cls(model=model, **kwargs)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
