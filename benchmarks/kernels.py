"""GEMM kernel benchmark on Llama-3-8B layer shapes: lqe W4A16 / W8A8 / FP8 against cuBLAS bf16,
torch._weight_int4pack_mm, torch._int_mm and torch._scaled_mm, with device-to-device copy bandwidth as the
memory roofline. Weights are rotated over enough copies to exceed the L2 cache. Two more columns show what a
model pays per layer with the op producing its input (RMSNorm, or SiLU-mul for down_proj): cuBLAS bf16 after the
float op, W8A8 after the float op and a separate per-token quantization, and W8A8 after the op fused with the
quantization (lqe/kernels/fused_quant.py). The W8A8 / FP8 GEMV, fp8 GEMM and layer rows (lqe-w8a8-layer,
lqe-fp8-layer: producer fused with the quantization + GEMM, against producer + cuBLAS bf16) come from
benchmarks/kernels_w8a8.py; every row carries its byte / FLOP floor and the run prints the W8A8 / FP8 tables it implies.

    python benchmarks/kernels.py [--m 1 16 128] [--shapes 4096x4096] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # K x N: qkv, o, gate_up, down
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024]
L2_BYTES = 50 * 2**20
ROTATE_BYTES = 4 * L2_BYTES


def bench(fn, reps: int = 100) -> float:
    """Median microseconds of ``fn()`` on CUDA events (triton.testing.do_bench when importable)."""
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
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src), reps=50)
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


def candidates(k: int, n: int):
    """``name -> (setup(x) -> fn, weight_bytes[, {column: setup(x) -> fn}])`` for every kernel that can run here,
    plus skip notes; the optional third element times the model columns (:func:`add_model_columns`)."""
    import lqe.kernels as lk
    from lqe.kernels import w8a8

    dev, out = "cuda", {}
    wbytes_bf16 = k * n * 2
    ws = rotating(lambda: torch.randn(k, n, device=dev, dtype=torch.bfloat16) * 0.02, wbytes_bf16)
    out["cublas-bf16"] = (lambda x: (lambda w=cycler(ws): lambda: torch.matmul(x, w()))(), wbytes_bf16)

    if lk.available():
        def make_w4():
            return lk.select_w4a16_kernel(random_w4(k, n, dev), dev, torch.bfloat16)[0].packed
        w4bytes = k * n // 2 + (k // 128) * n * 2
        p4 = rotating(make_w4, w4bytes)
        for name, path in [("lqe-w4a16", "auto"), ("lqe-w4a16-fused", "fused"), ("lqe-w4a16-dequant", "dequant")]:
            out[name] = ((lambda path: lambda x: (lambda p=cycler(p4): lambda: lk.wna16_gemm(x, p(), path=path))())(path), w4bytes)
        add_wna16_candidates(out, k, n, p4, w4bytes)
        from kernels_w4a16 import add_mma_rows  # lqe-w4a16-mma candidate rows (issue 24)

        add_mma_rows(out, k, n, rotating, cycler)

        def make_w8():
            wq = torch.randint(-127, 128, (k, n), dtype=torch.int8, device=dev)
            return lk.repack_w8a8(wq, torch.rand(n, device=dev) * 0.01)
        p8 = rotating(make_w8, k * n)

        def setup_w8a8(x):
            q, s, _ = w8a8.quantize_per_token(x)
            p = cycler(p8)
            return lambda: w8a8.w8a8_gemm(q, s, p(), out_dtype=torch.bfloat16)
        out["lqe-w8a8"] = (setup_w8a8, k * n)
    else:
        print(f"# lqe kernels unavailable: {lk.unavailable_reason()}")

    add_int4pack_row(out, k, n, dev)

    wi8 = rotating(lambda: torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev).t(), k * n)
    out["torch-int-mm"] = (lambda x: (lambda xq=torch.randint(-127, 128, x.shape, dtype=torch.int8, device=dev),
                                             c=cycler(wi8): lambda: torch._int_mm(xq, c()))(), k * n)
    plans = add_w8a8_candidates(out, k, n, wi8)
    add_model_columns(out, k, n, ws, plans)
    from kernels_w8a8 import add_w8a8_fp8_rows  # W8A8 / FP8 GEMV, fp8 GEMM and layer rows (issue 25)

    add_w8a8_fp8_rows(out, k, n, rotating, cycler, producer_of(k, n), plans, wi8)
    if w8a8.fp8_supported() is None:
        f8 = rotating(lambda: w8a8.fp8_quantize_weight(torch.randn(k, n, device=dev) * 0.02), k * n)

        def setup_fp8(x):
            xq, xs = w8a8.fp8_quantize_per_token(x)
            c = cycler(f8)
            return lambda: w8a8.fp8_gemm(xq, xs, *c())
        out["lqe-fp8/torch-scaled-mm"] = (setup_fp8, k * n)
    return out


def add_wna16_candidates(out: dict, k: int, n: int, p4: list, w4bytes: int) -> None:
    """Triton W4A16 rows on the same packed weights as lqe-w4a16 (lqe/kernels/triton_wna16.py): the GEMM with
    its table config, dequantize + cuBLAS, and the dequantize kernel alone (bytes: packed read + bf16 write)."""
    import lqe.kernels as lk
    from lqe.kernels import triton_wna16 as tw

    if tw.unavailable_reason("cuda") is not None:
        print(f"# triton-wna16 skipped: {tw.unavailable_reason('cuda')}")
        return
    for name, path in [("triton-wna16", "triton-wna16"), ("triton-dequant+cublas", "triton-dequant+cublas")]:
        out[name] = ((lambda path: lambda x: (lambda p=cycler(p4): lambda: lk.wna16_gemm(x, p(), path=path))())(path),
                     w4bytes)
    wbuf = torch.empty(k, n, device="cuda", dtype=torch.bfloat16)
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

        def make_w4():
            return lk.select_w4a16_kernel(random_w4(k, n), "cuda", torch.bfloat16)[0].packed
        p4 = rotating(make_w4, k * n // 2)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            floor_us = tw.flops_bytes(m, n, k, 4, 128, False)[1] / (copy_gbps * 1e3)
            base = bench((lambda c=cycler(wb): lambda: torch.matmul(x, c()))())
            timed = {}
            paths = [("table", "auto"), ("triton-dequant+cublas", "triton-dequant+cublas")]
            if lk.available():
                paths += [("lqe-wna16-fused", "fused")]
            for nm, path in paths:
                timed[nm] = bench((lambda c=cycler(p4), path=path: lambda: lk.wna16_gemm(x, c(), out=o, path=path))())
            for cfg in tw.sweep_configs(m):
                try:
                    timed[f"triton-wna16:{cfg.label()}"] = bench((lambda c=cycler(p4), cfg=cfg: lambda: lk.wna16_gemm(
                        x, c(), out=o, path="triton-wna16", config=cfg))(), reps=30)
                except Exception as e:  # noqa: BLE001 -- a config that does not compile / fit is skipped
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


def producer_of(k: int, n: int) -> str:
    """The op that produces a ``K x N`` layer's input in a Llama block: SiLU-mul for down_proj (K > N), RMSNorm for
    the others (qkv and gate_up; o_proj's input really is the attention output, its row shows the norm anyway)."""
    return "silu" if k > n else "rmsnorm"


def add_model_columns(out: dict, k: int, n: int, ws_bf16: list, plans: list | None) -> None:
    """Columns with what a model pays per layer, the op producing its input included (:func:`producer_of`):
    ``model_us`` on cublas-bf16 (producer + matmul) and on w8a8-table+quant (producer, separate per-token
    quantization, table GEMM), and ``model_fused_us`` on w8a8-table+quant (the producer fused with the
    quantization, lqe/kernels/fused_quant.py, then the table GEMM)."""
    from lqe.kernels import fused_ops as fo
    from lqe.kernels import fused_quant as fq
    from lqe.kernels import w8a8

    if plans is None or not fq.HAS_TRITON:
        return
    producer = producer_of(k, n)

    def ops(x):
        """(float producer, fused producer -> (q, scale)) on inputs shaped for ``x [M, K]``."""
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
    out["w8a8-table+quant"] = (*out["w8a8-table+quant"][:2], {"model_us": unfused, "model_fused_us": fused})


def w8a8_sweep(shapes: list[str], ms: list[int], copy_gbps: float, on_shape=None) -> list[dict]:
    """Time every candidate tile config of lqe/kernels/triton_w8a8.py (sweep_configs) per shape and M, beside
    cuBLAS bf16, int-mm+epilogue and lqe-w8a8 of the same run; print the best per M and a suggested table."""
    from lqe.kernels import triton_w8a8 as tw
    from lqe.kernels import w8a8

    rows, best_by_m = [], {}
    for shape in shapes:
        k, n = map(int, shape.split("x"))
        wi8 = rotating(lambda: torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda").t(), k * n)
        wb = rotating(lambda: torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02, k * n * 2)
        ws = torch.rand(n, device="cuda") * 0.01
        tw.reserve_workspace("cuda", max(ms) if max(ms) <= 64 else 64, n)
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
                try:
                    timed[f"triton-w8a8:{cfg}"] = bench((lambda c=cycler(wi8), cfg=cfg: lambda: tw.w8a8_mm(
                        q, s, c().t(), ws, out=o, config=cfg))(), reps=30)
                except Exception as e:  # noqa: BLE001 -- a config that does not compile / fit is skipped
                    print(f"# {shape} M={m} {cfg}: {type(e).__name__}: {str(e)[:100]}")
            if m <= 16:  # the GEMV (lqe/kernels/triton_gemv_w8a8.py) and its candidate configs
                from lqe.kernels import triton_gemv_w8a8 as tg

                tg.reserve_workspace("cuda", n)
                for cfg in tg.sweep_configs(m):
                    try:
                        timed[f"triton-gemv:{cfg}"] = bench((lambda c=cycler(wi8), cfg=cfg: lambda: tg.gemv_w8a8(
                            q, s, c().t(), ws, out=o, config=cfg))(), reps=30)
                    except Exception as e:  # noqa: BLE001 -- a config that does not compile / fit is skipped
                        print(f"# {shape} M={m} gemv {cfg}: {type(e).__name__}: {str(e)[:100]}")
            table_cfg = tw.pick_config(m, n, k, torch.device("cuda"))
            timed[f"triton-w8a8(table {table_cfg})"] = bench((lambda c=cycler(wi8): lambda: tw.w8a8_mm(
                q, s, c().t(), ws, out=o))())
            record_sweep(rows, best_by_m, f"sweep {shape} M={m}: cublas-bf16 {base:.2f} us", shape, m, base, timed,
                         top=4)
        if on_shape:
            on_shape(rows)
    print_geomeans("W8A8", best_by_m, len(shapes), top=3)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="*", default=MS)
    ap.add_argument("--shapes", nargs="*", default=[f"{k}x{n}" for k, n in SHAPES])
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels-<gpu>.json, or $OUT)")
    ap.add_argument("--w8a8-sweep", action="store_true",
                    help="only time every triton-w8a8 tile config (and int-mm+epilogue, lqe-w8a8) per shape and M")
    ap.add_argument("--wna16-sweep", action="store_true",
                    help="only time every triton-wna16 config (and the CUDA GEMM, dequant+cuBLAS) per shape and M")
    ap.add_argument("--w4a16", action="store_true",
                    help="only the W4A16 rows (lqe-w4a16-mma, layer path, int4pack, triton, dequant+cuBLAS, cuBLAS "
                         "bf16; benchmarks/kernels_w4a16.py) and the WNA16_MMA_TABLE they imply")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py: no CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        return 2
    gpu = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth()
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "capability": ".".join(map(str, torch.cuda.get_device_capability())),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    print(f"# {gpu} | torch {env['torch']} cuda {env['cuda']} | d2d copy {copy_gbps:.0f} GB/s")
    import kernels_w8a8 as kw8

    tag = "".join(c if c.isalnum() else "-" for c in gpu).strip("-").lower()
    path = Path(args.out) if args.out else (Path(os.environ["OUT"]) if os.environ.get("OUT") else
                                            Path(__file__).parent / "results") / \
        f"kernels{'-w8a8-sweep' if args.w8a8_sweep else ''}{'-wna16-sweep' if args.wna16_sweep else ''}{'-w4a16' if args.w4a16 else ''}-{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict], implied: dict | None = None) -> None:
        """Write what is measured so far (after every shape: a run cut by its time limit keeps its rows)."""
        path.write_text(json.dumps({"device": gpu, "env": env, "copy_gbps": round(copy_gbps, 1), "rows": rows,
                                    "implied_tables": implied or {}, "complete": implied is not None}, indent=1))

    rows = []
    if args.w8a8_sweep:
        rows = w8a8_sweep(args.shapes, args.m, copy_gbps, on_shape=save)
        args.shapes = []
    if args.wna16_sweep:
        rows += wna16_sweep(args.shapes, args.m, on_shape=lambda part: save(rows + part))
        args.shapes = []
    if args.w4a16:
        from kernels_w4a16 import w4a16_sweep

        rows += w4a16_sweep(args.shapes, args.m, copy_gbps, bench, rotating, cycler, kw8.floor_us, gpu,
                            on_shape=lambda part: save(rows + part))
        args.shapes = []
    hdr = (f"{'kernel':26s} {'KxN':>11s} {'M':>5s} {'us':>9s} {'TFLOP/s':>8s} {'GB/s':>7s} {'%copy':>6s} {'vs cuBLAS':>9s}"
           f"  | model: producer+layer us (vs bf16), fused producer->int8 us (vs bf16)")
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        cands = candidates(k, n)
        print(f"# {shape}: model columns include {producer_of(k, n)}")
        print(hdr)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = base_model = None
            for name, (setup, wbytes, *rest) in cands.items():
                try:
                    us = bench(setup(x))
                except Exception as e:  # noqa: BLE001
                    print(f"# {name} {shape} M={m} failed: {type(e).__name__}: {str(e)[:160]}")
                    continue
                extra = {}
                for col, make in (rest[0] if rest else {}).items():
                    try:
                        extra[col] = round(bench(make(x)), 2)
                    except Exception as e:  # noqa: BLE001
                        print(f"# {name} {col} {shape} M={m} failed: {type(e).__name__}: {str(e)[:160]}")
                if name == "cublas-bf16":
                    base, base_model = us, extra.get("model_us")
                gbps = (wbytes + m * k * 2 + m * n * 2) / (us * 1e-6) / 1e9
                row = {"kernel": name, "shape": shape, "m": m, "us": round(us, 2),
                       "tflops": round(2 * m * n * k / (us * 1e-6) / 1e12, 2), "gbps": round(gbps, 1),
                       "speedup_vs_cublas": round(base / us, 3) if base else None,
                       "floor_us": round(kw8.floor_us(name, m, n, k, copy_gbps, gpu), 2)}
                if name.endswith("-layer"):  # producer + quant + GEMM against producer + cuBLAS bf16
                    row["layer_vs_bf16"] = row["speedup_vs_cublas"] = round(base_model / us, 3) if base_model else None
                if extra:
                    row["producer"] = producer_of(k, n)
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
        save(rows)
    save(rows, kw8.print_implied_tables(rows) if not (args.w8a8_sweep or args.wna16_sweep or args.w4a16) else {})
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
