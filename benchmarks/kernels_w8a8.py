"""W8A8 int8 / FP8 rows of benchmarks/kernels.py (issue 25): the per-kernel GEMV and fp8 rows, the layer rows, the
byte / FLOP floor of each row and the kernel tables the run implies.

Layer rows (what a model's layer runs, the op producing its input included, timed as one sequence of launches):
* ``lqe-w8a8-layer``: RMSNorm (SiLU-mul for down_proj) fused with the per-token int8 quantization
  (lqe/kernels/fused_quant.py), then the GEMM + epilogue W8A8_TABLE picks for M (lqe/kernels/w8a8.w8a8_apply);
* ``lqe-fp8-layer``: the same producer fused with per-token fp8 quantization (lqe/kernels/fused_quant_fp8.py), then
  the kernel FP8_TABLE picks (lqe/kernels/w8a8.fp8_apply);
* ``lqe-fp8-block-layer``: the producer fused with 1 x 128 fp8 groups, then the 128 x 128 block-scaled Triton GEMM;
* their baseline, in the same run and on the same shapes: the float producer then cuBLAS bf16 (``model_us`` of the
  ``cublas-bf16`` row). ``layer_vs_bf16`` = that time / the layer's time.
o_proj (K = N: its input is the attention output, no producer to fuse into; lqe/models/llama.py ``act_quant_pairs``
names only qkv, gate_up and down) is timed as the model runs it: the standalone quantizer (lqe/kernels/w8a8.py:
the CUDA / Triton per-token quantizer, lqe/kernels/triton_act_quant.py) then the GEMM, against cuBLAS bf16 alone.

The sweeps (``kernels.py --w8a8-sweep`` / ``--fp8-sweep``) key every candidate by its unresolved config (``skauto``:
split-K from the SM count) so one label covers every shape, and print paste-able tables (:func:`implied_sweep_tables`):
``CONFIGS`` of lqe/kernels/triton_w8a8.py, triton_gemv_w8a8.py (``FP8_CONFIGS`` for fp8), triton_fp8.py (and its
``BLOCK_CONFIGS``), and ``W8A8_TABLE`` / ``FP8_TABLE`` of lqe/kernels/dispatch.py; rows above the largest M measured
are the current table's.
"""
from __future__ import annotations

import json
import math

import torch

# dense tensor-core peaks (TFLOP/s) for the FLOP floor; 8-bit = 2x bf16. Unknown GPU: bytes floor only.
PEAK_TFLOPS = {"h100": {"bf16": 989.0, "int8": 1979.0}, "h200": {"bf16": 989.0, "int8": 1979.0}}
W8A8_KERNEL_ROWS = ("triton-gemv", "triton-w8a8", "int-mm+epilogue", "lqe-w8a8")
FP8_KERNEL_ROWS = ("triton-gemv-fp8", "triton-fp8", "lqe-fp8/torch-scaled-mm")
# W4A16: one table per weight layout (a layer holds one): the wna16 layout's kernels, and lqe-w4a16-mma's own
WNA16_KERNEL_ROWS = ("lqe-w4a16-fused", "lqe-w4a16-fused-ring", "lqe-w4a16-fused-pdl", "lqe-w4a16-fused-ring-pdl",
                     "triton-wna16", "triton-wna16-swap", "triton-dequant+cublas", "triton-dequant-l2+cublas",
                     "lqe-w4a16-dequant")
WNA16_MMA_KERNEL_ROWS = ("lqe-w4a16-mma", "lqe-w4a16-mma-k2", "lqe-w4a16-mma-dequant+cublas")
TABLE_NAMES = {"triton-gemv-fp8": "triton-gemv", "lqe-fp8/torch-scaled-mm": "scaled-mm",
               "lqe-w4a16-fused": "lqe-wna16-fused", "lqe-w4a16-fused-ring": "lqe-wna16-ring",
               # (-pdl: the same kernel launched with PDL, a model's default on sm_90+: device_info.pdl_enabled)
               "lqe-w4a16-fused-pdl": "lqe-wna16-fused", "lqe-w4a16-fused-ring-pdl": "lqe-wna16-ring",
               "lqe-w4a16-dequant": "dequant+cublas"}


