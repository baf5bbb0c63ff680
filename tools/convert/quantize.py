"""Calibrate and export: RTN, GPTQ, AWQ or SmoothQuant (W8A8), block by block on calibration text, written
through the same export path (:func:`tools.convert.export.write_checkpoint`) and packers."""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field

import torch

from lqe.kernels.canonical import CanonicalWeight
from tools.convert import writer
from tools.convert.awq import AWQ_MAPPINGS, awq_layer
from tools.convert.blocks import SEQUENTIAL, BlockRunner, input_hooks, linear_groups, slice_batch
from tools.convert.calib_data import calibration_ids
from tools.convert.export import ExportReport, linear_names, write_checkpoint
from tools.convert.gptq import HessianAccumulator, drift_target, gptq_quantize
from tools.convert.blocktune import tune_layer
from tools.convert.refine import loop_threads, refine_codes
from tools.convert.rotation import ROTATIONS, model_rotation, rotate_embedding, rotate_head, rotate_layer
from tools.convert.rtn import rtn_canonical
from tools.convert.smoothquant import SQ_MAPPINGS, smooth_layer
from tools.convert.spec import ConvertError, ExportSpec
from tools.convert.streaming import (CalibModel, ResidentModel, StreamedModel, canonical_to, fp32_matmuls,
                                     resolve_device)

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
    device: str = "auto"  # where calibration runs: auto (cuda when available), cpu, cuda, cuda:N
    refine_passes: int = 0  # GPTQ: rounds of coordinate descent over the codes + scale refit (refine.refine_codes)
    tune_iters: int = 0  # GPTQ: steps of block-output tuning per decoder layer (blocktune.tune_layer); 0 = off
    tune_lr: float = 5e-3
    tune_seqs: int = 4  # calibration sequences per tuning step
    tune_rounding: bool = False  # also tune the rounding of each code (signed gradient; default: the scales only)
    rotate: str | None = None  # residual-stream rotation absorbed into the weights: hadamard | orthogonal (rotation.py)
    rotate_heads: bool = False  # with rotate: also a per-head rotation between v_proj and o_proj (SpinQuant R2)
    awq_scale: bool = False  # GPTQ: fold AWQ's searched per-channel scales into each layer before GPTQ quantizes it
    offload_activations: bool = False  # keep the calibration activations in CPU memory between layer runs
    kv_cache: str | None = None  # "fp8": also calibrate and write KV-cache scales (tools.convert.kv_cache)


@dataclass(slots=True)
class QuantizeResult:
    canon: dict[str, CanonicalWeight]
    seconds: float
    notes: dict[str, float] = field(default_factory=dict)
    layer_errors: list[float | None] = field(default_factory=list)  # per decoder layer (see streaming.LayerErrorProbe)
    layer_seconds: list[float] = field(default_factory=list)  # per decoder layer, wall time
    config_updates: dict = field(default_factory=dict)  # config.json keys calibration changed (an untied lm_head)


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


_slice_batch = slice_batch  # the first m sequences of a decoder layer's keyword argument


def _scale_layer(layer: torch.nn.Module, runner: BlockRunner, method: str, spec: ExportSpec, opts: CalibOptions,
                 sdt: torch.dtype, notes: dict[str, float], prefix: str, clip: bool) -> None:
    """AWQ's scale search (``method`` awq) or SmoothQuant's factors on one decoder layer, folded into its weights."""
    lin = dict(layer.named_modules())
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
                                  clip, sdt, duo=opts.awq_duo).items():
            notes[prefix + n] = ratio
    else:
        smooth_layer(layer, absum, opts.alpha)


