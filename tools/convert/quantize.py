"""Calibrate and export: RTN, GPTQ, AWQ or SmoothQuant (W8A8), block by block on calibration text, written
through the same export path (:func:`tools.convert.export.write_checkpoint`) and packers."""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from lqe.quant_layers.canonical import CanonicalWeight
from tools.convert import writer
from tools.convert.awq import AWQ_MAPPINGS, awq_layer
from tools.convert.blocks import SEQUENTIAL, BlockRunner, decoder_layers, input_hooks, linear_groups
from tools.convert.calib_data import calibration_ids
from tools.convert.export import ExportReport, linear_names, write_checkpoint
from tools.convert.gptq import HessianAccumulator, drift_target, gptq_quantize
from tools.convert.rtn import rtn_canonical
from tools.convert.smoothquant import SQ_MAPPINGS, smooth_layer
from tools.convert.spec import ConvertError, ExportSpec

logger = logging.getLogger("lqe.convert")
METHODS = ("rtn", "gptq", "awq", "smoothquant")


@dataclass(slots=True)
class CalibOptions:
    calib: str | None = None
    num_samples: int = 32
    seq_len: int = 256
    seed: int = 0
    alpha: float = 0.5
    awq_clip: bool = False
    batch_size: int = 8
    awq_duo: bool = False  # AWQ: s = mean|x|^a / mean|w~|^(1-a) (AutoAWQ's form) instead of the paper's mean|x|^a
    awq_tokens: int = 2048  # AWQ: calibration tokens (whole sequences) on which each scale's loss is measured


@dataclass(slots=True)
class QuantizeResult:
    canon: dict[str, CanonicalWeight]
    seconds: float
    notes: dict[str, float] = field(default_factory=dict)


def _set_weight(module: torch.nn.Module, cw: CanonicalWeight) -> None:
    with torch.no_grad():
        module.weight.copy_(cw.dequantize().t().to(module.weight.dtype))


_ORDER = [n for g in SEQUENTIAL for n in g]


def _stop_at(names: list[str]) -> str | None:
    """The one of ``names`` that runs last in a Llama/Qwen layer (None when one of them is not a known linear, whose
    place in the forward is unknown: then the whole layer runs)."""
    if not names or any(n not in _ORDER for n in names):
        return None
    return max(names, key=_ORDER.index)


def _slice_batch(obj, m: int, batch: int):
    """The first ``m`` sequences of a decoder layer's keyword argument (tensors of 2+ dims whose dim 0 is the batch:
    masks, rotary tables; 1-D ones such as ``cache_position`` run over positions)."""
    if isinstance(obj, torch.Tensor):
        return obj[:m] if obj.dim() >= 2 and obj.shape[0] == batch and batch != m else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_slice_batch(o, m, batch) for o in obj)
    if isinstance(obj, dict):
        return {k: _slice_batch(v, m, batch) for k, v in obj.items()}
    return obj


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
    drift = method == "gptq" and spec.drift_alpha > 0
    runner = BlockRunner(model, input_ids, opts.batch_size, track_float=drift)
    layers = decoder_layers(model)
    layer_prefix = next(n for n, m in model.named_modules() if m is layers)
    for i, layer in enumerate(tqdm(layers, desc=method, unit="layer")):
        prefix = f"{layer_prefix}.{i}."
        groups = linear_groups(layer)
        lin = dict(layer.named_modules())
        fp_layer = copy.deepcopy(layer) if drift else None
        if method == "gptq":
            passes = groups if spec.true_sequential else [tuple(n for g in groups for n in g)]
            for group in passes:
                # linears of a group read the same input: one Hessian per group
                readers = [g[0] for g in groups if set(g) & set(group)] if not spec.true_sequential else [group[0]]
                acc = {n: HessianAccumulator(lin[n].in_features) for n in readers}
                if fp_layer is not None:
                    runner.run_paired(layer, fp_layer, readers, lambda n, x, xf: acc[n].add(x, xf), _stop_at(readers))
                else:
                    with input_hooks(layer, readers, lambda n, x: acc[n].add(x)):
                        runner.run(layer, stop_at=_stop_at(readers))
                for n in group:
                    first = next(g[0] for g in groups if n in g)
                    hess, w = acc[first].hessian(), lin[n].weight
                    if fp_layer is not None:
                        w = drift_target(w, hess, acc[first].drift(), spec.drift_alpha, spec.damp_percent)
                    cw = gptq_quantize(w, hess, spec.bits, spec.group_size, spec.sym,
                                       spec.damp_percent, spec.desc_act, spec.static_groups, scale_dtype=sdt,
                                       mse=spec.mse)
                    _set_weight(lin[n], cw)
                    canon[prefix + n] = cw
        else:
            firsts = [m[1][0] for m in (AWQ_MAPPINGS if method == "awq" else SQ_MAPPINGS)]
            firsts = [n for n in firsts if n in lin]
            loss_x: dict[str, list[torch.Tensor]] = {n: [] for n in firsts}
            taken = {n: 0 for n in firsts}
            absum = {n: 0.0 for n in firsts}
            count = {n: 0 for n in firsts}

            def collect(n: str, x: torch.Tensor) -> None:
                flat = x.reshape(-1, x.shape[-1]).float()
                if method == "awq":
                    absum[n] = absum[n] + flat.abs().sum(0)
                    count[n] += flat.shape[0]
                    if taken[n] < opts.awq_tokens:  # whole sequences (attention needs them) up to the budget
                        m = min(x.shape[0], -(-(opts.awq_tokens - taken[n]) // x.shape[1]))
                        loss_x[n].append(x[:m].float())
                        taken[n] += m * x.shape[1]
                else:
                    absum[n] = torch.maximum(torch.as_tensor(absum[n]), flat.abs().amax(0))

            with input_hooks(layer, firsts, collect):
                runner.run(layer, stop_at=_stop_at(firsts))
            if method == "awq":
                kws = [_slice_batch(runner.kwargs[b], x.shape[0], runner.inputs[b].shape[0])
                       for b, x in enumerate(loss_x[firsts[0]])] if firsts else []
                means = {n: absum[n] / max(count[n], 1) for n in firsts}
                for n, ratio in awq_layer(layer, loss_x, kws, means, spec.bits, spec.group_size, spec.sym,
                                          opts.awq_clip, sdt, duo=opts.awq_duo).items():
                    notes[prefix + n] = ratio
            else:
                smooth_layer(layer, absum, opts.alpha)
            for group in groups:
                for n in group:
                    cw = rtn_canonical(lin[n].weight, spec.bits, spec.group_size, spec.sym, sdt)
                    _set_weight(lin[n], cw)
                    canon[prefix + n] = cw
        runner.advance(layer, fp_layer)
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
    if method == "awq" and opts.awq_tokens < 1:
        raise ConvertError(f"--awq-tokens {opts.awq_tokens}: AWQ needs at least one calibration token for its loss")
    if not 0 <= spec.drift_alpha <= 1:
        raise ConvertError(f"--drift-alpha {spec.drift_alpha} must be in [0, 1] (0 = plain GPTQ, 1 = full correction)")
    if spec.drift_alpha and method != "gptq":
        raise ConvertError(f"--drift-alpha applies to --method gptq, not {method}")
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
