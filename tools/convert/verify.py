"""Decode any GPTQ / AWQ / compressed-tensors checkpoint with the reference decoders, compare with reference float
weights, and flag the known corruptions (FORMATS.md §1.5, §2.5, §5): v1 zero=0 fields, v2 zeros under a v1
label (and the reverse), symmetric flag with non-constant zeros, AWQ GEMV layout, shapes that disagree with the
config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lqe.quant_layers import reference as ref
from lqe.quant_layers.ct_scheme import QArgs
from lqe.quant_layers.resolve import detect_method, find_quant_config
from tools.convert import writer
from tools.convert.spec import ConvertError


@dataclass(slots=True)
class LayerCheck:
    name: str
    kind: str
    shape: tuple[int, int] | None = None  # torch layout [N, K]
    max_err: float | None = None
    mean_err: float | None = None
    issues: list[str] = field(default_factory=list)


@dataclass(slots=True)
class VerifyResult:
    method: str
    layers: list[LayerCheck]
    problems: list[str]  # checkpoint-level

    @property
    def ok(self) -> bool:
        return not self.problems and not any(layer.issues for layer in self.layers)


def _gptq_layer(sd, name: str, cfg: dict[str, Any], chk: LayerCheck) -> torch.Tensor:
    bits, gs, sym = int(cfg["bits"]), int(cfg["group_size"]), bool(cfg.get("sym", True))
    fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
    qweight, qzeros, scales, g_idx = (sd.get(f"{name}.{leaf}") for leaf in ("qweight", "qzeros", "scales", "g_idx"))
    if qzeros is None or scales is None:
        raise ValueError("qzeros / scales missing")
    cw = ref.decode_gptq(qweight, qzeros, scales, g_idx, bits, gs, sym, fmt)
    n = cw.shape[1]
    if qzeros.shape[1] != ref.packed_size(n, bits) or qzeros.shape[0] != scales.shape[0]:
        raise ValueError(f"qzeros: expected shape [{scales.shape[0]}, {ref.packed_size(n, bits)}], found {list(qzeros.shape)}")
    stored = ref.unpack_gptq_qzeros(qzeros, bits, n)
    half = 1 << (bits - 1)
    if sym:
        want = ref.gptq_sym_stored_zero(bits, fmt)
        if not bool((stored == want).all()):
            if fmt == "gptq" and bool((stored == half).all()):
                chk.issues.append(f"v2 zeros ({half}) under a v1 'gptq' label (mislabeled; v1 loaders add 1)")
            elif fmt == "gptq_v2" and bool((stored == half - 1).all()):
                chk.issues.append(f"v1 zeros ({half - 1}) under a 'gptq_v2' label")
            else:
                chk.issues.append(f"sym=true but stored zeros are not the constant {want} "
                                  f"(found values {sorted(set(stored.unique().tolist()))[:6]})")
    elif fmt == "gptq" and bool(ref.v1_zero_corruption(stored, bits).any()):
        chk.issues.append(f"{int(ref.v1_zero_corruption(stored, bits).sum())} v1 zero fields = {2**bits - 1} "
                          "(true zero 0: unrepresentable in v1; AutoGPTQ's packer also corrupted the higher fields)")
    if g_idx is not None and g_idx.numel() != cw.shape[0]:
        raise ValueError(f"g_idx: expected [{cw.shape[0]}], found {list(g_idx.shape)}")
    return cw.dequantize().t()


def _awq_layer(sd, name: str, cfg: dict[str, Any], chk: LayerCheck) -> torch.Tensor:
    gs = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
    qweight, qzeros, scales = (sd.get(f"{name}.{leaf}") for leaf in ("qweight", "qzeros", "scales"))
    if scales is None:
        raise ValueError("scales missing")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if scales.shape[1] != n and scales.shape[0] == qweight.shape[0]:
        chk.issues.append(f"AWQ GEMV layout (qweight {list(qweight.shape)} and scales {list(scales.shape)} are [N, ...]); "
                          "lqe and vLLM read only the GEMM layout")
        return None
    cw = ref.decode_awq(qweight, qzeros, scales, gs)
    return cw.dequantize().t()


def _ct_layer(sd, name: str, w: QArgs, chk: LayerCheck) -> torch.Tensor:
    if f"{name}.weight_packed" in sd:
        shape = sd.get(f"{name}.weight_shape")
        if shape is None:
            raise ValueError("weight_shape missing")
        gs = int(w.group_size) if w.strategy == "group" else -1
        cw = ref.decode_ct_packed(sd[f"{name}.weight_packed"], sd[f"{name}.weight_scale"], shape, w.num_bits, gs,
                                  sd.get(f"{name}.weight_zero_point"), sd.get(f"{name}.weight_g_idx"))
        if w.symmetric and f"{name}.weight_zero_point" in sd:
            chk.issues.append("symmetric scheme but weight_zero_point present")
        return cw.dequantize().t()
    q, s = sd[f"{name}.weight"], sd[f"{name}.weight_scale"]
    if q.dtype != torch.int8:
        raise ValueError(f"weight: expected int8, found {q.dtype}")
    if s.numel() not in (1, q.shape[0]):
        raise ValueError(f"weight_scale: expected [{q.shape[0]}, 1] or [1], found {list(s.shape)}")
    return ref.dequant_ct_int(q, s, sd.get(f"{name}.weight_zero_point"))


def quantized_prefixes(sd: dict[str, torch.Tensor], method: str) -> list[str]:
    leaves = ("qweight",) if method in ("gptq", "awq") else ("weight_packed", "weight_scale")
    found = {k.rpartition(".")[0] for k in sd if k.rpartition(".")[2] in leaves}
    return sorted(found)


def verify_checkpoint(model_dir: str, against: str | None = None) -> VerifyResult:
    cfg = writer.read_config(model_dir)
    found = find_quant_config(model_dir, cfg)
    if found is None:
        raise ConvertError(f"{model_dir!r} has no quantization config (config.json quantization_config / quantize_config.json)")
    qcfg, where = found
    method = detect_method(qcfg, where)
    sd = writer.load_state_dict(model_dir)
    ref_sd = writer.load_state_dict(against) if against else None
    problems: list[str] = []
    w_args = None
    if method == "awq" and str(qcfg.get("version", "gemm")).lower() != "gemm":
        problems.append(f"AWQ version {qcfg.get('version')!r}: only the GEMM layout is loadable by lqe / vLLM")
    if method == "compressed-tensors":
        groups = list((qcfg.get("config_groups") or {}).values())
        if not groups:
            raise ConvertError("compressed-tensors config has no config_groups")
        w_args = QArgs.parse(groups[0].get("weights"))
        if str(qcfg.get("quantization_status", "compressed")).lower() != "compressed":
            problems.append(f"quantization_status {qcfg.get('quantization_status')!r} (expected 'compressed')")
    if method == "gptq" and str(qcfg.get("pack_dtype", "int32")).lower().removeprefix("torch.") != "int32":
        problems.append(f"pack_dtype {qcfg.get('pack_dtype')!r}: only int32 words are loadable")
    layers = []
    for name in quantized_prefixes(sd, method):
        chk = LayerCheck(name, method)
        try:
            if method == "gptq":
                w = _gptq_layer(sd, name, qcfg, chk)
            elif method == "awq":
                w = _awq_layer(sd, name, qcfg, chk)
            else:
                w = _ct_layer(sd, name, w_args, chk)
        except (ValueError, KeyError, RuntimeError) as e:
            chk.issues.append(f"cannot decode: {e}")
            w = None
        if w is not None:
            chk.shape = (int(w.shape[0]), int(w.shape[1]))
            if ref_sd is not None:
                r = ref_sd.get(name + ".weight")
                if r is None:
                    chk.issues.append(f"--against has no {name}.weight")
                elif tuple(r.shape) != chk.shape:
                    chk.issues.append(f"shape {list(chk.shape)} disagrees with the reference {list(r.shape)}")
                else:
                    d = (w.double() - r.double()).abs()
                    chk.max_err, chk.mean_err = float(d.max()), float(d.mean())
        layers.append(chk)
    if not layers:
        problems.append(f"no quantized layers found for method {method!r}")
    return VerifyResult(method, layers, problems)


def format_table(res: VerifyResult) -> str:
    rows = [("layer", "shape", "max_abs_err", "mean_abs_err", "status")]
    for c in res.layers:
        rows.append((c.name, "x".join(map(str, c.shape)) if c.shape else "?",
                     "-" if c.max_err is None else f"{c.max_err:.3g}", "-" if c.mean_err is None else f"{c.mean_err:.3g}",
                     "ok" if not c.issues else "ERROR: " + "; ".join(c.issues)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    lines += [f"checkpoint: ERROR: {p}" for p in res.problems]
    errs = [c.max_err for c in res.layers if c.max_err is not None]
    summary = f"{res.method}: {len(res.layers)} layers, {sum(bool(c.issues) for c in res.layers)} with errors"
    if errs:
        summary += f", max abs error {max(errs):.3g}"
    return "\n".join(lines + [summary, "OK" if res.ok else "FAILED"])
