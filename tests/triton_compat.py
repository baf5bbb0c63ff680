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
