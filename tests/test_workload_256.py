"""The issue-26 throughput workload (benchmarks/workload.py): deterministic, lengths in range, and its floor."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from workload import Request, workload_256, workload_floor  # noqa: E402


def test_workload_is_deterministic_and_in_range():
    a, b = workload_256(49152), workload_256(49152)
    assert len(a) == 256
    assert a == b, "the same seed must give the same requests"
    assert workload_256(49152, seed=1) != a
    ins, outs = [len(r.prompt) for r in a], [r.output_len for r in a]
    assert min(ins) >= 100 and max(ins) <= 1024 and min(outs) >= 100 and max(outs) <= 1024
    assert max(ins) - min(ins) > 700 and max(outs) - min(outs) > 700, "lengths spread over the range"
    assert 450 < sum(ins) / 256 < 680 and 450 < sum(outs) / 256 < 680, "uniform: mean near 562"
    ids = [t for r in a for t in r.prompt]
    assert min(ids) >= 2 and max(ids) < 49152
    assert workload_256(1000, n=8) == workload_256(1000, n=8)
    assert [len(r.prompt) for r in workload_256(1000, n=8)] == ins[:8], "a prefix of the same lengths"


def test_workload_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n >= 1"):
        workload_256(1000, n=0)
    with pytest.raises(ValueError, match="lo <= hi"):
        workload_256(1000, lo=10, hi=5)


def test_floor_counts_flops_and_bytes():
    reqs = [Request([5] * 3, 2), Request([5] * 1, 4)]
    fl = workload_floor(reqs, matmul_params=10, weight_bytes=100, layers=2, q_width=4, kv_bytes_per_token=8,
                        peak_flops=1e3, peak_bw=1e3)
    # tokens 5 + 5 = 10; contexts 1+..+5 twice = 30; decode contexts (3+4) + (1+2+3+4) = 17; 4 decode steps
    assert fl["flops"] == 2 * 10 * 10 + 4 * 2 * 4 * 30
    assert fl["bytes"] == 100 * 4 + 8 * 17
    assert fl["min_decode_steps"] == 4
    assert fl["floor_s"] == pytest.approx(max(fl["flops"], fl["bytes"]) / 1e3)
    assert fl["floor_bound"] == "compute"


def test_busy_union_counts_overlaps_once():
    from workload import busy_union

    assert busy_union([]) == (0, 0)
    assert busy_union([(0, 10)]) == (10, 10)
    # overlapping (two streams), nested, touching, then gaps: busy 10 + 11 + 3, span 0..33
    assert busy_union([(12, 20), (0, 10), (2, 8), (15, 17), (20, 22), (22, 23), (30, 33)]) == (10 + 11 + 3, 33)


def test_kernel_breakdown_sums_calls_per_name_longest_first():
    from workload import kernel_breakdown

    ev = [("gemm", 0, 3_000_000), ("attn", 3_000_000, 4_000_000), ("gemm", 5_000_000, 8_000_000),
          ("x" * 200, 8_000_000, 8_500_000)]
    rows = kernel_breakdown(ev, top=2, width=50)
    assert rows == [["gemm", 2, 6.0, 0.8], ["attn", 1, 1.0, 0.133]]
    assert kernel_breakdown([("x" * 200, 0, 10)], width=50) == [["x" * 50, 1, 0.0, 1.0]]
    assert kernel_breakdown([]) == []


def test_workload_id_names_the_requests():
    """e2e rows record workload_id beside throughput (benchmarks/compare_e2e.py compares throughput only between equal
    ids). Pinned: the 32 requests of ``e2e_gpu.py --quick`` on the smollm2 vocabulary; a change to the generator makes
    the committed throughput rows incomparable, so change this only with them."""
    from workload import workload_id

    a = workload_256(49152, 32)
    assert sum(r.output_len for r in a) == 17947
    assert workload_id(a) == workload_id(workload_256(49152, 32)) == "sha256:6ed173c5ad497b1c"
    assert workload_id(workload_256(49152, 32, seed=1)) != workload_id(a)
    assert workload_id(a[:31]) != workload_id(a) and workload_id(workload_256(151936, 32)) != workload_id(a)
    assert workload_id([Request([5, 6], 3)]) != workload_id([Request([5], 63)])  # fields kept apart
