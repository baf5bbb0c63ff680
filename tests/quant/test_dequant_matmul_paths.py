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
