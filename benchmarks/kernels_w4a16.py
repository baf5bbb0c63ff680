"""W4A16 rows of benchmarks/kernels.py (issue 24): lqe-w4a16-mma (csrc/gemm/w4a16_mma.cu) and its dequantize +
cuBLAS beside the layer path ``lqe-w4a16`` (today's dispatch.WNA16_TABLE), torch int4pack, triton-wna16, the
CUDA dequantize + cuBLAS and cuBLAS bf16, on the Llama-3-8B shapes, g128 weights rotated past the L2. Every row
carries its bytes floor (d2d copy bandwidth); the run prints the geo-mean speed-up over cuBLAS bf16 per M and
the ``WNA16_MMA_TABLE`` and ``WNA16_TABLE`` its measurement implies (paste into lqe/kernels/dispatch.py with the
JSON's name).

    python benchmarks/kernels.py --w4a16 [--m 1 16 256] [--shapes 4096x4096] [--out results.json]
"""
from __future__ import annotations

import math

import torch

from kernels_w8a8 import WNA16_MMA_KERNEL_ROWS
from lqe.kernels.device_info import pdl_supported

# the mma layout's rows, as the table it implies reads them (lqe-w4a16-mma-k2: the mma GEMM with 8 warps per block
# splitting each k-tile, gemm_mma.MMA_K2_KERNEL)
MMA_ROWS = WNA16_MMA_KERNEL_ROWS
# The CUDA GEMV rows are timed at M <= 16 only, each without PDL unless its name ends in -pdl (whatever LQE_PDL says):
# its default split-K ("lqe-w4a16-fused") and fewer / more split-K blocks (-t2 / -t8),
FUSED_ROW = "lqe-w4a16-fused"
FUSED_SPLIT_ROWS = {"lqe-w4a16-fused-t2": 2, "lqe-w4a16-fused-t8": 8}
FUSED_RING_ROW = "lqe-w4a16-fused-ring"  # its cp.async ring (lqe-wna16-ring)
# and the default / ring with programmatic dependent launch (sm_90+): back-to-back calls in the timed graph, each
# requesting its first weight batches while the call before it finishes (a model's default on sm_90+)
FUSED_PDL_ROWS = {"lqe-w4a16-fused-pdl": "fused", "lqe-w4a16-fused-ring-pdl": "ring"}
SMALL_M_ROWS = (FUSED_ROW, *FUSED_SPLIT_ROWS, FUSED_RING_ROW, *FUSED_PDL_ROWS)
# not a table name: gemm_mma.mma_gemm's sms (stripes) at 2 x the SM count. Two blocks share an SM only where their
# shared memory fits: the 8-stage M <= 16 kernel takes 88 KB (two fit an H100 / H200's 227 KB, not an A100's 164)
MMA_2CTA_ROW = "lqe-w4a16-mma-2cta"


def _canonical(k: int, n: int, dev: str):
    from kernels import random_w4

    return random_w4(k, n, dev, fp16_scales=True)


def add_mma_rows(out: dict, k: int, n: int, rotating, cycler, dev: str = "cuda") -> None:
    """``lqe-w4a16-mma`` and ``lqe-w4a16-mma-dequant+cublas`` on their own (mma-layout) packed weights, repacked
    explicitly (``repack_mma``), whatever dispatch.WNA16_TABLE names."""
    import lqe.kernels as lk
    from lqe.kernels import gemm_mma, repack_mma

    if not lk.available():
        return

    def make():
        p = repack_mma.repack_mma(_canonical(k, n, dev), torch.bfloat16)
        gemm_mma.reserve_workspace(dev, p.n_pad)
        return p

    wbytes = k * n // 2 + (k // 128) * n * 2
    pm = rotating(make, wbytes)
    for name in MMA_ROWS:
        out[name] = ((lambda name: lambda x: (lambda p=cycler(pm): lambda: lk.wna16_gemm(x, p(), path=name))())(name),
                     wbytes)
    # the same GEMM striped over two blocks per SM (twice the warps and the bytes in flight per SM; 2 x 57 KB of
    # shared memory at M <= 16): the candidate for the default stripe count
    sms2 = 2 * gemm_mma.sm_count(torch.device(dev))
    out[MMA_2CTA_ROW] = ((lambda x: (lambda p=cycler(pm): lambda: lk.wna16_gemm(
        x, p(), path="lqe-w4a16-mma", splits=sms2))()), wbytes)


