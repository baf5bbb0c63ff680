"""Builds the model, owns the paged KV cache, and runs one scheduled step.

Input preparation turns the scheduler's chunks into the flattened step (token ids, positions, slot mapping,
block tables); logits are computed only for the rows that need them (the last token of a sampling chunk and,
for requests asking for prompt logprobs, every prompt position).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from lqe.config import EngineConfig
from lqe.distributed.parallel_state import get_tp_rank, get_tp_size
from lqe.engine.cuda_graph import CudaGraphRunner, batch_buckets, bucket_for
from lqe.engine.graph_backends import CudaGraphBackend
from lqe.engine.kv_cache import KVCacheSpec, setup_fp8_layers
from lqe.engine.piecewise import PiecewiseRunner
from lqe.engine.token_buckets import token_buckets
from lqe.engine.scheduler import SchedulerOutput
from lqe.engine.step_inputs import StepInputBuilder, StepInputs, StepLayout
from lqe.forward_context import ForwardContext, set_forward_context
from lqe.kernels.attention_backends import select_backend
from lqe.kernels.attention_plan import choose_num_splits
from lqe.layers.act_quant_fusion import link_act_quant
from lqe.layers.attention import Attention, resolve_kv_cache_dtype
from lqe.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from lqe.loaders.hf_config import ModelConfig
from lqe.loaders.weights import iterate_weights, load_weights
from lqe.models import get_model_class
from lqe.quant_layers.base import QuantConfig
from lqe.quant_layers.checks import check_model_weights

_LOGITS_CHUNK = 512  # rows of prompt logprobs turned into [rows, vocab] logits at once


@dataclass(slots=True)
class StepResult:
    sampled: SamplerOutput | None  # one entry per scheduled chunk that samples, in schedule order
    # per scheduled index: list of (prompt token index, {token: (logprob, rank)}) filled this step
    prompt_logprobs: dict[int, list[tuple[int, dict[int, tuple[float, int]]]]]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str, model_cfg: ModelConfig, quant_config: QuantConfig | None,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.model_cfg, self.device, self.dtype = config, model_cfg, device, dtype
        self.block_size = config.block_size
        cls = get_model_class(model_cfg)
        with torch.device(device):
            self.model: nn.Module = cls(model_cfg, quant_config, dtype)
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        # tensor-parallel ranks read only their slices of each safetensors tensor
        load_weights(self.model, iterate_weights(model_dir, lazy=self.tp_size > 1))
        check_model_weights(self.model, allow=config.allow_nonfinite_weights)  # NaN / inf / zero scales
        for module in self.model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
        self.fused_act_quant = link_act_quant(self.model, self.tp_size)  # norm / SiLU-mul -> int8 for W8A8
        self.model.eval()
        backend = select_backend(device)
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.backend = backend
        self.attention_backend = backend.name
        # this rank's KV heads (all of them with one rank)
        self.num_kv_heads = next((m.num_kv_heads for m in self.model.modules() if isinstance(m, Attention)),
                                 model_cfg.num_key_value_heads)
        self.kv_spec = KVCacheSpec(
            model_cfg.num_hidden_layers, self.block_size, self.num_kv_heads, model_cfg.head_dim,
            resolve_kv_cache_dtype(config.kv_cache_dtype, model_cfg.raw, dtype), dtype, config.kv_cache_key_rotation)
        self.kv_calibrate: list[Attention] = []  # fp8 layers whose scales the first prefill computes
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[torch.Tensor] = []  # per-layer views of kv_cache
        self.num_blocks = 0
        self.inputs: StepInputBuilder | None = None
        self.graph_runner: CudaGraphRunner | None = None
        self.piecewise: PiecewiseRunner | None = None  # mixed / prefill steps by token bucket (lqe.engine.piecewise)
        self.steps_by_path = {"decode_graph": 0, "piecewise": 0, "eager": 0}
        # host-time accounting (benchmarks): when on, each step waits for the GPU before sampling and counts it
        self.measure_gpu_wait = False
        self.gpu_wait_s = 0.0
        self.host_syncs = 0  # device-to-host copies (to_host_start calls): one per sampling step
        self._pinned: list[torch.Tensor] | None = None  # to_host_start's two staging buffers and events
        self._copied: list[torch.cuda.Event] | None = None
        self._pin_turn = 0

    # -- memory ---------------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    def allocate_kv_cache(self, max_model_len: int) -> None:
        """The paged KV cache (:mod:`lqe.engine.kv_cache`) and the step buffers sized for it."""
        spec = self.kv_spec
        num_blocks = spec.num_blocks(self.config, self.device, max_model_len)
        self.kv_cache = spec.allocate(num_blocks, self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.kv_calibrate = setup_fp8_layers(self.model, spec, self.device)
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.table_width = needed = spec.blocks_per_request(max_model_len)
        self.buckets = batch_buckets(self.config.max_num_seqs, self.config.max_cudagraph_batch)
        tokens = max(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        seqs = self.config.max_num_seqs
        self.inputs = StepInputBuilder(self.device, self.block_size,  # + rows/sources of pending tokens (async)
                                       StepLayout(tokens, seqs, needed, tokens).size + 2 * seqs)

    def decode_splits(self, num_seqs: int) -> int:
        """Split count of the decode attention for a step of ``num_seqs`` sequences: a function of the batch's
        graph bucket and ``max_model_len`` only, so an eager step and a graph replay of the same batch split
        (and round) the same way, whatever the current sequence lengths."""
        b = bucket_for(num_seqs, self.buckets) or num_seqs
        return choose_num_splits(b, self.num_kv_heads, self.max_model_len, self.device)

    def capture_cuda_graphs(self, runner_cls: type[CudaGraphRunner] = CudaGraphRunner) -> None:
        """Capture the decode graphs (CUDA only, unless ``enforce_eager``); call after :meth:`allocate_kv_cache`.
        ``runner_cls=EagerPaddedRunner`` runs the same padded decode path eagerly (any device: for tests)."""
        if runner_cls is CudaGraphRunner and (self.device.type != "cuda" or self.config.enforce_eager or self.tp_size > 1):
            return  # tensor-parallel steps run eagerly: no collectives are captured in graphs
        if self.config.cudagraph_mode == "NONE" and runner_cls is CudaGraphRunner:
            return
        self.graph_runner = runner_cls(
            self.model, self.kv_caches, self.inputs, self.buckets, self.table_width, self.max_model_len, self.block_size, self.decode_splits)
        self.graph_runner.capture()
        self.capture_piecewise()

    def capture_piecewise(self, backend=None, buckets: list[int] | None = None) -> None:
        """Capture the piecewise graphs of mixed / prefill steps, one set per token bucket (after the decode graphs:
        their memory pool is shared). Default: CUDA graphs, on CUDA only, with ``cudagraph_mode`` FULL_AND_PIECEWISE,
        not ``enforce_eager``, one rank. ``backend=RecordingBackend()`` records the pieces as aten ops on any device
        (tests); ``buckets`` overrides :func:`token_buckets` of ``max_piecewise_tokens``."""
        if backend is None:
            if (self.device.type != "cuda" or self.config.enforce_eager or self.tp_size > 1
                    or self.config.cudagraph_mode != "FULL_AND_PIECEWISE"):
                return
            backend = CudaGraphBackend(pool=None if self.graph_runner is None else self.graph_runner.pool)
        if buckets is None:
            cap = self.config.max_num_batched_tokens
            buckets = token_buckets(min(cap, self.config.max_piecewise_tokens or cap))
        self.piecewise = PiecewiseRunner(self.model, self.kv_caches, self.inputs.device_buf, buckets, backend)
        self.piecewise.capture(stream=getattr(self.graph_runner, "capture_stream", None))

    def piecewise_bucket(self, sched: SchedulerOutput) -> int | None:
        """The token bucket whose piecewise graphs run ``sched``, or ``None`` (decode graph or eager)."""
        if self.piecewise is None or self.kv_calibrate:  # fp8 scales still to compute: an eager step
            return None
        return self.piecewise.bucket_for_step(sched, [] if self.graph_runner is None else self.graph_runner.buckets)

    # -- one step -------------------------------------------------------------------------------------
    def prepare_inputs(self, sched: SchedulerOutput, pad_tokens: int | None = None) -> StepInputs:
        """The step's flattened inputs and attention metadata (one host-to-device copy on CUDA); ``pad_tokens``:
        padded to that token bucket (piecewise graphs)."""
        return self.inputs.build(sched, pad_tokens=pad_tokens)

    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, StepInputs]:
        """Run the model on a scheduled step (K/V land in the cache); returns hidden states ``[T, hidden]``
        and the step's inputs. A step a token bucket covers replays its piecewise graphs: ``[bucket, hidden]``, the
        rows past the step's tokens are padding."""
        bucket = self.piecewise_bucket(sched)  # None while fp8 KV scales are still to compute: an eager step
        inp = self.prepare_inputs(sched, bucket)
        if self.device.type == "cuda":
            inp.meta.num_splits = self.decode_splits(inp.meta.num_seqs)
        if bucket is not None:
            self.steps_by_path["piecewise"] += 1
            return self.piecewise.run(bucket, inp), inp
        self.steps_by_path["eager"] += 1
        calibrate, self.kv_calibrate = self.kv_calibrate, []
        for m in calibrate:  # eager steps only: a graph capture never sees the flag
            m.calculate_kv_scales = True
        try:
            with set_forward_context(ForwardContext(inp.meta, self.kv_caches)):
                hidden = self.model(inp.input_ids, inp.positions)
        finally:
            self.kv_calibrate = [m for m in calibrate if m.calculate_kv_scales]  # a step that stored nothing
            for m in calibrate:
                m.calculate_kv_scales = False
        return hidden, inp

    def _step_logits(self, sched: SchedulerOutput):
        """``(logits of the sampled rows or None, hidden, inputs)`` of a step: a decode graph when one covers it
        (``hidden``, ``inputs`` None), else :meth:`forward` and the LM head on the rows that sample."""
        if self.graph_runner is not None and not self.kv_calibrate:  # fp8 scales still to compute: an eager step
            logits = self.graph_runner.run(sched)
            if logits is not None:
                self.steps_by_path["decode_graph"] += 1
                return logits, None, None
        hidden, inp = self.forward(sched)
        logits = None
        if inp.num_sample:
            logits = self.model.compute_logits(hidden if inp.sample_rows is None else hidden[inp.sample_rows])
        return logits, hidden, inp

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, sampling: SamplingBatch | None) -> StepResult:
        logits, hidden, inp = self._step_logits(sched)
        sampled = None
        if logits is not None and self.tp_rank == 0:  # TP workers only take part in the collectives
            sampled = self._launch_sample(logits, sched, sampling).result().sampled
        prompt_lp = {} if hidden is None else self._prompt_logprobs(sched, hidden, inp.meta.query_start_loc_cpu)
        return StepResult(sampled, prompt_lp)

    def _launch_sample(self, logits: torch.Tensor, sched: SchedulerOutput, sampling: SamplingBatch) -> "PendingStep":
        """Sample, and start the step's one device-to-host copy (:meth:`to_host_start`): the token ids and the
        finiteness flags together; :meth:`PendingStep.result` waits for it, fails the requests whose logits were
        NaN / inf, and reads logprobs when a request asks for them."""
        finite = torch.isfinite(logits).all(dim=-1)
        tokens, raw_logprobs = self.sampler.sample_tokens(logits, sampling)
        both = torch.stack([tokens.long(), finite.long()])
        return PendingStep(self, sched, sampling, both[0], raw_logprobs, self.to_host_start(both))

    def to_host_start(self, t: torch.Tensor):
        """Start the step's one device-to-host copy of ``t`` (int64), counted in :attr:`host_syncs`; on CUDA a
        non-blocking copy into pinned memory (two buffers alternate, so two steps may be in flight) and an event.
        :meth:`to_host_wait` waits on that event (no stream or device synchronize) and returns ``t`` as a list."""
        self.host_syncs += 1
        if t.device.type != "cuda":
            return t, None
        n = t.numel()
        if self._pinned is None or self._pinned[0].numel() < n:
            self._pinned = [torch.empty(max(n, 4096), dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        i = self._pin_turn = (self._pin_turn + 1) % 2
        host = self._pinned[i][:n].view(t.shape)
        host.copy_(t, non_blocking=True)
        self._copied[i].record()
        return host, self._copied[i]

    def to_host_wait(self, started) -> list:
        host, event = started
        if event is not None:
            t0 = time.perf_counter()
            event.synchronize()
            if self.measure_gpu_wait:
                self.gpu_wait_s += time.perf_counter() - t0
        return host.tolist()

    @torch.inference_mode()
    def execute_async(self, sched: SchedulerOutput, sampling: SamplingBatch | None) -> "PendingStep":
        """Launch a step (model, LM head, sampling) and start its one device-to-host copy without waiting for it:
        :meth:`PendingStep.result` waits. For async scheduling (:mod:`lqe.engine.async_steps`), one rank; no prompt
        logprobs (a step that asks for them runs through :meth:`execute`). ``PendingStep.tokens`` holds the sampled
        ids on the device (the next step's pending inputs)."""
        logits, _, _ = self._step_logits(sched)
        if logits is None:
            return PendingStep(self, sched, sampling, None, None, None)
        return self._launch_sample(logits, sched, sampling)

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor, qsl: list[int]):
        result: dict[int, list[tuple[int, dict[int, tuple[float, int]]]]] = {}
        for i, s in enumerate(sched.scheduled):
            seq = s.seq
            if not seq.wants_prompt_logprobs:
                continue
            # position p predicts prompt token p + 1
            first = max(s.start, len(seq.prompt_logprobs) - 1)
            last = min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1)
            if first >= last:
                continue
            k = seq.params.prompt_logprobs
            entries = []
            for c0 in range(first, last, _LOGITS_CHUNK):
                c1 = min(last, c0 + _LOGITS_CHUNK)
                rows = torch.arange(qsl[i] + c0 - s.start, qsl[i] + c1 - s.start, device=hidden.device)
                lp = self.model.compute_logits(hidden[rows]).float().log_softmax(dim=-1)
                targets = torch.tensor(seq.prompt_token_ids[c0 + 1:c1 + 1], device=lp.device)
                tok_lp = lp.gather(1, targets[:, None]).squeeze(1)
                ranks = (lp > tok_lp[:, None]).sum(dim=1) + 1
                top = lp.topk(k, dim=-1) if k > 0 else None
                for j in range(c1 - c0):
                    d = {int(targets[j]): (float(tok_lp[j]), int(ranks[j]))}
                    if top is not None:
                        for r, (tid, v) in enumerate(zip(top.indices[j].tolist(), top.values[j].tolist())):
                            d.setdefault(tid, (v, r + 1))
                    entries.append((c0 + 1 + j, d))
            result[i] = entries
        return result


