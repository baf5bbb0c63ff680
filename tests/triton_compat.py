"""Triton 3.6's interpreter (``TRITON_INTERPRET=1``) turns a loaded scalar into a loop bound with
``int(array_of_shape_(1,))``, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python
scalars"). :func:`patch` makes that conversion take the single element instead. Tests only: the real JIT is
unaffected, and nothing changes when the interpreter already works."""
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


def patch_bf16_rounding() -> None:
    """Triton 3.6's interpreter converts fp32 -> bf16 by truncating (and its "rtne" mode rounds ties away from zero);
    the GPU rounds to nearest even (``cvt.rn.bf16.f32``). After this call the interpreter rounds like the GPU, so a
    kernel that rounds to bf16 can be compared bit for bit with torch under the interpreter. Tests only."""
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 -- no triton: nothing to patch
        return
    original = interpreter._convert_float
    if getattr(original, "_lqe_patched", False):
        return

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(input, dtype=np.float32)).to(torch.bfloat16)
            return t.view(torch.int16).numpy().view(np.uint16).reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert._lqe_patched = True
    interpreter._convert_float = convert


def patch_fp8_rounding() -> None:
    """Triton 3.6+'s interpreter converts fp32 -> fp8 e4m3 by truncating the mantissa; the GPU rounds to nearest
    even (``cvt.rn.satfinite.e4m3x2.f32``), as torch's ``.to(float8_e4m3fn)`` does for in-range values. After this
    call the interpreter converts like torch, so fp8 quantizers compare bit for bit under the interpreter. Tests only."""
    try:
        import numpy as np
        import torch
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001 -- no triton: nothing to patch
        return
    original = interpreter._convert_float
    if getattr(original, "_lqe_fp8_patched", False):
        return

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            t = torch.from_numpy(np.ascontiguousarray(input, dtype=np.float32)).to(torch.float8_e4m3fn)
            return t.view(torch.uint8).numpy().reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert._lqe_fp8_patched = True
    convert._lqe_patched = getattr(original, "_lqe_patched", False)
    interpreter._convert_float = convert
