"""Compile the Triton launches lqe's wrappers make, for a Hopper GPU, on a machine without one.

:func:`captured_launches` stands in for ``JITFunction.run``: a wrapper called on CPU tensors (outside the
interpreter) records each launch (kernel, arguments, launch options) instead of running it. :func:`compile_launch`
then does what ``run`` would do on an sm_90 device: the same binder (Triton's specialization of every argument:
integer 1 as a constant, 16-divisible pointers and integers), the same options and constexprs, and
``triton.compile`` for ``GPUTarget("cuda", 90, 32)``. So a launch compiles here exactly when it would compile
there, for the Triton installed: the GPU machine has Triton 3.6, this one may have a newer one, and
``tests/test_hopper_launches.py`` run under the device's version checks the kernels it will run (the README says
how).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re


@dataclasses.dataclass
class Launch:
    fn: object  # the JITFunction
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.fn.__name__


@contextlib.contextmanager
def captured_launches():
    """Within the block, ``kernel[grid](...)`` records a :class:`Launch` and runs nothing."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def compile_launch(launch: Launch, capability: int = 90):
    """The compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.n_regs``, ``.n_spills`` where Triton fills them)
    of ``launch`` for an sm_<capability> GPU, as ``JITFunction.run`` would build it there."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn, kwargs = launch.fn, dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    if hasattr(knobs.compilation, "instrumentation_mode"):
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def spill_bytes(ptx: str) -> int:
    """Bytes of register spill stores ptxas reports for ``ptx`` (assembled again with ``-v`` by the ptxas Triton
    itself uses, for the PTX's own target)."""
    return ptxas_usage(ptx)[1]


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers per thread, bytes of spill stores) ptxas reports for ``ptx``, as :func:`spill_bytes` assembles it."""
    import os
    import subprocess
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path
    except ImportError:  # older Triton: one ptxas
        from triton import knobs
        ptxas = knobs.nvidia.ptxas.path
    arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"(\d+) bytes spill stores", proc.stderr)
    regs = re.findall(r"Used (\d+) registers", proc.stderr)
    assert found and regs, proc.stderr[-3000:]
    return max(map(int, regs)), sum(map(int, found))