def peak(device_name: str, kind: str) -> float | None:
    low = device_name.lower()
    for key, peaks in PEAK_TFLOPS.items():
        if key in low:
            return peaks[kind]
    return None


def floor_us(kernel: str, m: int, n: int, k: int, copy_gbps: float, device_name: str,
             producer: str | None = "rmsnorm") -> float:
    """max(bytes at d2d copy bandwidth, FLOPs at the dense tensor-core peak) of one row. Bytes: the weight
    (1 byte / element for 8-bit rows, 2 for bf16, 0.5 + scales for W4A16), activations in and out; layer rows add
    the producer's float input read (and the residual read + write of the norm), or with no producer (o_proj) the
    standalone quantizer's float read and 8-bit write."""
    if kernel.startswith("cublas") or kernel.startswith("torch-matmul"):
        wb, kind = 2.0, "bf16"
    elif "w4a16" in kernel or "wna16" in kernel or "int4" in kernel or "dequant" in kernel:
        wb, kind = 0.5 + 2 / 128, "bf16"
    else:
        wb, kind = 1.0, "int8"
    nbytes = wb * n * k + 2 * m * n + (m * k if kind == "int8" else 2 * m * k)
    if kernel.endswith("-layer"):
        nbytes += 3 * 2 * m * k if producer else 3 * m * k  # producer: x (+ residual) read, residual written
    t = nbytes / (copy_gbps * 1e3)
    p = peak(device_name, kind)
    return max(t, 2 * m * n * k / (p * 1e6)) if p else t


def _ops(k: int, x: torch.Tensor, producer: str | None):
    """(float producer, int8-quantizing producer, fp8-quantizing producer, fp8-group-quantizing producer) on inputs
    for x [M, K]: RMSNorm / SiLU-mul fused with the quantization, or with no producer (o_proj) ``x`` itself and the
    standalone quantizers the layer runs."""
    from lqe.kernels import fused_ops as fo
    from lqe.kernels import fused_quant as fq
    from lqe.kernels import fused_quant_fp8 as f8
    from lqe.kernels import w8a8

    if producer is None:
        return ((lambda: x), (lambda: w8a8.quantize_per_token_any(x)[:2]), (lambda: w8a8.fp8_quantize_per_token(x)),
                (lambda: w8a8.fp8_quantize_group(x, 128)))
    if producer == "silu":
        a = torch.randn(x.shape[0], 2 * k, device=x.device, dtype=x.dtype)
        return ((lambda: fo.silu_and_mul(a)), (lambda: fq.silu_mul_quant_int8(a)),
                (lambda: f8.silu_mul_quant_fp8(a)), (lambda: f8.silu_mul_quant_fp8(a, group=128)))
    r, w = torch.randn_like(x), torch.rand(k, device=x.device, dtype=x.dtype) + 0.5
    return ((lambda: fo.rms_norm(x, w, 1e-6, r)[0]), (lambda: fq.rms_norm_quant_int8(x, w, 1e-6, r)[:2]),
            (lambda: f8.rms_norm_quant_fp8(x, w, 1e-6, r)[:2]), (lambda: f8.rms_norm_quant_fp8(x, w, 1e-6, r, 128)[:2]))


def rotating_fp8(rotating, k: int, n: int):
    from lqe.kernels import w8a8

    return rotating(lambda: w8a8.fp8_quantize_weight(torch.randn(k, n, device="cuda") * 0.02), k * n)


