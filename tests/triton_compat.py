"""Triton 3.6's interpreter (``TRITON_INTERPRET=1``) turns a loaded scalar into a loop bound with
``int(array_of_shape_(1,))``, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python
scalars"). :func:`patch` makes that conversion take the single element instead. Tests only: the real JIT is
unaffected, and nothing changes when the interpreter already works.

:func:`patch_bf16_rounding` / :func:`patch_fp8_rounding` make the interpreter's fp32 -> bf16 / fp8 casts round as the
GPU does; :func:`run_interpreted` runs a test script in a fresh interpreter process (what every ``*_under_interpreter``
test of tests/ does)."""
from __future__ import annotations


def patch() -> None:
    try:
        import numpy as np
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 -- no triton: nothing to patch
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_lqe_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._lqe_patched = True
    interpreter._patch_lang_tensor = patched


def _route_fp32_cast(target: str, torch_dtype: str, bits_view: str, np_view: str) -> None:
    """Make the interpreter's fp32 -> ``tl.<target>`` conversion go through torch's ``.to(torch.<torch_dtype>)``
    (round to nearest even, as the GPU's ``cvt.rn`` does), returning the bits viewed as ``torch.<bits_view>`` /
    ``np.<np_view>``. Idempotent per target (a flag on the installed function), chains with the other targets."""
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 -- no triton: nothing to patch
        return
    flag = f"_lqe_{target}_patched"
    original = interpreter._convert_float
    if getattr(original, flag, False):
        return
    out_dtype, dt, bits, npv = getattr(tl, target), getattr(torch, torch_dtype), getattr(torch, bits_view), \
        getattr(np, np_view)

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == out_dtype:
            t = torch.from_numpy(np.ascontiguousarray(input, dtype=np.float32)).to(dt)
            return t.view(bits).numpy().view(npv).reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert.__dict__.update({k: v for k, v in original.__dict__.items() if k.startswith("_lqe_")})
    setattr(convert, flag, True)
    interpreter._convert_float = convert


def patch_bf16_rounding() -> None:
    """Triton 3.6's interpreter converts fp32 -> bf16 by truncating (and its "rtne" mode rounds ties away from zero);
    the GPU rounds to nearest even (``cvt.rn.bf16.f32``). After this call the interpreter rounds like the GPU, so a
    kernel that rounds to bf16 can be compared bit for bit with torch under the interpreter. Tests only."""
    _route_fp32_cast("bfloat16", "bfloat16", "int16", "uint16")


def patch_fp8_rounding(e5m2: bool = False) -> None:
    """Triton 3.6+'s interpreter converts fp32 -> fp8 e4m3 by truncating the mantissa (it drops the carry of a
    mantissa that rounds up: 31.5 -> 16, not 32) and rounds ties away from zero; the GPU rounds to nearest even
    (``cvt.rn.satfinite.e4m3x2.f32``), as torch's ``.to(float8_e4m3fn)`` does for in-range values. After this call
    the interpreter converts like torch (also for e5m2 with ``e5m2=True``), so fp8 quantizers and fp8 KV caches
    compare bit for bit under the interpreter. Tests only."""
    _route_fp32_cast("float8e4nv", "float8_e4m3fn", "uint8", "uint8")
    if e5m2:
        _route_fp32_cast("float8e5", "float8_e5m2", "uint8", "uint8")


INTERPRETER_PRELUDE = """import sys
sys.path[:0] = [{root!r}, {gpu!r}, {tests!r}]
import triton_compat
triton_compat.patch()
"""


def run_interpreted(script: str, ok: str, timeout: int = 300, **env: str) -> None:
    """Run ``script`` (indented or not) in a fresh Python with ``TRITON_INTERPRET=1`` and no visible GPU (the
    interpreter must be on before triton is first imported), after :data:`INTERPRETER_PRELUDE` (the repo root,
    tests/gpu and tests on ``sys.path``, :func:`patch` applied); ``env`` adds variables. Asserts that it exits 0
    and prints ``ok``, else shows the ends of its stdout and stderr."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    prelude = INTERPRETER_PRELUDE.format(root=str(tests.parent), gpu=str(tests / "gpu"), tests=str(tests))
    full_env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", **env)
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script)], env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and ok in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
