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