def add_w8a8_fp8_rows(out: dict, k: int, n: int, rotating, cycler, producer: str | None, plans: list | None,
                      wi8: list | None, groups=("w8a8", "fp8")) -> None:
    """Add the per-kernel ``triton-gemv``, ``triton-gemv-fp8``, ``triton-fp8`` rows and the layer rows to the
    candidates of benchmarks/kernels.py (``name -> (setup(x) -> fn, weight_bytes)``): the int8 ones with ``"w8a8"``
    in ``groups`` (and ``wi8``), the fp8 ones with ``"fp8"``."""
    from lqe.kernels import triton_gemv_w8a8 as tg

    dev = "cuda"
    ws = torch.rand(n, device=dev) * 0.01
    tg.reserve_workspace(dev, n)
    if "w8a8" in groups and wi8 is not None:
        add_int8_rows(out, k, n, cycler, producer, plans, wi8, ws)
    if "fp8" in groups:
        add_fp8_rows(out, k, n, rotating, cycler, producer)


def add_int8_rows(out: dict, k: int, n: int, cycler, producer: str | None, plans: list | None, wi8: list,
                  ws: torch.Tensor) -> None:
    from lqe.kernels import triton_gemv_w8a8 as tg
    from lqe.kernels import w8a8

    def gemv_i8(x):
        if x.shape[0] > tg.MAX_M:
            raise ValueError("triton-gemv serves M <= 16")
        q, s, _ = w8a8.quantize_per_token_any(x)
        c = cycler(wi8)
        return lambda: tg.gemv_w8a8(q, s, c().t(), ws)
    out["triton-gemv"] = (gemv_i8, k * n)
    if plans is not None:
        def layer_i8(x):
            _, fused, _, _ = _ops(k, x, producer)
            c = cycler(plans)
            return lambda: w8a8.w8a8_apply(*fused(), c(), out_dtype=torch.bfloat16)
        out["lqe-w8a8-layer"] = (layer_i8, k * n)


