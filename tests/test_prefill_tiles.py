"""The prefill tile map (lqe/kernels/prefill_tiles.py) and the tiled, GQA-packed prefill kernel on awkward mixed
steps, on CPU: the map's exact tiles, one build per step, and the kernels under Triton's interpreter
(``TRITON_INTERPRET=1``, in a fresh process as in ``tests/test_triton_interpret.py``) against the torch reference."""
from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

from lqe.forward_context import AttentionMetadata
from hopper_compile import spill_bytes
from lqe.kernels import prefill_tiles as pt
from triton_compat import run_interpreted


def _meta(specs: list[tuple[int, int]]) -> AttentionMetadata:
    """Host lists of a step of ``(query_len, context_len)`` rows (device tensors: placeholders)."""
    qsl, lens = [0], []
    for q, c in specs:
        qsl.append(qsl[-1] + q)
        lens.append(q + c)
    z = torch.zeros(1, dtype=torch.int32)
    return AttentionMetadata(slot_mapping=z, query_start_loc=z, seq_lens=z, block_tables=z.view(1, 1),
                             max_query_len=max(q for q, _ in specs), max_seq_len=max(lens),
                             query_start_loc_cpu=qsl, seq_lens_cpu=lens, block_size=16)


def test_tile_map_lists_exactly_the_prefill_tiles_longest_first():
    m = _meta([(1, 40), (70, 30), (1, 5), (3, 0), (0, 4), (17, 100), (1, 0)])
    tiles = pt.build_tile_map(m.query_start_loc_cpu, m.seq_lens_cpu, 16)
    # (seq, tile): keys read = min(seq_len, ctx + 16 (tile + 1)): 117, 116, 100, 94, 78, 62, 46, 3
    assert tiles == [(5, 1), (5, 0), (1, 4), (1, 3), (1, 2), (1, 1), (1, 0), (3, 0)]
    assert pt.build_tile_map([0, 1, 2, 3], [5, 9, 1], 16) == []  # decode-only: no tile
    with pytest.raises(ValueError, match="tokens_per_tile"):
        pt.build_tile_map([0, 4], [4], 0)


@pytest.mark.parametrize("tokens", [1, 7, 16, 21, 64])
def test_tile_map_covers_every_prefill_token_once(tokens):
    rnd = random.Random(tokens)
    for _ in range(20):
        specs = [(rnd.choice([0, 1, 1, 1, 2, rnd.randint(2, 300)]), rnd.randint(0, 200)) for _ in range(rnd.randint(1, 40))]
        m = _meta(specs)
        tiles = pt.build_tile_map(m.query_start_loc_cpu, m.seq_lens_cpu, tokens)
        covered = [(b, tok) for b, t in tiles for tok in range(t * tokens, min((t + 1) * tokens, specs[b][0]))]
        want = [(b, tok) for b, (q, _) in enumerate(specs) if q > 1 for tok in range(q)]
        assert sorted(covered) == want and len(covered) == len(set(covered))
        assert all(t * tokens < specs[b][0] for b, t in tiles)  # no empty tile
        keys = [min(c + q, c + (t + 1) * tokens) for b, t in tiles for q, c in [specs[b]]]
        assert keys == sorted(keys, reverse=True)


def test_tile_map_is_built_once_per_step(monkeypatch):
    builds = []
    real = pt.build_tile_map
    monkeypatch.setattr(pt, "build_tile_map", lambda *a: builds.append(a) or real(*a))
    step1 = _meta([(1, 9), (40, 3), (1, 2), (5, 0)])
    maps = [pt.step_plan(step1).tile_map(16, torch.device("cpu")) for _layer in range(32)]
    assert len(builds) == 1 and all(x is maps[0] for x in maps)
    assert maps[0].dtype == torch.int32 and maps[0].tolist() == [[1, 2], [1, 1], [1, 0], [3, 0]]
    assert pt.step_plan(step1).has_decode
    step2 = _meta([(12, 0), (3, 3)])  # the next step: a new metadata object, a new map
    for _layer in range(32):
        assert pt.step_plan(step2).tile_map(16, "cpu").tolist() == [[0, 0], [1, 0]]
    assert len(builds) == 2 and not pt.step_plan(step2).has_decode


