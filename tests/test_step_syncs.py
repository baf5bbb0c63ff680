"""One device-to-host sync per step (issue 26): every step that samples reads its token ids (and the finiteness
flags) through ``ModelRunner.to_host_start`` once; a step that only prefills part of a prompt reads nothing. The rotary
cos/sin are gathered once per step, not once per layer."""
import torch

from lqe import LLM, SamplingParams
from lqe.forward_context import ForwardContext, set_forward_context, step_cached


def _syncs_per_step(llm, params) -> list[tuple[int, int]]:
    """(tokens scheduled, to_host_start calls) of every step until the engine is idle."""
    engine = llm.llm_engine
    out = []
    while engine.has_unfinished():
        before = engine.runner.host_syncs
        sched_tokens = None
        orig = engine.scheduler.schedule

        def spy():
            nonlocal sched_tokens
            s = orig()
            sched_tokens = (s.num_batched_tokens, any(x.samples for x in s.scheduled))
            return s
        engine.scheduler.schedule = spy
        try:
            engine.step()
        finally:
            engine.scheduler.schedule = orig
        out.append((sched_tokens, engine.runner.host_syncs - before))
    return out


def test_one_sync_per_sampling_step_greedy_and_seeded(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=32 << 20, max_model_len=256, max_num_batched_tokens=24,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    engine.add_request("a", list(range(5, 45)), SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
    engine.add_request("b", list(range(50, 60)), SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.8, seed=3))
    steps = _syncs_per_step(llm, None)
    assert len(steps) >= 9
    mixed = [n for (tokens, samples), n in steps if samples and tokens > 2]
    assert mixed, "the 24-token budget must give mixed steps (a prefill chunk beside decodes)"
    for (tokens, samples), n in steps:
        assert n == (1 if samples else 0), f"a step of {tokens} tokens made {n} device-to-host syncs"


def test_nonfinite_flags_ride_the_same_copy(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=32 << 20, max_model_len=256)
    runner = llm.llm_engine.runner
    calls = []
    orig = runner.to_host_start
    runner.to_host_start = lambda t: calls.append(tuple(t.shape)) or orig(t)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0), use_tqdm=False)
    assert calls == [(2, 1), (2, 1)], calls  # [token ids; finite flags] x 1 row, once per step


def test_step_cached_builds_once_per_step():
    built = []
    ctx = ForwardContext(attn_metadata=None, kv_caches=[])
    with set_forward_context(ctx):
        for _ in range(3):
            assert step_cached("k", lambda: built.append(1) or torch.ones(1)).item() == 1
    assert built == [1]
    with set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[])):
        step_cached("k", lambda: built.append(2) or 0)
    assert built == [1, 2], "a new step builds again"
    assert step_cached("k", lambda: 7) == 7  # outside a step: no cache
