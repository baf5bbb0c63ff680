"""Export: a float HF checkpoint + quantization parameters (a parameter file, or fake-quantized weights) ->
a GPTQ / AWQ / compressed-tensors checkpoint. The calibration path (``quantize``) ends in :func:`write_checkpoint`."""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field

import torch

from lqe.kernels.canonical import CanonicalWeight
from tools.convert import writer
from tools.convert.fakequant import recover_grid
from tools.convert.packers import pack_layer, v1_zero_layers
from tools.convert.params import canonical_from_params, group_index_from, load_params
from tools.convert.qconfig import quantization_config
from tools.convert.spec import ConvertError, ExportSpec

logger = logging.getLogger("lqe.convert")
SKIP_WORDS = ("embed", "norm", "lm_head")


class ConvertWarning(UserWarning):
    pass


@dataclass(slots=True)
class ExportReport:
    out_dir: str
    layers: list[str]
    files: list[str]
    max_grid_dev: dict[str, float] = field(default_factory=dict)
    clamped: list[str] = field(default_factory=list)


def linear_names(sd: dict[str, torch.Tensor], quantize_lm_head: bool = False) -> list[str]:
    """Prefixes of the linear layers to quantize: every 2-D ``*.weight`` but embeddings, norms and lm_head."""
    names = []
    for key, t in sd.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf != "weight" or t.dim() != 2:
            continue
        last = prefix.rpartition(".")[2]
        if last == "lm_head":
            if quantize_lm_head:
                names.append(prefix)
            continue
        if not any(w in last for w in SKIP_WORDS):
            names.append(prefix)
    if quantize_lm_head and "lm_head" not in names:
        raise ConvertError("--quantize-lm-head: the checkpoint has no lm_head.weight (tied to the embeddings?)")
    return names


def float_linears(sd: dict[str, torch.Tensor], quantized: list[str]) -> list[str]:
    return ["lm_head"] if "lm_head" not in quantized else []


def canonical_weights(sd: dict[str, torch.Tensor], names: list[str], spec: ExportSpec,
                      params: dict[str, dict[str, torch.Tensor]] | None) -> tuple[dict[str, CanonicalWeight], dict[str, float]]:
    """From a parameter file when given, else by recovering the grid of fake-quantized weights."""
    if params is not None:
        missing = [n for n in names if n not in params]
        unknown = sorted(set(params) - set(names))
        if missing:
            raise ConvertError(f"the parameter file has no entries for {len(missing)} layer(s): {', '.join(missing[:8])}"
                               f"{' ...' if len(missing) > 8 else ''} (expected keys '<layer>.scales' [G, N], see tools/convert/params.py)")
        if unknown:
            raise ConvertError(f"the parameter file names layers that are not quantized linears of the model: {', '.join(unknown[:8])}")
    out, devs, off_grid = {}, {}, []
    for name in names:
        w = sd[name + ".weight"]
        n, k = w.shape
        spec.check_layer(name, n, k)
        p = params.get(name, {}) if params is not None else {}
        if "scales" in p:
            out[name] = canonical_from_params(name, w, p, spec.bits, spec.group_size, spec.sym)
            continue
        g_idx = group_index_from(p, name, k, spec.group_size)
        fit = recover_grid(w, spec.bits, spec.group_size, spec.sym, g_idx, spec.resolve_scale_dtype())
        devs[name] = fit.max_dev
        if fit.cw is None:
            off_grid.append(f"{name} (largest deviation {fit.max_dev:.3g}, {fit.bad_columns} group x channel blocks off grid)")
        else:
            out[name] = fit.cw
    if off_grid:
        kind = f"{spec.bits}-bit {'symmetric' if spec.sym else 'asymmetric'} group-{spec.group_size}"
        raise ConvertError(f"{len(off_grid)} layer(s) are not on a {kind} quantization grid (not fake-quantized with these "
                           f"settings); refusing to round them silently: " + "; ".join(off_grid) +
                           ". Check --bits/--group-size/--sym/--asym, pass --params, or use `quantize --method rtn`.")
    return out, devs


