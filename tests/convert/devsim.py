"""A second device simulated on the CPU, to find device-placement bugs without a GPU.

Inside :class:`DeviceSim`, every tensor is either *host* (made by a factory without ``device=``, e.g.
``torch.zeros(k)``, or moved with ``.cpu()`` / ``.to("cpu")``) or *device* (anything else, in particular what
``.to(SIM_DEVICE)`` or ``device=x.device`` gives: ``x.device`` reads as ``SIM_DEVICE`` for a device tensor).
An op that mixes a host tensor of one or more dimensions with a device tensor, which CUDA would refuse ("Expected
all tensors to be on the same device"), is counted in ``mixed`` with its innermost call site in tools/ or lqe/;
copies between the two (``copy_``, ``t[i] = x``, ``.to``) are allowed, as CUDA allows them."""
from __future__ import annotations

import collections
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

SIM_DEVICE = torch.device("cpu", 0)  # "the GPU": a CPU device with an index, told apart from plain "cpu"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HOST = "host"
_COPIES = ("__setitem__", "__getitem__", "copy_", "to", "cpu", "index_put_", "index_select")


def _is_host(t: torch.Tensor) -> bool:
    return getattr(t, "_sim_host", False)


def _device_kind(x) -> str | None:
    if isinstance(x, torch.device):
        return "device" if x.index is not None else _HOST
    if isinstance(x, str) and x.startswith("cpu"):
        return "device" if ":" in x else _HOST
    return None


def _site() -> str:
    for fr in reversed(traceback.extract_stack()[:-2]):
        rel = os.path.relpath(fr.filename, REPO)
        if rel.startswith(("tools", "lqe")):
            return f"{rel}:{fr.lineno}: {fr.line}"
    return "?"


class DeviceSim(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.mixed: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:
            return torch.device("cpu") if _is_host(args[0]) else SIM_DEVICE
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = [t for t in tensors if _is_host(t) and t.dim() > 0]
        name = getattr(func, "__name__", "")
        if host and any(not _is_host(t) for t in tensors) and name not in _COPIES:
            self.mixed[f"{name} {[tuple(t.shape) for t in host][:2]} at {_site()}"] += 1
        out = func(*args, **kwargs)
        if name == "cpu":
            kind = _HOST
        elif name == "to":
            kind = None
            for a in (*args[1:], *kwargs.values()):
                kind = ("device" if not _is_host(a) else _HOST) if isinstance(a, torch.Tensor) else \
                    _device_kind(a) or kind
            kind = kind or (_HOST if _is_host(args[0]) else "device")
        elif kwargs.get("device") is not None:
            kind = _device_kind(kwargs["device"]) or "device"
        elif not tensors:
            kind = _HOST  # a factory without device=
        else:
            kind = _HOST if all(_is_host(t) for t in tensors) else "device"
        first = args[0] if args else None
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                if kind == _HOST:
                    o._sim_host = True
                elif _is_host(o) and o is not first:  # a new tensor object that happens to carry an old tag
                    o._sim_host = False
        return out