@torch.no_grad()
@fp32_matmuls()
def calibrate(model: torch.nn.Module | CalibModel, input_ids: torch.Tensor | None, method: str, spec: ExportSpec,
              opts: CalibOptions, names: list[str]) -> QuantizeResult:
    """Quantize the decoder layers one by one (weights replaced by their dequantized values, scales folded); returns
    the CanonicalWeight of every layer in ``names``, on the CPU. ``model``: a :class:`~.streaming.StreamedModel`
    (layers read from the checkpoint onto its device one at a time; their float state kept by it) or a whole
    model, calibrated in place on its own device."""
    t0 = time.time()
    source = model if isinstance(model, CalibModel) else ResidentModel(model)
    model = source.model
    sdt = spec.resolve_scale_dtype()
    canon: dict[str, CanonicalWeight] = {}
    notes: dict[str, float] = {}
    drift = method == "gptq" and spec.drift_alpha > 0
    rot, tied = None, bool(getattr(model.config, "tie_word_embeddings", False))
    if opts.rotate:  # the stream the runner captures is the rotated one; each layer is rotated when it arrives
        rot = model_rotation(model, opts.rotate, opts.rotate_heads, opts.seed)
        rotate_embedding(model, rot)
    runner = None if method == "rtn" else BlockRunner(model, input_ids, opts.batch_size, track_float=drift,
                                                      offload=opts.offload_activations)
    source.capture_done()
    for i, layer in source.iter_layers(canon, method, runner):
        prefix = f"{source.layer_name(i)}."
        if rot is not None:
            rotate_layer(layer, rot)
        if method == "rtn":
            for n, m in layer.named_modules():
                if isinstance(m, torch.nn.Linear):
                    canon[prefix + n] = rtn_canonical(m.weight, spec.bits, spec.group_size, spec.sym, sdt)
            continue
        groups = linear_groups(layer)
        lin = dict(layer.named_modules())
        if method == "gptq" and opts.awq_scale:  # AWQ's scales folded first, then GPTQ on the scaled weights
            _scale_layer(layer, runner, "awq", spec, opts, sdt, notes, prefix, clip=False)
        fp_layer = copy.deepcopy(layer) if drift else None
        if method == "gptq":
            targets = None
            if opts.tune_iters:  # the float layer's outputs, on the float stream when it is tracked
                targets = runner.run(fp_layer if fp_layer is not None else layer, keep_outputs=True,
                                     inputs=runner.fp_inputs)
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
                    with loop_threads(hess.device):  # a column loop of small ops: one thread (see refine.py)
                        cw = gptq_quantize(w, hess, spec.bits, spec.group_size, spec.sym,
                                           spec.damp_percent, spec.desc_act, spec.static_groups, scale_dtype=sdt,
                                           mse=spec.mse)
                        if opts.refine_passes:
                            cw, _ = refine_codes(cw, w, hess, opts.refine_passes, sdt, spec.damp_percent)
                    _set_weight(lin[n], cw)
                    canon[prefix + n] = cw
            if targets is not None:
                names_i = [n for g in groups for n in g]
                tuned, rep = tune_layer(layer, {n: canon[prefix + n] for n in names_i},
                                        [runner.on_device(x) for x in runner.inputs], runner.kwargs, targets,
                                        opts.tune_iters, opts.tune_lr, opts.tune_seqs, opts.tune_rounding, sdt, opts.seed)
                notes[prefix + "tune"] = rep.after / rep.before if rep.before > 0 else 1.0
                for n, cw in tuned.items():
                    _set_weight(lin[n], cw)
                    canon[prefix + n] = cw
                targets = None
        else:
            _scale_layer(layer, runner, method, spec, opts, sdt, notes, prefix, clip=opts.awq_clip)
            for group in groups:
                for n in group:
                    cw = rtn_canonical(lin[n].weight, spec.bits, spec.group_size, spec.sym, sdt)
                    _set_weight(lin[n], cw)
                    canon[prefix + n] = cw
        runner.advance(layer, fp_layer)
        fp_layer = None  # the float copy goes before the next layer arrives
    runner = None  # and the activations before what follows the layers
    source.finish()
    config_updates = {}
    if rot is not None:
        rotate_head(model, rot)
        if tied:
            config_updates["tie_word_embeddings"] = False
    missing = [n for n in names if n not in canon]
    for n in missing:  # linears outside the decoder layers (e.g. a quantized lm_head): RTN
        cw = rtn_canonical(source.weight(n), spec.bits, spec.group_size, spec.sym, sdt)
        canon[n] = canonical_to(cw, "cpu")
    return QuantizeResult({n: canon[n] for n in names}, time.time() - t0, notes, source.layer_errors,
                          source.layer_seconds, config_updates)


