"""Triton fused ops (RMSNorm + residual, SiLU*mul, neox rotary) against their plain-torch formulas.

The ``check_*`` helpers also run on CPU under ``TRITON_INTERPRET=1`` (see ``tests/test_triton_interpret.py``).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(got, expected, dtype, what):
    err = ((got.float() - expected.float()).abs() / (1 + expected.float().abs())).max().item()
    assert err <= TOL[dtype], f"{what}: max rel error {err} > {TOL[dtype]} ({dtype})"
    return err


def check_rms_norm(tokens=7, hidden=576, dtype=torch.bfloat16, device="cuda", residual=True):
    from lqe.kernels.fused_ops import rms_norm

    g = torch.Generator().manual_seed(0)
    wide = torch.randn(tokens, hidden * 2, generator=g).to(dtype).to(device)
    x = wide[:, :hidden]  # a strided view, like a slice of a fused output
    res = torch.randn(tokens, hidden, generator=g).to(dtype).to(device) if residual else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    eps = 1e-6
    s = x + res if residual else x  # plain formula: HF LlamaRMSNorm after the residual add
    sf = s.float()
    expected = w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    got = rms_norm(x, w, eps, res)
    if residual:
        got, new_res = got
        if os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16:
            _close(new_res, s, dtype, "residual")  # the interpreter truncates fp32 -> bf16 instead of rounding
        else:
            assert torch.equal(new_res, s), "residual output must be x + residual in the input dtype"
    return _close(got, expected, dtype, "rms_norm")


def check_silu_and_mul(tokens=5, inter=1000, dtype=torch.bfloat16, device="cuda"):
    from lqe.kernels.fused_ops import silu_and_mul

    x = torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    expected = F.silu(x[:, :inter]) * x[:, inter:]
    return _close(silu_and_mul(x), expected, dtype, "silu_and_mul")


def check_rotary(tokens=9, heads=(8, 2), head_dim=64, rot_dim=None, dtype=torch.bfloat16, device="cuda"):
    from lqe.kernels.fused_ops import rotary_embedding

    rot_dim = rot_dim or head_dim
    g = torch.Generator().manual_seed(2)
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float64), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).float().to(device)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(device)
    h, kvh = heads
    qkv = torch.randn(tokens, (h + 2 * kvh) * head_dim, generator=g).to(dtype).to(device)
    q, k = qkv[:, :h * head_dim], qkv[:, h * head_dim:(h + kvh) * head_dim]

    def neox(x):  # rotate_half formula of HF Llama, in fp32
        x = x.reshape(tokens, -1, head_dim).float()
        r, rest = x[..., :rot_dim], x[..., rot_dim:]
        cos, sin = cos_sin[positions].chunk(2, -1)
        cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
        rot_half = torch.cat([-r[..., rot_dim // 2:], r[..., :rot_dim // 2]], -1)
        return torch.cat([r * cos + rot_half * sin, rest], -1).flatten(1).to(dtype)

    q_out, k_out = rotary_embedding(positions, q, k, cos_sin, head_dim)
    return max(_close(q_out, neox(q), dtype, "rotary q"), _close(k_out, neox(k), dtype, "rotary k"))


def check_torch_fallbacks(device="cpu"):
    """``use_triton=False`` gives the same answers (the path taken without triton or off-GPU)."""
    from lqe.kernels import fused_ops as fo

    x = torch.randn(3, 64, dtype=torch.float32, device=device)
    torch.testing.assert_close(fo.rms_norm(x, torch.ones(64), 1e-6, use_triton=False),
                               fo.rms_norm_torch(x, torch.ones(64), 1e-6))
    torch.testing.assert_close(fo.silu_and_mul(x, use_triton=False), F.silu(x[:, :32]) * x[:, 32:])


# ------------------------------------------------------------------------------------------------ GPU tests
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 896, 4096])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(dtype, hidden, residual):
    check_rms_norm(33, hidden, dtype, residual=residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 4864, 14336])
def test_silu_and_mul(dtype, inter):
    check_silu_and_mul(17, inter, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [((9, 3), 64, None), ((32, 8), 128, None), ((14, 2), 64, None), ((8, 8), 128, 64)])
def test_rotary(dtype, shape):
    heads, head_dim, rot_dim = shape
    check_rotary(70, heads, head_dim, rot_dim, dtype)


def test_fused_ops_match_lqe_layers():
    """Same numbers as the layers the models use today (lqe.layers.norm / activation / rotary)."""
    from lqe.kernels import fused_ops as fo
    from lqe.layers.activation import SiluAndMul
    from lqe.layers.norm import RMSNorm
    from lqe.layers.rotary import RotaryEmbedding

    dev, dt = "cuda", torch.bfloat16
    x, r = torch.randn(5, 576, device=dev, dtype=dt), torch.randn(5, 576, device=dev, dtype=dt)
    norm = RMSNorm(576, 1e-5, dt).to(dev)
    torch.testing.assert_close(fo.rms_norm(x, norm.weight, 1e-5, r), norm(x, r), atol=2e-2, rtol=2e-2)
    y = torch.randn(5, 2 * 1536, device=dev, dtype=dt)
    torch.testing.assert_close(fo.silu_and_mul(y), SiluAndMul()(y), atol=2e-2, rtol=2e-2)
    rope = RotaryEmbedding(64, 2048, 10000.0, None).to(dev)
    pos = torch.arange(5, device=dev) * 100
    q, k = torch.randn(5, 9 * 64, device=dev, dtype=dt), torch.randn(5, 3 * 64, device=dev, dtype=dt)
    for got, exp in zip(fo.rotary_embedding(pos, q, k, rope.cos_sin, 64), rope(pos, q, k)):
        torch.testing.assert_close(got, exp, atol=2e-2, rtol=2e-2)
