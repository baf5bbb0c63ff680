"""Shared helpers for the benchmarks: environment record, random prompts, random checkpoints (on disk, or drawn as
read: :class:`RandomCheckpointReader`)."""
from __future__ import annotations

import contextlib
import os
import platform
import random
import subprocess
import sys
import threading
import zlib

import torch

from lqe.kernels.device_info import cuda_fault

try:
    from tools.convert.writer import CheckpointReader
except ImportError:  # a benchmark run from elsewhere, with only benchmarks/ on the path
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tools.convert.writer import CheckpointReader


def commit() -> str | None:
    """The commit measured: ``LQE_COMMIT`` when set (a GPU machine's copy of the tree may have no .git), else the
    short hash of git's HEAD, else None."""
    if os.environ.get("LQE_COMMIT"):
        return os.environ["LQE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


def env_info() -> dict:
    info = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    info["lqe_commit"] = commit()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def random_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def random_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed + 1)
    return [rng.randint(lo, hi) for _ in range(n)]


def write_random_checkpoint(config, model_cls, out_dir, seed: int, shard_bytes: int = 4 << 30):
    """Write ``model_cls(config)`` as a bf16 safetensors checkpoint in ``out_dir`` (a ``pathlib.Path``) with N(0, 0.02)
    weights and unit norms, sharded at ``shard_bytes``, without ever building the model; reused when present.
    The weights are drawn on the GPU when there is one (an 8B model's worth of randn on CPU takes minutes)."""
    import json
    import shutil

    from safetensors.torch import save_file

    if (out_dir / "config.json").exists():
        return out_dir
    shapes = random_checkpoint_shapes(config, model_cls)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    shard, size, weight_map = {}, 0, {}

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(set(weight_map.values())):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    config.save_pretrained(tmp)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tmp.rename(out_dir)
    return out_dir


