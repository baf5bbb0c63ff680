import collections
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from device_faults import (  # noqa: E402,F401 -- pytest hooks
    pytest_runtest_logreport, pytest_runtest_logstart, pytest_runtest_makereport, pytest_runtest_protocol)
from helpers import build_tiny_model  # noqa: E402
from triton_compat import patch as _patch_triton_interpreter  # noqa: E402

_patch_triton_interpreter()

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
# the W4A16 table a benchmark variant selects (LQE_WNA16_TABLE=mma / swap) must not leak into the tests: those that
# want one set it themselves (monkeypatch), the others assert the default table's kernels
os.environ.pop("LQE_WNA16_TABLE", None)
os.environ.pop("LQE_PDL", None)  # (programmatic dependent launch: on by default on sm_90+; a test that compares sets it)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2")), "qwen2", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3")


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    from lqe import LLM

    return LLM(tiny_llama_dir, kv_cache_memory_bytes=64 << 20, max_model_len=512)


@pytest.fixture
def fake_cuda_plan(monkeypatch):
    """W8A8 layers on CPU get a kernel plan as on a GPU (``layer.w8a8_plan``, the ``_w8a8_cuda`` code path), whose
    GEMM + epilogue runs in torch; counts the layer calls that received a pre-quantized input."""
    import lqe.quant_layers.w8a8 as qw
    from lqe.kernels import w8a8 as kw
    from lqe.quant_layers import reference as ref

    def plan(w_nk, w_scale, dtype, asymmetric, table=None):
        n, k = w_nk.shape
        colsum = w_nk.to(torch.int32).sum(1, dtype=torch.int32) if asymmetric else None
        scale = w_scale.float().reshape(-1).expand(n).contiguous()
        return kw.W8A8Weights(w_nk.contiguous(), scale, colsum, None, ((None, "triton-w8a8"),), k, n), "fake plan"

    def apply(xq, a_scale, wts, azp=None, bias=None, out_dtype=torch.bfloat16):
        assert xq.dtype == torch.int8 and xq.shape[1] == wts.k
        zp = None if azp is None else azp.reshape(-1, 1)  # per token [M] or per tensor: a column broadcasts both
        return ref.int8_gemm_ref(xq, wts.w_nk, a_scale, wts.w_scale, zp, bias, out_dtype)

    calls = collections.Counter()
    real = qw.W8A8Int8Method._apply_quantized

    def counted(self, layer, x, bias):
        calls[layer.prefix.rsplit(".", 1)[-1]] += 1
        return real(self, layer, x, bias)

    monkeypatch.setattr(qw, "cuda_kernels_declined", lambda device: None)
    monkeypatch.setattr(kw, "plan_w8a8", plan)
    monkeypatch.setattr(kw, "w8a8_apply", apply)
    monkeypatch.setattr(qw.W8A8Int8Method, "_apply_quantized", counted)
    return calls
