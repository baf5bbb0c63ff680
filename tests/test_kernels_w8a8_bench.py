"""benchmarks/kernels_w8a8.py host helpers: the implied kernel tables and the per-row floors (no GPU needed)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import kernels_w8a8 as kw8  # noqa: E402


def test_implied_tables_take_the_geo_mean_winner_per_m_and_merge_runs():
    rows = []
    for shape, f in (("a", 1.0), ("b", 1.1)):
        for m, speeds in ((1, {"triton-gemv": 1.9, "triton-w8a8": 1.3}), (16, {"triton-gemv": 1.7, "triton-w8a8": 1.2}),
                          (64, {"int-mm+epilogue": 1.5, "triton-w8a8": 1.4 * f * f}),
                          (1024, {"triton-w8a8": 1.6, "int-mm+epilogue": 1.1, "cublas-bf16": 9.0})):
            rows += [{"kernel": k, "shape": shape, "m": m, "speedup_vs_cublas": v} for k, v in speeds.items()]
    rows.append({"kernel": "lqe-fp8/torch-scaled-mm", "shape": "a", "m": 1, "speedup_vs_cublas": 1.2})
    rows.append({"kernel": "lqe-fp8/torch-scaled-mm", "shape": "b", "m": 1, "speedup_vs_cublas": 1.2})
    rows.append({"kernel": "triton-gemv-fp8", "shape": "a", "m": 1, "speedup_vs_cublas": 1.8})
    t = kw8.implied_tables(rows)
    # M=64: int-mm 1.5 on both vs triton 1.4 and 1.694 -> geo-mean 1.54 wins for triton
    assert t["W8A8_TABLE"] == [(16, "triton-gemv"), (None, "triton-w8a8")]
    assert t["FP8_TABLE"] == [(None, "scaled-mm")]  # the GEMV was timed on one shape only


def test_floor_is_bytes_or_flops_whichever_is_larger():
    h100 = "NVIDIA H100 80GB HBM3"
    small = kw8.floor_us("triton-gemv", 1, 4096, 4096, 3000.0, h100)
    assert abs(small - (4096 * 4096 + 4096 + 2 * 4096) / 3e12 * 1e6) < 1e-6  # bytes-bound
    assert kw8.floor_us("cublas-bf16", 1, 4096, 4096, 3000.0, h100) > 1.9 * small
    big = kw8.floor_us("triton-w8a8", 8192, 4096, 4096, 3000.0, h100)
    assert abs(big - 2 * 8192 * 4096 * 4096 / (1979e6)) < 1e-6  # FLOP-bound
    assert kw8.floor_us("lqe-w8a8-layer", 1, 4096, 4096, 3000.0, h100) > small
