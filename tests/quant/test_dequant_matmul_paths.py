"""The CPU weight-only path has two formulations (grouped for few rows, dequantize-then-matmul for many);
both equal x @ W for every group layout, including a short last group."""
import pytest
import torch

from lqe.quant_layers.reference import rtn_quantize
from lqe.quant_layers.wna16_kernels import GROUPED_MAX_ROWS, DequantMatmul


@pytest.mark.parametrize("k, g, sym, bits", [(576, 128, True, 4), (576, 128, False, 4), (256, 64, False, 4),
                                            (320, -1, True, 8), (200, 32, False, 8)])
@pytest.mark.parametrize("m", [1, 7, GROUPED_MAX_ROWS, GROUPED_MAX_ROWS + 1, 40])
def test_both_formulations_match_dequantized_weight(k, g, sym, bits, m):
    torch.manual_seed(k + m)
    n = 96
    cw = rtn_quantize(torch.randn(n, k), bits, g, sym)
    layer = DequantMatmul(cw, torch.float32)
    x, bias = torch.randn(m, k), torch.randn(n)
    ref = x.double() @ cw.dequantize(torch.float64) + bias.double()
    out = layer(x, bias)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k, g", [(576, 128), (256, 64)])
@pytest.mark.parametrize("m", [1, 40])
def test_act_order_rows_are_sorted_once_and_x_gathered(k, g, m):
    torch.manual_seed(m)
    n = 64
    perm = torch.randperm(k)
    g_idx = (torch.argsort(perm) // g).to(torch.int32)  # GPTQ act-order: groups formed in a permuted order
    cw = rtn_quantize(torch.randn(n, k), 4, g, False, g_idx=g_idx)
    assert cw.has_act_order()
    layer = DequantMatmul(cw, torch.float32)
    assert layer.perm is not None and layer.ordered
    x = torch.randn(m, k)
    ref = x.double() @ cw.dequantize(torch.float64)
    assert torch.allclose(layer(x, None).double(), ref, rtol=1e-5, atol=1e-4)
