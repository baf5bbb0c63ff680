"""Runtime paths for weight-only quantized layers (W4A16 / W8A16), selected once per layer.

:func:`select_w4a16_kernel` walks a priority list: on a CUDA device the lqe CUDA kernel
(``lqe.kernels.select_w4a16_kernel(cw, device, dtype) -> (kernel | None, reason)``, wrapped in
:class:`CudaWNA16`), torch's packed CPU ops, then the dequantize+matmul path that always works. Each path is an
``nn.Module`` holding its tensors as buffers (so ``.to()`` moves them) with ``forward(x2d, bias)`` and
``describe()``. When a CUDA kernel declines, the reason is logged once per layer kind
(:func:`log_fallback_once`) and shown by ``describe()``; ``LQE_DISABLE_CUDA_KERNELS=1`` forces the torch paths.

Measured on this CPU (2 cores, torch 2.13, K=N=2048, g128, best of 7): ``_weight_int4pack_mm_for_cpu`` in bf16
takes 0.11 / 0.76 / 6.9 ms for M = 1 / 16 / 128 against 2.4 / 2.7 / 4.1 ms for dequant+matmul; in fp32 it is
slower than dequant+matmul (3.5 / 57 / 463 ms). ``_weight_int8pack_mm`` in bf16: 0.11 / 0.82 / 6.7 ms against
0.9 / 1.2 / 3.4 ms; in fp32 it loses for M > 1. Hence: packed ops for bf16/fp16 only, int8 only for M <= 32.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from lqe.kernels.canonical import CanonicalWeight

CHUNK_ELEMS = 1 << 23  # dequantize at most this many weights at once (32 MB in fp32)
INT4PACK_GROUPS = (32, 64, 128, 256)
INT8PACK_MAX_M = 32

log = logging.getLogger("lqe.quant_layers")
_LOGGED: set[tuple[str, str]] = set()


def cuda_kernels_declined(device: torch.device | str) -> str | None:
    """Why the lqe CUDA kernels are not even tried for a layer on ``device`` (``None``: try them). CPU layers
    never touch :mod:`lqe.kernels`, so their behaviour is exactly the torch paths'."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device is {device.type}"
    if os.environ.get("LQE_DISABLE_CUDA_KERNELS", "").strip() not in ("", "0"):
        return "disabled by LQE_DISABLE_CUDA_KERNELS"
    return None


def layer_kind(layer: nn.Module, family: str) -> str:
    """``family`` plus the layer's last name component (``qkv_proj``, ``down_proj`` ...): the unit fallbacks
    are logged per."""
    prefix = str(getattr(layer, "prefix", "") or "")
    return f"{family} {prefix.rsplit('.', 1)[-1]}".strip()


def log_fallback_once(kind: str, reason: str) -> None:
    """Log that a CUDA kernel declined layers of ``kind`` (once per kind and reason)."""
    key = (kind, reason)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    log.warning("lqe: %s runs on the torch path: %s", kind, reason)


def _with_reason(desc: str, why: str) -> str:
    """``"name (cuda)"`` -> ``"name (cuda; why)"``."""
    if not why:
        return desc
    return desc[:-1] + f"; {why})" if desc.endswith(")") else f"{desc} ({why})"


GROUPED_MAX_ROWS = 16  # up to this many tokens the grouped formulation beats dequantize-then-matmul on CPU