class PendingStep:
    """A launched step whose sampled tokens are still on their way to the host."""

    def __init__(self, runner: ModelRunner, sched: SchedulerOutput, sampling, tokens, raw_logprobs, started) -> None:
        self.runner, self.sched, self.sampling = runner, sched, sampling
        self.tokens, self.raw_logprobs, self.started = tokens, raw_logprobs, started

    def result(self) -> StepResult:
        if self.started is None:
            return StepResult(None, {})
        token_list, ok = self.runner.to_host_wait(self.started)
        raise_if_nonfinite(ok, self.sched)
        logprobs = self.runner.sampler.logprobs(self.raw_logprobs, token_list, self.sampling)
        return StepResult(SamplerOutput(token_list, logprobs), {})


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN / inf logits: sampling from them would emit garbage (token 0 forever)."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


def raise_if_nonfinite(ok: list, sched: SchedulerOutput) -> None:
    """Raise ``NonFiniteLogitsError`` naming the requests whose sampled row is not all finite (``ok [rows]``,
    a host list of flags)."""
    if all(ok):
        return
    rows = [s.seq for s in sched.scheduled if s.samples]
    bad = sorted({rows[i].request_id for i, good in enumerate(ok) if not good and i < len(rows)})
    raise NonFiniteLogitsError(
        f"the model produced non-finite logits (NaN / inf) for request(s) {', '.join(bad) or '?'}: the weights or "
        "the activations overflowed (fp16 overflow, or a corrupt checkpoint loaded with allow_nonfinite_weights); "
        "the request failed instead of emitting garbage. Try dtype='bfloat16' or 'float32'", bad)
