"""Calibrations longer than one process may run: a streamed calibration (:mod:`tools.convert.streaming`) made inside
``with resumable(LayerCheckpoint(path, key, deadline))`` saves its state between two decoder layers when its time is
up and raises :class:`CalibrationStopped`; the same calibration started again in the same ``with`` continues there
and gives the weights of an uninterrupted run (``benchmarks/calibration_gpu.py --stop-after-s``: the 8B shape over
several 10-minute GPU calls)."""
from __future__ import annotations

import contextvars
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from lqe.kernels.canonical import CanonicalWeight
from tools.convert.spec import ConvertError

if TYPE_CHECKING:
    from tools.convert.blocks import BlockRunner
    from tools.convert.streaming import CalibModel

logger = logging.getLogger("lqe.convert")


class CalibrationStopped(Exception):
    """Raised between two decoder layers by a :class:`LayerCheckpoint` whose time is up, once it has saved the
    calibration's state: the same calibration started again resumes at ``next_layer`` (``num_layers``: after the
    last layer, with the work that follows them)."""

    def __init__(self, next_layer: int, num_layers: int, path: str) -> None:
        super().__init__(f"calibration stopped before layer {next_layer} of {num_layers} to keep its time limit; its "
                         f"state is in {path}: run it again to continue")
        self.next_layer, self.num_layers, self.path = next_layer, num_layers, path


_CHECKPOINT: contextvars.ContextVar["LayerCheckpoint | None"] = contextvars.ContextVar("lqe_calib_checkpoint",
                                                                                       default=None)


def current_checkpoint() -> "LayerCheckpoint | None":
    """The checkpoint of the innermost :func:`resumable` around this call, if any."""
    return _CHECKPOINT.get()


@contextmanager
def resumable(checkpoint: "LayerCheckpoint") -> Iterator["LayerCheckpoint"]:
    """Streamed calibrations made inside (``quantize_checkpoint``'s among them) save and resume their layer loop
    with ``checkpoint``."""
    token = _CHECKPOINT.set(checkpoint)
    try:
        yield checkpoint
    finally:
        _CHECKPOINT.reset(token)


def _require_streamed(source: CalibModel) -> None:
    if not source.streaming:
        raise ConvertError("a resumable calibration streams the checkpoint (stream=True)")


def _raw_write(f, t: torch.Tensor) -> None:
    f.write(memoryview(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()))


