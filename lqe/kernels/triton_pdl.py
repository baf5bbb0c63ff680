"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (sm_90+, on unless ``LQE_PDL=0``; see
:func:`lqe.kernels.device_info.pdl_enabled` and csrc/gemm/gemm_common.cuh for the CUDA kernels' side).

A kernel launched with PDL may be scheduled while the kernel before it on the stream still runs. Such a kernel calls
:func:`pdl_start` before it touches memory that an earlier kernel writes (its inputs) or reads (its outputs, which
an earlier kernel may still be reading). Before it, the kernel may only pull into L2 what no recent kernel wrote (a
layer's weights, written once at load) with :func:`prefetch_l2`, as the W8A8 / FP8 GEMV does:

    @triton.jit
    def _kernel(..., PDL: tl.constexpr):
        if PDL:
            prefetch_l2(W + lines)  # weights: no register, no wait
        pdl_start(PDL)              # waits for the kernel before, then lets the next one be scheduled
        x = tl.load(X + offs)

    _kernel[grid](..., **pdl_args(x.device))

Every program of the kernel passes :func:`pdl_start` (it is unconditional at the kernel's top level), so the
ordering is transitive: a kernel that completed without waiting could finish before its own predecessor, and the
kernel after it would then run beside that predecessor.
"""
from __future__ import annotations

import torch

from lqe.kernels.device_info import pdl_enabled

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - triton is optional on CPU
    triton = None
    pdl_start = prefetch_l2 = None

_OFF = {"PDL": False}
_ON = {"PDL": True, "launch_pdl": True}


def pdl_args(device: torch.device) -> dict:
    """The launch keywords of a kernel with a ``PDL`` constexpr: ``PDL=True`` and Triton's ``launch_pdl=True`` when
    :func:`~lqe.kernels.device_info.pdl_enabled` (never under the interpreter, whose tensors are on the CPU), else
    ``PDL=False`` (the kernel compiles without ``griddepcontrol``, which sm_80 lacks)."""
    return _ON if pdl_enabled(device) else _OFF


if triton is not None:
    @triton.jit
    def prefetch_l2(ptrs):
        """Ask for the lines at ``ptrs`` in L2 (``prefetch.global.L2``: no register, no wait; one instruction per
        element, so pass one pointer per 128-byte line). What a PDL kernel may do with its weights before
        :func:`pdl_start`: its DRAM stream then starts while the kernel before it still runs."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                                  pack=1)

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """Wait until the kernel before this one on the stream has completed and its writes are visible, then let
        the kernel after this one be scheduled (its programs then wait in their own ``pdl_start``). Nothing when
        ``PDL`` is False."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
