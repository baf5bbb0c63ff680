"""The Triton FP8 GEMMs (lqe/kernels/triton_fp8.py): per-token x per-channel and 128 x 128 block-scaled, against
float64 products of the same fp8 values (fp32 accumulation order and output rounding are the only differences).
Split-K must be deterministic and leave its counters zeroed. The ``check_*`` helpers also run on CPU under
``TRITON_INTERPRET=1`` (tests/test_triton_fp8.py)."""
from __future__ import annotations

import pytest
import torch

from lqe.kernels.device_info import device_key


def fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def make_block_case(m, n, k, seed=0):
    from lqe.kernels.fused_quant_fp8 import quant_fp8_ref

    g = torch.Generator().manual_seed(seed + m + n + k)
    x = torch.randn(m, k, generator=g) * 2
    kp = -(-k // 128) * 128
    xpad = torch.nn.functional.pad(x, (0, kp - k))
    q, sa = quant_fp8_ref(xpad, 128)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    sw = torch.rand(-(-n // 128), kp // 128, generator=g) * 0.01 + 1e-3
    return q[:, :k].contiguous(), sa, w, sw


def fp8_mma_accumulation_tol(k: int, r: torch.Tensor, split_k: int = 1) -> float:
    """What an fp8 ``tl.dot`` chain over ``k`` may add to the error beyond the output rounding: Hopper's (and Ada's)
    fp8 MMA keeps its accumulator to about 14 mantissa bits per instruction (k = 32; DeepSeek-V3 report 3.5.2,
    SageAttention's measurements), and Triton does not promote it (max_num_imprecise_acc); so about 2^-14 of the
    output's magnitude per 32 of K in one chain. The kernels' fp32 split-K sums start a chain per split."""
    return 2 ** -14 * -(-k // (32 * max(1, split_k))) * r.abs().max().item()


def check_fp8_mm(m, n, k, cfg, block=False, bias=True, static=False, dt=torch.bfloat16, device="cuda"):
    from lqe.kernels import triton_fp8 as tf

    g = torch.Generator().manual_seed(m * 7 + n)
    b = torch.randn(n, generator=g).to(dt) if bias else None
    if block:
        xq, sa, w, sw = make_block_case(m, n, k)
        r = tf.block_fp8_ref(xq, sa, w, sw, None if b is None else b.float())
    else:
        x = torch.randn(m, k, generator=g) * 2
        sa = torch.tensor([0.02]) if static else x.abs().amax(1) / 448
        xq = (x / sa.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        sw = torch.rand(n, generator=g) * 0.01 + 1e-3
        r = sa.double().reshape(-1, 1) * sw.double().reshape(1, -1) * (xq.double() @ w.double().t())
        r = r if b is None else r + b.double()
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    out = torch.full((m, n), float("nan"), dtype=dt, device=device)
    y = tf.fp8_mm(on(xq), on(sa), on(w), on(sw), on(b), dt, out=out, config=cfg, block_scale=block)
    assert y.data_ptr() == out.data_ptr() and not y.isnan().any(), (m, n, k, str(cfg))
    tol = (1e-3 if dt == torch.float16 else 8e-3) * r.abs().max().item() + 1e-4
    if not block:  # one dot chain over K: the fp8 tensor cores' own accumulation (block scaling restarts it)
        tol += fp8_mma_accumulation_tol(k, r)
    err = (y.double().cpu() - r).abs().max().item()
    assert err <= tol, (m, n, k, str(cfg), block, err, tol)
    assert torch.equal(y, tf.fp8_mm(on(xq), on(sa), on(w), on(sw), on(b), dt, config=cfg, block_scale=block))
    ws = tf._WS.get(device_key(device))
    assert ws is None or not ws[1].any(), "split-K counters not left zeroed"
    return y


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_ok(), reason="needs an FP8 GPU (sm89+)")
@pytest.mark.parametrize("m", [1, 16, 64, 256, 1024])
@pytest.mark.parametrize("shape", [(4096, 6144), (14336, 4096), (200, 72)])
def test_fp8_mm_table_configs(m, shape):
    from lqe.kernels import triton_fp8 as tf

    k, n = shape
    cfg = tf.pick_config(m, n, k, torch.device("cuda"))
    check_fp8_mm(m, n, k, cfg, block=False)
    check_fp8_mm(m, n, k, cfg, block=True, bias=False, dt=torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_ok(), reason="needs an FP8 GPU (sm89+)")
@pytest.mark.parametrize("m", [16, 64, 256])
def test_fp8_sweep_configs_compile_and_are_right(m):
    from lqe.kernels import triton_fp8 as tf

    for cfg in tf.sweep_configs(m)[::4]:
        check_fp8_mm(m, 1024, 2048, cfg, block=False)
        check_fp8_mm(m, 1024, 2048, cfg, block=True)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_ok(), reason="needs an FP8 GPU (sm89+)")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_block_scaled_fp8_layer_runs_the_triton_kernel(m):
    """A compressed-tensors FP8 128x128 block checkpoint with dynamic activations: the layer takes the Triton
    block-scaled GEMM (not the weight-only dequant path) and matches the float product of its dequantized weight."""
    from test_kernel_selection import fp8_layer  # builders; tests/ is on sys.path

    layer, w = fp8_layer("block", static=False, k=384, sizes=(256, 200), dtype=torch.bfloat16, device="cuda")
    desc = layer.quant_method.describe(layer)
    assert "triton-fp8-block" in desc and getattr(layer, "fp8_block_scale", None) is not None, desc
    x = torch.randn(m, 384, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    ref = x.float() @ w.to("cuda").float().t()
    assert out.dtype == torch.bfloat16 and out.shape == (m, 456)
    assert (out.float() - ref).norm() / ref.norm() < 0.06  # fp8 activations (3 mantissa bits) per 1x128 group


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_ok(), reason="needs an FP8 GPU (sm89+)")
@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("shape", [(4096, 6144), (14336, 4096), (200, 72)])
def test_fp8_mm_swapped(m, shape):
    """The swap_ab candidate at M <= 16 (fp8 wgmma with the tokens as N, fp32 promotion every BLOCK_K), split-K auto
    and 1; a block-scaled launch ignores the flag."""
    from lqe.kernels import triton_fp8 as tf

    k, n = shape
    for sk, precise in ((0, True), (1, True), (0, False)):
        cfg = tf.Fp8Config(16, 64, 128, 4, 4, sk, swap_ab=True, precise_acc=precise)
        check_fp8_mm(m, n, k, cfg, block=False)
    check_fp8_mm(m, n, k, tf.Fp8Config(16, 64, 128, 4, 4, 0, swap_ab=True), block=True, bias=False)
