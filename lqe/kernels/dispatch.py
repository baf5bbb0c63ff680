"""Which kernel runs for which format, dtype and token count M: the one table a reader looks at.

Each format has a list of ``(max_m, kernel)`` rows, walked in order: the first row whose ``max_m`` is at least
the layer call's M wins (``None`` = no upper bound). The quant layers ask :func:`pick` at call time (on the
host, from shapes only, so a CUDA-graph capture fixes the choice per batch bucket). The rows are set by
measurement on the GPU named in each section (``benchmarks/kernels.py``); a kernel that cannot take a layer
(shape, dtype, build) is skipped with its reason by the selection code of that format.
"""
from __future__ import annotations

# ------------------------------------------------------------------------------------------------ W4A16 / W8A16
# (owned by the W4A16 kernel work: lqe/kernels/gemm.py and friends)
WNA16_TABLE: list[tuple[int | None, str]] = [
    (128, "lqe-wna16-fused"),
    (None, "dequant+cublas"),
]

# ------------------------------------------------------------------------------------------------ W8A8 int8 / FP8
# (owned by the W8A8 kernel work: lqe/kernels/w8a8.py and friends)
W8A8_TABLE: list[tuple[int | None, str]] = [
    (None, "lqe-w8a8"),
]


def pick(table: list[tuple[int | None, str]], m: int) -> str:
    """The kernel name of the first row of ``table`` that covers ``m`` tokens."""
    for max_m, name in table:
        if max_m is None or m <= max_m:
            return name
    raise ValueError(f"kernel table has no row for M={m}: its last row must have max_m=None")
