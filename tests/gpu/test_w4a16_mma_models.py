"""GPU: the weight-only checkpoint formats of the model matrix through the engine on each candidate W4A16 table of
issue 24: ``dispatch.WNA16_MMA_TABLE`` (``LQE_WNA16_TABLE=mma``: every quantized layer runs the lqe-w4a16-mma kernel,
K that no 64-group divides included: it pads K) and ``dispatch.WNA16_SWAP_TABLE`` (``swap``: the swapped-operand
Triton GEMM for the 12-token prompt and the 8-row decode graphs). The prompt logprobs are as close to the CPU fp32
reference as the torch path's, and CUDA-graph decode gives the eager tokens (each request alone token for token;
batched by the matrix's near-tie rule). The mma kernel itself is tested against its CPU emulation in
test_gemm_w4a16_mma.py, the swapped GEMM against the reference in test_gemm_wna16.py."""
from __future__ import annotations

import functools
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import test_cuda_graphs  # noqa: E402
from test_model_matrix import (BOUND, DTYPES, FORMATS, SLACK, build_checkpoints, check_same_greedy,  # noqa: E402
                               cpu_reference, prompt_logprobs)

# every 4- and 8-bit weight-only format (the 3-bit one has no lqe kernel)
NAMES = [n for n, f in FORMATS.items() if f.family == "weight" and "3bit" not in n]
GRAPH_NAMES = ["gptq-v2-asym-g128-actorder", "awq-zp-g128", "gptq-8bit-v2-asym-g32-actorder", "gptq-v2-asym-g64-odd-k"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return build_checkpoints(str(tmp_path_factory.mktemp("mma-matrix")), NAMES)


# LQE_WNA16_TABLE -> words every quantized layer's path description holds (the layout its layers are repacked into)
TABLES = {"mma": "lqe-w4a16-mma (", "swap": ": triton-wna16-swap",  # (swap / ring / mma-k2: a row of the table)
          "ring": ": lqe-wna16-ring", "mma-k2": ": lqe-w4a16-mma-k2"}
# the tables whose layers are repacked into the wna16 layout, which refuses K or N not a multiple of 64
WNA16_LAYOUT_TABLES = {"swap", "ring"}


@pytest.fixture(autouse=True, params=list(TABLES))
def table(request, monkeypatch):
    monkeypatch.setenv("LQE_WNA16_TABLE", request.param)
    return request.param


@functools.lru_cache(maxsize=None)
def torch_path_logprobs(checkpoint: str, dtype: torch.dtype) -> torch.Tensor:
    """The prompt logprobs of the torch path (``LQE_DISABLE_CUDA_KERNELS=1``): the same whatever the table, so one
    engine per checkpoint and dtype, not one per table."""
    old = os.environ.get("LQE_DISABLE_CUDA_KERNELS")
    os.environ["LQE_DISABLE_CUDA_KERNELS"] = "1"
    try:
        return prompt_logprobs(checkpoint, "cuda", dtype)[0]
    finally:
        if old is None:
            os.environ.pop("LQE_DISABLE_CUDA_KERNELS")
        else:
            os.environ["LQE_DISABLE_CUDA_KERNELS"] = old


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_format_on_table_matches_cpu_fp32(name, dtype, checkpoints, table):
    want = cpu_reference(checkpoints[name])
    got, paths = prompt_logprobs(checkpoints[name], "cuda", dtype)
    # (the swap and ring tables run on the wna16 layout: a layer that layout refuses, K not a multiple of 64, keeps
    # the dequant-matmul fallback, whose description names why; the mma table pads K, so it takes every layer)
    fallback = FORMATS[name].why if table in WNA16_LAYOUT_TABLES and FORMATS[name].path == "torch" else None
    assert paths and all(TABLES[table] in p or (fallback and fallback in p) for p in paths), paths
    torch_path = torch_path_logprobs(checkpoints[name], dtype)
    err, err_torch = (got - want).abs().max().item(), (torch_path - want).abs().max().item()
    assert torch.isfinite(got).all() and (got <= 0).all(), got
    assert err <= 2 * err_torch + SLACK["weight"], (err, err_torch)
    assert err < BOUND[dtype, "weight"], err


@pytest.mark.parametrize("name", GRAPH_NAMES)
def test_table_graphs_equal_eager(name, checkpoints):
    g_alone, g_batched, g = test_cuda_graphs._run(checkpoints[name], eager=False)
    e_alone, e_batched, e = test_cuda_graphs._run(checkpoints[name], eager=True)
    for i, (a, b) in enumerate(zip(e_alone, g_alone)):
        assert list(a.token_ids) == list(b.token_ids), f"request {i} alone: graphs {b.token_ids} != eager {a.token_ids}"
    counts = check_same_greedy(e_batched, g_batched, *test_cuda_graphs.TOL["weight"])
    assert counts["exact"] >= len(e_batched) // 2, counts
    assert {1, 2, 4} <= set(g["replays"]) and g["preemptions"] > 0, (sorted(set(g["replays"])), g["preemptions"])
