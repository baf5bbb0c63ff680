"""benchmarks/kernels_w8a8.py / kernels.py / kernels_w4a16.py host helpers (no GPU needed): the implied kernel tables,
the paste-able tables of the sweeps (synthetic timings), the per-row floors, the producer of each layer shape, the
--rows filter and the W4A16 rows' weight layouts whatever the W4A16 table names."""
from __future__ import annotations

import os
import sys

import pytest
import torch

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
    assert "WNA16_TABLE" not in t  # no W4A16 row timed: no table claimed


def test_implied_w4a16_tables_are_one_per_weight_layout():
    rows = []
    for shape in ("a", "b"):
        for m, speeds in ((1, {"lqe-w4a16-fused": 2.0, "triton-wna16-swap": 1.8, "lqe-w4a16-mma": 2.6,
                               "lqe-w4a16-mma-k2": 2.7}),
                          (16, {"lqe-w4a16-fused": 0.8, "triton-wna16-swap": 1.7, "triton-wna16": 1.1,
                                "lqe-w4a16-mma": 2.2, "lqe-w4a16-mma-dequant+cublas": 0.3}),
                          (1024, {"triton-wna16-swap": 0.6, "lqe-w4a16-dequant": 0.8, "triton-dequant+cublas": 0.75,
                                  "lqe-w4a16-mma": 0.5, "lqe-w4a16-mma-dequant+cublas": 0.79})):
            rows += [{"kernel": k, "shape": shape, "m": m, "speedup_vs_cublas": v} for k, v in speeds.items()]
    t = kw8.implied_tables(rows)
    # the wna16 layout's rows under their dispatch names; the mma rows in a table of their own
    assert t["WNA16_TABLE"] == [(1, "lqe-wna16-fused"), (16, "triton-wna16-swap"), (None, "dequant+cublas")]
    # (the 8-warp k-split GEMM is a table name of its own: timed at M = 1 only here, where it wins)
    assert t["WNA16_MMA_TABLE"] == [(1, "lqe-w4a16-mma-k2"), (16, "lqe-w4a16-mma"),
                                    (None, "lqe-w4a16-mma-dequant+cublas")]
    from lqe.kernels import dispatch, gemm

    for label in ("WNA16_TABLE", "WNA16_MMA_TABLE"):  # every name is one the dispatch code runs
        assert all(name in gemm._COUNTERPART for _, name in t[label]), t[label]
        assert getattr(dispatch, label)[-1][0] is None
    for table in (dispatch.WNA16_SWAP_TABLE, dispatch.WNA16_RING_TABLE):
        assert all(name in gemm._COUNTERPART for _, name in table) and table[-1][0] is None, table
    # the CUDA GEMV's ring row (timed at M <= 16 only) under its dispatch name where it is the fastest
    rows = [{"kernel": k, "shape": "4096x4096", "m": m, "speedup_vs_cublas": v}
            for m, speeds in ((1, {"lqe-w4a16-fused": 1.3, "lqe-w4a16-fused-ring": 2.4, "triton-wna16": 0.9}),
                              (64, {"triton-wna16": 0.9, "lqe-w4a16-dequant": 0.5}))
            for k, v in speeds.items()]
    assert kw8.implied_tables(rows)["WNA16_TABLE"] == [(1, "lqe-wna16-ring"), (None, "triton-wna16")]
    # the GEMV with PDL (a model's default on sm_90+) is the same table kernel as without: its faster twin names it
    rows = [{"kernel": k, "shape": "4096x4096", "m": m, "speedup_vs_cublas": v}
            for m, speeds in ((1, {"lqe-w4a16-fused": 1.5, "lqe-w4a16-fused-pdl": 1.7, "triton-wna16-swap": 1.6}),
                              (4, {"lqe-w4a16-fused-pdl": 1.4, "triton-wna16-swap": 1.6}))
            for k, v in speeds.items()]
    assert kw8.implied_tables(rows)["WNA16_TABLE"] == [(1, "lqe-wna16-fused"), (None, "triton-wna16-swap")]


