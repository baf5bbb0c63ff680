"""Triton paged attention of one mixed step, the old prefill grid against the tile map, in the same run.

The step (defaults: the Llama-3-8B shape, 32 query / 8 KV heads, head dim 128, bf16): ``--decodes`` decode rows over
``--decode-ctx`` cached tokens each and one ``--prefill-len``-token chunked prefill after ``--prefill-ctx`` cached
ones. Variants of ``lqe.kernels.triton_attention.paged_attention`` (all compute the same thing):

* ``dense``: the old launch, grid ``(cdiv(max_query_len, BLOCK_M), num_seqs, num_heads)``, nearly all programs idle;
* ``tiles``: grid over the step's tile map, one query head per program;
* ``tiles_packed`` (the default launch): tile map, all query heads of a KV head per program.

Also timed: the decode rows alone and the prefill row alone (the tile-map launch), which bound what a mixed step
can cost. Each line prints the GPU time per call (back-to-back calls sharing one metadata object, as a step's layers
do), its ratio to ``dense``, the step's floor (attention FLOPs and K/V + Q/O bytes at the GPU's peak,
benchmarks/workload.PEAKS) beside it, and the host time of a call with a new metadata object (a step's first layer:
tile map built and copied). Writes ``--out`` (JSON).

    python benchmarks/prefill_attention.py --out benchmarks/results/prefill-attention.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_info  # noqa: E402
from workload import peaks_for  # noqa: E402

from lqe.forward_context import AttentionMetadata  # noqa: E402


def make_step(specs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, dtype, block_size: int, seed=0):
    """Query, a filled paged cache (blocks shuffled) and the metadata of ``(query_len, context_len)`` rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-(q + c) // block_size) for q, c in specs]
    perm = torch.randperm(sum(blocks), generator=g, device="cuda").int()
    width = max(blocks)
    tables = torch.zeros(len(specs), width, dtype=torch.int32, device="cuda")
    qsl, lens, at = [0], [], 0
    for i, ((q, c), n) in enumerate(zip(specs, blocks)):
        tables[i, :n] = perm[at:at + n]
        at += n
        qsl.append(qsl[-1] + q)
        lens.append(q + c)
    t = qsl[-1]
    query = torch.randn(t, heads, head_dim, generator=g, device="cuda").to(dtype)
    cache = torch.randn(2, sum(blocks), block_size, kv_heads, head_dim, generator=g, device="cuda").to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), block_tables=tables,
        max_query_len=max(q for q, _ in specs), max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        block_size=block_size)
    return query, cache, meta


def floor_s(specs, heads: int, kv_heads: int, head_dim: int, elem: int) -> dict:
    """Attention FLOPs (QK^T and PV, causal) and bytes (each sequence's K/V once per KV head, Q and O once)."""
    flops = sum(4 * heads * head_dim * sum(c + j + 1 for j in range(q)) for q, c in specs)
    bytes_ = sum(2 * kv_heads * head_dim * elem * (q + c) + 2 * heads * head_dim * elem * q for q, c in specs)
    peaks = peaks_for(torch.cuda.get_device_name(0))
    if peaks is None:
        return {"flops": flops, "bytes": bytes_, "floor_ms": None}
    return {"flops": flops, "bytes": bytes_, "floor_ms": 1e3 * max(flops / peaks[0], bytes_ / peaks[1])}


def gpu_ms(fn, iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time per call of ``iters`` back-to-back calls (the GPU's queue stays
    full, so this is kernel time while the host keeps ahead)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return sorted(times)[len(times) // 2]


def host_us(fn, iters: int) -> float:
    """Median host microseconds of one call (planning + launches), the GPU drained between calls."""
    import time

    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decodes", type=int, default=255)
    p.add_argument("--decode-ctx", type=int, default=1024)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--prefill-ctx", type=int, default=1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_attention.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from lqe.kernels import triton_attention as ta

    dtype, h, kvh, d = torch.bfloat16, args.heads, args.kv_heads, args.head_dim
    decodes = [(1, args.decode_ctx)] * args.decodes
    prefill = [(args.prefill_len, args.prefill_ctx)]
    mixed = decodes[:args.decodes // 2] + prefill + decodes[args.decodes // 2:]
    scale = d ** -0.5
    rows, ref_out = [], None
    for step, specs in (("mixed", mixed), ("decode_only", decodes), ("prefill_only", prefill)):
        query, cache, meta = make_step(specs, h, kvh, d, dtype, args.block_size)
        out = torch.empty_like(query)
        fl = floor_s(specs, h, kvh, d, 2)
        variants = {"dense": dict(prefill_grid="dense", pack_gqa=False), "tiles": dict(pack_gqa=False),
                    "tiles_packed": {}} if step == "mixed" else {"tiles_packed": {}}
        for name, kw in variants.items():
            def same_step(kw=kw):  # one metadata object: the tile map is built once, as by a step's later layers
                ta.paged_attention(query, cache, meta, scale, out=out, **kw)

            def new_step(kw=kw):  # a fresh metadata object: the host build and copy of a step's first layer
                ta.paged_attention(query, cache, dataclasses.replace(meta), scale, out=out, **kw)
            ms = gpu_ms(same_step, args.iters)
            us = host_us(new_step, args.iters)
            if step == "mixed":
                if ref_out is None:
                    ref_out = out.clone()
                elif (out.float() - ref_out.float()).abs().max().item() > 4e-2:
                    raise SystemExit(f"{name} differs from dense on the mixed step")
            rows.append({"step": step, "variant": name, "ms": round(ms, 4), "host_us_first_layer": round(us, 1),
                         **fl, "floor_ms": None if fl["floor_ms"] is None else round(fl["floor_ms"], 4)})
    base = next(r["ms"] for r in rows if r["step"] == "mixed" and r["variant"] == "dense")
    for r in rows:
        r["ratio_vs_dense"] = round(r["ms"] / base, 3)
        r["vs_floor"] = None if not r["floor_ms"] else round(r["ms"] / r["floor_ms"], 2)
        print(f"{r['step']:>13} {r['variant']:>13}  {r['ms']:8.3f} ms  x{r['ratio_vs_dense']:.3f} of dense  "
              f"floor {r['floor_ms']} ms ({r['vs_floor']}x)  host {r['host_us_first_layer']} us")
    result = {"env": env_info(), "config": vars(args), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
