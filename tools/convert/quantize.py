"""Calibrate and export: RTN, GPTQ, AWQ or SmoothQuant (W8A8), block by block on calibration text, written
through the same export path (:func:`tools.convert.export.write_checkpoint`) and packers."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from lqe.quant_layers.canonical import CanonicalWeight
from tools.convert import writer
from tools.convert.awq import AWQ_MAPPINGS, awq_layer
from tools.convert.blocks import BlockRunner, decoder_layers, input_hooks, linear_groups
from tools.convert.calib_data import calibration_ids
from tools.convert.export import ExportReport, linear_names, write_checkpoint
from tools.convert.gptq import HessianAccumulator, gptq_quantize
from tools.convert.rtn import rtn_canonical
from tools.convert.smoothquant import SQ_MAPPINGS, smooth_layer
from tools.convert.spec import ConvertError, ExportSpec

logger = logging.getLogger("lqe.convert")
METHODS = ("rtn", "gptq", "awq", "smoothquant")
AWQ_SAMPLE_TOKENS = 2048  # tokens kept per mapping for the AWQ loss (the mean |x| uses all of them)


@dataclass(slots=True)
class CalibOptions:
    calib: str | None = None
    num_samples: int = 32
    seq_len: int = 256
    seed: int = 0
    alpha: float = 0.5
    awq_clip: bool = False
    batch_size: int = 8


@dataclass(slots=True)
class QuantizeResult:
    canon: dict[str, CanonicalWeight]
    seconds: float
    notes: dict[str, float] = field(default_factory=dict)


def _set_weight(module: torch.nn.Module, cw: CanonicalWeight) -> None:
    with torch.no_grad():
        module.weight.copy_(cw.dequantize().t().to(module.weight.dtype))


@torch.no_grad()
def calibrate(model: torch.nn.Module, input_ids: torch.Tensor | None, method: str, spec: ExportSpec,
              opts: CalibOptions, names: list[str]) -> QuantizeResult:
    """Quantize ``model`` in place (weights replaced by their dequantized values, scales folded); returns the
    CanonicalWeight of every layer in ``names``."""
    t0 = time.time()
    sdt = spec.resolve_scale_dtype()
    canon: dict[str, CanonicalWeight] = {}
    notes: dict[str, float] = {}
    modules = dict(model.named_modules())
    if method == "rtn":
        for name in tqdm(names, desc="rtn", leave=False):
            canon[name] = rtn_canonical(modules[name].weight, spec.bits, spec.group_size, spec.sym, sdt)
        return QuantizeResult(canon, time.time() - t0)
    runner = BlockRunner(model, input_ids, opts.batch_size)
    layers = decoder_layers(model)
    layer_prefix = next(n for n, m in model.named_modules() if m is layers)
    for i, layer in enumerate(tqdm(layers, desc=method, unit="layer")):
        prefix = f"{layer_prefix}.{i}."
        groups = linear_groups(layer)
        lin = dict(layer.named_modules())
        if method == "gptq":
            passes = groups if spec.true_sequential else [tuple(n for g in groups for n in g)]
            for group in passes:
                # linears of a group read the same input: one Hessian per group
                readers = [g[0] for g in groups if set(g) & set(group)] if not spec.true_sequential else [group[0]]
                acc = {n: HessianAccumulator(lin[n].in_features) for n in readers}
                with input_hooks(layer, readers, lambda n, x: acc[n].add(x)):
                    runner.run(layer)
                for n in group:
                    first = next(g[0] for g in groups if n in g)
                    cw = gptq_quantize(lin[n].weight, acc[first].hessian(), spec.bits, spec.group_size, spec.sym,
                                       spec.damp_percent, spec.desc_act, spec.static_groups, scale_dtype=sdt,
                                       mse=spec.mse)
                    _set_weight(lin[n], cw)
                    canon[prefix + n] = cw
        else:
            firsts = [m[1][0] for m in (AWQ_MAPPINGS if method == "awq" else SQ_MAPPINGS)]
            firsts = [n for n in firsts if n in lin]
            stats: dict[str, list] = {n: [] for n in firsts}
            absum = {n: 0.0 for n in firsts}
            count = {n: 0 for n in firsts}

            def collect(n: str, x: torch.Tensor) -> None:
                x = x.reshape(-1, x.shape[-1]).float()
                if method == "awq":
                    absum[n] = absum[n] + x.abs().sum(0)
                    count[n] += x.shape[0]
                    stats[n].append(x[torch.randperm(x.shape[0], generator=gen)[:AWQ_SAMPLE_TOKENS]])
                else:
                    absum[n] = torch.maximum(torch.as_tensor(absum[n]), x.abs().amax(0))

            gen = torch.Generator().manual_seed(opts.seed + i)
            with input_hooks(layer, firsts, collect):
                runner.run(layer)
            if method == "awq":
                sample = {n: torch.cat(v)[:AWQ_SAMPLE_TOKENS] for n, v in stats.items()}
                means = {n: absum[n] / max(count[n], 1) for n in firsts}
                for n, ratio in awq_layer(layer, sample, means, spec.bits, spec.group_size, spec.sym, opts.awq_clip, sdt).items():
                    notes[prefix + n] = ratio
            else:
                smooth_layer(layer, absum, opts.alpha)
            for group in groups:
                for n in group:
                    cw = rtn_canonical(lin[n].weight, spec.bits, spec.group_size, spec.sym, sdt)
                    _set_weight(lin[n], cw)
                    canon[prefix + n] = cw
        runner.advance(layer)
    missing = [n for n in names if n not in canon]
    for n in missing:  # linears outside the decoder layers (e.g. a quantized lm_head): RTN
        canon[n] = rtn_canonical(modules[n].weight, spec.bits, spec.group_size, spec.sym, sdt)
    return QuantizeResult({n: canon[n] for n in names}, time.time() - t0, notes)


def quantize_checkpoint(model_dir: str, out_dir: str, method: str, spec: ExportSpec, opts: CalibOptions | None = None,
                        overwrite: bool = False) -> tuple[ExportReport, QuantizeResult]:
    from transformers import AutoModelForCausalLM

    opts = opts or CalibOptions()
    if method not in METHODS:
        raise ConvertError(f"unknown method {method!r}; choose one of {METHODS}")
    spec.method = method
    spec.validate()
    if method == "smoothquant" and spec.fmt != "w8a8":
        raise ConvertError("SmoothQuant prepares activations for int8: use --format w8a8")
    if method == "awq" and spec.desc_act:
        raise ConvertError("AWQ does not reorder columns: drop --desc-act")
    writer.check_out_dir(out_dir, overwrite)
    orig = writer.load_state_dict(model_dir)
    names = linear_names(orig, spec.quantize_lm_head)
    for name in names:
        spec.check_layer(name, *orig[name + ".weight"].shape)
    ids = None if method == "rtn" else calibration_ids(model_dir, opts.calib, opts.num_samples, opts.seq_len, opts.seed)
    torch.manual_seed(opts.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval().requires_grad_(False)
    result = calibrate(model, ids, method, spec, opts, names)
    msd = model.state_dict()
    sd = {k: (msd[k].to(t.dtype) if k in msd else t) for k, t in orig.items()}
    report = write_checkpoint(model_dir, out_dir, sd, result.canon, spec, overwrite)
    logger.info("%s calibration took %.1f s", method, result.seconds)
    return report, result