def test_floor_is_bytes_or_flops_whichever_is_larger():
    h100 = "NVIDIA H100 80GB HBM3"
    small = kw8.floor_us("triton-gemv", 1, 4096, 4096, 3000.0, h100)
    assert abs(small - (4096 * 4096 + 4096 + 2 * 4096) / 3e12 * 1e6) < 1e-6  # bytes-bound
    assert kw8.floor_us("cublas-bf16", 1, 4096, 4096, 3000.0, h100) > 1.9 * small
    big = kw8.floor_us("triton-w8a8", 8192, 4096, 4096, 3000.0, h100)
    assert abs(big - 2 * 8192 * 4096 * 4096 / (1979e6)) < 1e-6  # FLOP-bound
    assert kw8.floor_us("lqe-w8a8-layer", 1, 4096, 4096, 3000.0, h100) > small


# ------------------------------------------------------------------------------------------------ sweep tables
def _by_m(speeds: dict[int, dict[str, tuple[float, ...]]]) -> dict:
    return {m: {nm: list(v) for nm, v in d.items()} for m, d in speeds.items()}


def test_sweep_tables_pick_the_geo_mean_winner_per_m_and_keep_unmeasured_rows():
    from lqe.kernels import triton_gemv_w8a8 as tg
    from lqe.kernels import triton_w8a8 as tw

    a, b = tw.W8A8Config(16, 64, 256, split_k=0), tw.W8A8Config(16, 128, 128, split_k=0)
    g1, g2 = tg.GemvConfig(32, 512), tg.GemvConfig(64, 256, use_dot=True)
    cfgs = {f"triton-w8a8:{a}": a, f"triton-w8a8:{b}": b, f"triton-gemv:{g1}": g1, f"triton-gemv:{g2}": g2}
    by_m = _by_m({
        1: {f"triton-w8a8:{a}": (1.2, 1.3), f"triton-w8a8:{b}": (1.1, 1.1), f"triton-gemv:{g1}": (1.9, 1.8),
            f"triton-gemv:{g2}": (1.5, 1.5), "int-mm+epilogue": (0.5,), "table": (1.7, 1.7)},
        # b wins on geo-mean (sqrt(1.0 * 1.7) = 1.30 > 1.25) though a wins one shape
        16: {f"triton-w8a8:{a}": (1.3, 1.2), f"triton-w8a8:{b}": (1.0, 1.7), f"triton-gemv:{g1}": (1.1, 1.1),
             f"triton-gemv:{g2}": (1.4, 1.4), "int-mm+epilogue": (0.9, 0.9), "table": (1.4, 1.4)},
        # only the GEMM: the GEMV serves M <= 16; int-mm beats every config
        64: {f"triton-w8a8:{a}": (1.0, 1.0), f"triton-w8a8:{b}": (1.2, 1.2), "int-mm+epilogue": (1.5, 1.4)},
    })
    current = {"triton_w8a8.CONFIGS": [(16, "c16"), (64, "c64"), (256, "c256"), (None, "cbig")],
               "triton_gemv_w8a8.CONFIGS": [(1, "g1"), (4, "g4"), (16, "g16")],
               "W8A8_TABLE": [(16, "triton-gemv"), (128, "int-mm+epilogue"), (None, "triton-w8a8")]}
    t = kw8.implied_sweep_tables(by_m, cfgs, 2, "w8a8", current)
    assert t["triton_w8a8.CONFIGS"] == [(1, a), (64, b), (256, "c256"), (None, "cbig")]
    assert t["triton_gemv_w8a8.CONFIGS"] == [(1, g1), (16, g2)]
    # int-mm at M=64 is merged with the current (128, int-mm) row above it
    assert t["W8A8_TABLE"] == [(16, "triton-gemv"), (128, "int-mm+epilogue"), (None, "triton-w8a8")]
    src = kw8.format_table("triton_w8a8.CONFIGS", t["triton_w8a8.CONFIGS"][:2])
    assert src.startswith("CONFIGS = [\n    (1, W8A8Config(block_m=16, block_n=64, block_k=256") and src.endswith("]")
    ns = {"W8A8Config": tw.W8A8Config}
    exec(src, ns)  # paste-able: the module's own names
    assert ns["CONFIGS"] == [(1, a), (64, b)]
    exec(kw8.format_table("W8A8_TABLE", t["W8A8_TABLE"]), ns)
    assert ns["W8A8_TABLE"] == t["W8A8_TABLE"]