def random_checkpoint_shapes(config, model_cls) -> dict[str, tuple[int, ...]]:
    """The tensors :func:`write_random_checkpoint` writes (and :class:`RandomCheckpointReader` draws): the state dict
    of ``model_cls(config)`` built on the meta device, in its order, ``lm_head.weight`` dropped when tied."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in model_cls(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


class RandomCheckpointReader(CheckpointReader):
    """A random bf16 checkpoint that never touches the disk: the ``tools.convert`` reader of the tensors
    :func:`write_random_checkpoint` would write for ``config`` / ``model_cls`` (same names, shapes, dtype and order;
    N(0, 0.02) weights, unit norms), each drawn when it is read, on the GPU when there is one (``draw_device``),
    straight in bf16 (no fp32 temporary of a 1 GB embedding), from a generator seeded by ``seed`` and the tensor's
    name: a tensor is the same every time it is read (a resumed calibration reads its layers again), whatever was
    read before. The values are not :func:`write_random_checkpoint`'s (it draws all tensors from one generator).

    ``model_dir``: where ``quantize_checkpoint`` finds config.json (see :meth:`save_config`): pass the reader as its
    ``reader`` and it reads no shard."""

    def __init__(self, config, model_cls, seed: int = 0, model_dir: str | os.PathLike | None = None,
                 draw_device: torch.device | str | None = None) -> None:
        self.config, self.seed = config, seed
        self.model_dir = None if model_dir is None else str(model_dir)
        self.draw_device = torch.device(draw_device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.files: dict[str, str] = {}
        self.meta = {k: torch.empty(s, dtype=torch.bfloat16, device="meta")
                     for k, s in random_checkpoint_shapes(config, model_cls).items()}

    def nbytes(self) -> int:
        """The checkpoint's size in bytes (what its safetensors files would hold)."""
        return sum(t.numel() * t.element_size() for t in self.meta.values())

    def save_config(self, model_dir: str | os.PathLike) -> str:
        """Write config.json (nothing else) into ``model_dir``, which becomes the reader's; returns it."""
        os.makedirs(model_dir, exist_ok=True)
        self.config.save_pretrained(str(model_dir))
        self.model_dir = str(model_dir)
        return self.model_dir

    def tensor_seed(self, key: str) -> int:
        return (self.seed * 0x9E3779B1 + zlib.crc32(key.encode())) % (1 << 63)

    def draw(self, key: str) -> torch.Tensor:
        """Tensor ``key`` on :attr:`draw_device`, in bf16."""
        shape = tuple(self.meta[key].shape)
        dev = self.draw_device
        if key.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16, device=dev)
        gen = torch.Generator(device=dev).manual_seed(self.tensor_seed(key))
        return torch.randn(shape, generator=gen, dtype=torch.bfloat16, device=dev).mul_(0.02)

    def get_many(self, keys: list[str], device: torch.device | str | None = None,
                 float_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        self.check_keys(keys)
        out: dict[str, torch.Tensor] = {}
        for k in keys:
            t = self.draw(k).to("cpu" if device is None else device)  # (the base class: on the CPU by default)
            out[k] = t.to(float_dtype) if float_dtype is not None else t
        return out


# ------------------------------------------------------------------------------------------------ device faults
class DeviceFault(RuntimeError):
    """A benchmark step left the process's CUDA context unusable (a kernel faulted on the device): every later CUDA
    call fails with the same error, so the run saves what it measured and goes on in a fresh process (:func:`restart`)
    instead of reporting every row after the culprit as failed. ``rows``: what the run keeps (set by the loop that
    knows which of its rows the fault may have spoiled)."""

    def __init__(self, what: str, error: str, **where):
        super().__init__(f"the CUDA context was lost in {what}: {error}")
        self.what, self.error, self.where, self.rows = what, error, where, None

    def record(self) -> dict:
        return {"what": self.what, "error": self.error, **self.where}

    def keep(self, rows: list[dict]) -> DeviceFault:
        """The rows to keep: ``rows`` less those of the ``shape`` and ``m`` being measured, which the fault may have
        spoiled."""
        pair = (self.where.get("shape"), self.where.get("m"))
        self.rows = [r for r in rows if (r.get("shape"), r.get("m")) != pair]
        return self


def raise_if_context_lost(what: str, rows: list[dict] | None = None, **where) -> None:
    """For a benchmark's ``except`` around one row: raise :class:`DeviceFault` when the failure lost the CUDA context
    (:func:`lqe.kernels.device_info.cuda_fault`); a failure that left it usable (a config that does not fit, out of
    memory) returns and the row is skipped as before. With ``rows`` (the run's rows so far), the fault keeps them
    less those of the ``shape`` and ``m`` in ``where``: the pair being measured, which the fault may have spoiled."""
    error = cuda_fault()
    if error:
        fault = DeviceFault(what, error, **where)
        raise fault if rows is None else fault.keep(rows)


HANG_S = float(os.environ.get("LQE_BENCH_HANG_S") or 90)


@contextlib.contextmanager
def hang_guard(on_fault, what: str, rows: list[dict], seconds: float | None = None, **where):
    """Run the body; when it has not returned after ``seconds`` (a kernel that never returns, e.g. a spin-wait on a
    block that is not resident: every later call would queue behind it), a watchdog thread hands ``on_fault`` a
    :class:`DeviceFault` keeping ``rows`` less the pair being measured. ``on_fault`` saves and restarts the process
    (``os.execv`` replaces every thread, the stuck one too); if it returns, the process ends with status 4. The main
    thread waits on the GPU with the GIL released (torch's synchronize), so the watchdog runs."""
    seconds = HANG_S if seconds is None else seconds

    def fire():
        try:
            on_fault(DeviceFault(what, f"no return after {seconds:.0f} s (a hung kernel?)", **where).keep(rows))
        finally:
            sys.stdout.flush()
            os._exit(4)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


MAX_RESTARTS = 4


def restart(extra_argv: list[str]) -> bool:
    """Replace this process by a fresh one running the same command with ``extra_argv`` appended (its pid, time
    limit and output stay those of this one); False, without restarting, after :data:`MAX_RESTARTS` restarts of one
    command (``LQE_FAULT_RESTARTS`` counts them)."""
    n = int(os.environ.get("LQE_FAULT_RESTARTS", "0")) + 1
    if n > MAX_RESTARTS:
        return False
    os.environ["LQE_FAULT_RESTARTS"] = str(n)
    print(f"# going on in a fresh process (restart {n} of at most {MAX_RESTARTS})", flush=True)
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, sys.argv[0], *sys.argv[1:], *extra_argv])
    return True  # not reached


def bench_row(bench, make, what: str, rows: list[dict], on_fault=None, **where) -> float | None:
    """``bench(make())`` for one benchmark row, or None (printed) when it fails and the CUDA context survives; a lost
    context raises :class:`DeviceFault` keeping ``rows`` less the pair being measured, and with ``on_fault`` a row
    that never returns hands that fault to it from a watchdog (:func:`hang_guard`)."""
    guard = hang_guard(on_fault, what, rows, **where) if on_fault else contextlib.nullcontext()
    try:
        with guard:
            return bench(make())
    except Exception as e:  # noqa: BLE001 -- one failing row must not lose the others
        raise_if_context_lost(what, rows, **where)
        print(f"# {what} failed: {type(e).__name__}: {str(e)[:160]}")
        return None
