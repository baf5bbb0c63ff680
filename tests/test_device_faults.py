"""A lost CUDA context stops a test run after its culprit (tests/device_faults.py), and cuda_fault() tells a lost
context from a usable one. On the CPU a stand-in probe plays the faulting device."""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from lqe.kernels import device_info

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from device_faults import (  # noqa
    pytest_runtest_logreport, pytest_runtest_logstart, pytest_runtest_makereport, pytest_runtest_protocol)
"""

TESTS_FILE = """
import os
import pytest
import device_faults

LOST = "AcceleratorError: CUDA error: an illegal memory access was encountered"
device_faults.probe = lambda: LOST if os.environ.get("STUB_LOST") and FAILED else None
FAILED = []

def test_cpu_failure_is_not_probed():  # the probe would say "lost" from here on: only gpu-marked tests ask it
    FAILED.append(1)
    assert False

@GPU
def test_one():
    pass

@GPU
def test_two():
    FAILED.append(1)
    assert False, "the kernel faulted"

@GPU
def test_three():
    if os.environ.get("STUB_HANG"):
        import time
        time.sleep(60)  # a kernel that never returns
"""


def _run(tmp_path: Path, lost: bool, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_fake_gpu.py").write_text(TESTS_FILE.replace("@GPU", "@pytest.mark." + "gpu"))  # (spelled so
    # that tests/test_layering.py does not take this file for a GPU test outside tests/gpu)
    for name in ("done", "fault"):
        (tmp_path / name).unlink(missing_ok=True)
    env = {**os.environ, "LQE_TESTS_DONE_FILE": str(tmp_path / "done"), "LQE_CUDA_FAULT_FILE": str(tmp_path / "fault"),
           "PYTHONPATH": str(ROOT), "STUB_LOST": "1" if lost else "", **env}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                           f"--junitxml={tmp_path / 'out.xml'}", *args, str(tmp_path / "test_fake_gpu.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc, tmp_path


def test_a_lost_context_stops_the_run_after_its_test(tmp_path):
    proc, d = _run(tmp_path, lost=True)
    assert proc.returncode == 2, proc.stdout  # interrupted
    assert "the CUDA context was lost in test_fake_gpu.py::test_two" in proc.stdout
    fault = (d / "fault").read_text().splitlines()
    assert [line.split("\t") for line in fault] == [
        ["test_fake_gpu.py::test_two", "AcceleratorError: CUDA error: an illegal memory access was encountered"]]
    done = [line.split("\t") for line in (d / "done").read_text().splitlines()]
    assert done == [r for t, outcome in (("test_cpu_failure_is_not_probed", "failed"), ("test_one", "passed"),
                                         ("test_two", "failed"))
                    for r in (["start", f"test_fake_gpu.py::{t}"], ["end", f"test_fake_gpu.py::{t}", outcome])]
    cases = {c.get("name"): c for c in ET.parse(d / "out.xml").getroot().iter("testcase")}
    assert set(cases) == {"test_cpu_failure_is_not_probed", "test_one", "test_two"}  # the XML is written
    assert cases["test_two"].find("failure") is not None


def test_a_usable_context_runs_everything(tmp_path):
    proc, d = _run(tmp_path, lost=False)
    assert proc.returncode == 1 and "2 failed, 2 passed" in proc.stdout, proc.stdout
    assert not (d / "fault").exists()
    assert sum(line.startswith("end\t") for line in (d / "done").read_text().splitlines()) == 4


def test_a_hung_test_ends_the_process_past_the_hang_limit(tmp_path):
    """LQE_TEST_HANG_S: a test that runs longer ends the process (tracebacks on stderr); its start record has no
    end, which is how the runner (budget.sh gpu_pytest) names it."""
    proc, d = _run(tmp_path, lost=False, STUB_HANG="1", LQE_TEST_HANG_S="2")
    assert proc.returncode not in (0, 2), proc.stdout
    assert "Timeout (0:00:02)!" in proc.stderr and "in test_three" in proc.stderr, proc.stderr[-2000:]
    done = [line.split("\t")[:2] for line in (d / "done").read_text().splitlines()]
    assert done[-1] == ["start", "test_fake_gpu.py::test_three"]
    assert ["end", "test_fake_gpu.py::test_two"] in done


def test_cuda_fault_without_cuda_is_none():
    assert device_info.cuda_fault() is None  # no GPU here, or one that works


def test_cuda_fault_reports_the_error_a_lost_context_raises(monkeypatch):
    calls = []

    def lost_sync():
        calls.append("sync")
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be ...")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lost_sync)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: real_empty(*a, **k))  # no CUDA here
    assert device_info.cuda_fault() == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert calls == ["sync"]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert device_info.cuda_fault() is None


def test_cuda_fault_never_initializes_cuda(monkeypatch):
    """A process that never used CUDA has no context to lose: the probe must not create one (or fail making it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: pytest.fail("synchronize called"))
    assert device_info.cuda_fault() is None