class LayerCheckpoint:
    """The state of a streamed calibration between two decoder layers, kept in the directory ``path``, so that a
    calibration longer than one process may run (a 10-minute GPU call) goes over several and still gives the weights
    of one uninterrupted run.

    Saved: ``state.json`` (the next layer, the settings ``key`` it was made with, each layer's error and seconds,
    each call's seconds and peak device memory), ``rng.pt`` (the torch generators), ``layer-<i>.pt`` per finished
    layer (its CanonicalWeights and float state, as the loop leaves them on the CPU) and ``acts.bin`` (the stored
    activations entering the next layer, and the float stream's with drift correction, raw). On resuming, the runner
    captures layer 0's inputs as usual (its keyword arguments: masks, rotary tables), then its activations, the
    finished layers and the generators come back from the files and the loop starts at the saved layer.
    Per-layer ``notes`` of the finished layers (AWQ ratios, block tuning) are not saved.

    ``deadline`` (a ``time.monotonic()`` time): before each layer, when that layer (predicted: 1.25 x the slowest so
    far) and the save would not end before it, the state is saved and :class:`CalibrationStopped` raised; before
    what follows the last layer, ``tail_s`` seconds are asked for the same way. A call always calibrates at least one
    layer (or the tail), so every call makes progress. ``save_every``: also save after every that many layers of a
    call (0: only when stopping; each save writes all the activations, 4 GiB for 128 x 2048 tokens of an 8B
    model). ``save_gbs``: the write rate the save time is predicted with."""

    def __init__(self, path: str | os.PathLike, key: dict, deadline: float | None = None, tail_s: float = 0.0,
                 save_every: int = 0, save_gbs: float = 0.5) -> None:
        self.path = Path(path)
        self.key = json.loads(json.dumps(key))
        self.deadline, self.tail_s, self.save_every, self.save_gbs = deadline, tail_s, save_every, save_gbs
        self.t0 = time.monotonic()
        self.previous_calls: list[dict] = []  # calls before this one: seconds, peak device memory, layers done
        self.start_layer = 0
        self.saves = 0

    # -- state on disk ----------------------------------------------------------------------------------------
    def exists(self) -> bool:
        return (self.path / "state.json").is_file()

    def read_state(self) -> dict:
        state = json.loads((self.path / "state.json").read_text())
        if state["key"] != self.key:
            diff = sorted(k for k in set(state["key"]) | set(self.key) if state["key"].get(k) != self.key.get(k))
            raise ConvertError(f"{self.path}: the saved calibration was made with other settings ({', '.join(diff)}); "
                               "remove the directory to start again")
        return state

    def clear(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def call_stats(self, source: CalibModel, next_layer: int) -> dict:
        call = {"seconds": round(time.monotonic() - self.t0, 3), "layers": [self.start_layer, next_layer]}
        if source.device.type == "cuda":
            call["peak_allocated"] = torch.cuda.max_memory_allocated(source.device)
            call["peak_reserved"] = torch.cuda.max_memory_reserved(source.device)
        return call

    def save(self, source: CalibModel, next_layer: int, canon: dict[str, CanonicalWeight],
             runner: BlockRunner | None) -> None:
        _require_streamed(source)
        t0 = time.monotonic()
        self.path.mkdir(parents=True, exist_ok=True)
        for i in range(next_layer):
            f = self.path / f"layer-{i:04d}.pt"
            if f.exists():
                continue
            prefix = source.layer_name(i) + "."
            layer = {"canon": {n: {"codes": cw.codes, "scales": cw.scales, "zeros": cw.zeros, "g_idx": cw.g_idx,
                                   "bits": cw.bits, "group_size": cw.group_size}
                               for n, cw in canon.items() if n.startswith(prefix)},
                     "state": {k: t for k, t in source.state.items() if k.startswith(prefix)}}
            torch.save(layer, f.with_suffix(".tmp"))
            os.replace(f.with_suffix(".tmp"), f)
        streams = {}
        if runner is not None:
            streams["inputs"] = runner.inputs
            if runner.fp_inputs is not None:
                streams["fp_inputs"] = runner.fp_inputs
        layout = {}
        with open(self.path / "acts.tmp", "wb") as f:
            for name, ts in streams.items():
                layout[name] = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in ts]
                for t in ts:
                    _raw_write(f, t)
        os.replace(self.path / "acts.tmp", self.path / "acts.bin")
        rng = {"cpu": torch.get_rng_state()}
        if source.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(source.device)
        torch.save(rng, self.path / "rng.pt")
        self.saves += 1
        state = {"key": self.key, "next_layer": next_layer, "num_layers": len(source.layers),
                 "layer_errors": source.layer_errors, "layer_seconds": source.layer_seconds, "acts": layout,
                 "calls": self.previous_calls + [self.call_stats(source, next_layer)],
                 "save_seconds": round(time.monotonic() - t0, 3)}
        tmp = self.path / "state.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.path / "state.json")
        logger.info("calibration state before layer %d saved in %s (%.1f s)", next_layer, self.path,
                    time.monotonic() - t0)

    def restore(self, source: CalibModel, canon: dict[str, CanonicalWeight], runner: BlockRunner | None) -> int:
        """Load a saved state into ``source``, ``canon`` and ``runner``: the layer to start at (0: nothing saved)."""
        _require_streamed(source)
        if not self.exists():
            return 0
        state = self.read_state()
        k = state["next_layer"]
        if state["num_layers"] != len(source.layers):
            raise ConvertError(f"{self.path}: saved for {state['num_layers']} decoder layers, the model has "
                               f"{len(source.layers)}")
        for f in self.path.glob("layer-*.pt"):  # a save cut short left layers past the state: made again
            if int(f.stem.split("-")[1]) >= k:
                f.unlink()
        for i in range(k):
            saved = torch.load(self.path / f"layer-{i:04d}.pt", weights_only=True)
            for name, c in saved["canon"].items():
                canon[name] = CanonicalWeight(c["codes"], c["scales"], c["zeros"], c["g_idx"], c["bits"],
                                              c["group_size"])
            source.state.update(saved["state"])
        streams = {"inputs": runner.inputs, "fp_inputs": runner.fp_inputs} if runner is not None else {}
        with open(self.path / "acts.bin", "rb") as f:
            for name, layout in state["acts"].items():
                dst = streams.get(name)
                if dst is None or len(dst) != len(layout):
                    raise ConvertError(f"{self.path}: saved activations '{name}' do not fit this calibration")
                for b, (shape, dtype) in enumerate(layout):
                    dst[b] = self._read(f, shape, getattr(torch, dtype), runner)
        if runner is not None and runner.fp_inputs is not None and "fp_inputs" not in state["acts"]:
            raise ConvertError(f"{self.path}: no float-stream activations saved (drift correction needs them)")
        if runner is not None:
            runner.steps = k
        rng = torch.load(self.path / "rng.pt", weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and source.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], source.device)
        source.layer_errors[:] = state["layer_errors"]
        source.layer_seconds[:] = state["layer_seconds"]
        self.previous_calls = state["calls"]
        self.start_layer = k
        logger.info("calibration resumed before layer %d from %s", k, self.path)
        return k

    @staticmethod
    def _read(f, shape: list[int], dtype: torch.dtype, runner: BlockRunner) -> torch.Tensor:
        pin = runner.store.type == "cpu" and runner.device.type == "cuda"
        t = torch.empty(shape, dtype=dtype, pin_memory=pin)
        if t.numel() and f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy())) != t.numel() * t.element_size():
            raise ConvertError(f"{f.name}: truncated")
        return t if runner.store.type == "cpu" else t.to(runner.store)

    # -- the loop's calls -------------------------------------------------------------------------------------
    def _save_seconds(self, runner: BlockRunner | None) -> float:
        if runner is None:
            return 1.0
        streams = runner.inputs + (runner.fp_inputs or [])
        return 1.0 + sum(t.numel() * t.element_size() for t in streams) / (self.save_gbs * 1e9)

    def before_layer(self, source: CalibModel, i: int, canon: dict[str, CanonicalWeight],
                     runner: BlockRunner | None) -> None:
        """Before layer ``i`` (``i`` = the layer count: before the work after the layers): save and stop when the
        time left is too short for it."""
        if self.deadline is None or i == self.start_layer:  # a call always makes progress
            return
        need = self.tail_s if i == len(source.layers) else 1.25 * max(source.layer_seconds, default=0.0)
        if time.monotonic() + need + self._save_seconds(runner) > self.deadline:
            self.save(source, i, canon, runner)
            raise CalibrationStopped(i, len(source.layers), str(self.path))

    def after_layer(self, source: CalibModel, done: int, canon: dict[str, CanonicalWeight],
                    runner: BlockRunner | None) -> None:
        if self.save_every and (done - self.start_layer) % self.save_every == 0 and done < len(source.layers):
            self.save(source, done, canon, runner)
