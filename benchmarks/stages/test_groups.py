"""The gate's GPU test ids in LQE_TEST_JOBS groups run side by side (benchmarks/run_gpu.sh):

    python - IDS_FILE JOBS < benchmarks/stages/test_groups.py     # one line per group: its ids, space-separated

Ids stay with their file, so a module's fixtures (a model or checkpoint built once per module) are built in one
process, not in every group. Groups are balanced by estimated seconds: a test of a file in ``SECONDS_PER_TEST`` (its
mean time in the H200 gates, 8 groups side by side) costs that; a test of a file not measured yet costs ``HEAVY_S``
when the file's name holds one of ``HEAVY`` (it builds models or engines) and ``LIGHT_S`` otherwise. Balanced by
test count, the 257cdec gate's groups took 32 to 284 s. A file costing more than a group's share is cut into
consecutive chunks of at most that share; the chunks are dealt costliest first to the group with the least cost so
far. ``--times LOGDIR...`` prints the table from a gate's JUnit XML (gpu-tests-*.xml).
"""
from __future__ import annotations

import sys

HEAVY = ("model", "graph", "piecewise", "engine", "lifecycle", "calibration")
HEAVY_S, LIGHT_S = 2.0, 0.3
# Mean seconds per test, H200 gates at 3382fc4 and 257cdec (2026-11-27; a file's passing run where one failed).
SECONDS_PER_TEST = {
    "test_act_quant_standalone.py": 2.63, "test_calibration_gpu.py": 3.16, "test_cuda_graphs.py": 4.39,
    "test_fused_act_quant.py": 0.50, "test_fused_act_quant_fp8.py": 2.58, "test_fused_act_quant_schemes.py": 0.89,
    "test_gemm_w4a16_mma.py": 0.05, "test_gemm_w8a8.py": 0.47, "test_gemm_wna16.py": 0.25,
    "test_gemv_w8a8.py": 2.60, "test_kv_cache_fp8_engine.py": 5.01, "test_lifecycle_gpu.py": 6.23,
    "test_model_matrix.py": 2.07, "test_piecewise_gpu.py": 2.15, "test_quant_layers_gpu.py": 2.14,
    "test_triton_attention.py": 1.30, "test_triton_attention_fp8.py": 1.09, "test_triton_fp8_gemm.py": 3.34,
    "test_triton_fused_ops.py": 0.08, "test_w4a16_mma_models.py": 1.46,
    # not measured yet: estimated as test_cuda_graphs.py's (two engine runs per test, as there)
    "test_pdl_models.py": 4.39,
}


def cost(test_id: str) -> float:
    name = test_id.split("::", 1)[0].rsplit("/", 1)[-1]
    if name in SECONDS_PER_TEST:
        return SECONDS_PER_TEST[name]
    return HEAVY_S if any(h in name for h in HEAVY) else LIGHT_S


def test_groups(ids: list[str], jobs: int) -> list[list[str]]:
    jobs = max(1, jobs)
    files: dict[str, list[str]] = {}
    for tid in ids:
        files.setdefault(tid.split("::", 1)[0], []).append(tid)
    share = sum(map(cost, ids)) / jobs
    chunks: list[list[str]] = []
    for f in files.values():
        per = max(1, int(share / cost(f[0])))  # tests per chunk
        chunks += [f[i:i + per] for i in range(0, len(f), per)]
    groups: list[list[str]] = [[] for _ in range(jobs)]
    loads = [0] * jobs
    for chunk in sorted(chunks, key=lambda c: len(c) * cost(c[0]), reverse=True):
        g = loads.index(min(loads))
        groups[g] += chunk
        loads[g] += len(chunk) * cost(chunk[0])
    return [g for g in groups if g]


test_groups.__test__ = False  # not a pytest test

def seconds_per_test(xml_paths: list[str]) -> dict[str, float]:
    """Mean seconds per test of each file, from pytest JUnit XML (classname ``tests.gpu.test_x``)."""
    import xml.etree.ElementTree as ET

    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for path in xml_paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            if not case.get("classname"):
                continue
            name = case.get("classname").rsplit(".", 1)[-1] + ".py"
            total[name] = total.get(name, 0.0) + float(case.get("time") or 0.0)
            count[name] = count.get(name, 0) + 1
    return {n: round(total[n] / count[n], 2) for n in sorted(total)}


if __name__ == "__main__" and sys.argv[1:2] == ["--times"]:
    import glob
    import os

    xmls = [x for d in sys.argv[2:] for x in sorted(glob.glob(os.path.join(d, "gpu-tests-*.xml")))]
    for file_name, secs in seconds_per_test(xmls).items():
        print(f'    "{file_name}": {secs:.2f},')
elif __name__ == "__main__":
    ids = [line.strip() for line in open(sys.argv[1]) if line.strip()]
    for group in test_groups(ids, int(sys.argv[2])):
        print(" ".join(group))