SCRIPT = """
    # fp32 -> fp8 (e4m3 and e5m2) as the GPU (and torch) rounds it
    triton_compat.patch_fp8_rounding(e5m2=True)
    import torch
    import test_triton_attention as A
    import test_triton_attention_fp8 as A8
    from lqe.kernels import prefill_tiles as pt

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
    # decode rows between prefill rows, cached prefixes, q_len not a multiple of the tile, an empty row, padding;
    # GQA 4 (packed: 16 tokens x 4 heads), 3 (21 tokens x 3 heads, one idle row), 1 (64 tokens)
    mixed = [(1, 40), (70, 30), (1, 5), (3, 0), (1, 1), (17, 100)]
    A.check_attention(mixed, 8, 2, 128, f16, "cpu", pad_tokens=3, strided_kv=True)
    A.check_attention([(22, 10), (1, 60), (43, 0), (1, 0), (2, 21)], 6, 2, 80, bf16, "cpu", block_size=8)
    A.check_attention([(1, 20), (65, 3), (1, 9), (2, 70)], 4, 4, 64, f32, "cpu")
    # the unpacked and the dense (old) launches compute the same
    A.check_attention(mixed, 8, 2, 64, f16, "cpu", pack_gqa=False)
    A.check_attention(mixed, 6, 2, 64, f32, "cpu", prefill_grid="dense", pack_gqa=True)
    # fp8 KV: packed GQA 4, e4m3, bf16 queries; GQA 3, e5m2, head dim 80
    A8.check_attention_fp8(mixed, 8, 2, 128, bf16, "cpu", E4M3, pad_tokens=2)
    A8.check_attention_fp8([(1, 33), (25, 7), (1, 2)], 6, 2, 80, f16, "cpu", E5M2, block_size=8)

    # tiles vs dense grid, same packing: the same programs, bit for bit; the tile map is built once per step
    from lqe.kernels import triton_attention as ta
    builds = []
    real = pt.build_tile_map
    pt.build_tile_map = lambda *a: builds.append(a) or real(*a)
    q, k, v, cache, meta = A.make_case([(1, 30), (19, 12), (1, 4), (5, 0)], 8, 2, 64, f32, "cpu", seed=3)
    ta.store_kv(k, v, cache, meta.slot_mapping)
    layers = [ta.paged_attention(q, cache, meta, 0.125) for _ in range(4)]
    assert len(builds) == 1, builds
    assert all(torch.equal(x, layers[0]) for x in layers)
    dense = ta.paged_attention(q, cache, meta, 0.125, prefill_grid="dense")
    assert torch.equal(dense, layers[0])
    q2, k2, v2, cache2, meta2 = A.make_case([(9, 0), (1, 3)], 8, 2, 64, f32, "cpu", seed=4)
    ta.paged_attention(q2, cache2, meta2, 0.125)
    ta.paged_attention(q2, cache2, meta2, 0.125)
    assert len(builds) == 2, builds
    print("PREFILL-TILES-OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
def test_tiled_prefill_under_interpreter():
    run_interpreted(SCRIPT, "PREFILL-TILES-OK")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="ahead-of-time compilation needs the real JIT")
@pytest.mark.parametrize("cfg", [
    dict(q="bf16", kv="bf16", GROUP=4, PACK=4, HEAD_DIM=128, QUANT=False),  # llama3-8b: packed
    dict(q="bf16", kv="bf16", GROUP=4, PACK=1, HEAD_DIM=128, QUANT=False, DENSE=True),  # the baseline grid
    dict(q="fp16", kv="fp16", GROUP=3, PACK=3, HEAD_DIM=80, QUANT=False),  # 21 tokens x 3 heads, D padded
    dict(q="bf16", kv="fp8e4nv", GROUP=4, PACK=4, HEAD_DIM=128, QUANT=True),
    dict(q="fp16", kv="fp16", GROUP=1, PACK=1, HEAD_DIM=256, QUANT=False),
], ids=["bf16-g4-d128", "dense-d128", "fp16-g3-d80", "fp8-g4-d128", "fp16-g1-d256"])
def test_tiled_prefill_compiles_for_hopper_without_spills(cfg):
    """The prefill kernel compiles to sm_90 with tensor-core dots and no register spills (ptxas -v: the PTX alone
    never shows them), with the block sizes paged_attention picks for the head dim."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lqe.kernels import triton_attention as ta

    cfg = dict(cfg)
    q, kv = cfg.pop("q"), cfg.pop("kv")
    block_m, block_n, warps = ta._blocks(cfg["HEAD_DIM"])
    consts = dict(PAGE=16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(cfg["HEAD_DIM"]),
                  DENSE=False, DOT_F32=False, PRECISION=None)
    consts.update(cfg)
    types = {"Q": f"*{q}", "KV": f"*{kv}", "Out": f"*{q}", "BlockTables": "*i32", "QueryStart": "*i32",
             "SeqLens": "*i32", "Tiles": "*i32", "KScale": "*fp32", "VScale": "*fp32", "scale_log2": "fp32"}
    fn = ta._prefill_kernel
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": 2})
    ptx = k.asm["ptx"]
    assert "mma" in ptx, "the prefill kernel should use tensor cores"
    assert ".local" not in ptx, "register spills to local memory"
    assert spill_bytes(ptx) == 0, "ptxas spills registers"
