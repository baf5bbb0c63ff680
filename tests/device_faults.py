"""pytest hooks (imported by tests/conftest.py) that keep one faulting GPU kernel from failing a whole test run.

A kernel that faults on the device (an illegal address, a trap) leaves the process's CUDA context unusable, and
every later test in that process fails with the same error: one bad launch would read as hundreds of failures and
hide the results of every kernel after it. After a failed gpu-marked test these hooks ask
:func:`lqe.kernels.device_info.cuda_fault`; when the context is lost they stop the run after that test (the
JUnit XML is still written) and append ``<nodeid>\t<error>`` to ``$LQE_CUDA_FAULT_FILE``. With
``$LQE_TESTS_DONE_FILE`` set, ``start\t<nodeid>`` and ``end\t<nodeid>\t<passed|failed|skipped>`` lines record each
test, so the runner (``gpu_pytest`` in benchmarks/stages/budget.sh) can go on with the tests not reached, in a fresh
process, name the test a crashed process was running, and count the tests it ran before (it wrote no JUnit XML).
Without those variables (a plain ``pytest`` run) a lost context still stops the run, naming the test.

A kernel that never returns (a spin-wait on a block that is not resident) hangs its test, and the group's time
limit would then stop every test after it. With ``$LQE_TEST_HANG_S`` set, a test that runs longer ends the process
(``faulthandler``: the tracebacks of every thread go to stderr first); the runner names that test as it names a
crashed one and goes on with the rest.
"""
from __future__ import annotations

import faulthandler
import os
import sys

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


_stderr = []  # a duplicate of the process's stderr: pytest captures sys.stderr while a test runs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    hang_s = float(os.environ.get("LQE_TEST_HANG_S") or 0)
    if hang_s > 0:
        if not _stderr:
            _stderr.append(os.fdopen(os.dup(sys.__stderr__.fileno()), "w"))
        faulthandler.dump_traceback_later(hang_s, exit=True, file=_stderr[0])
    try:
        yield
    finally:
        if hang_s > 0:
            faulthandler.cancel_dump_traceback_later()


def pytest_runtest_logstart(nodeid, location):
    _append("LQE_TESTS_DONE_FILE", f"start\t{nodeid}")


_outcome: dict[str, str] = {}


def pytest_runtest_logreport(report):
    worst = _outcome.get(report.nodeid, "passed")
    if report.failed:
        worst = "failed"
    elif report.skipped and worst != "failed":
        worst = "skipped"
    _outcome[report.nodeid] = worst
    if report.when == "teardown":
        _append("LQE_TESTS_DONE_FILE", f"end\t{report.nodeid}\t{_outcome.pop(report.nodeid)}")
