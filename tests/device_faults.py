"""pytest hooks (imported by tests/conftest.py) that keep one faulting GPU kernel from failing a whole test run.

A kernel that faults on the device (an illegal address, a trap) leaves the process's CUDA context unusable, and
every later test in that process fails with the same error: one bad launch would read as hundreds of failures and
hide the results of every kernel after it. After a failed gpu-marked test these hooks ask
:func:`lqe.kernels.device_info.cuda_fault`; when the context is lost they stop the run after that test (the
JUnit XML is still written) and append ``<nodeid>\t<error>`` to ``$LQE_CUDA_FAULT_FILE``. With
``$LQE_TESTS_DONE_FILE`` set, ``start\t<nodeid>`` and ``end\t<nodeid>`` lines record each test, so the runner
(``gpu_pytest`` in benchmarks/stages/budget.sh) can go on with the tests not reached, in a fresh process, and name
the test a crashed process was running.
Without those variables (a plain ``pytest`` run) a lost context still stops the run, naming the test.
"""
from __future__ import annotations

import os

import pytest

from lqe.kernels.device_info import cuda_fault


def probe() -> str | None:
    """The lost context's error, or None (a module-level name so a test can stand in for a faulting device)."""
    return cuda_fault()


def _append(env: str, line: str) -> None:
    path = os.environ.get(env)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed or "gpu" not in item.keywords or item.session.shouldstop:
        return
    error = probe()
    if error:
        _append("LQE_CUDA_FAULT_FILE", f"{item.nodeid}\t{error}")
        item.session.shouldstop = (f"the CUDA context was lost in {item.nodeid} ({error}); the tests after it need "
                                   "a fresh process (benchmarks/stages/budget.sh: gpu_pytest runs them)")


def pytest_runtest_logstart(nodeid, location):
    _append("LQE_TESTS_DONE_FILE", f"start\t{nodeid}")


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        _append("LQE_TESTS_DONE_FILE", f"end\t{report.nodeid}")
