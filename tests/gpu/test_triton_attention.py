"""Triton paged attention and KV store against the torch reference, on ragged batches.

The helpers ``make_case`` / ``check_attention`` also run on CPU under ``TRITON_INTERPRET=1``
(``tests/test_triton_interpret.py`` calls them in a subprocess).
"""
from __future__ import annotations

import pytest
import torch

from lqe.forward_context import AttentionMetadata
from lqe.kernels import attention_ref as ref

ATOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def make_case(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: str, block_size: int = 16, seed: int = 0, pad_tokens: int = 0):
    """``specs``: one ``(query_len, context_len)`` per sequence. The cache holds random K/V everywhere (the
    cached prefix and garbage elsewhere); blocks are handed out in a shuffled order. ``pad_tokens`` extra tokens
    with slot -1 follow the last sequence (they must not be written)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(q + c) // block_size) for q, c in specs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq)
    tables, slots, qsl, seq_lens, nxt = [], [], [0], [], 0
    for (q, c), n in zip(specs, blocks_per_seq):
        row = perm[nxt:nxt + n]
        nxt += n
        tables.append(row + [0] * (max_blocks - n))
        slots += [row[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
        qsl.append(qsl[-1] + q)
        seq_lens.append(q + c)
    slots += [-1] * pad_tokens
    t = qsl[-1] + pad_tokens
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    query, key, value = rnd(t, num_heads, head_dim), rnd(t, num_kv_heads, head_dim), rnd(t, num_kv_heads, head_dim)
    kv_cache = rnd(2, num_blocks, block_size, num_kv_heads, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(q for q, _ in specs), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, block_size=block_size,
    )
    to = lambda x: x.to(device)  # noqa: E731
    return to(query), to(key), to(value), to(kv_cache), meta


def check_attention(specs, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cuda",
                    block_size=16, num_splits=None, seed=0, pad_tokens=0, strided_kv=False, **attn_kw) -> float:
    """``attn_kw``: extra ``paged_attention`` arguments (``prefill_grid``, ``pack_gqa``)."""
    from lqe.kernels import triton_attention as ta

    query, key, value, cache, meta = make_case(specs, num_heads, num_kv_heads, head_dim, dtype, device,
                                               block_size, seed, pad_tokens)
    if strided_kv:  # K and V as views into one fused qkv tensor, as the model produces them
        qkv = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
        h_d, kv_d = num_heads * head_dim, num_kv_heads * head_dim
        query = qkv[:, :h_d].view(-1, num_heads, head_dim)
        key = qkv[:, h_d:h_d + kv_d].view(-1, num_kv_heads, head_dim)
        value = qkv[:, h_d + kv_d:].view(-1, num_kv_heads, head_dim)
    scale = head_dim ** -0.5
    cache_ref = cache.clone()
    ref.store_kv(key, value, cache_ref, meta.slot_mapping)
    ta.store_kv(key, value, cache, meta.slot_mapping)
    assert torch.equal(cache, cache_ref), "triton store_kv differs from the reference"
    n = meta.query_start_loc_cpu[-1]
    expected = ref.paged_attention_ref(query[:n], cache_ref, meta, scale).float()
    got = ta.paged_attention(query, cache, meta, scale, num_splits=num_splits, **attn_kw)[:n].float()
    err = (got - expected).abs().max().item()
    assert err <= ATOL[dtype], f"max abs error {err} > {ATOL[dtype]} for {specs} {dtype} D={head_dim}"
    return err


# ------------------------------------------------------------------------------------------------ GPU tests
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, gpu]
DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_with_cached_prefix(dtype, head_dim):
    check_attention([(37, 0), (5, 16), (128, 300), (2, 7), (200, 33)], 8, 2, head_dim, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 16])
def test_decode_long_contexts_split_k(dtype, head_dim, num_splits):
    specs = [(1, 4000), (1, 17), (1, 0), (1, 1023), (1, 2500)]
    check_attention(specs, 32, 8, head_dim, dtype, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (14, 2), (16, 1)])
def test_mixed_batch_gqa(dtype, heads):
    specs = [(1, 900), (64, 100), (1, 5), (300, 0), (1, 3000), (17, 17)]
    check_attention(specs, heads[0], heads[1], 128, dtype, pad_tokens=5, strided_kv=True)


@pytest.mark.parametrize("head_dim", [16, 32, 80, 256])
@pytest.mark.parametrize("block_size", [1, 16, 32, 256])
def test_odd_head_dims_and_block_sizes(head_dim, block_size):
    check_attention([(1, 700), (40, 90), (1, 1)], 4, 2, head_dim, torch.float16, block_size=block_size)


def test_many_decode_rows():
    specs = [(1, (i * 997) % 3000) for i in range(64)]
    check_attention(specs, 32, 8, 128, torch.bfloat16)


# ------------------------------------------------------------------ mixed steps: the prefill tile map, GQA packing
def _mixed_specs(num_decodes: int, prefill: tuple[int, int], every: int = 16) -> list[tuple[int, int]]:
    """Decode rows of assorted context lengths with the prefill chunk and two short prefill rows among them."""
    specs = [(1, (i * 389) % 1500 + 1) for i in range(num_decodes)]
    specs.insert(num_decodes // 2, prefill)
    specs.insert(every, (2, 33))
    specs.insert(3 * every, (19, 0))
    return specs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((12, 4), 80), ((8, 8), 64), ((16, 2), 128),
                                            ((8, 2), 256)])
@pytest.mark.parametrize("pack_gqa", [None, False])
def test_mixed_step_tiles_vs_reference(dtype, heads, head_dim, pack_gqa):
    """Decodes around a chunked prefill over a cached prefix (q_len not a multiple of any tile): tiled launch, packed
    GQA or not, == the reference."""
    check_attention(_mixed_specs(40, (301, 700)), heads[0], heads[1], head_dim, dtype, pad_tokens=7,
                    strided_kv=True, pack_gqa=pack_gqa)


@pytest.mark.parametrize("pack_gqa", [True, False])
def test_tiled_grid_equals_dense_grid_bitwise(pack_gqa):
    """The tile map runs the same programs as the dense (old) grid, minus the idle ones: identical outputs."""
    from lqe.kernels import triton_attention as ta

    q, k, v, cache, meta = make_case(_mixed_specs(100, (512, 1000)), 32, 8, 128, torch.bfloat16, "cuda")
    ta.store_kv(k, v, cache, meta.slot_mapping)
    tiles = ta.paged_attention(q, cache, meta, 0.088, pack_gqa=pack_gqa)
    dense = ta.paged_attention(q, cache, meta, 0.088, pack_gqa=pack_gqa, prefill_grid="dense")
    assert torch.equal(tiles, dense)


def test_mixed_step_builds_tiles_once_without_syncs(monkeypatch):
    """Every layer of a step shares its tile map (one build, one pinned non-blocking copy); no layer syncs."""
    from lqe.kernels import prefill_tiles as pt
    from lqe.kernels import triton_attention as ta

    builds = []
    real = pt.build_tile_map
    monkeypatch.setattr(pt, "build_tile_map", lambda *a: builds.append(a) or real(*a))
    q, k, v, cache, meta = make_case(_mixed_specs(255, (512, 1024)), 32, 8, 128, torch.bfloat16, "cuda")
    ta.store_kv(k, v, cache, meta.slot_mapping)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # torch-side syncs only (Triton launches and compiles are not torch's)
    try:
        outs = [ta.paged_attention(q, cache, meta, 0.088) for _layer in range(8)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(builds) == 1
    n = meta.query_start_loc_cpu[-1]
    expected = ref.paged_attention_ref(q[:n], cache, meta, 0.088).float()
    for o in outs:
        assert (o[:n].float() - expected).abs().max().item() <= ATOL[torch.bfloat16]


def test_steps_with_other_tile_counts_reuse_the_compiled_prefill_kernel():
    """The tile count is a grid dimension: steps of different shapes (same model) compile nothing new."""
    from lqe.kernels import triton_attention as ta

    def compiled() -> int:  # Triton's per-device kernel caches: (kernel_cache, key_cache, target, backend, binder)
        return sum(len(c[0]) for c in ta._prefill_kernel.device_caches.values())

    seen = []
    for i, specs in enumerate([_mixed_specs(10, (64, 0)), _mixed_specs(30, (500, 300)), [(7, 5), (1, 3)],
                               _mixed_specs(3, (1000, 17))]):
        q, k, v, cache, meta = make_case(specs, 32, 8, 128, torch.bfloat16, "cuda", seed=i)
        tables = torch.zeros(meta.num_seqs, 128, dtype=torch.int32, device="cuda")  # one width, as in the engine
        tables[:, :meta.block_tables.shape[1]] = meta.block_tables
        meta.block_tables = tables
        ta.store_kv(k, v, cache, meta.slot_mapping)
        n = meta.query_start_loc_cpu[-1]
        got = ta.paged_attention(q, cache, meta, 0.088)[:n].float()
        assert (got - ref.paged_attention_ref(q[:n], cache, meta, 0.088).float()).abs().max().item() <= 4e-2
        seen.append(compiled())
    assert seen[0] >= 1 and seen == [seen[0]] * len(seen), seen