def write_checkpoint(model_dir: str, out_dir: str, sd: dict[str, torch.Tensor], canon: dict[str, CanonicalWeight],
                     spec: ExportSpec, overwrite: bool = False, src_dtype: torch.dtype | None = None,
                     config_updates: dict | None = None) -> ExportReport:
    """Pack ``canon`` with the format's packer, keep every other tensor in float, write configs and side files.

    ``sd`` needs no float weights of the layers in ``canon`` (they are not written); ``src_dtype``, the source
    checkpoint's float dtype (the default of ``--float-dtype``), is otherwise that of ``sd``'s first float tensor.
    ``config_updates``: config.json keys to change (also in a ``text_config``), e.g. ``tie_word_embeddings`` false
    when calibration untied the LM head (a rotation folds the final norm into it)."""
    spec.validate()
    cfg = writer.read_config(model_dir)
    for key, value in (config_updates or {}).items():
        cfg[key] = value
        if isinstance(cfg.get("text_config"), dict) and key in cfg["text_config"]:
            cfg["text_config"][key] = value
    if src_dtype is None:
        src_dtype = next((t.dtype for t in sd.values() if t.is_floating_point()), torch.float32)
    fdtype = spec.float_dtype or src_dtype
    zero0 = [n for n, cw in canon.items() if spec.fmt == "gptq" and v1_zero_layers(cw)]
    if zero0 and not spec.clamp_zero:
        raise ConvertError(f"{len(zero0)} layer(s) have true zero points of 0, which GPTQ v1 ('gptq') cannot store "
                           f"(it stores zero-1): {', '.join(zero0[:8])}{' ...' if len(zero0) > 8 else ''}. "
                           "Use --format gptq_v2, or --clamp-zero to clamp them to 1 (changes those weights).")
    if zero0:
        warnings.warn(f"--clamp-zero: zero points 0 clamped to 1 in {', '.join(zero0)}", ConvertWarning, stacklevel=2)
    tensors: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        prefix, _, leaf = key.rpartition(".")
        if prefix in canon and leaf in ("weight", "bias"):
            continue
        tensors[key] = t.to(fdtype) if t.is_floating_point() else t
    for name, cw in canon.items():
        bias = sd.get(name + ".bias")
        for leaf, t in pack_layer(name, cw, spec, bias, fdtype).items():
            tensors[f"{name}.{leaf}"] = t
    qcfg, standalone = quantization_config(spec, float_linears(sd, list(canon)))
    cfg["quantization_config"] = qcfg
    if spec.float_dtype is not None:
        name = str(fdtype).removeprefix("torch.")
        cfg["torch_dtype"] = name
        if "dtype" in cfg:
            cfg["dtype"] = name
    with writer.staging_dir(out_dir, overwrite) as tmp:
        writer.copy_side_files(model_dir, tmp)
        files = writer.write_shards(tmp, tensors, spec.max_shard_size)
        writer.write_json(os.path.join(tmp, "config.json"), cfg)
        if standalone is not None:
            writer.write_json(os.path.join(tmp, "quantize_config.json"), standalone)
    logger.info("wrote %d quantized layers to %s (%s)", len(canon), out_dir, ", ".join(files))
    return ExportReport(out_dir, list(canon), files, clamped=zero0)


def export_checkpoint(model_dir: str, out_dir: str, fmt: str = "gptq", bits: int = 4, group_size: int = 128,
                      sym: bool = True, desc_act: bool = False, params: str | dict | None = None, *,
                      overwrite: bool = False, spec: ExportSpec | None = None, **spec_kwargs) -> ExportReport:
    """Export ``model_dir`` (float weights, fake-quantized unless ``params`` gives scales/zeros) to ``out_dir``.

    ``params``: a parameter file path or ``{prefix: {"scales", "zeros", "g_idx"|"perm"}}`` (see :mod:`.params`)."""
    spec = spec or ExportSpec(fmt=fmt, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act, **spec_kwargs)
    spec.validate()
    writer.check_out_dir(out_dir, overwrite)
    sd = writer.load_state_dict(model_dir)
    names = linear_names(sd, spec.quantize_lm_head)
    if isinstance(params, str):
        params = load_params(params)
    canon, devs = canonical_weights(sd, names, spec, params)
    report = write_checkpoint(model_dir, out_dir, sd, canon, spec, overwrite)
    report.max_grid_dev = devs
    return report
