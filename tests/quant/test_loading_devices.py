"""Weight loaders never assume that a checkpoint tensor (always read onto the CPU) and the parameter it fills share
a device. On a GPU the parameters live on CUDA; here they live on an emulated second device: a tensor subclass
that reports ``meta`` as its device but keeps real CPU data, and refuses, as CUDA does, any op other than a
copy or a ``.to`` that mixes it with a (non-scalar) CPU tensor."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lqe.quant_layers import reference as ref
from lqe.quant_layers.awq import AWQConfig
from lqe.quant_layers.compressed_tensors import CompressedTensorsConfig
from lqe.quant_layers.gptq import GPTQConfig
from qutil import load, make_layer, rel_err, shard_ids

OTHER = torch.device("meta")  # the device the emulated parameters report
aten = torch.ops.aten
INDEXING = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)


class OnOther(torch.Tensor):
    """A tensor on ``OTHER`` whose data is the CPU tensor ``inner`` (views share it, so writes land)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "OnOther":
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=OTHER,
                                                strides=inner.stride(), storage_offset=inner.storage_offset())
        t.inner = inner
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    def tolist(self):
        return self.inner.tolist()


class OtherDeviceMode(TorchDispatchMode):
    """Sees the ops on plain tensors too, so ``cpu_tensor.to(OTHER)`` and factories on ``OTHER`` make ``OnOther``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _unwrap(x):
    return x.inner if isinstance(x, OnOther) else x


def _wrap(x):
    return OnOther(x) if isinstance(x, torch.Tensor) and not isinstance(x, OnOther) else x


def _dispatch(func, args, kwargs):
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    on_other = any(isinstance(t, OnOther) for t in tensors)
    wants_other = kwargs.get("device") is not None and torch.device(kwargs["device"]) == OTHER
    kwargs = {k: (torch.device("cpu") if k == "device" and wants_other else v) for k, v in kwargs.items()}
    moves = func in (aten.copy_.default, aten._to_copy.default)
    if func in INDEXING:  # CUDA moves CPU index tensors itself
        indices = {id(t) for t in tree_flatten(args[1])[0]}
        tensors = [t for t in tensors if id(t) not in indices]
    on_cpu = [t for t in tensors if not isinstance(t, OnOther) and t.dim() > 0]  # CUDA, too, accepts CPU scalars
    if on_other and on_cpu and not moves:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{OTHER} and cpu! (emulated, in {func})")
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if func is aten.copy_.default:
        return args[0]
    stays = func is aten._to_copy.default and kwargs.get("device") is None and isinstance(args[0], OnOther)
    if wants_other or stays or (on_other and func is not aten._to_copy.default):
        return tree_map(_wrap, out)
    return out


def move_params(layer: nn.Module) -> None:
    """Put every parameter of ``layer`` on ``OTHER``, keeping its loader attributes."""
    for name, p in list(layer._parameters.items()):
        if p is None:
            continue
        moved = nn.Parameter(OnOther(p.data.clone()), requires_grad=False)
        moved.__dict__.update(p.__dict__)
        layer._parameters[name] = moved


def cpu_data(t: torch.Tensor) -> torch.Tensor:
    return t.inner if isinstance(t, OnOther) else t


# --------------------------------------------------------------------------------------------- fused layers
def _gptq(act: bool, sym: bool, bits: int = 4, gs: int = 32, k: int = 128, sizes=(64, 32, 32)):
    g_idx = (torch.randperm(k) // (k if gs == -1 else gs)).to(torch.int32) if act else None
    tensors = [ref.encode_gptq(ref.rtn_quantize(torch.randn(n, k), bits, gs, sym, g_idx=g_idx), "gptq_v2") for n in sizes]
    cfg = GPTQConfig.from_hf_config({"quant_method": "gptq", "bits": bits, "group_size": gs, "sym": sym, "desc_act": act,
                                     "checkpoint_format": "gptq_v2"})
    return cfg, "qkv", k, list(sizes), tensors


def _awq(k: int = 128, sizes=(64, 64), gs: int = 32):
    tensors = [ref.encode_awq(ref.rtn_quantize(torch.randn(n, k), 4, gs, False)) for n in sizes]
    cfg = AWQConfig.from_hf_config({"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True, "version": "GEMM"})
    return cfg, "gate_up", k, list(sizes), tensors


def _ct(weights: dict, acts: dict | None, fmt: str) -> CompressedTensorsConfig:
    return CompressedTensorsConfig.from_hf_config({
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}})


def _ct_w4a16(k: int = 128, sizes=(64, 32, 32), gs: int = 32):
    g_idx = (torch.randperm(k) // gs).to(torch.int32)
    tensors = []
    for n in sizes:
        t = ref.encode_ct_packed(ref.rtn_quantize(torch.randn(n, k), 4, gs, False, g_idx=g_idx))
        tensors.append({**t, "weight_g_idx": g_idx})
    w = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": gs, "actorder": "group"}
    return _ct(w, None, "pack-quantized"), "qkv", k, list(sizes), tensors


def _w8a8(static: bool, sym: bool, tensor_scale: bool, k: int = 64, sizes=(64, 32, 32)):
    tensors = []
    for i, n in enumerate(sizes):
        q, s = ref.quantize_int8_per_channel(torch.randn(n, k))
        t = {"weight": q, "weight_scale": s.amax().reshape(1) if tensor_scale else s}
        if static:
            t["input_scale"] = torch.tensor([0.02 + 0.005 * i])
            if not sym:
                t["input_zero_point"] = torch.tensor([3 - i], dtype=torch.int8)
        tensors.append(t)
    w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor" if tensor_scale else "channel"}
    a = {"num_bits": 8, "type": "int", "symmetric": sym, "strategy": "tensor" if static else "token", "dynamic": not static}
    return _ct(w, a, "int-quantized"), "qkv", k, list(sizes), tensors


def _fp8(strategy: str, static: bool, k: int = 64, sizes=(64, 32)):
    tensors = []
    for n in sizes:
        q, s = ref.quantize_fp8(torch.randn(n, k), per_channel=strategy == "channel")
        tensors.append({"weight": q, "weight_scale": s, **({"input_scale": torch.tensor([0.05])} if static else {})})
    w = {"num_bits": 8, "type": "float", "strategy": strategy}
    a = {"num_bits": 8, "type": "float", "strategy": "tensor" if static else "token", "dynamic": not static}
    return _ct(w, a, "float-quantized"), "gate_up", k, list(sizes), tensors


def _float(k: int = 64, sizes=(64, 32, 32)):
    return None, "qkv", k, list(sizes), [{"weight": torch.randn(n, k)} for n in sizes]  # LinearBase's own loader


CASES = {
    "float": _float,
    "gptq-actorder": lambda: _gptq(act=True, sym=False),  # g_idx: the "shared" loader of issue 12
    "gptq-sym": lambda: _gptq(act=False, sym=True),
    "gptq-8bit": lambda: _gptq(act=True, sym=False, bits=8, gs=-1),
    "awq": _awq,
    "ct-w4a16-actorder": _ct_w4a16,
    "ct-w8a8-static-asym": lambda: _w8a8(static=True, sym=False, tensor_scale=False),
    "ct-w8a8-tensor-scale": lambda: _w8a8(static=True, sym=True, tensor_scale=True),
    "ct-w8a8-dynamic": lambda: _w8a8(static=False, sym=True, tensor_scale=False),
    "fp8-tensor-static": lambda: _fp8("tensor", True),
    "fp8-channel": lambda: _fp8("channel", False),
}


def _build(case: str, other: bool, dtype: torch.dtype = torch.float16) -> nn.Module:
    torch.manual_seed(0)
    cfg, kind, k, sizes, tensors = CASES[case]()
    layer = make_layer(cfg, kind, k, sizes, dtype)
    if other:
        move_params(layer)
        with OtherDeviceMode():
            load(layer, tensors)
    else:
        load(layer, tensors)
    return layer


@pytest.mark.parametrize("case", list(CASES))
def test_fused_layer_loads_onto_another_device(case):
    """Every parameter of a fused layer on another device receives exactly what a CPU layer receives."""
    want = _build(case, other=False)
    got = _build(case, other=True)
    assert len(shard_ids(got)) > 1
    for name, p in want.named_parameters():
        q = got.get_parameter(name)
        assert isinstance(q, OnOther) and q.device == OTHER, name
        assert not (p.is_floating_point() and p.isnan().any()), name  # every value was loaded
        assert torch.equal(cpu_data(q), p.data), name
        assert getattr(q, "loaded_shards", None) == getattr(p, "loaded_shards", None), name


@pytest.mark.parametrize("case", list(CASES))
def test_fused_layer_processes_and_runs_on_another_device(case):
    """After loading, repacking and the forward stay on the parameters' device (the torch path: kernels are
    chosen by device type) and compute what the CPU layer computes."""
    got, want = _build(case, other=True), _build(case, other=False)
    with OtherDeviceMode():
        got.quant_method.process_weights_after_loading(got)
    want.quant_method.process_weights_after_loading(want)
    x = torch.randn(5, want.input_size, dtype=torch.float16)
    with OtherDeviceMode():
        y = got(x.to(OTHER))
    assert isinstance(y, OnOther) and y.dtype == torch.float16
    assert rel_err(cpu_data(y), want(x)) < 1e-2, case  # fp16: the CPU layer may take another (int4 mm) path


def test_shared_g_idx_mismatch_still_reported_across_devices():
    torch.manual_seed(0)
    cfg, kind, k, sizes, tensors = _gptq(act=True, sym=False)
    tensors[2]["g_idx"] = tensors[2]["g_idx"].flip(0)
    layer = make_layer(cfg, kind, k, sizes)
    move_params(layer)
    with OtherDeviceMode(), pytest.raises(ValueError, match=r"g_idx \(shard 'v'\) differs from shard"):
        load(layer, tensors)


def test_emulated_device_refuses_mixed_ops():
    """The emulation is only worth something if it fails where CUDA fails (and passes where CUDA passes)."""
    p = OnOther(torch.arange(4))
    with OtherDeviceMode():
        with pytest.raises(RuntimeError, match="same device"):
            torch.equal(torch.arange(4), p)
        with pytest.raises(RuntimeError, match="same device"):
            p + torch.ones(4, dtype=torch.int64)
        assert torch.equal(torch.arange(4).to(p.device), p)
        assert isinstance(p * torch.tensor(2), OnOther)  # a CPU scalar is allowed, as on CUDA
        assert cpu_data(p[torch.tensor([0, 2])]).tolist() == [0, 2]  # and so are CPU index tensors
        p[1:3].copy_(torch.tensor([7, 8]))
    assert p.inner.tolist() == [0, 7, 8, 3]