def test_sweep_tables_open_ended_when_the_largest_m_was_measured_and_the_default_current_tables():
    from lqe.kernels import dispatch
    from lqe.kernels import triton_fp8 as tf

    c1, c2 = tf.Fp8Config(16, 64, split_k=0), tf.Fp8Config(128, 128, 128, 8, 4, split_k=1)
    cfgs = {f"triton-fp8:{c1}": c1, f"triton-fp8:{c2}": c2, f"triton-fp8-block:{c1}": c1}
    by_m = _by_m({1: {f"triton-fp8:{c1}": (1.3,), "scaled-mm": (1.2,), f"triton-fp8-block:{c1}": (1.1,)},
                  4096: {f"triton-fp8:{c2}": (1.7,), "scaled-mm": (1.6,), "table": (1.6,)}})
    t = kw8.implied_sweep_tables(by_m, cfgs, 1, "fp8")  # current = the modules' tables
    assert t["triton_fp8.CONFIGS"] == [(1, c1), (None, c2)]
    # M=1 only, and its winner is the current first row's config: that row stands, the rest are the current ones
    assert tf.BLOCK_CONFIGS[0] == (16, c1) and t["triton_fp8.BLOCK_CONFIGS"] == tf.BLOCK_CONFIGS
    assert t["FP8_TABLE"] == [(None, "triton-fp8")]
    assert "triton_gemv_w8a8.FP8_CONFIGS" not in t  # no GEMV timed
    assert dispatch.FP8_TABLE[-1][0] is None


def test_merge_rows():
    cur = [(16, "x"), (64, "y"), (None, "z")]
    assert kw8.merge_rows([(1, "a"), (8, "a"), (16, "b")], cur) == [(8, "a"), (16, "b"), (64, "y"), (None, "z")]
    assert kw8.merge_rows([(1, "a"), (128, "y")], cur) == [(1, "a"), (None, "y")]
    assert kw8.merge_rows([(1, "a"), (32, "y")], cur) == [(1, "a"), (64, "y"), (None, "z")]
    assert kw8.merge_rows([], cur) == cur
    assert kw8.merge_rows([(1, "a"), (16, "b")], [(1, "g"), (16, "h")], open_end=False) == [(1, "a"), (16, "b")]


def test_sweep_labels_are_unresolved_so_every_shape_shares_them():
    from lqe.kernels import triton_fp8 as tf
    from lqe.kernels import triton_gemv_w8a8 as tg
    from lqe.kernels import triton_w8a8 as tw

    for mod, m in ((tw, 1), (tw, 1024), (tg, 1), (tg, 16), (tf, 1), (tf, 1024)):
        for cfg in mod.sweep_configs(m):
            # a label names an unresolved (auto) or a fixed split, never one resolved for a shape
            assert cfg.split_k >= 0 and ("skauto" in str(cfg)) == (cfg.split_k == 0)


# ------------------------------------------------------------------------------------------------ kernels.py rows
def test_producer_of_matches_the_model_fusion():
    """qkv / gate_up read a fused RMSNorm, down_proj a fused SiLU-mul, o_proj (the attention output) none: the pairs
    lqe/models/llama.py fuses."""
    import kernels as kb

    from lqe.models.llama import LlamaDecoderLayer

    consumers = {c for _, c in LlamaDecoderLayer.act_quant_pairs}
    assert "self_attn.o_proj" not in consumers and "mlp.down_proj" in consumers
    roles = dict(zip(("qkv", "o", "gate_up", "down"), kb.SHAPES))
    assert [kb.producer_of(*roles[r]) for r in ("qkv", "o", "gate_up", "down")] == ["rmsnorm", None, "rmsnorm", "silu"]
    h100 = "NVIDIA H100 80GB HBM3"
    assert kw8.floor_us("lqe-w8a8-layer", 16, 4096, 4096, 3000.0, h100, None) < \
        kw8.floor_us("lqe-w8a8-layer", 16, 4096, 4096, 3000.0, h100, "rmsnorm")


