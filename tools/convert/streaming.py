"""Where calibration gets its decoder layers: streamed from the checkpoint one at a time onto the calibration device
(:class:`StreamedModel`, what ``quantize`` does), or resident in a whole model already in memory
(:class:`ResidentModel`, the reference the streaming path is tested against).

Streaming: the HF model is built with its parameters on the meta device (no memory; buffers such as rotary tables
stay real), the input embedding is read onto the CPU for :class:`~tools.convert.blocks.BlockRunner` to capture
layer 0's inputs (a table lookup: a forward hook moves its output to the device, which never holds the table, 2 GiB
in float32 for Llama-3-8B), then :meth:`CalibModel.iter_layers` reads each decoder layer's tensors from the shards
onto the device,
yields the layer for calibration, keeps its float state (every tensor but the quantized linears' weights: norms
that AWQ / SmoothQuant / rotations changed, biases) on the CPU in the checkpoint's dtype, moves the layer's
CanonicalWeights to the CPU and puts the layer back on the meta device. Peak device memory is one decoder layer
plus the calibration activations (and whatever a method allocates for the layer).

Extension points for transforms (e.g. a residual-stream rotation): change ``model``'s input embedding before the
BlockRunner captures (it is on the CPU; a tied lm_head is the same tensor, so untie it first if it must not
change); change ``layer`` at the top of the loop body (its full float state after the body is what is kept);
after :meth:`CalibModel.finish` (calibrate calls it after the last layer) everything outside the layers is real:
what the capture used on the CPU, the rest (an untied lm_head) on the device. Change the final norm / lm_head there
(assign a new ``lm_head.weight`` to untie it; move rotation matrices to ``w.device``). Every real non-layer tensor
is part of :meth:`CalibModel.float_state`, which the writer stores.

Resuming: inside ``with resumable(LayerCheckpoint(...))`` (:mod:`tools.convert.resume`) a streamed calibration saves
its state between decoder layers and stops when its time is up; the same calibration started again in the same
``with`` continues where it stopped and gives the weights of an uninterrupted run."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from tqdm import tqdm

from lqe.kernels.canonical import CanonicalWeight
from tools.convert.blocks import BlockRunner, decoder_layers, use_repeated_kv_attention
from tools.convert.progress import LayerErrorProbe, weight_error
from tools.convert.resume import LayerCheckpoint, current_checkpoint
from tools.convert.spec import ConvertError
from tools.convert.writer import CheckpointReader, quantized_weight

logger = logging.getLogger("lqe.convert")
DEVICES = "auto, cpu, cuda or cuda:N"


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; ``cuda[:N]`` must exist (ConvertError otherwise)."""
    text = "auto" if name is None else str(name)
    if text == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ConvertError(f"--device {text!r}: expected {DEVICES}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ConvertError(f"--device {text!r}: calibration runs on {DEVICES}")
    if not torch.cuda.is_available():
        raise ConvertError(f"--device {text}: no CUDA GPU is visible (torch.cuda.is_available() is False; torch "
                           f"{torch.__version__}, built for CUDA {torch.version.cuda}). Use --device cpu, or auto.")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConvertError(f"--device {text}: only {count} CUDA device(s) are visible (cuda:0 .. cuda:{count - 1})")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


@contextmanager
def empty_weights() -> Iterator[None]:
    """Parameters registered inside go to the meta device (buffers stay real): a model skeleton costing no memory."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # (a meta one is kept as is: tying weights assigns them again)
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _fp32_precision_backends() -> list:
    """The backends of torch's per-backend fp32 precision API (torch >= 2.9: ``torch.backends.cuda.matmul`` and
    ``torch.backends.mkldnn.matmul``, each with ``fp32_precision``); none before it."""
    mkldnn = getattr(torch.backends, "mkldnn", None)
    found = []
    for backend in (getattr(torch.backends.cuda, "matmul", None), getattr(mkldnn, "matmul", None)):
        try:
            if backend is not None and isinstance(backend.fp32_precision, str):
                found.append(backend)
        except (AttributeError, RuntimeError):
            pass
    return found


@contextmanager
def fp32_matmuls() -> Iterator[None]:
    """Full-precision fp32 matmuls inside (no TF32, whatever the process chose): Hessians and activations are fp32
    sums. Usable as a decorator.

    torch has two APIs for it, which must not be mixed: the legacy one (``set_float32_matmul_precision``) and, since
    2.9, per backend ``torch.backends.cuda.matmul.fp32_precision = "ieee" | "tf32"`` (and mkldnn's). Once a process
    set the new one (to tf32, say), the legacy getter raises ("mix of the legacy and new APIs"), and setting the new
    one in a process on the legacy API makes legacy reads (``allow_tf32``) raise inside. So the guard keeps to the
    API the process is on: the legacy one while its getter answers, else the new one (each backend's value saved,
    set to ``ieee``, restored)."""
    try:
        before = torch.get_float32_matmul_precision()
    except RuntimeError:  # the process set the new API
        before = None
    if before is not None:
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)
        return
    backends = _fp32_precision_backends()
    saved = [b.fp32_precision for b in backends]
    for b in backends:
        b.fp32_precision = "ieee"
    try:
        yield
    finally:
        for b, value in zip(backends, saved):
            b.fp32_precision = value


def canonical_to(cw: CanonicalWeight, device: torch.device | str) -> CanonicalWeight:
    """``cw`` with its tensors on ``device`` (in place; returned for chaining)."""
    cw.codes = cw.codes.to(device)
    cw.scales = cw.scales.to(device)
    cw.zeros = None if cw.zeros is None else cw.zeros.to(device)
    cw.g_idx = None if cw.g_idx is None else cw.g_idx.to(device)
    return cw


def _to_meta(module: nn.Module) -> None:
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None and not p.is_meta:
                mod._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=False)


class CalibModel:
    """The decoder layers calibration iterates over, and the float state it leaves (see the module docstring)."""

    streaming = False
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        # saves / resumes the layer loop (``with resumable(...)``; streamed models only: restore / save refuse others)
        self.checkpoint: LayerCheckpoint | None = current_checkpoint()
        self.layers = decoder_layers(model)
        self.layer_prefix = next(n for n, m in model.named_modules() if m is self.layers)
        self.layer_errors: list[float | None] = []
        self.layer_seconds: list[float] = []  # wall time per layer: load, calibrate, release

    def layer_name(self, i: int) -> str:
        return f"{self.layer_prefix}.{i}"

    def iter_layers(self, canon: dict[str, CanonicalWeight], desc: str,
                    runner: BlockRunner | None = None) -> Iterator[tuple[int, nn.Module]]:
        """``(i, layer)`` for every decoder layer, on the calibration device; when the caller comes back for the next
        one, layer ``i``'s CanonicalWeights (the entries of ``canon`` under its prefix) go to the CPU and its float
        state is kept. The progress bar shows the last layer's error (:class:`LayerErrorProbe`, or
        :func:`weight_error` without a runner)."""
        n = len(self.layers)
        ckpt = self.checkpoint
        start = ckpt.restore(self, canon, runner) if ckpt is not None else 0
        bar = tqdm(range(start, n), desc=desc, unit="layer", initial=start, total=n)
        try:
            for i in bar:
                if ckpt is not None:
                    ckpt.before_layer(self, i, canon, runner)
                t0 = time.perf_counter()
                layer = self._load(i)
                probe = LayerErrorProbe(runner) if runner is not None and runner.inputs else None
                yield i, layer
                prefix = self.layer_name(i) + "."
                if probe is not None:
                    err = probe.error()
                else:
                    err = weight_error(layer, prefix, canon) if runner is None else None
                self.layer_errors.append(err)
                if err is not None:
                    bar.set_postfix_str(f"err={err:.2e}")
                    logger.debug("%s: relative error %.3e", self.layer_name(i), err)
                for name in [n for n in canon if n.startswith(prefix)]:
                    canonical_to(canon[name], "cpu")
                self._release(i, layer, canon)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.layer_seconds.append(time.perf_counter() - t0)
                if ckpt is not None:
                    ckpt.after_layer(self, i + 1, canon, runner)
            if ckpt is not None:  # what follows the layers (lm_head, the writer) must fit too
                ckpt.before_layer(self, n, canon, runner)
        finally:
            bar.close()

    def capture_done(self) -> None:
        """Called once the runner holds layer 0's inputs: nothing before the layers is needed on the device now."""

    def finish(self) -> None:
        """Called after the last layer, before lm_head quantization and :meth:`float_state`."""

    def weight(self, name: str) -> torch.Tensor:
        """The float weight of module ``name`` (outside the decoder layers, e.g. lm_head) on the calibration device."""
        return self.model.get_submodule(name).weight.to(self.device)

    def float_state(self, canon: dict[str, CanonicalWeight]) -> dict[str, torch.Tensor]:
        """Float tensors of the calibrated model (CPU) for the writer, keyed like the checkpoint; the weights of the
        quantized linears (``canon``) are left out."""
        raise NotImplementedError

    def _load(self, i: int) -> nn.Module:
        return self.layers[i]

    def _release(self, i: int, layer: nn.Module, canon: dict[str, CanonicalWeight]) -> None:
        pass