class DequantMatmul(nn.Module):
    """Keeps uint8 codes ``[K, N]``; each call dequantizes column blocks and multiplies (any bits, group size,
    act-order, zero points)."""

    name = "dequant-matmul"
    why = ""  # set when a CUDA kernel declined this layer

    def __init__(self, cw: CanonicalWeight, act_dtype: torch.dtype) -> None:
        super().__init__()
        k, n = cw.shape
        g = k if cw.group_size == -1 else cw.group_size
        codes, gi, perm = cw.codes, cw.group_index(), None
        if cw.g_idx is not None:
            # act-order: sort the rows by group once (and gather x's columns the same way per call), so groups
            # become consecutive rows whenever every group has g members, as GPTQ's act-order produces
            order = torch.argsort(gi, stable=True)
            if torch.equal(gi[order], torch.arange(k, device=gi.device) // g):
                codes, gi, perm = codes[order], gi[order], order
        self.ordered = torch.equal(gi, torch.arange(k, device=gi.device) // g)  # consecutive groups, last may be short
        self.uniform = self.ordered and k % g == 0
        self.group = g
        self.k = k
        if self.ordered and k % g:
            # a short last group (K=576, g=128) is padded with zero codes to a whole group, read by the grouped
            # decode path against zero-padded x: one batched matmul instead of two (the dequant path slices [:k])
            codes = torch.cat([codes, codes.new_zeros(g - k % g, codes.shape[1])])
        self.register_buffer("perm", perm)
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", cw.scales.to(act_dtype).contiguous())
        self.register_buffer("zeros", None if cw.zeros is None else cw.zeros.to(act_dtype).contiguous())
        self.register_buffer("gi", None if self.uniform else gi.contiguous())
        self.sym_zero = float(1 << (cw.bits - 1))

    def dequant(self, n0: int, n1: int) -> torch.Tensor:
        """``W[:, n0:n1]`` in the activation dtype."""
        dt = self.scales.dtype
        codes = self.codes[:self.k, n0:n1].to(dt)
        k = self.k
        if self.uniform:
            codes = codes.view(k // self.group, self.group, n1 - n0)
            z = self.sym_zero if self.zeros is None else self.zeros[:, None, n0:n1]
            return ((codes - z) * self.scales[:, None, n0:n1]).view(k, n1 - n0)
        z = self.sym_zero if self.zeros is None else self.zeros[self.gi, n0:n1]
        return (codes - z) * self.scales[self.gi, n0:n1]

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        k, n = self.k, self.codes.shape[1]
        x = x.to(self.scales.dtype)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.ordered and x.dim() == 2 and x.shape[0] <= GROUPED_MAX_ROWS:
            out = self._grouped(x)
            return out if bias is None else out + bias
        step = max(64, (CHUNK_ELEMS // max(k, 1)) // 64 * 64)
        outs = [x @ self.dequant(n0, min(n, n0 + step)) for n0 in range(0, n, step)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if bias is None else out + bias

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """Few rows (decode): ``sum_g s_g * (x_g @ q_g - sum(x_g) * z_g)`` with one batched matmul over the
        groups, so the only full-size temporary is the float copy of the codes (3x less memory traffic than
        dequantizing first). A short last group reads zero-padded codes against zero-padded x."""
        kp, n = self.codes.shape
        m, g = x.shape[0], self.group
        if kp != self.k:
            x = torch.nn.functional.pad(x, (0, kp - self.k))
        ng = kp // g
        xg = x.reshape(m, ng, g).transpose(0, 1)  # [G, M, g]
        part = torch.bmm(xg, self.codes.to(x.dtype).view(ng, g, n))  # [G, M, N]
        z = self.sym_zero if self.zeros is None else self.zeros[:, None, :]
        part -= xg.sum(-1, keepdim=True) * z
        return (part * self.scales[:, None, :]).sum(0)

    def describe(self) -> str:
        return _with_reason(f"{self.name} ({self.codes.device.type})", self.why)


class Int4PackCPU(nn.Module):
    """``torch._weight_int4pack_mm_for_cpu``: computes ``(q - 8) * s + m`` per group, so a zero point z is
    folded into ``m = s * (8 - z)``."""

    name = "torch-int4pack"

    @staticmethod
    def why_not(cw: CanonicalWeight, device: torch.device, act_dtype: torch.dtype) -> str | None:
        k, n = cw.shape
        if device.type != "cpu" or not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
            return "needs CPU torch with _weight_int4pack_mm_for_cpu"
        if cw.bits != 4:
            return f"4-bit only (got {cw.bits})"
        if act_dtype not in (torch.bfloat16, torch.float16):
            return f"slower than dequant-matmul for {act_dtype}"
        if cw.g_idx is not None:
            return "no act-order"
        if cw.group_size not in INT4PACK_GROUPS or k % cw.group_size:
            return f"group size must be one of {INT4PACK_GROUPS} and divide K={k}"
        if n % 16:
            return f"N={n} must be a multiple of 16"
        return None

    def __init__(self, cw: CanonicalWeight, act_dtype: torch.dtype) -> None:
        super().__init__()
        self.group = cw.group_size
        self.out_features = cw.shape[1]
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(cw.codes.t().to(torch.int32).contiguous(), 2))
        s = cw.scales.float()
        m = s * (8.0 - cw.zero_points())
        self.register_buffer("scales_and_zeros", torch.stack([s, m], dim=-1).to(act_dtype).contiguous())

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.to(self.scales_and_zeros.dtype).contiguous()
        out = torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_zeros)
        return out if bias is None else out + bias

    def describe(self) -> str:
        return f"{self.name} (cpu)"


class Int8WeightOnly(nn.Module):
    """Symmetric per-channel int8 weights ``[N, K]``: ``torch._weight_int8pack_mm`` for small M on CPU in
    bf16/fp16, otherwise dequantize + matmul (no second copy of the weights either way)."""

    name = "int8-weight-only"
    why = ""

    @staticmethod
    def why_not(cw: CanonicalWeight, device: torch.device, act_dtype: torch.dtype) -> str | None:
        if cw.bits != 8:
            return f"8-bit only (got {cw.bits})"
        if cw.group_size != -1 and cw.group_size < cw.shape[0]:
            return "per-channel scales only (group_size -1)"
        if cw.zeros is not None and not bool((cw.zeros == 128).all()):
            return "symmetric only"
        return None

    def __init__(self, cw: CanonicalWeight, act_dtype: torch.dtype) -> None:
        super().__init__()
        w = (cw.codes.to(torch.int16) - 128).to(torch.int8).t().contiguous()
        self.register_buffer("weight", w)
        self.register_buffer("scale", cw.scales.reshape(-1).to(act_dtype).contiguous())

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.to(self.scale.dtype)
        use_pack = (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
                    and x.shape[0] <= INT8PACK_MAX_M and hasattr(torch, "_weight_int8pack_mm"))
        if use_pack:
            out = torch._weight_int8pack_mm(x.contiguous(), self.weight, self.scale)
            return out if bias is None else out + bias
        return F.linear(x, self.weight.to(x.dtype) * self.scale[:, None], bias)

    def describe(self) -> str:
        dev = self.weight.device.type
        d = "torch-int8pack for M<=32 else dequant-matmul (cpu)" if dev == "cpu" else f"dequant-matmul ({dev})"
        return f"{self.name}: " + _with_reason(d, self.why)


class CudaWNA16(nn.Module):
    """The lqe W4A16/W8A16 GPU kernels (:func:`lqe.kernels.wna16_gemm`: the CUDA GEMM, the Triton GEMM or
    dequantize + cuBLAS, per ``dispatch.WNA16_TABLE`` and M). Holds only the repacked kernel state (int32
    ``qweight``, read by all of them, scales / zero points in the activation dtype, the act-order ``perm``) as
    buffers; no float copy of the weights is kept (the dequantize path writes a temporary per call)."""

    name = "cuda w4a16 kernel"

    def __init__(self, kernel, description: str) -> None:
        super().__init__()
        p = kernel.packed
        self.register_buffer("qweight", p.qweight)
        self.register_buffer("scales", p.scales)
        self.register_buffer("zeros", p.zeros)
        self.register_buffer("perm", p.perm)
        self.bits, self.group_size, self.k, self.n = p.bits, p.group_size, p.k, p.n
        # the layout class (PackedWNA16, or PackedMMA for lqe-w4a16-mma) and its non-tensor fields
        self._layout = type(p)
        self._meta = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)
                      if not isinstance(getattr(p, f.name), torch.Tensor) and getattr(p, f.name) is not None}
        self.description = description

    def packed(self):
        return self._layout(qweight=self.qweight, scales=self.scales, zeros=self.zeros, perm=self.perm, **self._meta)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from lqe.kernels import gemm

        x = x.to(self.scales.dtype)
        if bias is not None:
            bias = bias.to(x.dtype).contiguous()
        return gemm.wna16_gemm(x, self.packed(), bias)

    def describe(self) -> str:
        return f"{self.name} ({self.description})"


def _external(cw: CanonicalWeight, device: torch.device, act_dtype: torch.dtype) -> tuple[nn.Module | None, str]:
    """The lqe CUDA kernel for ``cw`` or ``(None, why not)``. A broken build or an unexpected repack error falls
    back to the torch paths with the error as the reason; two errors are the user's to see and are raised: a bad
    ``LQE_WNA16_TABLE`` (ValueError, naming the values), and running out of GPU memory while repacking (the
    fallback would keep the codes in twice the memory, and run slower)."""
    try:
        import lqe.kernels as kernels
        from lqe.kernels.gemm import active_table
    except Exception as e:  # noqa: BLE001 -- any failure here must leave the torch path usable
        return None, f"lqe-wna16 failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    active_table()  # raises on a bad LQE_WNA16_TABLE
    try:
        kernel, desc = kernels.select_w4a16_kernel(cw, device, act_dtype)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 -- any failure here must leave the torch path usable
        return None, f"lqe-wna16 failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if kernel is None:
        return None, desc
    return CudaWNA16(kernel, desc), ""


def select_w4a16_kernel(cw: CanonicalWeight, device: torch.device | str, act_dtype: torch.dtype) -> tuple[nn.Module, list[str]]:
    """The fastest path that can run ``cw`` on ``device``; returns ``(module, reasons the better ones were
    skipped)``. Dequant+matmul is always possible, so this never fails. On CUDA, the first reason is why the
    lqe kernel declined; the torch module returned then shows it in ``describe()``."""
    device = torch.device(device)
    reasons: list[str] = []
    cuda_why = ""
    declined = cuda_kernels_declined(device)
    if declined is None:
        module, cuda_why = _external(cw, device, act_dtype)
        if module is not None:
            return module, reasons
        reasons.append(cuda_why)
    elif device.type == "cuda":  # a GPU layer told not to use the kernels: say so in describe()
        cuda_why = declined
        reasons.append(cuda_why)
    for cls in (Int4PackCPU, Int8WeightOnly):
        why = cls.why_not(cw, device, act_dtype)
        if why is None:
            try:
                module = cls(cw, act_dtype).to(device)
                module.why = cuda_why
                return module, reasons
            except RuntimeError as e:  # a torch build without the op for this shape
                why = str(e).splitlines()[0]
        reasons.append(f"{cls.name}: {why}")
    module = DequantMatmul(cw, act_dtype).to(device)
    module.why = cuda_why
    return module, reasons
