"""LLMEngine: requests in, incremental outputs out, one ``step()`` at a time."""
from __future__ import annotations

import gc
import itertools
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterable

import torch

from lqe.config import EngineConfig
from lqe.engine import detokenizer
from lqe.engine.async_steps import AsyncStepper
from lqe.engine.block_manager import BlockManager
from lqe.engine.model_runner import ModelRunner, StepResult
from lqe.engine.scheduler import Scheduler, SchedulerOutput
from lqe.engine.sequence import Sequence
from lqe.layers.sampler import SamplingBatch
from lqe.loaders.generation_config import read_generation_defaults
from lqe.loaders.hf_config import parse_model_config, read_config_json
from lqe.loaders.model_source import resolve_model
from lqe.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from lqe.sampling_params import SamplingParams

logger = logging.getLogger("lqe")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        self._closed = False
        self.model_dir = resolve_model(config.model, config.revision)
        raw = read_config_json(self.model_dir)
        self.model_config = cfg = parse_model_config(raw)
        self.device = _pick_device(config.device)
        self.dtype = _pick_dtype(config.dtype, cfg.torch_dtype, self.device)
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        self.quant_config = _quant_config(self.model_dir, raw, config.quantization)
        self.generation_defaults = read_generation_defaults(self.model_dir)
        self.tokenizer = _load_tokenizer(config.tokenizer or self.model_dir, config.trust_remote_code)
        self.eos_token_ids = set(cfg.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))
        torch.manual_seed(config.seed)
        self.tp = None  # tensor parallelism: the worker processes of ranks 1..N-1 (this process is rank 0)
        if config.tensor_parallel_size > 1:
            self._start_tensor_parallel()
        try:
            with self._tp_scope():
                self.runner = ModelRunner(config, self.model_dir, cfg, self.quant_config, self.device, self.dtype)
                self.runner.allocate_kv_cache(self.max_model_len)
        except BaseException as e:
            if self.tp is not None:
                err = self.tp.fail("loading the model", e)
                if err is not e:
                    raise err from e
            raise
        with self._tp_scope():
            self.runner.capture_cuda_graphs()
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        # async scheduling (lqe.engine.async_steps): one rank only (workers run each step as it comes)
        self.async_stepper = AsyncStepper(self) if config.async_scheduling and self.tp is None else None
        self.requests: dict[str, _Request] = {}
        self.structured = None  # StructuredOutputs, built on the first request that asks for it
        self._seq_ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info(
            "%s on %s (%s), %s, weights %.1f MiB, KV cache %d blocks x %d tokens (%.1f MiB), attention %s, "
            "loaded in %.1fs", self.model_dir, self.device, str(self.dtype).removeprefix("torch."),
            self.quant_description(), self.runner.weight_bytes() / 2**20, self.runner.num_blocks, config.block_size,
            self.runner.kv_cache.numel() * self.runner.kv_cache.element_size() / 2**20, self.runner.attention_backend,
            time.perf_counter() - t0)

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` updated with the sampling fields of the model's ``generation_config.json``, as vLLM
        does when the caller passes none (``max_new_tokens`` becomes ``max_tokens``)."""
        return SamplingParams(**self.generation_defaults)

    def _start_tensor_parallel(self) -> None:
        from lqe.distributed.worker import RunnerBuilder, TPWorkerGroup

        builder = RunnerBuilder(self.config, self.model_dir, self.model_config, self.quant_config, self.device,
                                self.dtype, self.max_model_len)
        self.tp = TPWorkerGroup(self.config.tensor_parallel_size, builder)

    def _tp_scope(self):
        """This engine's tensor-parallel rank and size for the code inside (see lqe.distributed.parallel_state)."""
        return self.tp.scope() if self.tp is not None else nullcontext()

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine was shut down (shutdown() was called, or its `with` block ended); "
                               "create a new LLM to generate again")

    def shutdown(self) -> None:
        """Release everything the engine holds; idempotent, and later requests get a clear error.

        Stops the tensor-parallel workers and leaves the process group (so another tensor-parallel engine can start
        in this process), then drops the model weights, the KV cache, the CUDA graphs and the pinned step buffers
        (all owned by the model runner); on a GPU the freed memory goes back to the device. ``del llm`` followed by
        garbage collection releases the same things without this call (the workers' stop is a finalizer)."""
        if self._closed:
            return
        self._closed = True
        self.requests.clear()
        if self.tp is not None:
            self.tp.shutdown()
        on_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        if on_cuda:
            torch.cuda.synchronize(self.device)  # nothing in flight still reads what is freed below
        if self.async_stepper is not None:  # a step left in flight (an abandoned stream()) holds the runner
            self.async_stepper.inflight = None
            self.async_stepper = None
        self.runner = None
        self.structured = None
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        gc.collect()  # cycles inside the model (hooks, fused-layer links) hold weights until collected
        if on_cuda:
            torch.cuda.empty_cache()

    def quant_description(self) -> str:
        kinds: dict[str, int] = {}
        for m in self.runner.model.modules():
            method = getattr(m, "quant_method", None)
            if method is not None:
                d = method.describe(m)
                kinds[d] = kinds.get(d, 0) + 1
        return "; ".join(f"{n} x {d}" for d, n in kinds.items())

    # -- requests -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        self._check_open()
        params = params or self.default_sampling_params()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids instead of text")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary [0, {vocab})")
        if len(ids) > self.max_model_len - 1:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len={self.max_model_len} leaves room for "
                             f"at most {self.max_model_len - 1} prompt tokens (and one generated token)")
        if params.structured_outputs is not None:
            self._structured().compile(params.structured_outputs)  # a bad schema fails here, naming the problem
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            gen = torch.Generator(device=self.device)
            seed = params.seed + i if params.seed is not None else hash((self.config.seed, next(self._seq_ids))) % 2**63
            gen.manual_seed(seed)
            seq = Sequence(next(self._seq_ids), request_id, i, list(ids), params, gen, arrival)
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs.append(None)
            detokenizer.init_offsets(seq)
            if params.structured_outputs is not None:
                self.structured.add(seq.seq_id, params.structured_outputs)
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, text, list(ids), params, seqs, arrival)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if self.structured is not None:
                    self.structured.remove(seq.seq_id)
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (self.async_stepper is not None and self.async_stepper.inflight is not None)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.usage(), bm.num_free_blocks,
                           bm.num_blocks, bm.hits / bm.queries if bm.queries else 0.0, self.scheduler.num_preemptions,
                           self.prompt_tokens_total, self.generation_tokens_total)

    # -- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._check_open()
        if self.async_stepper is not None:
            return self.async_stepper.step()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("no request could be scheduled although nothing is running (KV cache exhausted)")
            return []
        if self.tp is not None:
            result = self.tp.execute(self.runner, sched, self._sampling_batch(sched))
        else:
            result = self.runner.execute(sched, self._sampling_batch(sched))
        return self._process(sched, result)

    def _sampling_batch(self, sched: SchedulerOutput) -> SamplingBatch | None:
        seqs = [s.seq for s in sched.scheduled if s.samples]
        if not seqs:
            return None
        f = lambda attr, dt: torch.tensor([getattr(s.params, attr) for s in seqs], dtype=dt)  # noqa: E731
        banned = []
        for s in seqs:
            b = []
            if len(s.output_token_ids) < s.params.min_tokens:
                b = list(s.params.stop_token_ids) + ([] if s.params.ignore_eos else sorted(self.eos_token_ids))
            banned.append(b)
        return SamplingBatch(
            temperature=f("temperature", torch.float32), top_k=f("top_k", torch.long), top_p=f("top_p", torch.float32),
            min_p=f("min_p", torch.float32), repetition_penalty=f("repetition_penalty", torch.float32),
            presence_penalty=f("presence_penalty", torch.float32), frequency_penalty=f("frequency_penalty", torch.float32),
            generators=[s.generator for s in seqs], output_token_ids=[s.output_token_ids for s in seqs],
            prompt_token_ids=[s.prompt_token_ids for s in seqs], banned_token_ids=banned,
            num_logprobs=[s.params.logprobs for s in seqs],
            logit_bias=[s.params.logit_bias for s in seqs] if any(s.params.logit_bias for s in seqs) else None,
            token_bitmask=None if self.structured is None else self.structured.bitmask([s.seq_id for s in seqs]),
        )

    def _process(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        touched: dict[str, None] = {}
        k = 0
        for i, s in enumerate(sched.scheduled):
            seq = s.seq
            seq.num_computed_tokens = s.start + s.num_new_tokens
            self.block_manager.register_full_blocks(seq)
            for idx, d in result.prompt_logprobs.get(i, []):
                if idx == len(seq.prompt_logprobs):
                    seq.prompt_logprobs.append(d)
            if s.start < seq.num_prompt_tokens:
                self.prompt_tokens_total += min(s.num_new_tokens, seq.num_prompt_tokens - s.start)
            if not s.samples:
                continue
            self._accept_token(seq, result.sampled.token_ids[k], result.sampled.logprobs[k])
            k += 1
            touched[seq.request_id] = None
        return [self._request_output(self.requests[rid]) for rid in touched if rid in self.requests]

    def _accept_token(self, seq: Sequence, token: int, lp) -> None:
        """Append a sampled token with its logprobs, then the stop checks (and the grammar's)."""
        seq.append_token(token)
        self.generation_tokens_total += 1
        if lp is not None:
            d = {token: (lp.token_logprob, lp.rank)}
            for r, (tid, v) in enumerate(zip(lp.top_ids, lp.top_logprobs)):
                d.setdefault(tid, (v, r + 1))
            seq.output_logprobs.append(d)
            seq.cumulative_logprob += lp.token_logprob
        self._check_stop(seq, token)
        if self.structured is not None:
            done = self.structured.accept(seq.seq_id, token)
            if done and not seq.is_finished:  # the grammar is complete (its stop token was ignore_eos'd)
                self._finish(seq, "stop", None)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if self.tokenizer is not None:
            seq.output_text += detokenizer.decode_new_text(self.tokenizer, seq)
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                return self._finish(seq, "stop", token)
            if not p.ignore_eos and token in self.eos_token_ids:
                return self._finish(seq, "stop", None)
            for stop in p.stop_strings:
                pos = seq.output_text.find(stop, max(0, len(seq.output_text) - 64 - len(stop)))
                if pos >= 0:
                    seq.output_text = seq.output_text[:pos + (len(stop) if p.include_stop_str_in_output else 0)]
                    return self._finish(seq, "stop", stop)
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    def _structured(self):
        if self.structured is None:
            from lqe.structured_output import StructuredOutputs

            self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
        return self.structured

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        if self.structured is not None:
            self.structured.remove(seq.seq_id)
        if self.tokenizer is not None and reason != "stop":
            seq.output_text += detokenizer.decode_new_text(self.tokenizer, seq, flush=True)
        self.scheduler.finish(seq, reason, stop_reason)

    def _request_output(self, req: _Request) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            logprobs = None
            if req.params.logprobs is not None:
                logprobs = [{t: Logprob(v, r, self._decode1(t)) for t, (v, r) in d.items()} for d in seq.output_logprobs]
            outs.append(CompletionOutput(seq.index, seq.output_text, list(seq.output_token_ids),
                                         seq.cumulative_logprob if req.params.logprobs is not None else None,
                                         logprobs, seq.finish_reason, seq.stop_reason))
        finished = all(s.is_finished for s in req.seqs)
        prompt_lp = None
        if req.params.prompt_logprobs is not None:
            prompt_lp = [None if d is None else {t: Logprob(v, r) for t, (v, r) in d.items()}
                         for d in req.seqs[0].prompt_logprobs]
        first = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        metrics = RequestMetrics(req.arrival_time, min(first) if first else None,
                                 time.monotonic() if finished else None, req.seqs[0].num_cached_tokens)
        if finished:
            del self.requests[req.request_id]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished, prompt_lp, metrics,
                             req.seqs[0].num_cached_tokens)

    def _decode1(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA GPU is available; use device='cpu'")
    return torch.device(name)


def _pick_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(str(checkpoint_dtype), torch.bfloat16) if checkpoint_dtype in ("float16", "bfloat16") else torch.bfloat16


def _quant_config(model_dir: str, raw: dict, requested: str | None):
    try:
        from lqe.quant_layers import resolve_quant_config
    except ImportError:
        resolve_quant_config = None
    if resolve_quant_config is not None:
        return resolve_quant_config(model_dir, raw, requested)
    if requested is not None or raw.get("quantization_config"):
        raise ValueError("quantized checkpoints are not supported by this build")
    return None


def _load_tokenizer(path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        # str(e): a log record holding the exception would keep its traceback (and this engine) alive
        logger.warning("no tokenizer loaded from %s (%s); prompts must be token ids", path, str(e))
        return None
