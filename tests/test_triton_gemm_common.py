"""The host side the Triton quantized GEMM wrappers share (lqe/kernels/triton_gemm_common.py): operand checks, the
output, the split-K buffers of a launch; and that every wrapper refuses bad operands before it launches anything."""
import pytest
import torch

from lqe.kernels import triton_fp8, triton_gemv_w8a8, triton_w8a8
from lqe.kernels.triton_gemm_common import SplitKWorkspace, check_operands, gemm_io, nonempty_splits

E4M3 = torch.float8_e4m3fn


def test_check_operands_names_the_kernel_and_the_shapes():
    x, w = torch.zeros(2, 64), torch.zeros(32, 64)
    check_operands("k", x, w)
    for bad_x, bad_w in ((torch.zeros(2, 48), w), (torch.zeros(64), w), (x, torch.zeros(64, 32).t())):
        with pytest.raises(ValueError, match=r"^kern: xq \(.*\) and w \[N, K\] \(.*\) \(K contiguous\) do not match"):
            check_operands("kern", bad_x, bad_w)


def test_gemm_io_output_and_contiguous_activations():
    w = torch.zeros(24, 40)
    xt = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3).t()  # [3, 40], K not contiguous
    xq, out, m, n, k = gemm_io("k", xt, w, None, torch.float16)
    assert (m, n, k) == (3, 24, 40) and xq.stride(1) == 1 and torch.equal(xq, xt)
    assert out.shape == (3, 24) and out.dtype == torch.float16
    given = torch.empty(3, 24)
    x = torch.zeros(3, 40)
    xq, out, *_ = gemm_io("k", x, w, given, torch.float16)
    assert out is given and xq is x  # nothing copied or allocated that was already right


def test_split_k_buffers_of_a_launch():
    ws = SplitKWorkspace("k", "m", torch.int32, cnt_slots=4)
    unused = torch.zeros(1)
    assert ws.for_launch(torch.device("cpu"), 1, 100, "x", 2, unused) == (1, unused, unused)
    assert not ws  # a launch without split-K allocates nothing
    sk, part, cnt = ws.for_launch(torch.device("cpu"), 3, 100, "x", 4, unused)
    assert sk == 3 and part.numel() >= 100 and part.dtype == torch.int32 and cnt.numel() == 4
    assert ws.for_launch(torch.device("cpu"), 3, 100, "x", 5, unused) == (1, unused, unused)  # a counter per tile


def test_no_split_is_left_without_k_blocks():
    """split_k_range gives each split ceil(k_blocks / SPLIT_K) blocks; the trimmed count keeps that share and leaves
    no split empty (56 K blocks over 9 splits: 7 each, 8 splits)."""
    for k_blocks in range(1, 80):
        for want in range(1, 40):
            got = nonempty_splits(want, k_blocks * 64 - 3, 64)
            share = -(-k_blocks // min(want, k_blocks))
            assert 1 <= got <= want and -(-k_blocks // got) == share  # same work per program
            assert (got - 1) * share < k_blocks  # the last split has a block
    assert nonempty_splits(9, 14336, 256) == 8 and nonempty_splits(14, 14336, 256) == 14


@pytest.mark.parametrize("kernel", ["w8a8", "fp8", "gemv"])
def test_launches_have_no_empty_split(kernel, monkeypatch):
    """The wrappers launch the trimmed split count: K = 14336 in 256-wide blocks asked for 9 splits runs 8."""
    mod = {"w8a8": triton_w8a8, "fp8": triton_fp8, "gemv": triton_gemv_w8a8}[kernel]
    name = {"w8a8": "_w8a8_mm_kernel", "fp8": "_fp8_mm_kernel", "gemv": "_gemv_kernel"}[kernel]
    grids = []

    class Launch:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *a, **kw: None

    monkeypatch.setattr(mod, name, Launch())
    dt = E4M3 if kernel == "fp8" else torch.int8
    x, w = torch.zeros(1, 14336, dtype=dt), torch.zeros(64, 14336, dtype=dt)
    cfg = {"w8a8": lambda: triton_w8a8.W8A8Config(16, 64, 256, split_k=9),
           "fp8": lambda: triton_fp8.Fp8Config(16, 64, 256, split_k=9),
           "gemv": lambda: triton_gemv_w8a8.GemvConfig(block_n=64, block_k=256, split_k=9)}[kernel]()
    call = {"w8a8": triton_w8a8.w8a8_mm, "fp8": triton_fp8.fp8_mm, "gemv": triton_gemv_w8a8.gemv_w8a8}[kernel]
    call(x, torch.ones(1), w, torch.ones(64), out_dtype=torch.float16, config=cfg)
    assert grids and grids[0][1] == 8


def test_a_grown_workspace_keeps_the_old_buffers_alive(monkeypatch):
    """Growing replaces the buffers, but a CUDA graph captured before still addresses the old ones: they are kept,
    not freed. Growing during a capture is refused (reserve as well as acquire), naming the call to make."""
    ws = SplitKWorkspace("k", "lqe.kernels.mod", torch.float32)
    ws.reserve("cpu", 10)
    first = ws["cpu"]
    ws.reserve("cpu", 5)
    assert ws["cpu"] is first and not ws.retired  # large enough: nothing allocated
    ws.reserve("cpu", 20)
    assert ws["cpu"][0].numel() == 20 and ws.retired == [first]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"during CUDA-graph capture: call lqe\.kernels\.mod\.reserve_workspace"):
        ws.reserve("cuda:0", 8, "layer q")
    ws["cuda:0"] = ws["cpu"]  # (a CUDA entry on a CPU machine: only the size check runs)
    with pytest.raises(RuntimeError, match="too small for layer q"):
        ws.acquire(torch.device("cuda:0"), 64, "layer q")


@pytest.mark.parametrize("kernel", ["triton-w8a8", "torch._int_mm", "triton-fp8", "triton-gemv"])
def test_wrappers_refuse_mismatched_operands(kernel):
    dt = E4M3 if kernel == "triton-fp8" else torch.int8
    x, w = torch.zeros(2, 64, dtype=dt), torch.zeros(32, 48, dtype=dt)
    s, ws = torch.ones(2), torch.ones(32)
    call = {"triton-w8a8": triton_w8a8.w8a8_mm, "torch._int_mm": triton_w8a8.int_mm_w8a8,
            "triton-fp8": triton_fp8.fp8_mm, "triton-gemv": triton_gemv_w8a8.gemv_w8a8}[kernel]
    with pytest.raises(ValueError, match=rf"^{kernel}: xq \(2, 64\) and w \[N, K\] \(32, 48\)"):
        call(x, s, w, ws)


@pytest.mark.parametrize("kernel", ["w8a8", "fp8", "gemv"])
def test_zero_tokens_return_an_empty_output_without_a_launch(kernel):
    dt = E4M3 if kernel == "fp8" else torch.int8
    x, w = torch.zeros(0, 64, dtype=dt), torch.zeros(32, 64, dtype=dt)
    call = {"w8a8": triton_w8a8.w8a8_mm, "fp8": triton_fp8.fp8_mm, "gemv": triton_gemv_w8a8.gemv_w8a8}[kernel]
    out = call(x, torch.ones(0), w, torch.ones(32), out_dtype=torch.float16)
    assert out.shape == (0, 32) and out.dtype == torch.float16
