"""Piecewise graphs of mixed and prefill steps (lqe.engine.piecewise), on CPU: the pieces are recorded as aten ops
over the same static tensors (``RecordingBackend``: a CUDA graph's semantics, replayed eagerly), so these tests
check the splitting at each attention, the static q/k/v/output buffers, the padding to token buckets, the eager
attention between pieces with the step's real metadata and the LM head on the sampled rows."""

from functools import partial

import pytest
import torch

from lqe import LLM, SamplingParams
from lqe.engine.cuda_graph import EagerPaddedRunner
from lqe.engine.graph_backends import CapturedHostSyncError, NoGraphBackend, RecordingBackend
from lqe.engine.piecewise import PiecewiseRunner
from lqe.engine.token_buckets import token_buckets
from lqe.forward_context import ForwardContext, set_forward_context

from helpers import mixed_workload

BUCKETS = [16, 32, 48, 64]


def _llm(model_dir, **kw):
    base = dict(cudagraph_mode="FULL_AND_PIECEWISE", kv_cache_memory_bytes=64 << 20, max_model_len=256,
                max_num_batched_tokens=64, max_num_seqs=6,
                max_cudagraph_batch=4)
    return LLM(model_dir, **{**base, **kw})


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_padded_step_replays_the_eager_step_exactly(model, request):
    """One mixed step (a decode beside a 23-token prefill chunk), piecewise vs the eager forward of the same padded
    inputs: the same hidden states (real rows), logits, KV cache, bit for bit; the captured pieces are layers + 1.
    Llama, Qwen2 (qkv bias, untied head) and Qwen3 (q/k norms before rotary)."""
    llm = _llm(request.getfixturevalue(model), enable_prefix_caching=False)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    backend = RecordingBackend()
    runner.capture_piecewise(backend, BUCKETS)
    pw = runner.piecewise
    layers = runner.model_cfg.num_hidden_layers
    assert pw.buckets == BUCKETS and all(len(g.pieces) == layers + 1 for g in pw.graphs.values())
    assert [lay.layer_idx for lay, *_ in pw.graphs[32].layers] == list(range(layers))
    assert backend.num_ops > 0
    p = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    engine.add_request("a", list(range(5, 17)), p)
    engine.step()
    engine.add_request("b", list(range(40, 63)), p)
    sched = engine.scheduler.schedule()
    assert sched.num_batched_tokens == 24 and runner.piecewise_bucket(sched) == 32
    kv_before = runner.kv_cache.clone()
    with torch.inference_mode():
        inp = runner.prepare_inputs(sched, 32)
        with set_forward_context(ForwardContext(inp.meta, runner.kv_caches)):
            eager = runner.model(inp.input_ids, inp.positions).clone()
        rows = inp.sample_rows.clone()
        eager_logits = runner.model.compute_logits(eager[rows])
        kv_eager = runner.kv_cache.clone()
        runner.kv_cache.copy_(kv_before)
        hidden, inp2 = runner.forward(sched)
        logits = runner.model.compute_logits(hidden[inp2.sample_rows])
    assert hidden.shape[0] == 32 and rows.tolist() == [0, 23]
    assert torch.equal(hidden[:24], eager[:24])
    assert torch.equal(logits, eager_logits)
    assert torch.equal(runner.kv_cache, kv_eager) and not torch.equal(kv_eager, kv_before)
    assert runner.steps_by_path == {"decode_graph": 0, "piecewise": 2, "eager": 0}  # a's prefill, then this step


# longer prompts and shorter outputs than test_cuda_graph_bookkeeping
_workload = partial(mixed_workload, shared_len=24, max_body=70, tokens=(2, 14))


@pytest.mark.parametrize("num_kv_blocks", [None, 20])
def test_generation_on_piecewise_path_equals_eager(tiny_llama_dir, num_kv_blocks):
    """A batched workload (chunked prefills beside decodes, prefix-cache hits, seeded sampling; preemption forced by a
    20-block cache) with mixed / prefill steps on the piecewise path and decodes on the padded decode path gives the
    eager engine's tokens; several token buckets ran, one device-to-host sync per sampling step."""
    prompts, params = _workload(10)
    kw = {} if num_kv_blocks is None else {"num_kv_blocks": num_kv_blocks}
    want = [o.outputs[0].token_ids for o in _llm(tiny_llama_dir, **kw).generate(prompts, params, use_tqdm=False)]
    llm = _llm(tiny_llama_dir, **kw)
    runner = llm.llm_engine.runner
    runner.capture_cuda_graphs(EagerPaddedRunner)
    runner.capture_piecewise(RecordingBackend(), BUCKETS)
    used, samples = [], [0]
    run, schedule = runner.piecewise.run, llm.llm_engine.scheduler.schedule
    runner.piecewise.run = lambda b, inp: (used.append(b), run(b, inp))[1]

    def spy():
        s = schedule()
        samples[0] += any(x.samples for x in s.scheduled)
        return s
    llm.llm_engine.scheduler.schedule = spy
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert len(set(used)) >= 3, used
    assert runner.steps_by_path["decode_graph"] > 0 and runner.steps_by_path["eager"] == 0, runner.steps_by_path
    assert runner.host_syncs == samples[0]
    if num_kv_blocks:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    else:
        assert llm.llm_engine.block_manager.hits > 0