def w4a16_candidates(k: int, n: int, rotating, cycler, dev: str = "cuda") -> dict:
    """Only the W4A16 comparison set: ``name -> (setup(x) -> fn, weight_bytes)``. Every row times what its name says
    whatever dispatch.WNA16_TABLE names: ``lqe-w4a16`` (the layer path) on what ``select_w4a16_kernel`` gives a layer,
    ``lqe-w4a16-dequant`` and ``triton-wna16`` on an explicit ``repack_wna16`` (the table naming lqe-w4a16-mma makes
    the selected weights mma-layout, which those paths cannot read), the mma rows on an explicit ``repack_mma``."""
    import lqe.kernels as lk
    from kernels import add_int4pack_row, add_wna16_candidates

    out = {}
    wb16 = k * n * 2
    ws = rotating(lambda: torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.02, wb16)
    out["cublas-bf16"] = (lambda x: (lambda w=cycler(ws): lambda: torch.matmul(x, w()))(), wb16)
    if lk.available():
        w4bytes = k * n // 2 + (k // 128) * n * 2
        layer = rotating(lambda: lk.select_w4a16_kernel(_canonical(k, n, dev), dev, torch.bfloat16)[0].packed,
                         w4bytes)
        p4 = rotating(lambda: lk.repack_wna16(_canonical(k, n, dev), torch.bfloat16), w4bytes)
        for name, path, packed in [("lqe-w4a16", "auto", layer), ("lqe-w4a16-dequant", "dequant", p4)]:
            out[name] = ((lambda path, packed: lambda x: (lambda p=cycler(packed): lambda: lk.wna16_gemm(
                x, p(), path=path))())(path, packed), w4bytes)
        add_wna16_candidates(out, k, n, p4, w4bytes, dev)
        # the CUDA GEMV (the layer path at M <= 4) with fewer / more split-K blocks than its default target of
        # gemm.TARGET_BLOCKS_PER_SM = 4 per SM: longer weight streams per warp against more blocks in flight
        from lqe.kernels import gemm_mma

        sms = gemm_mma.sm_count(torch.device(dev))
        gemv = [(FUSED_ROW, "fused", None, False), (FUSED_RING_ROW, "ring", None, False)]
        gemv += [(name, "fused", max(1, sms * per_sm // max(1, -(-n // 256))), False)
                 for name, per_sm in FUSED_SPLIT_ROWS.items()]
        if pdl_supported(torch.device(dev)):
            gemv += [(name, path, None, True) for name, path in FUSED_PDL_ROWS.items()]
        for name, path, splits, pdl in gemv:
            out[name] = ((lambda path, splits, pdl: lambda x: (lambda p=cycler(p4): lambda: lk.wna16_gemm(
                x, p(), path=path, splits=splits, pdl=pdl))())(path, splits, pdl), w4bytes)
        out.pop("triton-dequant-only", None)
        add_mma_rows(out, k, n, rotating, cycler, dev)
    else:
        print(f"# lqe kernels unavailable: {lk.unavailable_reason()}")
    add_int4pack_row(out, k, n, dev)
    return out


def w4a16_sweep(shapes: list[str], ms: list[int], copy_gbps: float, bench, rotating, cycler, floor_us,
                gpu: str, on_shape=None, rows: list[dict] | None = None, skip=frozenset(), done=frozenset(),
                on_fault=None) -> list[dict]:
    """The sweep's rows, appended to ``rows`` (a run resumed after a device fault passes the rows it kept, the
    kernels it leaves out in ``skip`` and the ``(shape, M)`` pairs already measured in ``done``). A kernel that loses
    the CUDA context raises :class:`common.DeviceFault` with the rows to keep (all but the faulted pair's); one that
    does not return hands that fault to ``on_fault`` from a watchdog (:func:`common.hang_guard`). ``on_shape(rows,
    tables)`` is called after every shape and once at the end with :func:`implied_w4a16_tables` (the tables implied
    by the shapes measured so far; benchmarks/kernels.py saves them under the JSON's ``implied_tables``)."""
    from common import bench_row

    rows = [] if rows is None else rows
    by_m: dict[int, dict[str, list[float]]] = {}
    for r in rows:  # resumed: the geo-means count the rows measured before the fault
        if r.get("speedup_vs_cublas") and r.get("shape") in shapes:
            by_m.setdefault(r["m"], {}).setdefault(r["kernel"], []).append(r["speedup_vs_cublas"])
    for i, shape in enumerate(shapes):
        if all((shape, m) in done for m in ms):
            continue
        k, n = map(int, shape.split("x"))
        cands = {name: c for name, c in w4a16_candidates(k, n, rotating, cycler).items() if name not in skip}
        print(f"# W4A16 {shape}")
        print(f"{'kernel':30s} {'M':>5s} {'us':>9s} {'floor us':>9s} {'GB/s':>7s} {'vs cuBLAS':>9s}")
        for m in ms:
            if (shape, m) in done:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = None
            for name, (setup, wbytes) in cands.items():
                if name in SMALL_M_ROWS and m > 16:
                    continue
                us = bench_row(bench, lambda: setup(x), f"{name} {shape} M={m}", rows, on_fault, kernel=name,
                               shape=shape, m=m)
                if us is None:
                    continue
                if name == "cublas-bf16":
                    base = us
                fl = floor_us(name, m, n, k, copy_gbps, gpu)
                sp = round(base / us, 3) if base else None
                gbps = (wbytes + m * k * 2 + m * n * 2) / (us * 1e-6) / 1e9
                rows.append({"kernel": name, "shape": shape, "m": m, "us": round(us, 2), "floor_us": round(fl, 2),
                             "gbps": round(gbps, 1), "speedup_vs_cublas": sp})
                if sp:
                    by_m.setdefault(m, {}).setdefault(name, []).append(sp)
                print(f"{name:30s} {m:5d} {us:9.2f} {fl:9.2f} {gbps:7.0f} {sp if sp else '':>9}")
        if on_shape:  # the caller saves what is measured so far, with the tables it implies so far
            on_shape(rows, implied_w4a16_tables(rows) if by_m else None)
    print("# W4A16: geometric-mean speed-up over cuBLAS bf16 across shapes")
    for m, d in sorted(by_m.items()):
        gm = sorted(((math.exp(sum(map(math.log, v)) / len(v)), nm) for nm, v in d.items() if len(v) == len(shapes)),
                    reverse=True)
        print(f"#   M={m:5d}: " + ", ".join(f"{nm} {g:.2f}x" for g, nm in gm))
    tables = implied_w4a16_tables(rows)
    for label, table in tables.items():
        print(f"# implied dispatch.{label} ({gpu}): {table}")
    if on_shape:  # the tables go into the JSON's implied_tables, beside the other implied tables (not as rows:
        on_shape(rows, tables)  # every row has a kernel, shape and M)
    return rows


def implied_w4a16_tables(rows: list[dict]) -> dict:
    """The table per weight layout the rows imply (kernels_w8a8.implied_tables): ``WNA16_MMA_TABLE`` (the mma GEMM
    or its dequantize + cuBLAS) and ``WNA16_TABLE`` (the CUDA GEMV with or without PDL, the Triton GEMMs, dequantize +
    cuBLAS), each where its kernels were timed."""
    from kernels_w8a8 import implied_tables

    tables = implied_tables(rows)
    return {label: tables[label] for label in ("WNA16_MMA_TABLE", "WNA16_TABLE") if label in tables}
