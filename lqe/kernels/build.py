"""JIT build of the lqe CUDA GEMM extension (csrc/gemm) on first GPU use, cached on disk.

``pip install -e .`` never compiles CUDA. The first call to :func:`load` builds with
``torch.utils.cpp_extension.load`` (ninja) or, when ninja is missing, with nvcc/c++ directly, into
``$LQE_KERNEL_CACHE`` (default ``~/.cache/lqe/kernels``) under a directory keyed by a hash of the sources,
torch / CUDA versions and target archs, so a stale build is never loaded. ``LQE_CUDA_ARCHS`` (e.g. ``"90a"``)
narrows the default ``80;89;90a`` to save compile time.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc" / "gemm"
DEFAULT_ARCHS = "80;89;90a"
# The defines torch.utils.cpp_extension passes to nvcc: our code must not rely on half/bf16 operators.
NVCC_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr",
]


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("LQE_KERNEL_CACHE", Path.home() / ".cache" / "lqe" / "kernels")).expanduser()


def gencode_flags() -> list[str]:
    archs = [a.strip() for a in os.environ.get("LQE_CUDA_ARCHS", DEFAULT_ARCHS).replace(",", ";").split(";") if a.strip()]
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cu")) + [CSRC / "bindings.cpp"]


def _digest() -> str:
    h = hashlib.sha256()
    for p in sorted(CSRC.glob("*")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{' '.join(gencode_flags())}|{sys.version_info[:2]}".encode())
    return h.hexdigest()[:16]


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc") or (("/usr/local/cuda/bin/nvcc") if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def prerequisites() -> str | None:
    """Why a build cannot even start, or ``None``."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    if torch.version.cuda is None:
        return "this torch build has no CUDA"
    if not (CSRC / "bindings.cpp").exists():
        return f"CUDA sources not found at {CSRC} (install lqe from a source checkout)"
    if _nvcc() is None:
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    return None


def _build_with_ninja(name: str, build_dir: Path) -> ModuleType:
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=name, sources=[str(s) for s in sources()], build_directory=str(build_dir),
        extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "-lineinfo", *gencode_flags()],
        extra_include_paths=[str(CSRC)], verbose=bool(os.environ.get("LQE_BUILD_VERBOSE")),
    )


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"command failed: {' '.join(cmd)}\n{r.stdout[-4000:]}{r.stderr[-4000:]}")


def _build_direct(name: str, build_dir: Path) -> ModuleType:
    """nvcc + c++ without ninja: the same flags as torch's CUDAExtension."""
    from torch.utils import cpp_extension

    nvcc = _nvcc()
    cuda_home = Path(nvcc).resolve().parents[1]
    inc = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC}"]
    defs = [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    objs, jobs = [], []
    for src in sources():
        obj = build_dir / (src.name + ".o")
        objs.append(str(obj))
        if src.suffix == ".cu":
            jobs.append([nvcc, "-c", str(src), "-o", str(obj), "-O3", "-lineinfo", "-Xcompiler", "-fPIC",
                         *gencode_flags(), *NVCC_DEFINES, *inc, *defs])
        else:
            jobs.append([os.environ.get("CXX", "c++"), "-c", str(src), "-o", str(obj), "-O3", "-fPIC",
                         f"-I{cuda_home / 'include'}", *inc, *defs])
    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        list(pool.map(_run, jobs))
    torch_lib = Path(torch.__file__).parent / "lib"
    so = build_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    _run([os.environ.get("CXX", "c++"), "-shared", *objs, "-o", str(so), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}",
          "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu", "-ltorch_cuda", "-ltorch_python",
          f"-L{cuda_home / 'lib64'}", "-lcudart"])
    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load() -> ModuleType:
    """Build (first time) and import the extension; raises :class:`BuildError` with the reason."""
    reason = prerequisites()
    if reason is not None:
        raise BuildError(reason)
    name = f"lqe_gemm_{_digest()}"
    build_dir = cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    ninja = cpp_extension.is_ninja_available()
    log.info("lqe kernels: building/loading %s in %s (%s)", name, build_dir, "ninja" if ninja else "nvcc direct")
    try:
        return _build_with_ninja(name, build_dir) if ninja else _build_direct(name, build_dir)
    except BuildError:
        raise
    except Exception as e:  # compiler errors surface as RuntimeError / subprocess errors
        raise BuildError(f"building {name} failed: {e}") from e