class ResidentModel(CalibModel):
    """A whole model in memory (``from_pretrained``), calibrated in place on its own device: the reference path."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, next(model.parameters()).device)

    def float_state(self, canon: dict[str, CanonicalWeight]) -> dict[str, torch.Tensor]:
        return {k: t.detach().cpu() for k, t in self.model.state_dict().items() if not quantized_weight(k, canon)}


class StreamedModel(CalibModel):
    """A model skeleton whose weights are read from the checkpoint (``reader``) only where and when needed."""

    streaming = True

    def __init__(self, model_dir: str, device: torch.device, reader: CheckpointReader | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.reader = reader or CheckpointReader(model_dir)
        self.dtype = dtype
        config = AutoConfig.from_pretrained(model_dir)
        with empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.eval().requires_grad_(False)
        if device.type == "cuda":
            use_repeated_kv_attention(model)
        for mod in model.modules():  # non-persistent buffers (rotary tables) are computed, not read: move them
            for name, buf in mod._buffers.items():
                if buf is not None:
                    mod._buffers[name] = buf.to(device)
        super().__init__(model, device)
        self.state: dict[str, torch.Tensor] = {}  # float state of the layers done so far (CPU, checkpoint dtype)
        names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        self._ties = [ns for ns in names.values() if len(ns) > 1]  # tied weights: the first name owns the tensor
        # everything outside the layers but the output embedding (lm_head: big, and needed only at the end, by
        # finish(); tied to the input embedding, it is that embedding)
        out, emb = model.get_output_embeddings(), model.get_input_embeddings()
        out_weight = out.weight if out is not None and out.weight is not emb.weight else None
        before = [n for n, p in model.named_parameters()
                  if not self._in_layers(n) and p is not out_weight]
        modules = sorted({n.rpartition(".")[0] for n in before})
        emb_name = next(n for n, m in model.named_modules() if m is emb)
        self.materialize([m for m in modules if m != emb_name])
        # the input embedding serves a lookup: its table stays on the CPU, its output goes to the device
        self.materialize([emb_name], torch.device("cpu"))
        self._embed_hook = None
        if device != torch.device("cpu"):
            self._embed_hook = emb.register_forward_hook(lambda m, args, y: y.to(device))

    def _in_layers(self, name: str) -> bool:
        return name == self.layer_prefix or name.startswith(self.layer_prefix + ".")

    def materialize(self, modules: list[str], device: torch.device | None = None) -> None:
        """Read the parameters (and persistent buffers) of the named modules that are still on the meta device from
        the checkpoint onto ``device`` (default: the calibration device; direct children only, not their
        submodules); tied weights stay tied (one tensor under every name)."""
        for name in modules:
            mod = self.model.get_submodule(name)
            keys = [k for k, t in mod.state_dict(keep_vars=True).items() if "." not in k and t.is_meta]
            if not keys:
                continue
            full = [f"{name}.{k}" if name else k for k in keys]
            tensors = self.reader.get_many(full, self.device if device is None else device, self.dtype)
            mod.load_state_dict({k: tensors[f] for k, f in zip(keys, full)}, strict=False, assign=True)
            for ns in self._ties:  # (a transform that untied them assigned a real tensor: left alone)
                owner = self.model.get_parameter(ns[0])
                for other in ns[1:]:
                    parent, _, leaf = other.rpartition(".")
                    if self.model.get_parameter(other).is_meta:
                        self.model.get_submodule(parent)._parameters[leaf] = owner

    def finish(self) -> None:
        """After the last layer: read what is still on the meta device outside the layers (an untied lm_head, the
        final norm) onto the calibration device, so post-layer transforms and lm_head quantization see real
        tensors."""
        rest = [n for n, p in self.model.named_parameters() if p.is_meta and not self._in_layers(n)]
        self.materialize(sorted({n.rpartition(".")[0] for n in rest}))

    def capture_done(self) -> None:
        if self._embed_hook is not None:
            self._embed_hook.remove()
            self._embed_hook = None
        moved: dict[int, nn.Parameter] = {}
        for name, mod in self.model.named_modules(remove_duplicate=False):
            if self._in_layers(name):
                continue
            for pname, p in mod._parameters.items():
                if p is not None and not p.is_meta:
                    if id(p) not in moved:  # tied weights move once and stay one tensor
                        moved[id(p)] = nn.Parameter(p.to("cpu"), requires_grad=False)
                    mod._parameters[pname] = moved[id(p)]

    def weight(self, name: str) -> torch.Tensor:
        p = self.model.get_submodule(name).weight
        if p.is_meta:
            return self.reader.get(name + ".weight", self.device, self.dtype)
        return p.to(self.device)

    def _load(self, i: int) -> nn.Module:
        layer = self.layers[i]
        prefix = self.layer_name(i) + "."
        names = list(layer.state_dict(keep_vars=True))
        missing = [prefix + n for n in names if prefix + n not in self.reader]
        if missing:
            raise ConvertError(f"{self.reader.model_dir}: the checkpoint has no {', '.join(missing[:4])}"
                               f"{' ...' if len(missing) > 4 else ''} (the model's own names for layer {i}); streaming "
                               "calibration reads tensors by those names")
        tensors = self.reader.get_many([prefix + n for n in names], self.device, self.dtype)
        layer.load_state_dict({n: tensors[prefix + n] for n in names}, strict=True, assign=True)
        return layer

    def _release(self, i: int, layer: nn.Module, canon: dict[str, CanonicalWeight]) -> None:
        prefix = self.layer_name(i) + "."
        for name, t in layer.state_dict().items():
            key = prefix + name
            if not quantized_weight(key, canon):
                self.state[key] = self._keep(key, t)
        _to_meta(layer)

    def _keep(self, key: str, t: torch.Tensor) -> torch.Tensor:
        # an own copy: a tensor read on the CPU is a view of its shard's memory map, which it would keep mapped
        t = t.detach().to("cpu", copy=True)
        src = self.reader.meta.get(key)
        return t.to(src.dtype) if src is not None and t.is_floating_point() else t

    def float_state(self, canon: dict[str, CanonicalWeight]) -> dict[str, torch.Tensor]:
        out = dict(self.state)
        seen: set[int] = set()
        for key, t in self.model.state_dict().items():
            if t.is_meta or key in out or quantized_weight(key, canon):
                continue
            if t.data_ptr() in seen and key not in self.reader:  # a tied lm_head is the embedding again
                continue
            seen.add(t.data_ptr())
            out[key] = self._keep(key, t)
        return out