def test_rows_filter():
    import kernels as kb

    assert kb.parse_rows(None) == set(kb.ROW_GROUPS) and kb.parse_rows("w8a8, fp8") == {"w8a8", "fp8"}
    with pytest.raises(SystemExit, match="unknown group"):
        kb.parse_rows("w8a8,int4")
    names = [nm for g in kb.ROW_GROUPS.values() for nm in g]
    assert len(names) == len(set(names)) and kb.row_group("cublas-bf16") is None
    assert kb.row_group("lqe-fp8-block-layer") == "fp8" and kb.row_group("triton-gemv") == "w8a8"
    for flag in ("--rows", "--fp8-sweep", "--w8a8-sweep"):
        assert flag in open(kb.__file__).read()


@pytest.fixture
def w4a16_on_cpu(monkeypatch):
    """The W4A16 rows built on CPU with dispatch.WNA16_TABLE naming lqe-w4a16-mma: the kernels 'available', the layer
    selection giving the mma layout as it does on a GPU with that table, every GEMM call recorded, not run."""
    import kernels as kb

    import lqe.kernels as lk
    from lqe.kernels import dispatch, gemm, gemm_mma, repack, repack_mma
    from lqe.kernels import triton_wna16 as tw

    monkeypatch.setattr(dispatch, "WNA16_TABLE", list(dispatch.WNA16_MMA_TABLE))
    monkeypatch.delenv("LQE_WNA16_TABLE", raising=False)
    assert gemm.table_uses_mma()
    monkeypatch.setattr(lk, "available", lambda: True)

    def select(cw, device, dtype):
        p = repack_mma.repack_mma(cw, dtype) if gemm.table_uses_mma() else repack.repack_wna16(cw, dtype)
        return gemm.WNA16Kernel(p, "stub"), "stub"
    monkeypatch.setattr(lk, "select_w4a16_kernel", select)
    monkeypatch.setattr(tw, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(gemm_mma, "reserve_workspace", lambda device, n_pad: None)
    monkeypatch.setattr(kb, "rotating", lambda make, nbytes: [make()])
    monkeypatch.setattr(kb, "add_int4pack_row", lambda *a, **k: None)
    calls = []
    monkeypatch.setattr(lk, "wna16_gemm", lambda x, p, bias=None, out=None, path="auto", **k: calls.append(
        (path, type(p).__name__) + {True: ("pdl",), False: ("no-pdl",), None: ()}[k.get("pdl")]))
    monkeypatch.setattr(tw, "dequantize", lambda p, out=None: calls.append(("dequantize", type(p).__name__)))
    return kb, calls


def _layouts(out: dict, calls: list) -> dict[str, str]:
    seen = {}
    for name, (setup, *_) in out.items():
        if name == "cublas-bf16":
            continue
        calls.clear()
        setup(torch.zeros(1, 256, dtype=torch.bfloat16))()
        assert len(calls) == 1, (name, calls)
        seen[name] = calls[0]
    return seen


def test_w4a16_rows_time_their_own_layout_whatever_the_table(w4a16_on_cpu, monkeypatch):
    kb, calls = w4a16_on_cpu
    import kernels_w4a16 as k4

    want = {"lqe-w4a16": ("auto", "PackedMMA"),  # the layer path: what the table gives a layer
            "lqe-w4a16-fused": ("fused", "PackedWNA16", "no-pdl"), "lqe-w4a16-dequant": ("dequant", "PackedWNA16"),
            "triton-wna16": ("triton-wna16", "PackedWNA16"), "triton-wna16-swap": ("triton-wna16-swap", "PackedWNA16"),
            "triton-dequant+cublas": ("triton-dequant+cublas", "PackedWNA16"),
            "triton-dequant-l2+cublas": ("triton-dequant-l2+cublas", "PackedWNA16"),
            "triton-dequant-only": ("dequantize", "PackedWNA16"),
            "lqe-w4a16-mma": ("lqe-w4a16-mma", "PackedMMA"),
            "lqe-w4a16-mma-dequant+cublas": ("lqe-w4a16-mma-dequant+cublas", "PackedMMA"),
            "lqe-w4a16-mma-2cta": ("lqe-w4a16-mma", "PackedMMA"),
            "lqe-w4a16-mma-k2": ("lqe-w4a16-mma-k2", "PackedMMA"),
            # (the GEMV rows without -pdl launch without it, whatever the default: pdl=False)
            "lqe-w4a16-fused-t2": ("fused", "PackedWNA16", "no-pdl"),
            "lqe-w4a16-fused-t8": ("fused", "PackedWNA16", "no-pdl"),
            "lqe-w4a16-fused-ring": ("ring", "PackedWNA16", "no-pdl"),
            "lqe-w4a16-fused-pdl": ("fused", "PackedWNA16", "pdl"),
            "lqe-w4a16-fused-ring-pdl": ("ring", "PackedWNA16", "pdl")}
    monkeypatch.setattr(k4, "pdl_supported", lambda device: True)  # (sm_90+ only: the rows launch with pdl=True)
    out = {}
    kb.add_w4a16_rows(out, 256, 128, dev="cpu")
    w4a16_only = {*k4.FUSED_SPLIT_ROWS, k4.FUSED_RING_ROW, *k4.FUSED_PDL_ROWS}  # (kernels.py --w4a16's own rows)
    assert _layouts(out, calls) == {nm: v for nm, v in want.items() if nm not in w4a16_only}
    out = k4.w4a16_candidates(256, 128, kb.rotating, kb.cycler, dev="cpu")
    assert _layouts(out, calls) == {nm: v for nm, v in want.items() if nm in out}
    assert {"lqe-w4a16", "lqe-w4a16-dequant", "triton-wna16", "triton-wna16-swap", "lqe-w4a16-mma",
            "triton-dequant-l2+cublas", "lqe-w4a16-mma-2cta", *k4.SMALL_M_ROWS} <= set(out)


def test_a_rows_run_keeps_the_other_rows_of_the_file(tmp_path):
    """``--rows w8a8,fp8`` writes into the kernels-<gpu>.json the gate wrote: the rows it does not time again stay,
    marked carried_over with their run's commit; another GPU's file is not mixed in."""
    import json

    path = tmp_path / "kernels-x.json"
    rows = [{"kernel": "lqe-w4a16", "shape": "4096x6144", "m": 1, "us": 10.0},
            {"kernel": "cublas-bf16", "shape": "4096x6144", "m": 1, "us": 30.0}]
    path.write_text(json.dumps({"device": "GPU A", "commit": "abc1234", "rows": rows}))
    import kernels

    kept = kernels.carried_rows(path, "GPU A")
    assert [r["kernel"] for r in kept] == ["lqe-w4a16", "cublas-bf16"]
    assert all(r["carried_over"] == "abc1234" for r in kept)
    assert kernels.carried_rows(path, "GPU B") == []
    assert kernels.carried_rows(tmp_path / "missing.json", "GPU A") == []


@pytest.fixture
def stub_gpu(monkeypatch):
    """benchmarks/kernels.py on a stand-in GPU: CUDA calls answered on the CPU, a row's time is what its function
    returns."""
    import kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stub GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"multi_processor_count": 132}))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    real_randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **k: real_randn(*a, **k))
    monkeypatch.setattr(kernels, "copy_bandwidth", lambda: 3000.0)
    monkeypatch.setattr(kernels, "bench", lambda fn, reps=100: fn())
    return kernels