def check_accuracy_options(method: str, opts: CalibOptions) -> None:
    """The accuracy methods' options (rotation, AWQ scaling before GPTQ, refinement, block tuning), in words."""
    if opts.rotate is not None and opts.rotate not in ROTATIONS:
        raise ConvertError(f"--rotate {opts.rotate!r}: choose none or one of {', '.join(ROTATIONS)}")
    if opts.rotate_heads and opts.rotate is None:
        raise ConvertError("--rotate-heads needs --rotate hadamard (or orthogonal)")
    gptq_only = {"--awq-scale": opts.awq_scale, "--refine-passes": opts.refine_passes,
                 "--tune-iters": opts.tune_iters}
    for flag, value in gptq_only.items():
        if value and method != "gptq":
            raise ConvertError(f"{flag} applies to --method gptq, not {method}")
    for flag, value in (("--refine-passes", opts.refine_passes), ("--tune-iters", opts.tune_iters)):
        if value < 0:
            raise ConvertError(f"{flag} must be >= 0, got {value}")
    if opts.tune_iters and (opts.tune_seqs < 1 or not opts.tune_lr > 0):
        raise ConvertError(f"--tune-seqs must be >= 1 and --tune-lr > 0, got {opts.tune_seqs} and {opts.tune_lr}")


def quantize_checkpoint(model_dir: str, out_dir: str, method: str, spec: ExportSpec, opts: CalibOptions | None = None,
                        overwrite: bool = False, *, device: str | torch.device | None = None, stream: bool = True,
                        input_ids: torch.Tensor | None = None,
                        reader: writer.CheckpointReader | None = None) -> tuple[ExportReport, QuantizeResult]:
    """Calibrate ``model_dir`` with ``method`` and write the checkpoint to ``out_dir``.

    ``device`` (default ``opts.device``): where calibration runs (``auto`` = cuda when a GPU is visible, else cpu).
    The float checkpoint is streamed: one decoder layer on the device at a time, the rest read from the shards when
    the writer needs it.
    ``stream=False`` loads the whole model with ``from_pretrained`` and calibrates it in place on the CPU instead (the
    reference the streaming path is tested against). ``input_ids [num_samples, seq_len]`` replace the calibration
    text of ``opts`` (benchmarks calibrate on random tokens). ``reader`` (default: a
    :class:`~tools.convert.writer.CheckpointReader` of ``model_dir``'s shards) is where every float tensor comes
    from (benchmarks draw a random checkpoint as it is read); ``model_dir`` then needs only config.json (and the side
    files the writer copies). It streams: not with ``stream=False``."""
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
    check_accuracy_options(method, opts)
    want = opts.device if device is None else device
    dev = resolve_device("cpu" if not stream and str(want) == "auto" else want)
    if not stream and dev.type != "cpu":
        raise ConvertError(f"the whole-model reference path (stream=False) runs on the CPU, not {dev}")
    if reader is not None and not stream:
        raise ConvertError("a given checkpoint reader streams its tensors: stream=False loads model_dir's shards")
    writer.check_out_dir(out_dir, overwrite)
    if reader is None:
        reader = writer.CheckpointReader(model_dir)  # shard headers only
    names = linear_names(reader.meta, spec.quantize_lm_head)
    for name in names:
        spec.check_layer(name, *reader.meta[name + ".weight"].shape)
    if method == "rtn":
        ids = None
    elif input_ids is not None:
        ids = input_ids
    else:
        ids = calibration_ids(model_dir, opts.calib, opts.num_samples, opts.seq_len, opts.seed)
    torch.manual_seed(opts.seed)
    if stream:
        logger.info("%s calibration on %s, streaming %s layer by layer", method, dev, model_dir)
        source = StreamedModel(model_dir, dev, reader)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval().requires_grad_(False)
        source = ResidentModel(model)
    result = calibrate(source, ids, method, spec, opts, names)
    sd = writer.writer_tensors(reader, source.float_state(result.canon), result.canon)
    del source
    report = write_checkpoint(model_dir, out_dir, sd, result.canon, spec, overwrite, src_dtype=reader.float_dtype(),
                              config_updates=result.config_updates)
    logger.info("%s calibration took %.1f s", method, result.seconds)
    if opts.kv_cache:
        from tools.convert.kv_cache import add_kv_cache_scales

        kv_ids = ids if ids is not None else calibration_ids(model_dir, opts.calib, opts.num_samples, opts.seq_len,
                                                             opts.seed)
        result.notes["kv_cache_scales"] = len(add_kv_cache_scales(out_dir, kv_ids, dev.type)) // 2
    return report, result