def test_prompt_logprobs_and_large_steps_run_eagerly(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, max_num_batched_tokens=96, enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    runner.capture_piecewise(RecordingBackend(), BUCKETS)  # largest bucket 64 < the 96-token budget
    lp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate([list(range(5, 25))], lp, use_tqdm=False)
    assert out[0].prompt_logprobs is not None and runner.steps_by_path["piecewise"] == 1  # only the decode step
    llm.generate([list(range(5, 95))], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    assert runner.steps_by_path["eager"] == 2  # the prompt-logprobs prefill and the 90-token prefill


def test_capture_budget_leaves_small_buckets_eager(tiny_llama_dir):
    """Past the capture time budget the smaller buckets are not captured; their steps run eagerly (not padded to a
    much larger bucket), the captured ones still replay."""
    llm = _llm(tiny_llama_dir, enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    runner.piecewise = PiecewiseRunner(runner.model, runner.kv_caches, runner.inputs.device_buf, BUCKETS,
                                       RecordingBackend())
    runner.piecewise.capture(max_seconds=0.0)  # the largest bucket always; the budget is spent after it
    assert runner.piecewise.buckets == [64]
    greedy = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([list(range(5, 15))], greedy, use_tqdm=False)  # 10 tokens: bucket 16, not captured
    llm.generate([list(range(5, 60))], greedy, use_tqdm=False)  # 55 tokens: bucket 64
    assert runner.steps_by_path == {"decode_graph": 0, "piecewise": 1, "eager": 1}


def test_recording_refuses_a_host_sync_inside_a_piece():
    class Syncs(torch.nn.Module):
        def forward(self, ids, pos):
            return torch.ones(ids.shape[0], 4) * float(ids.sum())  # .item(): a CUDA graph cannot capture it

    buf = torch.zeros(64, dtype=torch.int32)
    pw = PiecewiseRunner(Syncs(), [], buf, [8], RecordingBackend())
    with pytest.raises(CapturedHostSyncError, match="aten::item"):
        pw.capture()
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    assert not _get_current_dispatch_mode_stack()  # the failed capture left no recording mode behind
    ok = PiecewiseRunner(Syncs(), [], buf, [8], NoGraphBackend())  # eager pieces: nothing captured, no error
    ok.capture()
    assert ok.buckets == [8]


def test_engine_options(tiny_llama_dir):
    with pytest.raises(ValueError, match="cudagraph_mode"):
        LLM(tiny_llama_dir, cudagraph_mode="PIECEWISE_ONLY")
    with pytest.raises(ValueError, match="max_piecewise_tokens"):
        LLM(tiny_llama_dir, max_piecewise_tokens=0)
    llm = _llm(tiny_llama_dir, cudagraph_mode="full_decode_only", max_piecewise_tokens=32)
    runner = llm.llm_engine.runner
    assert runner.config.cudagraph_mode == "FULL_DECODE_ONLY"
    assert runner.piecewise is None  # CPU: no graphs captured by default
    assert token_buckets(32) == [32]


def test_fp8_kv_cache_calibrates_eagerly_then_replays(tiny_llama_dir):
    """fp8 KV cache without checkpoint scales: the first prefill computes them on the eager path (no graph ever runs
    the calibration), later mixed steps replay pieces reading the scales in place; tokens equal the eager engine's."""
    prompts, params = _workload(6, seed=1)
    want = [o.outputs[0].token_ids for o in
            _llm(tiny_llama_dir, kv_cache_dtype="fp8").generate(prompts, params, use_tqdm=False)]
    llm = _llm(tiny_llama_dir, kv_cache_dtype="fp8")
    runner = llm.llm_engine.runner
    runner.capture_piecewise(RecordingBackend(), BUCKETS)
    assert runner.kv_calibrate
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert runner.steps_by_path["eager"] == 1 and runner.steps_by_path["piecewise"] > 3, runner.steps_by_path
