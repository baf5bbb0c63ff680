"""GEMM kernel benchmark on Llama-3-8B layer shapes: lqe W4A16 / W8A8 / FP8 against cuBLAS bf16,
torch._weight_int4pack_mm, torch._int_mm and torch._scaled_mm, with device-to-device copy bandwidth as the
memory roofline. Weights are rotated over enough copies to exceed the L2 cache. Two more columns show what a
model pays per layer with the op producing its input (RMSNorm for qkv / gate_up, SiLU-mul for down_proj; none for
o_proj, whose input is the attention output: :func:`producer_of`): cuBLAS bf16 after the float op, W8A8 after the
float op and a separate per-token quantization, and W8A8 after the op fused with the quantization
(lqe/kernels/fused_quant.py). The W8A8 / FP8 GEMV, fp8 GEMM and layer rows (lqe-w8a8-layer, lqe-fp8-layer: producer
fused with the quantization + GEMM, against producer + cuBLAS bf16; for o_proj the standalone quantizer + GEMM against
cuBLAS bf16 alone) come from benchmarks/kernels_w8a8.py; every row carries its byte / FLOP floor and the run prints the
W8A8 / FP8 tables it implies after every shape (and saves them in the JSON).

    python benchmarks/kernels.py [--m 1 16 128] [--shapes 4096x4096] [--rows w8a8,fp8] [--out results.json]
    python benchmarks/kernels.py --w8a8-sweep | --fp8-sweep | --wna16-sweep | --w4a16 [--m ...] [--shapes ...]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DeviceFault, bench_row, commit, raise_if_context_lost, restart  # noqa: E402

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # K x N: qkv, o, gate_up, down
# --rows groups: which rows each times (cublas-bf16, the baseline, always runs)
ROW_GROUPS = {
    "w4a16": ("lqe-w4a16", "lqe-w4a16-fused", "lqe-w4a16-dequant", "triton-wna16", "triton-wna16-swap",
              "triton-dequant+cublas", "triton-dequant-l2+cublas",
              "triton-dequant-only", "torch-int4pack", "lqe-w4a16-mma", "lqe-w4a16-mma-dequant+cublas",
              "lqe-w4a16-mma-2cta", "lqe-w4a16-mma-k2"),
    "w8a8": ("lqe-w8a8", "torch-int-mm", "triton-w8a8", "int-mm+epilogue", "w8a8-table+quant", "triton-gemv",
             "lqe-w8a8-layer"),
    "fp8": ("triton-gemv-fp8", "triton-fp8", "lqe-fp8-layer", "lqe-fp8-block-layer", "lqe-fp8/torch-scaled-mm"),
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024]
L2_BYTES = 50 * 2**20
ROTATE_BYTES = 4 * L2_BYTES


# Rows are timed as CUDA-graph replays of back-to-back calls (triton.testing.do_bench_cudagraph): the GPU time a
# step pays, since decode runs captured (and mixed steps in piecewise graphs). LQE_BENCH_TIMING=eager times Python
# calls instead (triton.testing.do_bench), where a small-M kernel shorter than its launch measures the host: the H200
# gate at 3382fc4 (eager) had cuBLAS bf16 4096x4096 M=1 at 18.4 us, graph-timed 13.1 us, and the lqe Triton rows
# 2-6x slower than their graph times. The H100 rows of f1c96af were timed eagerly. A row whose calls cannot be
# captured (a host sync) is timed eagerly and counted in GRAPH_FALLBACKS (saved as graph_fallbacks).
TIMING = os.environ.get("LQE_BENCH_TIMING", "graph")
GRAPH_FALLBACKS: dict[str, int] = {}


def bench(fn, reps: int = 100) -> float:
    """Median microseconds of ``fn()``: CUDA-graph replays (``LQE_BENCH_TIMING=graph``, the default), else eager
    calls on CUDA events (:func:`bench_eager`)."""
    if TIMING not in ("eager", "graph"):
        raise SystemExit(f"LQE_BENCH_TIMING={TIMING!r}: use 'eager' or 'graph'")
    try:
        from triton.testing import do_bench_cudagraph
    except ImportError:
        do_bench_cudagraph = None
    if TIMING == "graph" and do_bench_cudagraph is not None:
        try:
            return do_bench_cudagraph(fn, rep=max(10, reps // 4), return_mode="median") * 1e3
        except RuntimeError as e:
            torch.cuda.synchronize()
            fn()  # a call that fails by itself fails its row here; one that only cannot be captured is timed eagerly
            why = str(e).splitlines()[0][:80]
            GRAPH_FALLBACKS[why] = GRAPH_FALLBACKS.get(why, 0) + 1
    return bench_eager(fn, reps)


def bench_eager(fn, reps: int = 100) -> float:
    """Median microseconds of eager ``fn()`` calls on CUDA events (triton.testing.do_bench when importable)."""
    try:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=reps, return_mode="median") * 1e3
    except ImportError:
        pass
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def rotating(make, nbytes: int) -> list:
    """Enough independent copies of a weight that cycling through them spills the L2."""
    return [make() for _ in range(max(2, min(32, math.ceil(ROTATE_BYTES / max(nbytes, 1)))))]


def cycler(items):
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]

    return nxt


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (read + write), always timed eagerly: a 1 GiB copy is long enough that the host
    does not count, and do_bench_cudagraph's estimate gave 2765 GB/s on the H200 where do_bench gave 4253."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = bench_eager(lambda: dst.copy_(src), reps=50)
    return 2 * src.numel() / (us * 1e-6) / 1e9  # read + write


def random_w4(k: int, n: int, dev: str = "cuda", fp16_scales: bool = False):
    """A random 4-bit g128 symmetric ``CanonicalWeight [k, n]`` (``fp16_scales``: scales rounded to fp16 values)."""
    from lqe.kernels.canonical import CanonicalWeight

    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8, device=dev)
    scales = torch.rand(k // 128, n, device=dev) * 0.01 + 1e-3
    return CanonicalWeight(codes, scales.half().float() if fp16_scales else scales, None, None, 4, 128)


def add_int4pack_row(out: dict, k: int, n: int, dev: str = "cuda") -> None:
    """``torch-int4pack`` (torch's int4 kernel, tinygemm) on g128 weights; skipped with a note where this torch's
    API refuses it (it differs between torch versions)."""
    try:
        def make_i4():
            wi = torch.randint(0, 16, (n, k), dtype=torch.int32, device=dev)
            packed = torch._convert_weight_to_int4pack((wi[:, ::2] << 4 | wi[:, 1::2]).to(torch.uint8), 8)
            sz = torch.stack([torch.rand(k // 128, n, device=dev), torch.zeros(k // 128, n, device=dev)], -1)
            return packed, sz.to(torch.bfloat16).contiguous()
        i4 = rotating(make_i4, k * n // 2)
        torch._weight_int4pack_mm(torch.randn(1, k, device=dev, dtype=torch.bfloat16), *i4[0][:1], 128, i4[0][1])
        out["torch-int4pack"] = (lambda x: (lambda c=cycler(i4): lambda: (lambda t: torch._weight_int4pack_mm(x, t[0], 128, t[1]))(c()))(), k * n // 2)
    except Exception as e:  # noqa: BLE001
        print(f"# torch-int4pack skipped: {type(e).__name__}: {str(e)[:120]}")


def row_group(name: str) -> str | None:
    """The --rows group of row ``name`` (None: the cuBLAS baseline, or unknown)."""
    return next((g for g, names in ROW_GROUPS.items() if name in names), None)


RESULTS = Path(__file__).resolve().parent / "results"


def carried_doc(path: Path, gpu: str) -> tuple[list[dict], dict, str | None]:
    """What a ``--rows`` run keeps beside its own rows: ``(rows, implied_tables, source)`` of the earlier run in
    ``path``, or, when ``path`` does not exist (a device run writing to an empty $OUT), of the committed file of the
    same name in benchmarks/results, so the file it writes can replace that one without losing its other rows (as
    e2e_gpu.merge_base does for the e2e rows). Only a file of the same GPU counts; rows are marked ``carried_over``
    (with that run's commit); ``source`` is the file they came from (None: nothing carried)."""
    src = path if path.exists() else RESULTS / path.name
    try:
        old = json.loads(src.read_text())
    except (OSError, ValueError):
        return [], {}, None
    if not isinstance(old, dict) or old.get("device") != gpu:
        return [], {}, None
    commit = old.get("commit") or (old.get("env") or {}).get("lqe_commit")
    rows = [{**r, "carried_over": r.get("carried_over", commit or True)} for r in old.get("rows", [])
            if isinstance(r, dict) and {"kernel", "shape", "m"} <= r.keys()]
    tables = old.get("implied_tables") if isinstance(old.get("implied_tables"), dict) else {}
    try:
        where = str(src.resolve().relative_to(RESULTS.parent.parent))
    except ValueError:
        where = str(src)
    return rows, dict(tables), where


def carried_rows(path: Path, gpu: str) -> list[dict]:
    """The rows of an earlier run in ``path`` (or its committed namesake in benchmarks/results when ``path`` does not
    exist: :func:`carried_doc`) on the same GPU, marked ``carried_over`` (with that run's commit), for a ``--rows`` run
    to keep beside its own: the W8A8 stage re-times its groups without erasing the W4A16 rows the gate wrote into the
    same kernels-<gpu>.json. Each row's ratio is from its own run."""
    return carried_doc(path, gpu)[0]


def parse_rows(spec: str | None) -> frozenset[str]:
    """``--rows w8a8,fp8`` -> the groups (all of :data:`ROW_GROUPS` when not given); unknown names are an error."""
    if not spec:
        return frozenset(ROW_GROUPS)
    groups = frozenset(g.strip() for g in spec.split(",") if g.strip())
    bad = sorted(groups - set(ROW_GROUPS))
    if bad:
        raise SystemExit(f"--rows: unknown group(s) {', '.join(bad)} (known: {', '.join(ROW_GROUPS)})")
    return groups


def add_w4a16_rows(out: dict, k: int, n: int, dev: str = "cuda") -> None:
    """The W4A16 rows on weights in the layout each row's name says, whatever dispatch.WNA16_TABLE names:
    ``lqe-w4a16`` on what :func:`select_w4a16_kernel` gives a layer (the layer path: the mma layout once the table
    names lqe-w4a16-mma), ``lqe-w4a16-fused`` / ``-dequant`` and the Triton rows on an explicit
    :func:`repack_wna16`, the ``lqe-w4a16-mma*`` rows on an explicit ``repack_mma``."""
    import lqe.kernels as lk

    w4bytes = k * n // 2 + (k // 128) * n * 2
    layer = rotating(lambda: lk.select_w4a16_kernel(random_w4(k, n, dev), dev, torch.bfloat16)[0].packed, w4bytes)
    p4 = rotating(lambda: lk.repack_wna16(random_w4(k, n, dev), torch.bfloat16), w4bytes)
    for name, path, packed in [("lqe-w4a16", "auto", layer), ("lqe-w4a16-fused", "fused", p4),
                               ("lqe-w4a16-dequant", "dequant", p4)]:
        pdl = False if path == "fused" else None  # (the GEMV alone; its -pdl twin is in kernels_w4a16)
        out[name] = ((lambda path, packed, pdl: lambda x: (lambda p=cycler(packed): lambda: lk.wna16_gemm(
            x, p(), path=path, pdl=pdl))())(path, packed, pdl), w4bytes)
    add_wna16_candidates(out, k, n, p4, w4bytes, dev)
    from kernels_w4a16 import add_mma_rows  # lqe-w4a16-mma candidate rows (issue 24)

    add_mma_rows(out, k, n, rotating, cycler, dev)


def candidates(k: int, n: int, groups: frozenset[str] = frozenset(ROW_GROUPS)):
    """``name -> (setup(x) -> fn, weight_bytes[, {column: setup(x) -> fn}])`` for every kernel of the ``groups``
    (:data:`ROW_GROUPS`) that can run here, plus skip notes; the optional third element times the model columns
    (:func:`add_model_columns`)."""
    import lqe.kernels as lk
    from lqe.kernels import w8a8

    dev, out = "cuda", {}
    wbytes_bf16 = k * n * 2
    ws = rotating(lambda: torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.02, wbytes_bf16)
    out["cublas-bf16"] = (lambda x: (lambda w=cycler(ws): lambda: torch.matmul(x, w()))(), wbytes_bf16)

    if "w4a16" in groups:
        if lk.available():
            add_w4a16_rows(out, k, n, dev)
        else:
            print(f"# lqe kernels unavailable: {lk.unavailable_reason()}")
        add_int4pack_row(out, k, n, dev)

    plans = wi8 = None
    if "w8a8" in groups:
        if lk.available():
            def make_w8():
                wq = torch.randint(-127, 128, (k, n), dtype=torch.int8, device=dev)
                return lk.repack_w8a8(wq, torch.rand(n, device=dev) * 0.01)
            p8 = rotating(make_w8, k * n)

            def setup_w8a8(x):
                q, s, _ = w8a8.quantize_per_token(x)
                p = cycler(p8)
                return lambda: w8a8.w8a8_gemm(q, s, p(), out_dtype=torch.bfloat16)
            out["lqe-w8a8"] = (setup_w8a8, k * n)
        wi8 = rotating(lambda: torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev).t(), k * n)
        out["torch-int-mm"] = (lambda x: (lambda xq=torch.randint(-127, 128, x.shape, dtype=torch.int8, device=dev),
                                                 c=cycler(wi8): lambda: torch._int_mm(xq, c()))(), k * n)
        plans = add_w8a8_candidates(out, k, n, wi8)
    if groups & {"w8a8", "fp8"}:
        add_model_columns(out, k, n, ws, plans)
        from kernels_w8a8 import add_w8a8_fp8_rows  # W8A8 / FP8 GEMV, fp8 GEMM and layer rows (issue 25)

        add_w8a8_fp8_rows(out, k, n, rotating, cycler, producer_of(k, n), plans, wi8, groups)
    if "fp8" in groups and w8a8.fp8_supported() is None:
        f8 = rotating(lambda: w8a8.fp8_quantize_weight(torch.randn(k, n, device=dev) * 0.02), k * n)

        def setup_fp8(x):
            xq, xs = w8a8.fp8_quantize_per_token(x)
            c = cycler(f8)
            return lambda: w8a8.fp8_gemm(xq, xs, *c())
        out["lqe-fp8/torch-scaled-mm"] = (setup_fp8, k * n)
    return {name: v for name, v in out.items() if name == "cublas-bf16" or row_group(name) in groups}


def add_wna16_candidates(out: dict, k: int, n: int, p4: list, w4bytes: int, dev: str = "cuda") -> None:
    """Triton W4A16 rows on the wna16-layout packed weights ``p4`` (lqe/kernels/triton_wna16.py; build them with
    :func:`repack_wna16`): the GEMM with its table config, the swapped-operand GEMM with its own table
    (``triton-wna16-swap``: the weights are wgmma's register operand on Hopper), dequantize + cuBLAS (whole, and in
    L2-sized column chunks), and the dequantize kernel alone (bytes: packed read + bf16 write)."""
    import lqe.kernels as lk
    from lqe.kernels import triton_wna16 as tw

    if tw.unavailable_reason(dev) is not None:
        print(f"# triton-wna16 skipped: {tw.unavailable_reason(dev)}")
        return
    for name in ("triton-wna16", "triton-wna16-swap", "triton-dequant+cublas",  # (swap: its SWAP_CONFIG_TABLE)
                 "triton-dequant-l2+cublas"):  # (l2: column chunks that fit in L2, triton_wna16.l2_chunk_cols)
        out[name] = ((lambda path: lambda x: (lambda p=cycler(p4): lambda: lk.wna16_gemm(x, p(), path=path))())(name),
                     w4bytes)
    wbuf = torch.empty(k, n, device=dev, dtype=torch.bfloat16)
    out["triton-dequant-only"] = ((lambda x: (lambda p=cycler(p4): lambda: tw.dequantize(p(), wbuf))()),
                                  w4bytes + k * n * 2)


def wna16_sweep(shapes: list[str], ms: list[int], on_shape=None) -> list[dict]:
    """Time every candidate config of lqe/kernels/triton_wna16.py (sweep_configs) per shape and M, beside cuBLAS
    bf16, the CUDA GEMM, Triton dequantize + cuBLAS and the current table, all in this run; print the best per M,
    the geometric mean over shapes and the bytes floor (packed weights + scales + x + y at d2d copy speed)."""
    import lqe.kernels as lk
    from lqe.kernels import triton_wna16 as tw

    copy_gbps = copy_bandwidth()
    rows, by_m = [], {}
    for shape in shapes:
        k, n = map(int, shape.split("x"))
        wb = rotating(lambda: torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02, k * n * 2)

        def make_w4():  # the wna16 layout these paths read, whatever WNA16_TABLE names
            return lk.repack_wna16(random_w4(k, n), torch.bfloat16)
        p4 = rotating(make_w4, k * n // 2)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            floor_us = tw.flops_bytes(m, n, k, 4, 128, False)[1] / (copy_gbps * 1e3)
            base = bench((lambda c=cycler(wb): lambda: torch.matmul(x, c()))())
            timed = {}
            paths = [("table", "auto"), ("triton-dequant+cublas", "triton-dequant+cublas")]
            if lk.available() and m <= 16:  # (the CUDA GEMV: the layer path at small M only)
                paths += [("lqe-wna16-fused", "fused")]
            for nm, path in paths:
                timed[nm] = bench((lambda c=cycler(p4), path=path: lambda: lk.wna16_gemm(x, c(), out=o, path=path))())
            for cfg in tw.sweep_configs(m):
                try:
                    timed[f"triton-wna16:{cfg.label()}"] = bench((lambda c=cycler(p4), cfg=cfg: lambda: lk.wna16_gemm(
                        x, c(), out=o, path="triton-wna16", config=cfg))(), reps=30)
                except Exception as e:  # noqa: BLE001 -- a config that does not compile / fit is skipped
                    raise_if_context_lost(f"triton-wna16:{cfg.label()} {shape} M={m}")
                    print(f"# {shape} M={m} {cfg.label()}: {type(e).__name__}: {str(e)[:100]}")
            record_sweep(rows, by_m, f"wna16 sweep {shape} M={m}: cublas-bf16 {base:.2f} us, bytes floor "
                         f"{floor_us:.2f} us", shape, m, base, timed, top=4, floor_us=floor_us)
        del wb, p4
        torch.cuda.empty_cache()
        if on_shape:
            on_shape(rows)
    print_geomeans("W4A16", by_m, len(shapes), top=4)
    return rows


def add_w8a8_candidates(out: dict, k: int, n: int, wi8: list) -> list | None:
    """W8A8 int8 rows on the checkpoint layout (int8 [N, K], the same rotating weights as torch-int-mm):
    triton-w8a8 (table config), int-mm+epilogue (cuBLASLt + Triton epilogue), and w8a8-table+quant: the per-token
    quantization plus the kernel W8A8_TABLE picks for M, i.e. what a model's layer pays. Returns the table's
    plans of the rotating weights (None when none)."""
    from lqe.kernels import w8a8

    try:
        from lqe.kernels import triton_w8a8 as tw
    except Exception as e:  # noqa: BLE001
        print(f"# triton-w8a8 skipped: {type(e).__name__}: {str(e)[:120]}")
        return None
    dev = "cuda"
    ws = torch.rand(n, device=dev) * 0.01
    tw.reserve_workspace(dev, tw.workspace_rows(), n)

    def setup(x, path="triton", cfg=None):
        q, s, _ = w8a8.quantize_per_token_any(x)
        c = cycler(wi8)
        o = torch.empty(x.shape[0], n, device=dev, dtype=torch.bfloat16)
        if path == "int-mm":
            return lambda: tw.int_mm_w8a8(q, s, c().t(), ws, out=o)
        return lambda: tw.w8a8_mm(q, s, c().t(), ws, out=o, config=cfg)

    out["triton-w8a8"] = (setup, k * n)
    out["int-mm+epilogue"] = ((lambda x: setup(x, "int-mm")), k * n)
    plans = [w8a8.plan_w8a8(w.t(), ws, torch.bfloat16, False)[0] for w in wi8]
    if plans[0] is None:
        return None
    out["w8a8-table+quant"] = ((lambda x: (lambda c=cycler(plans): lambda: w8a8.w8a8_apply(
        *w8a8.quantize_per_token_any(x)[:2], c(), out_dtype=torch.bfloat16))()), k * n)
    return plans


def producer_of(k: int, n: int) -> str | None:
    """The op that produces a ``K x N`` layer's input in a Llama block, the one a W8A8 / FP8 model fuses the
    quantization into (lqe/models/llama.py ``act_quant_pairs``): SiLU-mul for down_proj (K > N), RMSNorm for qkv and
    gate_up (K < N), none for o_proj (K == N: its input is the attention output, quantized by the layer itself)."""
    return "silu" if k > n else None if k == n else "rmsnorm"


def add_model_columns(out: dict, k: int, n: int, ws_bf16: list, plans: list | None) -> None:
    """Columns with what a model pays per layer, the op producing its input included (:func:`producer_of`):
    ``model_us`` on cublas-bf16 (producer + matmul: the baseline of the layer rows) and on w8a8-table+quant
    (producer, separate per-token quantization, table GEMM), and ``model_fused_us`` on w8a8-table+quant (the producer
    fused with the quantization, lqe/kernels/fused_quant.py, then the table GEMM). With no producer (o_proj) the
    model runs the matmul alone, or the standalone quantization + GEMM, and there is no fused column."""
    from lqe.kernels import fused_ops as fo
    from lqe.kernels import fused_quant as fq
    from lqe.kernels import w8a8

    if not fq.HAS_TRITON:
        return
    producer = producer_of(k, n)

    def ops(x):
        """(float producer, fused producer -> (q, scale) or None) on inputs shaped for ``x [M, K]``."""
        if producer is None:
            return (lambda: x), None
        if producer == "silu":
            a = torch.randn(x.shape[0], 2 * k, device=x.device, dtype=x.dtype)
            return (lambda: fo.silu_and_mul(a)), (lambda: fq.silu_mul_quant_int8(a))
        r, w = torch.randn_like(x), torch.rand(k, device=x.device, dtype=x.dtype) + 0.5
        return (lambda: fo.rms_norm(x, w, 1e-6, r)[0]), (lambda: fq.rms_norm_quant_int8(x, w, 1e-6, r)[:2])

    def bf16(x):
        f, c = ops(x)[0], cycler(ws_bf16)
        return lambda: torch.matmul(f(), c())

    def unfused(x):
        f, c = ops(x)[0], cycler(plans)
        return lambda: w8a8.w8a8_apply(*w8a8.quantize_per_token_any(f())[:2], c(), out_dtype=torch.bfloat16)

    def fused(x):
        f, c = ops(x)[1], cycler(plans)
        return lambda: w8a8.w8a8_apply(*f(), c(), out_dtype=torch.bfloat16)

    out["cublas-bf16"] = (*out["cublas-bf16"][:2], {"model_us": bf16})
    if plans is not None:
        cols = {"model_us": unfused} if producer is None else {"model_us": unfused, "model_fused_us": fused}
        out["w8a8-table+quant"] = (*out["w8a8-table+quant"][:2], cols)


def sweep_done(kind: str, by_m: dict, cfgs: dict, num_shapes: int, gpu: str, note: str = "") -> dict[str, list]:
    """Print the geo-mean ranking and the paste-able tables the timings of ``num_shapes`` shapes imply (after every
    shape: a sweep cut by its time limit still says what it found); return the tables (saved in the JSON)."""
    import kernels_w8a8 as kw8

    print_geomeans(kind.upper(), by_m, num_shapes, top=4)
    tables = kw8.implied_sweep_tables(by_m, cfgs, num_shapes, kind)
    kw8.print_sweep_tables(tables, gpu, num_shapes, note)
    return tables


def w8a8_sweep(shapes: list[str], ms: list[int], copy_gbps: float, on_shape=None) -> list[dict]:
    """Time every candidate tile config of lqe/kernels/triton_w8a8.py and, for M <= 16, of the GEMV
    (triton_gemv_w8a8.py) (sweep_configs: labels with the unresolved split-K, ``skauto``, so one label covers every
    shape) per shape and M, beside cuBLAS bf16, int-mm+epilogue, lqe-w8a8 and ``table`` (what W8A8_TABLE and the
    current CONFIGS run) of the same run; print the best per M, the geo-mean ranking and the tables it implies
    (``CONFIGS`` of both modules and ``W8A8_TABLE``, paste-able) after every shape. ``on_shape(rows, tables)``."""
    from lqe.kernels import triton_gemv_w8a8 as tg
    from lqe.kernels import triton_w8a8 as tw
    from lqe.kernels import w8a8

    gpu = torch.cuda.get_device_name()
    rows, by_m, cfgs = [], {}, {}
    for i, shape in enumerate(shapes):
        k, n = map(int, shape.split("x"))
        wi8 = rotating(lambda: torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda").t(), k * n)
        wb = rotating(lambda: torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02, k * n * 2)
        ws = torch.rand(n, device="cuda") * 0.01
        tw.reserve_workspace("cuda", max(tw.workspace_rows(), max(ms) if max(ms) <= 64 else 64), n)
        tg.reserve_workspace("cuda", n)
        plans = [w8a8.plan_w8a8(w.t(), ws, torch.bfloat16, False)[0] for w in wi8]
        p8 = None
        try:
            import lqe.kernels as lk

            if lk.available():
                p8 = rotating(lambda: lk.repack_w8a8(torch.randint(-127, 128, (k, n), dtype=torch.int8, device="cuda"),
                                                     ws), k * n)
        except Exception:  # noqa: BLE001
            p8 = None
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q, s, _ = w8a8.quantize_per_token_any(x)
            o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            base = bench((lambda c=cycler(wb): lambda: torch.matmul(x, c()))())
            timed = {}
            if tw.int_mm_unsupported(m, n, k) is None:
                timed["int-mm+epilogue"] = bench((lambda c=cycler(wi8): lambda: tw.int_mm_w8a8(q, s, c().t(), ws, out=o))())
            if p8 is not None:
                timed["lqe-w8a8"] = bench((lambda c=cycler(p8): lambda: w8a8.w8a8_gemm(q, s, c(), out=o))())
            for cfg in tw.sweep_configs(m):
                label = f"triton-w8a8:{cfg}"
                try:
                    timed[label] = bench((lambda c=cycler(wi8), cfg=cfg: lambda: tw.w8a8_mm(
                        q, s, c().t(), ws, out=o, config=cfg))(), reps=30)
                    cfgs[label] = cfg
                except Exception as e:  # noqa: BLE001 -- a config that does not compile / fit is skipped
                    raise_if_context_lost(f"{label} {shape} M={m}")
                    print(f"# {shape} M={m} {cfg}: {type(e).__name__}: {str(e)[:100]}")
            if m <= tg.MAX_M:  # the GEMV and its candidate configs
                for cfg in tg.sweep_configs(m):
                    label = f"triton-gemv:{cfg}"
                    try:
                        timed[label] = bench((lambda c=cycler(wi8), cfg=cfg: lambda: tg.gemv_w8a8(
                            q, s, c().t(), ws, out=o, config=cfg))(), reps=30)
                        cfgs[label] = cfg
                    except Exception as e:  # noqa: BLE001 -- a config that does not compile / fit is skipped
                        raise_if_context_lost(f"{label} {shape} M={m}")
                        print(f"# {shape} M={m} gemv {cfg}: {type(e).__name__}: {str(e)[:100]}")
            if plans[0] is not None:  # what a layer runs today: W8A8_TABLE, then that kernel's current CONFIGS
                timed["table"] = bench((lambda c=cycler(plans): lambda: w8a8.w8a8_apply(
                    q, s, c(), out_dtype=torch.bfloat16))())
            record_sweep(rows, by_m, f"sweep {shape} M={m}: cublas-bf16 {base:.2f} us", shape, m, base, timed,
                         top=4)
        del wi8, wb, plans, p8
        torch.cuda.empty_cache()
        tables = sweep_done("w8a8", by_m, cfgs, i + 1, gpu, f", after {shape}")
        if on_shape:
            on_shape(rows, tables)
    return rows


def fp8_sweep(shapes: list[str], ms: list[int], copy_gbps: float, on_shape=None) -> list[dict]:
    """Time every candidate config of the Triton fp8 GEMM (lqe/kernels/triton_fp8.py sweep_configs), per channel and
    128 x 128 block-scaled (the configs the block kernel takes as they are: BLOCK_K 128, BLOCK_N <= 128), and for
    M <= 16 of the fp8 GEMV (triton_gemv_w8a8.py), per shape and M, beside cuBLAS bf16, ``scaled-mm``
    (torch._scaled_mm, row-wise scales), ``table`` (FP8_TABLE with the current configs) and ``block-table`` (the
    current block-scaled config); print the best per M, the geo-mean ranking and the paste-able tables it implies
    (triton_fp8 ``CONFIGS`` / ``BLOCK_CONFIGS``, triton_gemv_w8a8 ``FP8_CONFIGS``, ``FP8_TABLE``) after every shape.
    Activations quantized as the layer's own path does (per token; 1 x 128 groups for the block kernel)."""
    import kernels_w8a8 as kw8

    from lqe.kernels import triton_fp8 as tf
    from lqe.kernels import triton_gemv_w8a8 as tg
    from lqe.kernels import w8a8

    if w8a8.fp8_supported() is not None:
        print(f"# fp8 sweep skipped: {w8a8.fp8_supported()}")
        return []
    gpu = torch.cuda.get_device_name()
    rows, by_m, cfgs = [], {}, {}
    for i, shape in enumerate(shapes):
        k, n = map(int, shape.split("x"))
        f8 = kw8.rotating_fp8(rotating, k, n)
        wb = rotating(lambda: torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02, k * n * 2)
        blocks = [(wq, torch.rand(-(-n // 128), k // 128, device="cuda") * 0.01) for wq, _ in f8] if k % 128 == 0 \
            else None
        tf.reserve_workspace("cuda", n)
        tg.reserve_workspace("cuda", n)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = w8a8.fp8_quantize_per_token(x)
            o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            base = bench((lambda c=cycler(wb): lambda: torch.matmul(x, c()))())
            timed = {"scaled-mm": bench((lambda c=cycler(f8): lambda: (lambda t: w8a8.fp8_gemm(xq, xs, *t))(c()))()),
                     "table": bench((lambda c=cycler(f8): lambda: (lambda t: w8a8.fp8_apply(xq, xs, *t))(c()))())}

            def sweep(prefix, configs, weights, run):
                for cfg in configs:
                    try:
                        timed[f"{prefix}:{cfg}"] = bench((lambda c=cycler(weights), cfg=cfg: lambda: run(c(), cfg))(),
                                                         reps=30)
                        cfgs[f"{prefix}:{cfg}"] = cfg
                    except Exception as e:  # noqa: BLE001 -- a config that does not compile / fit is skipped
                        raise_if_context_lost(f"{prefix}:{cfg} {shape} M={m}")
                        print(f"# {shape} M={m} {prefix} {cfg}: {type(e).__name__}: {str(e)[:100]}")
            sweep("triton-fp8", tf.sweep_configs(m), f8,
                  lambda t, cfg: tf.fp8_mm(xq, xs, t[0], t[1], out=o, config=cfg))
            if m <= tg.MAX_M:
                sweep("triton-gemv", tg.sweep_configs(m), f8,
                      lambda t, cfg: tg.gemv_w8a8(xq, xs, t[0], t[1], out=o, config=cfg))
            if blocks is not None:
                gq, gs = w8a8.fp8_quantize_group(x, tf.SCALE_BLOCK)
                timed["block-table"] = bench((lambda c=cycler(blocks): lambda: (
                    lambda t: w8a8.fp8_block_apply_quantized(gq, gs, *t))(c()))())
                sweep("triton-fp8-block", [c for c in tf.sweep_configs(m) if c.block_k == tf.SCALE_BLOCK
                                           and c.block_n <= tf.SCALE_BLOCK], blocks,
                      lambda t, cfg: tf.fp8_mm(gq, gs, t[0], t[1], out=o, config=cfg, block_scale=True))
            record_sweep(rows, by_m, f"fp8 sweep {shape} M={m}: cublas-bf16 {base:.2f} us", shape, m, base, timed,
                         top=4)
        del f8, wb, blocks
        torch.cuda.empty_cache()
        tables = sweep_done("fp8", by_m, cfgs, i + 1, gpu, f", after {shape}")
        if on_shape:
            on_shape(rows, tables)
    return rows


def record_sweep(rows: list, by_m: dict, title: str, shape: str, m: int, base: float, timed: dict[str, float],
                 top: int, floor_us: float | None = None) -> None:
    """Print the ``top`` fastest candidates of one (shape, M) and append every one to ``rows`` / ``by_m``."""
    order = sorted(timed.items(), key=lambda kv: kv[1])
    print(f"# {title}; best: " + ", ".join(f"{nm} {us:.2f} us {base / us:.2f}x" for nm, us in order[:top]))
    for nm, us in timed.items():
        row = {"kernel": nm, "shape": shape, "m": m, "us": round(us, 2), "bf16_us": round(base, 2),
               "speedup_vs_cublas": round(base / us, 3)}
        if floor_us is not None:
            row["floor_us"] = round(floor_us, 2)
        rows.append(row)
        by_m.setdefault(m, {}).setdefault(nm, []).append(base / us)


def print_geomeans(what: str, by_m: dict, num_shapes: int, top: int) -> None:
    """Per M, the candidates timed on every shape, ranked by geometric-mean speed-up over cuBLAS bf16."""
    print(f"# {what} sweep: geometric-mean speed-up over cuBLAS bf16 across shapes, best {top} per M")
    for m, d in by_m.items():
        full = {nm: v for nm, v in d.items() if len(v) == num_shapes}
        gm = sorted(((math.exp(sum(map(math.log, v)) / len(v)), nm) for nm, v in full.items()), reverse=True)
        print(f"#   M={m:5d}: " + ", ".join(f"{nm} {g:.2f}x" for g, nm in gm[:top]))


def plain_rows(shapes: list[str], ms: list[int], groups: frozenset[str], rows: list[dict], done: set, skip: set,
               copy_gbps: float, gpu: str, save, on_fault=None) -> list[dict]:
    """Every candidate row of ``groups`` per shape and M beside cuBLAS bf16, appended to ``rows`` and saved after each
    shape; ``(shape, M)`` pairs in ``done`` and kernels in ``skip`` are left out (a run resumed after a device
    fault). A kernel that loses the CUDA context raises :class:`common.DeviceFault` with the rows to keep; one that
    does not return hands that fault to ``on_fault`` from a watchdog (:func:`common.hang_guard`)."""
    import kernels_w8a8 as kw8

    hdr = (f"{'kernel':26s} {'KxN':>11s} {'M':>5s} {'us':>9s} {'TFLOP/s':>8s} {'GB/s':>7s} {'%copy':>6s} {'vs cuBLAS':>9s}"
           f"  | model: producer+layer us (vs bf16), fused producer->int8 us (vs bf16)")
    for i, shape in enumerate(shapes):
        if all((shape, m) in done for m in ms):
            continue
        k, n = map(int, shape.split("x"))
        producer = producer_of(k, n)
        cands = {name: c for name, c in candidates(k, n, groups).items() if name not in skip}
        print(f"# {shape}: model columns include "
              f"{producer or 'no producer (o_proj: the attention output; the layer quantizes it itself)'}")
        print(hdr)
        for m in ms:
            if (shape, m) in done:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = base_model = None
            for name, (setup, wbytes, *rest) in cands.items():
                where = dict(kernel=name, shape=shape, m=m)
                us = bench_row(bench, lambda: setup(x), f"{name} {shape} M={m}", rows, on_fault, **where)
                if us is None:
                    continue
                extra = {}
                for col, make in (rest[0] if rest else {}).items():
                    v = bench_row(bench, lambda: make(x), f"{name} {col} {shape} M={m}", rows, on_fault, **where)
                    if v is not None:
                        extra[col] = round(v, 2)
                if name == "cublas-bf16":
                    base, base_model = us, extra.get("model_us")
                gbps = (wbytes + m * k * 2 + m * n * 2) / (us * 1e-6) / 1e9
                row = {"kernel": name, "shape": shape, "m": m, "us": round(us, 2),
                       "tflops": round(2 * m * n * k / (us * 1e-6) / 1e12, 2), "gbps": round(gbps, 1),
                       "speedup_vs_cublas": round(base / us, 3) if base else None,
                       "floor_us": round(kw8.floor_us(name, m, n, k, copy_gbps, gpu, producer), 2)}
                if name.endswith("-layer"):  # producer + quant + GEMM against producer + cuBLAS bf16
                    row["layer_vs_bf16"] = row["speedup_vs_cublas"] = round(base_model / us, 3) if base_model else None
                    row["producer"] = producer or "none"
                if extra:
                    row["producer"] = producer or "none"
                for col, v in extra.items():
                    row[col] = v
                    row[col.replace("_us", "_speedup_vs_cublas")] = round(base_model / v, 3) if base_model else None
                rows.append(row)
                model = "".join(f"  {row[c]:9.2f} ({row[c.replace('_us', '_speedup_vs_cublas')] or float('nan'):4.2f}x)"
                                for c in ("model_us", "model_fused_us") if c in row)
                print(f"{name:26s} {shape:>11s} {m:5d} {us:9.2f} {row['tflops']:8.2f} {gbps:7.0f} "
                      f"{100 * gbps / copy_gbps:5.0f}% {row['speedup_vs_cublas'] or float('nan'):8.2f}x" + model
                      + f"  floor {row['floor_us']:.2f} us")
        del cands
        torch.cuda.empty_cache()
        save(rows, kw8.print_implied_tables(rows, f" after {i + 1} shape(s)"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="*", default=MS)
    ap.add_argument("--shapes", nargs="*", default=[f"{k}x{n}" for k, n in SHAPES])
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels-<gpu>.json, or $OUT)")
    ap.add_argument("--rows", default=None,
                    help=f"comma-separated row groups to time ({', '.join(ROW_GROUPS)}; default all): e.g. w8a8,fp8 "
                         "(cublas-bf16, the baseline, always runs)")
    ap.add_argument("--w8a8-sweep", action="store_true",
                    help="only time every triton-w8a8 / int8 GEMV config (and int-mm+epilogue, lqe-w8a8, the current "
                         "table) per shape and M; print the CONFIGS / W8A8_TABLE they imply")
    ap.add_argument("--fp8-sweep", action="store_true",
                    help="only time every triton-fp8 (per-channel and block-scaled) / fp8 GEMV config (and "
                         "torch._scaled_mm, the current tables) per shape and M; print the configs / FP8_TABLE they imply")
    ap.add_argument("--wna16-sweep", action="store_true",
                    help="only time every triton-wna16 config (and the CUDA GEMM, dequant+cuBLAS) per shape and M")
    ap.add_argument("--w4a16", action="store_true",
                    help="only the W4A16 rows (lqe-w4a16-mma, layer path, int4pack, triton, dequant+cuBLAS, cuBLAS "
                         "bf16; benchmarks/kernels_w4a16.py) and the WNA16_MMA_TABLE / WNA16_TABLE they imply")
    ap.add_argument("--resume", default=None, help=argparse.SUPPRESS)  # the state a run left when a fault lost its
    # CUDA context (written by on_fault below; the run goes on from it in a fresh process)
    args = ap.parse_args(argv)
    groups = parse_rows(args.rows)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py: no CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        return 2
    gpu = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "capability": ".".join(map(str, torch.cuda.get_device_capability())),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count, "lqe_commit": commit(),
           "timing": TIMING}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"# {gpu} | torch {env['torch']} cuda {env['cuda']} | d2d copy {copy_gbps:.0f} GB/s | timing {TIMING}")
    import kernels_w8a8 as kw8

    tag = "".join(c if c.isalnum() else "-" for c in gpu).strip("-").lower()
    modes = "".join(f"-{name}" for name, on in (("w8a8-sweep", args.w8a8_sweep), ("fp8-sweep", args.fp8_sweep),
                                                ("wna16-sweep", args.wna16_sweep), ("w4a16", args.w4a16)) if on)
    path = Path(args.out) if args.out else (Path(os.environ["OUT"]) if os.environ.get("OUT") else
                                            Path(__file__).parent / "results") / f"kernels{modes}-{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # a --rows run keeps the rows (and implied tables) of the groups it does not time: its --out file's, or the
    # committed benchmarks/results file's of that name when --out does not exist yet (an empty $OUT on the device)
    kept, implied, carried_from = carried_doc(path, gpu) if groups != frozenset(ROW_GROUPS) else ([], {}, None)
    if carried_from:
        print(f"# --rows {args.rows}: keeping {len(kept)} row(s) of {carried_from} (same GPU) beside this run's")
    # After a device fault (a kernel that loses the CUDA context): this run's rows so far, the faults, the kernels
    # left out from then on; the (shape, M) pairs with a cuBLAS row are done.
    state = json.loads(Path(args.resume).read_text()) if args.resume else {"rows": [], "faults": [], "skip": []}
    faults, skip = state["faults"], set(state["skip"])
    done = {(r["shape"], r["m"]) for r in state["rows"] if r.get("kernel") == "cublas-bf16"}
    if faults:
        print(f"# resumed after {len(faults)} device fault(s), without {sorted(skip)}: {faults[-1]['what']}")

    def save(rows: list[dict], tables: dict | None = None, complete: bool = False) -> None:
        """Write what is measured so far (after every shape: a run cut by its time limit keeps its rows and the
        tables they imply so far). A ``--rows`` run keeps the file's rows it did not measure again."""
        implied.update({name: kw8.table_json(t) for name, t in (tables or {}).items()})
        new = {(r.get("kernel"), r.get("shape"), r.get("m")) for r in rows}
        old = [r for r in kept if (r["kernel"], r["shape"], r["m"]) not in new]
        path.write_text(json.dumps({"device": gpu, "env": env, "copy_gbps": round(copy_gbps, 1), "rows": old + rows,
                                    "implied_tables": implied, "complete": complete,
                                    **({"carried_from": carried_from} if carried_from and old else {}),
                                    **({"device_faults": faults} if faults else {}),
                                    **({"graph_fallbacks": GRAPH_FALLBACKS} if GRAPH_FALLBACKS else {})}, indent=1))

    def on_fault(f: DeviceFault, rows: list[dict]) -> int:
        """Save what the run measured (less what the fault may have spoiled), and go on in a fresh process without
        the faulting kernel; exit status 4 when it cannot."""
        print(f"# {f}", flush=True)
        faults.append(f.record())
        if f.rows is None:  # a config sweep: its rows are in the file as of its last shape; the fault goes beside
            doc = json.loads(path.read_text()) if path.exists() else {"device": gpu, "env": env, "rows": []}
            path.write_text(json.dumps({**doc, "device_faults": faults}, indent=1))
            print(f"# stopped after the device fault; {path} has the rows of the shapes measured before it")
            return 4
        rows = f.rows
        save(rows)
        kernel = f.where.get("kernel")
        if kernel and kernel != "cublas-bf16":
            state_path = Path(tempfile.gettempdir()) / f"lqe-{path.stem}-{os.getpid()}.resume.json"
            state_path.write_text(json.dumps({"rows": rows, "faults": faults, "skip": sorted(skip | {kernel})}))
            restart(["--resume", str(state_path)])
        print(f"# stopped after the device fault ({len(faults)} so far); {path} has the rows measured before it")
        return 4

    def on_hang(f: DeviceFault) -> None:  # from hang_guard's watchdog thread: f.rows is set
        on_fault(f, f.rows)

    rows = list(state["rows"])
    sweeping = args.w8a8_sweep or args.fp8_sweep or args.wna16_sweep or args.w4a16
    try:
        if args.w8a8_sweep:
            rows = w8a8_sweep(args.shapes, args.m, copy_gbps, on_shape=save)
        if args.fp8_sweep:
            rows += fp8_sweep(args.shapes, args.m, copy_gbps, on_shape=lambda part, tables: save(rows + part, tables))
        if args.wna16_sweep:
            rows += wna16_sweep(args.shapes, args.m, on_shape=lambda part: save(rows + part))
        if args.w4a16:
            from kernels_w4a16 import w4a16_sweep

            rows = w4a16_sweep(args.shapes, args.m, copy_gbps, bench, rotating, cycler, kw8.floor_us, gpu,
                               on_shape=save, rows=rows, skip=skip, done=done, on_fault=on_hang)
        if not sweeping:
            rows = plain_rows(args.shapes, args.m, groups, rows, done, skip, copy_gbps, gpu, save, on_fault=on_hang)
    except DeviceFault as f:
        return on_fault(f, rows)
    save(rows, complete=True)
    if GRAPH_FALLBACKS:
        print(f"# timed eagerly (not capturable): {GRAPH_FALLBACKS}")
    print(f"# wrote {path}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
