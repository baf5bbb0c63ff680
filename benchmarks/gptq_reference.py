"""GPTQ by GPTQModel on exactly lqe's calibration tokens, saved as a checkpoint that lqe then measures: the
reference the accuracy-vs-throughput table's GPTQ rows are compared with.

    pip install --no-deps gptqmodel==7.7.0   # plus the few pure-Python packages it imports (see README)
    python benchmarks/gptq_reference.py --model smollm2-135m-instruct --out /tmp/gm-sym --sym
    python benchmarks/accuracy.py --model /tmp/gm-sym --seq-len 1024 --max-windows 8

The calibration ids come from ``tools.convert.calib_data.calibration_ids`` with the same file, sample count,
length and seed as ``tools.convert quantize``, so both quantizers see the same tokens. By default GPTQModel runs
plain GPTQ (damp 0.01, true-sequential, no group-aware reordering, no RTN fallback, no clipping search); pass
``--library-defaults`` to keep the library's own defaults instead. gptqmodel is not a dependency of lqe: this
script is the only place that imports it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _single_cpu_pool() -> None:
    """GPTQModel sizes a loader thread pool from the CPU count and refuses to start on a 2-core machine; give it
    one worker per pool on CPU (the quantization math is unchanged)."""
    import gptqmodel
    from gptqmodel.utils.linalg_warmup import run_torch_linalg_warmup
    from gptqmodel.utils.threadx import DeviceThreadPool, WarmUpCtx, WarmupTask

    def build():
        return DeviceThreadPool(inference_mode=True,
                                warmups={"cpu": WarmupTask(run_torch_linalg_warmup, scope=WarmUpCtx.THREAD_AND_DEVICE)},
                                workers={"cpu": 1, "model_loader:cpu": 1}, empty_cache_every_n=512)

    gptqmodel._build_device_thread_pool = build


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", required=True)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--sym", dest="sym", action="store_true", default=True)
    g.add_argument("--asym", dest="sym", action="store_false")
    p.add_argument("--desc-act", action="store_true")
    p.add_argument("--damp", type=float, default=0.01)
    p.add_argument("--library-defaults", action="store_true",
                   help="GPTQModel's own defaults (damp 0.05, group-aware reordering, RTN fallback) instead of plain GPTQ")
    p.add_argument("--calib", default=None, help="calibration text (default ../shared/data/wikitext2-valid.tokens where it "
                   "exists, as the README rows used; else tools.convert's packaged default)")
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args(argv)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    try:
        import gptqmodel
        from gptqmodel import GPTQModel
        from gptqmodel.quantization.config import GPTQConfig
    except ImportError as e:
        raise SystemExit(f"gptq_reference.py needs GPTQModel ({e}); install it with `pip install --no-deps gptqmodel` "
                         "and the packages its import asks for") from e
    import torch

    from lqe.loaders.model_source import resolve_model
    from tools.convert.calib_data import calibration_ids

    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = os.path.abspath(resolve_model(a.model))  # absolute: the library runs from the output directory
    from tools.convert.calib_data import SHARED_CALIB

    if a.calib is None and os.path.isfile(SHARED_CALIB):
        a.calib = SHARED_CALIB  # explicit: calibration_ids' own default is the packaged text
    ids = calibration_ids(model_dir, a.calib, a.num_samples, a.seq_len, a.seed)
    extra = {} if a.library_defaults else dict(damp_percent=a.damp, act_group_aware=False, fallback=None,
                                               static_groups=False, mse=0.0, true_sequential=True)
    cfg = GPTQConfig(bits=a.bits, group_size=a.group_size, sym=a.sym, desc_act=a.desc_act, format="gptq",
                     device="cpu" if not torch.cuda.is_available() else "cuda", **extra)
    if not torch.cuda.is_available():
        _single_cpu_pool()
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    os.chdir(out)  # GPTQModel writes ./logs/ into the working directory: keep it beside the checkpoint
    model = GPTQModel.load(model_dir, cfg, dtype=torch.float32)
    t = time.perf_counter()
    model.quantize([{"input_ids": r.tolist(), "attention_mask": [1] * r.numel()} for r in ids], batch_size=1,
                   calibration_sort=None)
    seconds = time.perf_counter() - t
    model.save(out)
    print(f"gptqmodel {gptqmodel.__version__}: {a.bits}-bit g{a.group_size} {'sym' if a.sym else 'asym'}"
          f"{' act-order' if a.desc_act else ''}, {ids.shape[0]} x {ids.shape[1]} calibration tokens, "
          f"quantized in {seconds:.1f} s -> {out}\nmeasure it: python benchmarks/accuracy.py --model {out}")


if __name__ == "__main__":
    main()
