"""The gate's GPU test ids in LQE_TEST_JOBS groups run side by side (benchmarks/run_gpu.sh):

    python - IDS_FILE JOBS < benchmarks/stages/test_groups.py     # one line per group: its ids, space-separated

Ids stay with their file, so a module's fixtures (a model or checkpoint built once per module) are built in one
process, not in every group. Groups are balanced by estimated cost: a test of a file that builds models or engines
(its name holds one of ``HEAVY``) counts ``HEAVY_COST`` kernel tests (seconds against milliseconds). A file costing
more than a group's share is cut into consecutive chunks of at most that share; the chunks are dealt costliest first
to the group with the least cost so far.
"""
from __future__ import annotations

import sys

HEAVY = ("model", "graph", "piecewise", "engine", "lifecycle", "calibration")
HEAVY_COST = 8


def cost(test_id: str) -> int:
    name = test_id.split("::", 1)[0].rsplit("/", 1)[-1]
    return HEAVY_COST if any(h in name for h in HEAVY) else 1


def test_groups(ids: list[str], jobs: int) -> list[list[str]]:
    jobs = max(1, jobs)
    files: dict[str, list[str]] = {}
    for tid in ids:
        files.setdefault(tid.split("::", 1)[0], []).append(tid)
    share = max(1, -(-sum(map(cost, ids)) // jobs))
    chunks: list[list[str]] = []
    for f in files.values():
        per = max(1, share // cost(f[0]))  # tests per chunk
        chunks += [f[i:i + per] for i in range(0, len(f), per)]
    groups: list[list[str]] = [[] for _ in range(jobs)]
    loads = [0] * jobs
    for chunk in sorted(chunks, key=lambda c: len(c) * cost(c[0]), reverse=True):
        g = loads.index(min(loads))
        groups[g] += chunk
        loads[g] += len(chunk) * cost(chunk[0])
    return [g for g in groups if g]


test_groups.__test__ = False  # not a pytest test

if __name__ == "__main__":
    ids = [line.strip() for line in open(sys.argv[1]) if line.strip()]
    for group in test_groups(ids, int(sys.argv[2])):
        print(" ".join(group))
