"""Reference paged attention in plain torch: runs on CPU and GPU, and is the ground truth for GPU kernels.

Handles ragged batches in one call: prefill chunks with a cached prefix, decodes, and mixes of both; GQA by
grouping query heads over their shared KV head.

Quantized cache (``kv_cache`` of dtype float8_e4m3fn / float8_e5m2): the cache holds ``x / scale`` rounded to
fp8, saturated at the format's largest finite value; reads multiply by the layer's ``k_scale`` / ``v_scale``
(float32 tensors of one element, so a CUDA graph reads their current value). Only the gathered blocks of the
step are dequantized, never a full copy of the cache.
"""
from __future__ import annotations

import torch

from lqe.forward_context import AttentionMetadata


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 format (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in fp32, saturated to ``dtype``'s finite range, rounded to ``dtype`` (to nearest even)."""
    m = fp8_max(dtype)
    return (x.float() / scale).clamp_(-m, m).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp8 cache values -> float32 ``x * scale``; a 16/32-bit cache passes through unchanged."""
    if not is_fp8(x.dtype):
        return x
    return x.float() * (1.0 if scale is None else scale)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` ``[T, KVH, D]`` into the paged cache at ``slot_mapping`` (``-1`` = skip); an fp8
    cache stores them quantized with ``k_scale`` / ``v_scale`` (1.0 when not given)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    slot_mapping = slot_mapping.long()
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    if is_fp8(kv_cache.dtype):  # torch has no fp8 index_copy_: copy the bytes
        one = torch.ones(1, dtype=torch.float32, device=key.device)
        k8 = quantize_kv(key, one if k_scale is None else k_scale, kv_cache.dtype)
        v8 = quantize_kv(value, one if v_scale is None else v_scale, kv_cache.dtype)
        flat = flat.view(torch.uint8)
        flat[0].index_copy_(0, slot_mapping, k8.view(torch.uint8))
        flat[1].index_copy_(0, slot_mapping, v8.view(torch.uint8))
        return
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, k_scale: torch.Tensor | None = None,
              v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached K and V of one sequence: two ``[seq_len, KVH, D]`` tensors (fp8 caches come
    back dequantized, in float32)."""
    block_size = kv_cache.shape[2]
    n = -(-seq_len // block_size)
    blocks = kv_cache[:, block_table[:n].long()]  # [2, n, BS, KVH, D]
    kv = blocks.reshape(2, n * block_size, *kv_cache.shape[3:])[:, :seq_len]
    return dequantize_kv(kv[0], k_scale), dequantize_kv(kv[1], v_scale)


def paged_attention_ref(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, H, D]`` over each sequence's cached K/V (already stored); an fp8
    cache is read through ``k_scale`` / ``v_scale``."""
    out = torch.empty_like(query)
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    decode = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] == 1]
    if len(decode) > 1:
        _batched_decode(query, kv_cache, meta, decode, scale, out, k_scale, v_scale)
        done = set(decode)
    else:
        done = set()
    for i in range(meta.num_seqs):
        if i in done:
            continue
        start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
        if end == start:
            continue
        q = query[start:end]  # [L, H, D]
        k, v = gather_kv(kv_cache, meta.block_tables[i], seq_len, k_scale, v_scale)
        ctx = seq_len - (end - start)
        q_pos = torch.arange(ctx, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]  # [L, S]
        o = _attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale)  # [H, L, D]
        out[start:end] = o.transpose(0, 1)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [H, L, D]``, ``k``/``v`` ``[KVH, S, D]``, ``mask [L, S]`` (True = attend) -> ``[H, L, D]``.

    Query heads ``h`` use KV head ``h // (H // KVH)``; grouping them avoids materialising repeated K/V."""
    return _attend_batched(q[None], k[None], v[None], mask[None, None], scale)[0]


def _attend_batched(q, k, v, mask, scale):
    """``q [B, H, L, D]``, ``k``/``v`` ``[B, KVH, S, D]``, ``mask`` broadcastable to ``[B, 1, L, S]``."""
    b, h, l, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    scores = torch.matmul(q.float().reshape(b, kvh, g * l, d), k.float().transpose(-1, -2)) * scale
    scores = scores.view(b, kvh, g, l, s).masked_fill(~mask.reshape(b, 1, 1, l, s), float("-inf"))
    probs = scores.view(b, kvh, g * l, s).softmax(dim=-1)
    return torch.matmul(probs, v.float()).view(b, h, l, d).to(q.dtype)


def _batched_decode(query, kv_cache, meta: AttentionMetadata, rows: list[int], scale: float, out,
                    k_scale=None, v_scale=None) -> None:
    """All one-token queries at once: pad each sequence's KV to the longest and mask the padding."""
    block_size = kv_cache.shape[2]
    idx = torch.tensor([meta.query_start_loc_cpu[i] for i in rows], device=query.device)
    lens = torch.tensor([meta.seq_lens_cpu[i] for i in rows], device=query.device)
    max_len = max(meta.seq_lens_cpu[i] for i in rows)
    n = -(-max_len // block_size)
    tables = meta.block_tables[torch.tensor(rows, device=query.device)][:, :n].long()  # [B, n]
    kv = kv_cache[:, tables]  # [2, B, n, BS, KVH, D]
    kv = kv.reshape(2, len(rows), n * block_size, *kv_cache.shape[3:])[:, :, :max_len]
    q = query[idx].unsqueeze(2)  # [B, H, 1, D]
    if is_fp8(kv.dtype):
        k, v = dequantize_kv(kv[0], k_scale).transpose(1, 2), dequantize_kv(kv[1], v_scale).transpose(1, 2)
    else:
        k, v = kv[0].transpose(1, 2).to(q.dtype), kv[1].transpose(1, 2).to(q.dtype)  # [B, KVH, S, D]
    mask = (torch.arange(max_len, device=query.device)[None, :] < lens[:, None])[:, None, None, :]
    o = _attend_batched(q, k, v, mask, scale)
    out[idx] = o.squeeze(2)
