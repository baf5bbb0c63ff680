"""GPU: programmatic dependent launch (``LQE_PDL=1``, sm_90+) changes no token and no logprob. With it, the CUDA GEMV
of the W4A16 / W8A16 layers, the Triton kernels of a decode step (RMSNorm, rotary, KV store, decode attention,
SiLU-mul), the W8A8 / FP8 layers' quantizing producers and GEMV / GEMM, and triton-wna16 are scheduled while the
kernel before them runs and wait for it in the kernel (csrc/gemm/gemm_common.cuh, lqe/kernels/triton_pdl.py). The
arithmetic is the same, so a model generates exactly what it does without PDL: every request alone and all of them
batched (bucket padding, prefix caching and forced preemption as in test_cuda_graphs.py), in CUDA graphs
(programmatic edges in the captured graph) and eagerly. A wait placed after a load, or a kernel that exits without
waiting, reads a half-written activation or races a split-K workspace: the tokens or logprobs then differ. The
kernels alone: test_gemm_wna16.py::test_pdl_gives_the_same_outputs."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import test_cuda_graphs  # noqa: E402
from test_model_matrix import build_checkpoints  # noqa: E402

# a float model (only the Triton kernels take PDL; cuBLAS runs its GEMMs), 4- and 8-bit GPTQ with act-order, AWQ,
# int8 W8A8 (dynamic asymmetric: the fused producers, the standalone quantizer and the GEMV) and FP8
NAMES = ["gptq-v2-asym-g128-actorder", "gptq-8bit-v2-asym-g32-actorder", "awq-zp-g128", "ct-w8a8-dynamic-asym",
         "ct-fp8-channel-dynamic"]
CASES = ["base-base", *NAMES]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return build_checkpoints(str(tmp_path_factory.mktemp("pdl-matrix")), NAMES)


def _outputs(model_dir: str, eager: bool, pdl: bool, monkeypatch) -> list[tuple[list[int], list]]:
    monkeypatch.setenv("LQE_PDL", "1" if pdl else "0")
    alone, batched, _ = test_cuda_graphs._run(model_dir, eager=eager)
    return [(list(o.token_ids), [sorted(d.items()) for d in (o.logprobs or [])]) for o in [*alone, *batched]]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", CASES)
def test_pdl_generates_the_same_tokens_and_logprobs(name, eager, checkpoints, monkeypatch):
    from lqe.kernels.device_info import pdl_enabled

    monkeypatch.setenv("LQE_PDL", "1")
    if not pdl_enabled(torch.device("cuda")):
        pytest.skip(f"programmatic dependent launch needs compute capability 9.0+, not {torch.cuda.get_device_capability()}")
    want = _outputs(checkpoints[name], eager, False, monkeypatch)
    got = _outputs(checkpoints[name], eager, True, monkeypatch)
    assert len(got) == len(want) > 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0], f"output {i}: tokens with PDL {g[0]} != without {w[0]}"
        assert g[1] == w[1], f"output {i}: logprobs differ with PDL"