def add_fp8_rows(out: dict, k: int, n: int, rotating, cycler, producer: str | None) -> None:
    from lqe.kernels import triton_gemv_w8a8 as tg
    from lqe.kernels import w8a8

    dev = "cuda"
    if w8a8.fp8_supported() is not None:
        print(f"# fp8 rows skipped: {w8a8.fp8_supported()}")
        return
    from lqe.kernels import triton_fp8 as tf

    f8 = rotating_fp8(rotating, k, n)
    tf.reserve_workspace(dev, n)

    def gemv_f8(x):
        if x.shape[0] > tg.MAX_M:
            raise ValueError("triton-gemv serves M <= 16")
        xq, xs = w8a8.fp8_quantize_per_token(x)
        c = cycler(f8)
        return lambda: (lambda t: tg.gemv_w8a8(xq, xs, t[0], t[1]))(c())
    out["triton-gemv-fp8"] = (gemv_f8, k * n)

    def mm_f8(x):
        xq, xs = w8a8.fp8_quantize_per_token(x)
        c = cycler(f8)
        return lambda: (lambda t: tf.fp8_mm(xq, xs, t[0], t[1]))(c())
    out["triton-fp8"] = (mm_f8, k * n)

    def layer_f8(x):
        _, _, fused, _ = _ops(k, x, producer)
        c = cycler(f8)
        return lambda: (lambda t: w8a8.fp8_apply(*fused(), t[0], t[1]))(c())
    out["lqe-fp8-layer"] = (layer_f8, k * n)

    if k % 128 == 0:
        blocks = [(wq, torch.rand(-(-n // 128), k // 128, device=dev) * 0.01) for wq, _ in f8]

        def layer_block(x):
            _, _, _, fused = _ops(k, x, producer)
            c = cycler(blocks)
            return lambda: (lambda t: w8a8.fp8_block_apply_quantized(*fused(), t[0], t[1]))(c())
        out["lqe-fp8-block-layer"] = (layer_block, k * n)


def implied_tables(rows: list[dict]) -> dict[str, list]:
    """Per M, the fastest per-kernel row by geometric-mean speed-up over cuBLAS bf16 across the shapes timed, as
    W8A8_TABLE / FP8_TABLE / WNA16_TABLE / WNA16_MMA_TABLE rows ``(max_m, kernel)`` (adjacent M with the same winner
    merged); printed by benchmarks/kernels.py so a GPU run says which table its numbers imply. The two W4A16 tables
    are one per weight layout; which layout wins per M is in the geo-means printed beside them."""
    out = {}
    for label, names in (("W8A8_TABLE", W8A8_KERNEL_ROWS), ("FP8_TABLE", FP8_KERNEL_ROWS),
                         ("WNA16_TABLE", WNA16_KERNEL_ROWS), ("WNA16_MMA_TABLE", WNA16_MMA_KERNEL_ROWS)):
        by_m: dict[int, dict[str, list[float]]] = {}
        shapes = {r["shape"] for r in rows}
        for r in rows:
            if r["kernel"] in names and r.get("speedup_vs_cublas"):
                by_m.setdefault(r["m"], {}).setdefault(r["kernel"], []).append(r["speedup_vs_cublas"])
        table: list[list] = []
        for m in sorted(by_m):
            full = {nm: v for nm, v in by_m[m].items() if len(v) == len(shapes)}
            if not full:
                continue
            best = max(full, key=lambda nm: sum(map(math.log, full[nm])))
            name = TABLE_NAMES.get(best, best)
            if table and table[-1][1] == name:
                table[-1][0] = m
            else:
                table.append([m, name])
        if table:
            table[-1][0] = None
            out[label] = [tuple(t) for t in table]
    return out


def print_implied_tables(rows: list[dict], note: str = "") -> dict[str, list]:
    tables = implied_tables(rows)
    for label, table in tables.items():
        print(f"# {label} implied by this run{note} (geo-mean over shapes, per M): {table}")
    return tables


# ------------------------------------------------------------------------------------------------ sweep tables
# per sweep kind: the config tables it implies (name, label prefix, module, attribute, open-ended last row) and the
# kernel table (dispatch name, {label prefix or exact label: kernel name})
SWEEP_TABLES = {
    "w8a8": ([("triton_w8a8.CONFIGS", "triton-w8a8:", "lqe.kernels.triton_w8a8", "CONFIGS", True),
              ("triton_gemv_w8a8.CONFIGS", "triton-gemv:", "lqe.kernels.triton_gemv_w8a8", "CONFIGS", False)],
             ("W8A8_TABLE", {"triton-gemv:": "triton-gemv", "triton-w8a8:": "triton-w8a8",
                             "int-mm+epilogue": "int-mm+epilogue", "lqe-w8a8": "lqe-w8a8"})),
    "fp8": ([("triton_fp8.CONFIGS", "triton-fp8:", "lqe.kernels.triton_fp8", "CONFIGS", True),
             ("triton_fp8.BLOCK_CONFIGS", "triton-fp8-block:", "lqe.kernels.triton_fp8", "BLOCK_CONFIGS", True),
             ("triton_gemv_w8a8.FP8_CONFIGS", "triton-gemv:", "lqe.kernels.triton_gemv_w8a8", "FP8_CONFIGS", False)],
            ("FP8_TABLE", {"triton-gemv:": "triton-gemv", "scaled-mm": "scaled-mm", "triton-fp8:": "triton-fp8"})),
}


def geo_means(by_m: dict[int, dict[str, list[float]]], num_shapes: int) -> dict[int, dict[str, float]]:
    """Per M, the geometric-mean speed-up of every label timed on all ``num_shapes`` shapes."""
    return {m: {nm: math.exp(sum(map(math.log, v)) / len(v)) for nm, v in d.items() if len(v) == num_shapes and v}
            for m, d in by_m.items()}


def _matches(label: str, key: str) -> bool:
    return label.startswith(key) if key.endswith(":") else label == key


def merge_rows(measured: list[tuple[int, object]], current: list[tuple[int | None, object]],
               open_end: bool = True) -> list[tuple[int | None, object]]:
    """Per-M winners ``[(m, value)]`` (ascending M) as table rows ``(max_m, value)``: adjacent equal values merged;
    the rows of ``current`` above the largest M measured kept (not measured: left as they are); the last row
    open-ended (``None``) when ``open_end`` (the winner at the largest M extends upwards when no current row lies
    above it)."""
    rows: list[tuple[int | None, object]] = []
    for m, v in sorted(measured, key=lambda mv: mv[0]):
        if rows and rows[-1][1] == v:
            rows[-1] = (m, v)
        else:
            rows.append((m, v))
    if not rows:
        return list(current)
    top = rows[-1][0]
    tail = [(mm, v) for mm, v in current if mm is not None and mm > top]
    above = bool(tail)
    if tail and tail[0][1] == rows[-1][1]:
        rows[-1] = tail.pop(0)
    rows += tail
    if open_end:
        if above and current[-1][0] is None:
            rows.append(current[-1])
        else:
            rows[-1] = (None, rows[-1][1])
    return rows


def implied_sweep_tables(by_m: dict[int, dict[str, list[float]]], cfgs: dict[str, object], num_shapes: int,
                         kind: str, current: dict[str, list] | None = None) -> dict[str, list]:
    """The tables a sweep's timings imply: for each config table of :data:`SWEEP_TABLES` ``[kind]``, per M the
    config (``cfgs[label]``) with the best geo-mean over the shapes; for the kernel table, per M the kernel whose best
    label has the best geo-mean. Merged with ``current`` (default: the tables as the modules hold them now) above the
    largest M measured. Labels outside the tables ("table", the current choice) only rank in the geo-means."""
    import importlib

    from lqe.kernels import dispatch

    cfg_specs, (kname, families) = SWEEP_TABLES[kind]
    if current is None:
        current = {name: list(getattr(importlib.import_module(mod), attr)) for name, _, mod, attr, _ in cfg_specs}
        current[kname] = list(getattr(dispatch, kname))
    gm = geo_means(by_m, num_shapes)
    out: dict[str, list] = {}
    for name, prefix, _, _, open_end in cfg_specs:
        measured = []
        for m in sorted(gm):
            cands = {nm: g for nm, g in gm[m].items() if nm.startswith(prefix) and nm in cfgs}
            if cands:
                measured.append((m, cfgs[max(cands, key=cands.get)]))
        if measured:
            out[name] = merge_rows(measured, current.get(name, []), open_end)
    measured = []
    for m in sorted(gm):
        best = {kern: max((g for nm, g in gm[m].items() if _matches(nm, key)), default=None)
                for key, kern in families.items()}
        best = {kern: g for kern, g in best.items() if g is not None}
        if best:
            measured.append((m, max(best, key=best.get)))
    if measured:
        out[kname] = merge_rows(measured, current.get(kname, []), True)
    return out


def format_table(name: str, rows: list[tuple[int | None, object]]) -> str:
    """``NAME = [`` rows ``]`` as Python source (configs by their dataclass repr, kernels as strings)."""
    lines = [f"{name.rsplit('.', 1)[-1]} = ["]
    for max_m, v in rows:
        lines.append(f"    ({max_m!r}, {json.dumps(v) if isinstance(v, str) else repr(v)}),")
    return "\n".join(lines + ["]"])


def table_json(rows: list[tuple[int | None, object]]) -> list[list]:
    """A table as the results JSON keeps it (``implied_tables``): kernels by name, configs by the dataclass repr
    :func:`format_table` prints to paste."""
    return [[max_m, v if isinstance(v, str) else repr(v)] for max_m, v in rows]


def print_sweep_tables(tables: dict[str, list], gpu: str, num_shapes: int, note: str = "") -> None:
    where = {"W8A8_TABLE": "lqe/kernels/dispatch.py", "FP8_TABLE": "lqe/kernels/dispatch.py"}
    for name, rows in tables.items():
        mod = where.get(name, f"lqe/kernels/{name.split('.')[0]}.py")
        print(f"# paste into {mod} ({gpu}, geo-mean over {num_shapes} shape(s){note}; rows above the largest M "
              f"measured are the current ones):")
        print(format_table(name, rows))
