"""Shared helpers for the benchmarks: environment record and random prompts."""
from __future__ import annotations

import os
import platform
import random
import subprocess

import torch


def env_info() -> dict:
    info = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        info["lqe_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        info["lqe_commit"] = None
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
