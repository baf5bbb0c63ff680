"""How a captured piece of a piecewise step (:mod:`lqe.engine.piecewise`) is recorded and replayed.

A backend opens a piece with :meth:`begin`, and :meth:`end` returns something with ``replay()``:

* :class:`CudaGraphBackend`: each piece is a ``torch.cuda.CUDAGraph``; all pieces (of every bucket) share one
  memory pool, so a piece's intermediates reuse the memory of the pieces before it.
* :class:`RecordingBackend`: each piece is the list of aten ops it ran (a ``TorchDispatchMode``), each op with the
  very tensors it read and wrote. ``replay()`` re-runs the ops in order and writes each result into the tensor
  the op produced at recording time -- the semantics of a CUDA graph (same ops, same addresses, the data read
  afresh) on any device, so CPU tests check the splitting, the static buffers and the padding of the piecewise
  path without a GPU. Ops a CUDA graph cannot capture (a device-to-host read such as ``.item()`` / ``.tolist()``,
  data-dependent shapes) raise, as the capture would.
* :class:`NoGraphBackend`: pieces run eagerly and record nothing (warm-up before a capture).

``abort()`` leaves a piece an exception interrupted (no capture or dispatch mode may outlive it).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops whose result the host reads, or whose output shape depends on the data: a CUDA graph capture fails on them
# (``.tolist()`` reads CPU memory without an op: a CPU recording cannot see it; the CUDA capture does)
_UNCAPTURABLE = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::nonzero",
                 "aten::masked_select", "aten::unique_dim", "aten::_unique2", "aten::unique_consecutive",
                 "aten::repeat_interleave"}


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """The side stream every engine of this process warms up and captures its CUDA graphs on, one per device.

    cuBLAS keeps a workspace (32 MiB on Hopper) for each stream it has run on until the process ends, so a new stream
    per engine kept 32 MiB per engine after its shutdown (measured on the H200 at 3382fc4: 64.5 MiB allocated after
    the first LLM's shutdown, 96.5 after the second's, 0.5 after torch's private workspace clearing). One stream per
    device keeps that to one workspace. Engines replay their graphs on the stream of their caller, in turn, so the
    workspace they share is never used by two graphs at once."""
    if isinstance(device, int):
        device = torch.device("cuda", device)
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


class CapturedHostSyncError(RuntimeError):
    """An op in a captured piece reads device data on the host (or sizes its output by it)."""


class CudaGraphBackend:
    def __init__(self, pool=None) -> None:
        self.pool = pool  # share the decode graphs' pool when given
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> torch.cuda.CUDAGraph:
        graph, self._graph = self._graph, None
        graph.capture_end()
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    def abort(self) -> None:
        """Leave a capture an exception interrupted (the stream would otherwise stay in capture mode)."""
        graph, self._graph = self._graph, None
        if graph is not None:
            try:
                graph.capture_end()
            except RuntimeError:
                pass  # the capture was already invalidated: nothing to end


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _UNCAPTURABLE or (name == "aten::index" and _bool_index(args)):
            raise CapturedHostSyncError(
                f"{name} inside a captured piece: it reads device data on the host (or sizes its output by it), which "
                "a CUDA graph cannot capture; keep data-dependent host logic out of the model forward")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _bool_index(args) -> bool:
    return len(args) > 1 and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1] or ())


class RecordedPiece:
    def __init__(self, ops: list[tuple]) -> None:
        self.ops = ops

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for old, fresh in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                # a view or an in-place op already wrote the recorded storage; a fresh result is copied into the
                # tensor the op produced when recorded (its "address"), which later ops read
                if isinstance(old, torch.Tensor) and old.untyped_storage().data_ptr() != fresh.untyped_storage().data_ptr():
                    old.copy_(fresh)


class RecordingBackend:
    def __init__(self) -> None:
        self._mode: _Recorder | None = None
        self.num_ops = 0

    def begin(self) -> None:
        self._mode = _Recorder()
        self._mode.__enter__()

    def end(self) -> RecordedPiece:
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self.num_ops += len(mode.ops)
        return RecordedPiece(mode.ops)

    def abort(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)


class NoGraphBackend:
    def begin(self) -> None:
        return None

    def end(self) -> None:
        return None

    def abort(self) -> None:
        return None
