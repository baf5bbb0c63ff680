"""The 256-request throughput workload (issue 26, nano-vllm's protocol) and its roofline floor.

* :func:`workload_256`: ``n`` requests (256), input and output lengths each uniform in ``[100, 1024]``, random
  token ids, ``ignore_eos`` so every request generates exactly its output length; ``seed`` 0. Deterministic: the
  same arguments give the same requests on any machine (Python's ``random``, no torch).
* :func:`workload_id`: a digest of the requests, recorded beside each throughput figure (benchmarks/compare_e2e.py
  compares throughput only between runs of the same requests).
* :func:`workload_floor`: the least time the workload can take on a GPU of given peak FLOP/s and memory
  bandwidth: ``max(FLOPs / peak_flops, bytes / peak_bw)`` where FLOPs are the matmuls (2 x matmul parameters per
  token, prompt and output tokens) plus attention (4 x layers x query width x context per token), and bytes are
  the weights read once per decode step (at least ``max(output_len)`` steps: every request decodes one token
  per step) plus every decoded token's read of its KV context.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

# dense bf16 tensor-core FLOP/s and HBM bytes/s (spec sheets) by a substring of torch.cuda.get_device_name()
PEAKS = {"H100 80GB HBM3": (989e12, 3.35e12), "H100 PCIe": (756e12, 2.0e12), "H200": (989e12, 4.8e12),
         "A100": (312e12, 2.0e12)}


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


def workload_256(vocab: int, n: int = 256, lo: int = 100, hi: int = 1024, seed: int = 0) -> list[Request]:
    """``n`` requests with input and output lengths uniform in ``[lo, hi]`` and token ids in ``[2, vocab)``."""
    if n < 1 or lo < 1 or hi < lo or vocab < 3:
        raise ValueError(f"workload_256 needs n >= 1, 1 <= lo <= hi and vocab >= 3 (got n={n}, lo={lo}, hi={hi}, "
                         f"vocab={vocab})")
    rng = random.Random(seed)
    in_lens = [rng.randint(lo, hi) for _ in range(n)]
    out_lens = [rng.randint(lo, hi) for _ in range(n)]
    return [Request([rng.randrange(2, vocab) for _ in range(k)], o) for k, o in zip(in_lens, out_lens)]


def workload_id(reqs: list[Request]) -> str:
    """A digest of the requests (every prompt's token ids and every output length, in order): two runs with the same
    id ran the same requests, whatever code drew them."""
    h = hashlib.sha256()
    for r in reqs:
        h.update(f"{r.output_len}:{','.join(map(str, r.prompt))};".encode())
    return f"sha256:{h.hexdigest()[:16]}"


def peaks_for(gpu_name: str) -> tuple[float, float] | None:
    for key, val in PEAKS.items():
        if key in gpu_name:
            return val
    return None


def workload_floor(reqs: list[Request], *, matmul_params: int, weight_bytes: int, layers: int, q_width: int,
                   kv_bytes_per_token: int, peak_flops: float, peak_bw: float) -> dict:
    """The workload's FLOPs, bytes and floor seconds. ``matmul_params``: parameters multiplied per token
    (embedding gather excluded, LM head included); ``q_width``: heads x head_dim; ``kv_bytes_per_token``: K and
    V of one token over all layers, in cache bytes."""
    tokens = sum(len(r.prompt) + r.output_len for r in reqs)
    # context of each position p (0-based) is p + 1 tokens; sum over the whole sequence of prompt + output
    ctx = sum((len(r.prompt) + r.output_len) * (len(r.prompt) + r.output_len + 1) // 2 for r in reqs)
    flops = 2 * matmul_params * tokens + 4 * layers * q_width * ctx
    decode_ctx = sum(sum(range(len(r.prompt), len(r.prompt) + r.output_len)) for r in reqs)
    steps = max(r.output_len for r in reqs)
    nbytes = weight_bytes * steps + kv_bytes_per_token * decode_ctx
    return {"flops": flops, "bytes": nbytes, "min_decode_steps": steps,
            "floor_s": max(flops / peak_flops, nbytes / peak_bw),
            "floor_bound": "compute" if flops / peak_flops >= nbytes / peak_bw else "memory"}


def kernel_breakdown(events: list[tuple[str, int, int]], top: int = 12, width: int = 90) -> list[list]:
    """The ``top`` kernels (or copies) by total device time: ``[name, calls, ms, share of the summed time]`` for
    ``events`` ``(name, start_ns, end_ns)``, the longest first; names cut to ``width`` characters (templated CUDA
    names run to hundreds). What a step's GPU time goes to: attention, the GEMMs of each format, norms, copies."""
    total: dict[str, list] = {}
    for name, start, end in events:
        t = total.setdefault(name[:width], [0, 0])
        t[0] += 1
        t[1] += end - start
    summed = sum(ns for _, ns in total.values()) or 1
    rows = sorted(total.items(), key=lambda kv: -kv[1][1])[:top]
    return [[name, calls, round(ns / 1e6, 3), round(ns / summed, 3)] for name, (calls, ns) in rows]


def busy_union(intervals: list[tuple[int, int]]) -> tuple[int, int]:
    """``(busy, span)`` of GPU activity intervals ``(start, end)`` (any unit): ``busy`` the length of their union
    (overlapping kernels, e.g. on two streams, count once), ``span`` from the first start to the last end."""
    busy, span_start, span_end, cur_start, cur_end = 0, None, None, None, None
    for start, end in sorted(intervals):
        span_start = start if span_start is None else span_start
        span_end = end if span_end is None else max(span_end, end)
        if cur_end is None or start > cur_end:
            busy += 0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += 0 if cur_end is None else cur_end - cur_start
    return busy, (0 if span_start is None else span_end - span_start)
