import pytest
import torch

from lqe.engine.block_manager import BlockManager
from lqe.engine.scheduler import Scheduler
from lqe.engine.sequence import Sequence
from lqe.sampling_params import SamplingParams

_ids = iter(range(10**6))


def seq(tokens, **params) -> Sequence:
    return Sequence(next(_ids), f"r{next(_ids)}", 0, list(tokens), SamplingParams(**params), torch.Generator())


def compute_all(bm: BlockManager, s: Sequence) -> None:
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.blocks_needed(s, 10) == 3
    bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.allocate(s, 12)  # still fits in 3 blocks
    assert len(s.block_table) == 3
    bm.allocate(s, 13)
    assert len(s.block_table) == 4
    bm.free_seq(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(16, 4)
    a = seq(range(10))  # 2 full blocks + 2 tokens
    compute_all(bm, a)
    b = seq(list(range(8)) + [99, 98, 97])
    bm.match_prefix(b)
    assert b.block_table == a.block_table[:2]
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.free_seq(a)
    assert bm.blocks[b.block_table[0]].ref_count == 1
    assert bm.hits == 2


def test_prefix_miss_on_different_tokens_and_chain():
    bm = BlockManager(16, 4)
    compute_all(bm, seq(range(12)))
    c = seq([0, 1, 2, 99] + list(range(4, 12)))  # first block differs: nothing matches, even later blocks
    bm.match_prefix(c)
    assert c.block_table == [] and c.num_computed_tokens == 0


def test_match_leaves_one_token_to_compute():
    bm = BlockManager(16, 4)
    compute_all(bm, seq(range(8)))
    d = seq(range(8))  # identical 2-block prompt: only the first block may be reused
    bm.match_prefix(d)
    assert d.num_computed_tokens == 4


def test_freed_blocks_stay_cached_until_evicted():
    bm = BlockManager(4, 4)
    a = seq(range(9))
    compute_all(bm, a)
    bm.free_seq(a)
    b = seq(list(range(8)) + [5])
    bm.match_prefix(b)
    assert b.num_cached_tokens == 8, "blocks freed with a hash are found again"
    bm.free_seq(b)
    filler = seq(range(1000, 1016))
    bm.allocate(filler, 16)  # takes every block: the cached ones are evicted
    bm.free_seq(filler)
    c = seq(list(range(8)) + [5])
    bm.match_prefix(c)
    assert c.num_cached_tokens == 0


def test_prompt_logprobs_disable_prefix_reuse():
    bm = BlockManager(16, 4)
    compute_all(bm, seq(range(12)))
    s = seq(range(12), prompt_logprobs=0)
    bm.match_prefix(s)
    assert s.num_computed_tokens == 0


def test_double_free_is_detected():
    bm = BlockManager(4, 4)
    s = seq(range(4))
    bm.allocate(s, 4)
    table = list(s.block_table)
    bm.free_seq(s)
    s.block_table = table
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free_seq(s)


def test_scheduler_budget_chunks_and_mixes_prefill_with_decode():
    bm = BlockManager(64, 4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(range(6)), seq(range(100, 125))
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(a, 6), (b, 4)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    for x in out.scheduled:
        x.seq.num_computed_tokens = x.start + x.num_new_tokens
    a.append_token(7)
    out = sch.schedule()  # a decodes one token, b continues its prefill with the rest of the budget
    assert [(x.seq, x.start, x.num_new_tokens) for x in out.scheduled] == [(a, 6, 1), (b, 4, 9)]


def test_scheduler_respects_max_num_seqs_fcfs():
    bm = BlockManager(64, 4)
    sch = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [seq(range(3)) for _ in range(3)]
    for s in seqs:
        sch.add(s)
    out = sch.schedule()
    assert [x.seq for x in out.scheduled] == seqs[:2]
    assert list(sch.waiting) == [seqs[2]]


def test_scheduler_preempts_latest_running_when_blocks_run_out():
    bm = BlockManager(4, 4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq(range(8)), seq(range(100, 108))
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    assert len(out.scheduled) == 2 and bm.num_free_blocks == 0
    for x in out.scheduled:
        x.seq.num_computed_tokens = 8
        x.seq.append_token(1)
    out = sch.schedule()  # a needs a 3rd block: b (admitted later) is preempted
    assert out.preempted == [b]
    assert [x.seq for x in out.scheduled] == [a]
    assert sch.waiting[0] is b and b.block_table == [] and b.num_computed_tokens == 0
