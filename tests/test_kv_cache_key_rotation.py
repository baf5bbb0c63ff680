"""Key rotation of the fp8 KV cache (``kv_cache_key_rotation``): queries and keys multiplied per head by one
randomized Hadamard matrix before the keys are quantized. Attention computes the same function (q . k is kept),
keys never grow (a checkpoint's k_scale cannot saturate), and the fp8 error of keys with outlier channels drops."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from lqe import LLM, SamplingParams
from lqe.config import EngineConfig
from lqe.kernels import attention_ref as ref
from lqe.kernels.attention_backends import TorchAttentionBackend
from lqe.kernels.hadamard import rotation_matrix, signed_hadamard
from lqe.layers.attention import Attention, key_rotation

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))
from test_triton_attention import make_case  # noqa: E402

PROMPT = [(7 * i + 3) % 4000 + 5 for i in range(60)]


def _attn(llm) -> list[Attention]:
    return [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Attention)]


def _run(llm):
    """Prompt logprobs and 8 greedy tokens: prefill, then decodes reading the stored keys."""
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]), out.outputs[0].token_ids


@pytest.mark.parametrize("n", [64, 80, 96, 128])
def test_signed_hadamard(n):
    m = signed_hadamard(n, seed=0)
    assert set(m.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(m @ m.T, n * torch.eye(n, dtype=torch.float64))
    assert torch.equal(m, signed_hadamard(n, seed=0)) and not torch.equal(m, signed_hadamard(n, seed=1))
    torch.testing.assert_close(rotation_matrix("hadamard", n, seed=0), m / n ** 0.5)


def test_key_rotation_matrices():
    assert signed_hadamard(6) is None and key_rotation(6, torch.float32, "cpu") is None
    rot_q, rot_k = key_rotation(64, torch.bfloat16, "cpu")
    assert (rot_q.dtype, rot_k.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(rot_q.float() @ rot_k.T, torch.eye(64), atol=0, rtol=0)  # (M)(M / D)^T = I exactly
    layer = Attention(4, 32, 2, 0.2, 0)
    with pytest.raises(ValueError, match="head_dim=32"):
        layer.set_key_rotation((rot_q, rot_k))
    layer.set_key_rotation(key_rotation(32, torch.float32, "cpu"))
    assert layer.rot_q is not None and "rot_q" not in dict(layer.named_buffers())  # not a weight
    layer.set_key_rotation(None)
    assert layer.rot_q is None and layer.rot_k is None


def test_option():
    with pytest.raises(ValueError, match="kv_cache_key_rotation='yes' must be True or False"):
        EngineConfig(model="m", kv_cache_key_rotation="yes")
    assert EngineConfig(model="m").kv_cache_key_rotation is True


def test_engine_rotates_fp8_caches_only(tiny_llama_dir):
    kw = dict(kv_cache_memory_bytes=4 << 20, max_model_len=256)
    for kv, rot, on in (("fp8", True, True), ("fp8_e5m2", True, True), ("fp8", False, False), ("auto", True, False)):
        llm = LLM(tiny_llama_dir, kv_cache_dtype=kv, kv_cache_key_rotation=rot, **kw)
        layers = _attn(llm)
        assert all((m.rot_q is not None) == on and (m.rot_k is not None) == on for m in layers), (kv, rot)
        if on:  # one pair shared by every layer, counted with the cache's fixed overhead, not the weights
            assert all(m.rot_q is layers[0].rot_q and m.rot_k is layers[0].rot_k for m in layers)
            assert layers[0].rot_q.dtype == torch.float32  # the tiny model's dtype
            r = llm.llm_engine.runner
            d = layers[0].head_dim
            assert r.kv_spec.fixed_bytes() == 2 * len(layers) * 4 + d * d * 8


def test_rotation_keeps_what_attention_computes(tiny_llama_dir):
    """A 32-bit cache holding rotated keys (the layers rotated by hand before the first step) gives the prompt
    logprobs and greedy tokens of the unrotated engine: q' . k' = q . k, through prefill and decode."""
    kw = dict(kv_cache_memory_bytes=4 << 20, max_model_len=256)
    base_lp, base_tokens = _run(LLM(tiny_llama_dir, **kw))
    llm = LLM(tiny_llama_dir, **kw)
    rotation = key_rotation(_attn(llm)[0].head_dim, torch.float32, "cpu")
    for m in _attn(llm):
        m.set_key_rotation(rotation)
    lp, tokens = _run(llm)
    torch.testing.assert_close(lp, base_lp, atol=2e-5, rtol=0)
    assert tokens == base_tokens
    assert llm.llm_engine.runner.kv_cache.dtype == torch.float32


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rotation_cuts_fp8_error_of_outlier_keys(kv_dtype):
    """Keys and queries sharing two large channels (RoPE's slow dimensions, attention sinks): the scores are
    dominated by those products, whose fp8 rounding goes straight into the logits unrotated; rotated, each score's
    error averages over head_dim products. Prefill and decode rows, scales from the step (vLLM's rule)."""
    heads, kvh, d = 8, 2, 64
    q, k, v, cache, meta = make_case([(24, 0), (1, 0), (17, 0), (1, 0)], heads, kvh, d, torch.float32, "cpu")
    for x in (q, k):
        x[..., 5] *= 12
        x[..., 40] *= -9

    def attend(dtype, rotate):
        layer = Attention(heads, d, kvh, d ** -0.5, 0)
        layer.backend = TorchAttentionBackend()
        if rotate:
            layer.set_key_rotation(key_rotation(d, torch.float32, "cpu"))
        c = torch.zeros_like(cache, dtype=dtype)
        layer.calculate_kv_scales = ref.is_fp8(dtype)
        t = q.shape[0]
        return layer.attend(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), meta, c)

    exact = attend(torch.float32, False)
    torch.testing.assert_close(attend(torch.float32, True), exact, atol=1e-5, rtol=1e-5)
    err_plain = (attend(kv_dtype, False) - exact).norm() / exact.norm()
    err_rot = (attend(kv_dtype, True) - exact).norm() / exact.norm()
    assert err_rot < 0.6 * err_plain, (float(err_rot), float(err_plain))


def test_checkpoint_scale_bounds_rotated_keys():
    """|k M / D|max <= |k|max: a k_scale calibrated on unrotated keys (llm-compressor, vLLM) keeps every rotated
    key inside fp8's range, even for adversarial keys aligned with a row of M."""
    layer = Attention(2, 64, 1, 0.125, 0)
    layer.set_key_rotation(key_rotation(64, torch.float32, "cpu"))
    g = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.randn(256, 64, generator=g) * torch.rand(256, 1, generator=g) * 30,
                      layer.rot_q.T.clone()])  # rows of M^T: all mass lands on one output channel
    rotated = keys @ layer.rot_k
    assert (rotated.abs().amax(1) <= keys.abs().amax(1) * (1 + 1e-6)).all()
    assert torch.allclose(rotated[-64:].abs().amax(1), keys[-64:].abs().amax(1))  # the bound is reached