def test_kernels_py_goes_on_after_a_device_fault(tmp_path, monkeypatch, stub_gpu):
    """A kernel that loses the CUDA context in benchmarks/kernels.py: the run saves its rows less the faulted
    (shape, M), and a fresh process (here: main called again with the --resume state the restart would pass) goes on
    from there without that kernel, so the rows after it are measured and the fault is in the JSON."""
    import json

    import common

    kernels = stub_gpu

    lost = []
    monkeypatch.setattr(common, "cuda_fault", lambda: "AcceleratorError: CUDA error: an illegal memory access" if lost
                        else None)

    def fake_candidates(k, n, groups):
        def timed(us):
            return lambda x: lambda: us

        def faulting(x):
            def run():
                if x.shape[0] == 16 and k == 4096 and n == 4096:  # the second shape at M = 16 faults
                    lost.append(1)
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                return 5.0
            return run
        return {"cublas-bf16": (timed(10.0), k * n * 2), "lqe-w4a16-mma": (faulting, k * n // 2),
                "triton-wna16": (timed(8.0), k * n // 2)}

    monkeypatch.setattr(kernels, "candidates", fake_candidates)
    restarts = []

    def restart(extra):  # the real one replaces the process (os.execv) and never returns
        restarts.append(extra)
        raise SystemExit("restarted")

    monkeypatch.setattr(kernels, "restart", restart)
    out = tmp_path / "kernels-stub.json"
    argv = ["--m", "1", "16", "--shapes", "4096x6144", "4096x4096", "4096x28672", "--out", str(out)]
    with pytest.raises(SystemExit, match="restarted"):
        kernels.main(argv)
    assert restarts and restarts[0][0] == "--resume"
    doc = json.loads(out.read_text())
    got = {(r["kernel"], r["shape"], r["m"]) for r in doc["rows"]}
    assert ("lqe-w4a16-mma", "4096x6144", 16) in got and ("cublas-bf16", "4096x4096", 1) in got
    assert not any(s == "4096x4096" and m == 16 for _, s, m in got)  # the faulted pair is measured again
    assert doc["device_faults"][0]["kernel"] == "lqe-w4a16-mma" and not doc["complete"]

    lost.clear()  # the fresh process has a usable context
    assert kernels.main(argv + restarts[0]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["kernel"], r["shape"], r["m"]): r for r in doc["rows"]}
    assert doc["complete"] and doc["device_faults"][0]["shape"] == "4096x4096"
    for shape in ("4096x6144", "4096x4096", "4096x28672"):
        for m in (1, 16):
            assert rows[("cublas-bf16", shape, m)]["us"] == 10.0 and ("triton-wna16", shape, m) in rows
    assert ("lqe-w4a16-mma", "4096x28672", 1) not in rows  # left out after its fault
    assert ("lqe-w4a16-mma", "4096x4096", 1) in rows  # measured before it
    assert len(doc["rows"]) == len(rows)  # nothing measured twice


def test_kernels_py_restarts_past_a_hung_kernel(tmp_path, monkeypatch, stub_gpu):
    """A row that never returns: after LQE_BENCH_HANG_S a watchdog saves the rows (less the hung pair) and restarts
    the run without that kernel, ending the process if it cannot."""
    import json
    import time

    import common

    kernels = stub_gpu

    monkeypatch.setattr(common, "HANG_S", 0.3)
    hung = []

    def fake_candidates(k, n, groups):
        def hangs(x):
            def run():
                if x.shape[0] == 16 and not hung:
                    hung.append(1)
                    time.sleep(1.5)  # the watchdog fires meanwhile
                return 4.0
            return run
        return {"cublas-bf16": (lambda x: lambda: 10.0, k * n * 2), "lqe-w4a16-mma": (hangs, k * n // 2)}

    monkeypatch.setattr(kernels, "candidates", fake_candidates)
    restarts, exits = [], []
    monkeypatch.setattr(kernels, "restart", lambda extra: restarts.append(extra))
    monkeypatch.setattr(common.os, "_exit", exits.append)
    out = tmp_path / "kernels-stub.json"
    argv = ["--m", "1", "16", "--shapes", "4096x6144", "4096x4096", "--out", str(out)]
    kernels.main(argv)  # (here the process is not replaced: the stuck row returns after the watchdog fired)
    assert exits == [4] and len(restarts) == 1 and restarts[0][0] == "--resume"
    state = json.loads(open(restarts[0][1]).read())
    assert state["skip"] == ["lqe-w4a16-mma"] and "no return after" in state["faults"][0]["error"]
    assert {(r["kernel"], r["m"]) for r in state["rows"]} == {("cublas-bf16", 1), ("lqe-w4a16-mma", 1)}
    monkeypatch.setattr(kernels, "restart", lambda extra: pytest.fail("restarted again"))
    assert kernels.main(argv + restarts[0]) == 0
    doc = json.loads(out.read_text())
    got = {(r["kernel"], r["shape"], r["m"]) for r in doc["rows"]}
    assert ("cublas-bf16", "4096x6144", 16) in got and ("lqe-w4a16-mma", "4096x4096", 1) not in got
    assert doc["complete"] and doc["device_faults"][0]["kernel"] == "lqe-w4a16-mma"


def test_kernels_py_w4a16_saves_the_implied_tables_and_completes(tmp_path, monkeypatch, stub_gpu):
    """``kernels.py --w4a16`` ends with a complete JSON: every row has a kernel, shape and M, and the WNA16_MMA_TABLE
    and WNA16_TABLE the run implies are in ``implied_tables`` (the first used to be appended as a shape-less row,
    which the final save's row keys could not read: KeyError, the file left ``complete: false``)."""
    import json

    import kernels_w4a16 as k4

    kernels = stub_gpu
    speed = {1: {"lqe-w4a16-mma": 5.0, "lqe-w4a16-mma-dequant+cublas": 9.0, "triton-wna16-swap": 6.0},
             16: {"lqe-w4a16-mma": 6.0, "lqe-w4a16-mma-dequant+cublas": 9.5, "triton-wna16-swap": 7.0},
             256: {"lqe-w4a16-mma": 12.0, "lqe-w4a16-mma-dequant+cublas": 8.0, "triton-wna16-swap": 11.0,
                   "triton-dequant+cublas": 9.0}}

    def fake_candidates(k, n, rotating, cycler, dev="cuda"):
        def timed(name):
            return lambda x: lambda: speed[x.shape[0]].get(name, 12.0 if name == "triton-dequant+cublas" else 10.0)
        return {name: (timed(name), k * n // 2) for name in ("cublas-bf16", "lqe-w4a16", *k4.MMA_ROWS,
                                                             "triton-wna16-swap", "triton-dequant+cublas")}

    monkeypatch.setattr(k4, "w4a16_candidates", fake_candidates)
    out = tmp_path / "kernels-w4a16-stub.json"
    assert kernels.main(["--w4a16", "--m", "1", "16", "256", "--shapes", "256x128", "512x128", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"]
    assert all({"kernel", "shape", "m"} <= r.keys() for r in doc["rows"])
    assert len(doc["rows"]) == 2 * 3 * (4 + len(k4.MMA_ROWS))  # cuBLAS, the layer path, swap, dequant + the mma rows
    assert [tuple(t) for t in doc["implied_tables"]["WNA16_MMA_TABLE"]] == [
        (16, "lqe-w4a16-mma"), (None, "lqe-w4a16-mma-dequant+cublas")]
    # and the wna16 layout's table, from its kernels' rows (one table per weight layout)
    assert [tuple(t) for t in doc["implied_tables"]["WNA16_TABLE"]] == [
        (16, "triton-wna16-swap"), (None, "triton-dequant+cublas")]


@pytest.mark.parametrize("flag,sweep", [("--w8a8-sweep", "w8a8_sweep"), ("--fp8-sweep", "fp8_sweep")])
def test_a_config_sweep_saves_its_implied_config_tables(tmp_path, monkeypatch, stub_gpu, flag, sweep):
    """A config sweep saves after every shape the tables it implies, config tables included: their dataclass configs
    are written as the repr the run prints to paste (on the H200 at 50fb9ce the W8A8 sweep's first save raised
    TypeError, W8A8Config is not JSON serializable, and the run lost every shape after the first)."""
    import json

    from lqe.kernels.triton_fp8 import Fp8Config
    from lqe.kernels.triton_gemv_w8a8 import GemvConfig
    from lqe.kernels.triton_w8a8 import W8A8Config

    kernels = stub_gpu
    gemv, tile, fp8 = GemvConfig(16, 1024, use_dot=False, num_warps=8), W8A8Config(16, 64, 512), Fp8Config(16, 64, 128)
    shapes = ["256x128", "512x128"]

    def fake_sweep(shape_list, ms, copy_gbps, on_shape=None):
        rows = []
        for shape in shape_list:
            rows.append({"kernel": "cublas-bf16", "shape": shape, "m": 1, "us": 2.0})
            on_shape(rows, {"triton_gemv_w8a8.CONFIGS": [(1, gemv)], "triton_w8a8.CONFIGS": [(16, tile), (None, tile)],
                            "triton_fp8.CONFIGS": [(None, fp8)],
                            "W8A8_TABLE": [(1, "triton-gemv"), (None, "triton-w8a8")]})
        return rows

    monkeypatch.setattr(kernels, sweep, fake_sweep)
    out = tmp_path / "sweep.json"
    assert kernels.main([flag, "--m", "1", "--shapes", *shapes, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["shape"] for r in doc["rows"]] == shapes
    tables = doc["implied_tables"]
    assert tables["triton_gemv_w8a8.CONFIGS"] == [[1, repr(gemv)]]
    assert tables["triton_w8a8.CONFIGS"] == [[16, repr(tile)], [None, repr(tile)]]
    assert tables["triton_fp8.CONFIGS"] == [[None, repr(fp8)]]
    assert tables["W8A8_TABLE"] == [[1, "triton-gemv"], [None, "triton-w8a8"]]
    assert eval(tables["triton_gemv_w8a8.CONFIGS"][0][1], {"GemvConfig": GemvConfig}) == gemv  # paste-able as saved


def test_a_rows_run_into_an_empty_out_keeps_the_committed_rows(tmp_path, monkeypatch, stub_gpu):
    """On the device $OUT starts empty: ``--rows w8a8,fp8 --out $OUT/kernels-<gpu>.json`` keeps the rows (and implied
    tables) of the committed benchmarks/results file of that name, when it is the same GPU's, so copying the file
    back does not erase the W4A16 rows; another GPU's committed file is not mixed in; an existing --out wins."""
    import json

    kernels = stub_gpu
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(kernels, "RESULTS", results)
    committed = [{"kernel": "lqe-w4a16", "shape": "256x128", "m": 1, "us": 4.0},
                 {"kernel": "lqe-w8a8", "shape": "256x128", "m": 1, "us": 99.0}]
    (results / "kernels-stub.json").write_text(json.dumps(
        {"device": "Stub GPU", "env": {"lqe_commit": "c0ffee1"}, "rows": committed,
         "implied_tables": {"WNA16_TABLE": [[None, "lqe-wna16-fused"]]}, "complete": True}))
    (results / "kernels-other.json").write_text(json.dumps({"device": "Other GPU", "rows": committed}))
    monkeypatch.setattr(kernels, "candidates", lambda k, n, groups: {
        "cublas-bf16": (lambda x: lambda: 10.0, k * n * 2), "lqe-w8a8": (lambda x: lambda: 5.0, k * n)})
    argv = ["--rows", "w8a8,fp8", "--m", "1", "--shapes", "256x128"]
    out = tmp_path / "out" / "kernels-stub.json"
    assert kernels.main(argv + ["--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["kernel"], r["shape"], r["m"]): r for r in doc["rows"]}
    assert doc["complete"] and len(rows) == len(doc["rows"]) == 3
    assert rows[("lqe-w4a16", "256x128", 1)]["carried_over"] == "c0ffee1"
    assert rows[("lqe-w8a8", "256x128", 1)]["us"] == 5.0 and "carried_over" not in rows[("lqe-w8a8", "256x128", 1)]
    assert doc["implied_tables"]["WNA16_TABLE"] == [[None, "lqe-wna16-fused"]]
    assert doc["implied_tables"]["W8A8_TABLE"] == [[None, "lqe-w8a8"]]
    assert doc["carried_from"].endswith("kernels-stub.json")

    other = tmp_path / "out" / "kernels-other.json"
    assert kernels.main(argv + ["--out", str(other)]) == 0
    assert {r["kernel"] for r in json.loads(other.read_text())["rows"]} == {"cublas-bf16", "lqe-w8a8"}

    out.write_text(json.dumps({"device": "Stub GPU", "rows": [{"kernel": "triton-wna16", "shape": "256x128", "m": 1}]}))
    assert kernels.main(argv + ["--out", str(out)]) == 0  # the existing --out file, not the committed one
    assert {r["kernel"] for r in json.loads(out.read_text())["rows"]} == {"triton-wna16", "cublas-bf16", "lqe-w8a8"}
