"""Run a HF causal LM block by block on calibration inputs, so only one decoder layer's activations live at a
time: capture the first layer's inputs (hidden states + the keyword arguments HF passes: mask, rotary
embeddings ...), then for each layer collect what a method needs through forward hooks on its linears,
quantize it, and feed the quantized layer's outputs to the next one. Activations live on the device the first
layer's inputs arrive on (the calibration device: the input embedding's, or where a hook on it moves its output);
the layers themselves may come and go (see :mod:`.streaming`)."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

logger = logging.getLogger("lqe.convert")
# linears of a Llama/Qwen decoder layer in execution order, grouped by shared input (true-sequential order)
SEQUENTIAL = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


class _Stop(Exception):
    pass


def _raise_stop(module, args):
    raise _Stop


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no .model.layers; block-wise calibration supports Llama-like models")
    return layers


def slice_batch(obj, m: int, batch: int):
    """The first ``m`` sequences of a decoder layer's keyword argument (tensors of 2+ dims whose dim 0 is the batch:
    masks, rotary tables; 1-D ones such as ``cache_position`` run over positions)."""
    if isinstance(obj, torch.Tensor):
        return obj[:m] if obj.dim() >= 2 and obj.shape[0] == batch and batch != m else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(slice_batch(o, m, batch) for o in obj)
    if isinstance(obj, dict):
        return {k: slice_batch(v, m, batch) for k, v in obj.items()}
    return obj


def linear_groups(layer: nn.Module) -> list[tuple[str, ...]]:
    """Known groups first, then any other linear alone (module order)."""
    linears = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
    groups = [tuple(n for n in grp if n in linears) for grp in SEQUENTIAL]
    groups = [g for g in groups if g]
    seen = {n for g in groups for n in g}
    return groups + [(n,) for n in linears if n not in seen]


class BlockRunner:
    """``inputs``: the current layer's inputs as the quantized layers before it produce them. With ``track_float``,
    also ``fp_inputs``: the same layer's inputs in the float model (what the quantized stream should reproduce).
    ``input_ids`` may live anywhere: each batch goes to the device of the model's input embedding; ``device``, where
    the layers run, is where layer 0's inputs arrive (the embedding's device, unless a forward hook on the embedding
    moves its output: the streaming path keeps the table on the CPU). ``offload`` keeps the stored activations in
    (pinned) CPU memory between runs, each batch copied to the device for its forward: the device then holds one
    batch instead of all of them. ``steps`` counts
    :meth:`advance` calls; :meth:`before_next_run` registers a callback for the next run's layer."""

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, batch_size: int = 8, track_float: bool = False,
                 offload: bool = False) -> None:
        self.model = model
        self.layers = decoder_layers(model)
        self.inputs: list[torch.Tensor] = []
        self.kwargs: list[dict] = []
        self.fp_inputs: list[torch.Tensor] | None = None
        self.steps = 0
        self._before_run: Callable[[nn.Module], None] | None = None
        first = self.layers[0]
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        ids_device = embed.weight.device if embed is not None else next(model.parameters()).device
        self.device = self.store = ids_device
        self.offload = offload

        def catch(module, args, kwargs):
            x = args[0] if args else kwargs.pop("hidden_states")
            if not self.inputs:  # the calibration device: where layer 0's inputs arrive
                self.device = x.device
                self.store = torch.device("cpu") if offload else x.device
            self.inputs.append(self.stored(x))
            self.kwargs.append({k: v for k, v in kwargs.items() if k != "hidden_states"})
            raise _Stop

        handle = first.register_forward_pre_hook(catch, with_kwargs=True)
        try:
            with torch.no_grad():
                for i in range(0, input_ids.shape[0], batch_size):
                    try:
                        model(input_ids[i:i + batch_size].to(ids_device), use_cache=False)
                    except _Stop:
                        pass
        finally:
            handle.remove()
        if track_float:
            self.fp_inputs = list(self.inputs)

    def run(self, layer: nn.Module, keep_outputs: bool = False, stop_at: str | None = None,
            inputs: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """Run ``layer`` on every stored batch; with ``stop_at`` (a submodule name), abandon each forward once that
        submodule's input is known (hooks registered before this call still see it): what comes after is not
        needed."""
        if keep_outputs and stop_at is not None:
            raise ValueError("keep_outputs needs the whole forward; drop stop_at")
        self._fire(layer)
        outs = []
        handle = layer.get_submodule(stop_at).register_forward_pre_hook(_raise_stop) if stop_at is not None else None
        try:
            with torch.no_grad():
                for x, kw in zip(self.inputs if inputs is None else inputs, self.kwargs):
                    try:
                        y = layer(self.on_device(x), **kw)
                    except _Stop:
                        continue
                    if keep_outputs:
                        outs.append(y[0] if isinstance(y, tuple) else y)
        finally:
            if handle is not None:
                handle.remove()
        return outs if keep_outputs else None

    def run_paired(self, layer: nn.Module, fp_layer: nn.Module, names: list[str],
                   fn: Callable[[str, torch.Tensor, torch.Tensor], None], stop_at: str | None = None) -> None:
        """For each batch, ``fn(name, x, x_fp)`` with the input of linear ``name`` in ``layer`` (fed the quantized
        stream) and in ``fp_layer`` (the float copy of the layer, fed the float stream)."""
        if self.fp_inputs is None:
            raise ValueError("run_paired needs BlockRunner(track_float=True)")
        self._fire(layer)
        seen: dict[str, torch.Tensor] = {}
        fp_mods, mods = dict(fp_layer.named_modules()), dict(layer.named_modules())
        handles = [fp_mods[n].register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, a[0].detach()))
                   for n in names]
        handles += [mods[n].register_forward_pre_hook(lambda m, a, n=n: fn(n, a[0].detach(), seen[n])) for n in names]
        if stop_at is not None:
            handles += [fp_mods[stop_at].register_forward_pre_hook(_raise_stop),
                        mods[stop_at].register_forward_pre_hook(_raise_stop)]
        try:
            with torch.no_grad():
                for x, xf, kw in zip(self.inputs, self.fp_inputs, self.kwargs):
                    for mod, inp in ((fp_layer, xf), (layer, x)):
                        try:
                            mod(self.on_device(inp), **kw)
                        except _Stop:
                            pass
                    seen.clear()
        finally:
            for h in handles:
                h.remove()

    def advance(self, layer: nn.Module, fp_layer: nn.Module | None = None) -> None:
        """Replace the stored inputs by ``layer``'s outputs (call after quantizing it); with float tracking, the
        float stream by the outputs of ``fp_layer`` (the layer before quantization)."""
        self._fire(layer)
        if self.fp_inputs is not None:
            if fp_layer is None:
                raise ValueError("a BlockRunner tracking the float stream needs the float layer to advance")
            self._replace(fp_layer, self.fp_inputs)
        self._replace(layer, self.inputs)
        self.steps += 1

    @torch.no_grad()
    def _replace(self, layer: nn.Module, inputs: list[torch.Tensor]) -> None:
        """``inputs[b] = layer(inputs[b])`` batch by batch: one batch's old and new activations coexist, not all."""
        for b, kw in enumerate(self.kwargs):
            y = layer(self.on_device(inputs[b]), **kw)
            inputs[b] = self.stored(y[0] if isinstance(y, tuple) else y)

    def before_next_run(self, fn: Callable[[nn.Module], None]) -> None:
        """``fn(layer)`` once, when :meth:`run`, :meth:`run_paired` or :meth:`advance` next starts on a layer: the
        layer as calibration first sees it (after any transform of the loop body, before it is quantized)."""
        self._before_run = fn

    def _fire(self, layer: nn.Module) -> None:
        fn, self._before_run = self._before_run, None
        if fn is not None:
            fn(layer)

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` where the activations are kept (pinned host memory when offloading from a GPU)."""
        if x.device == self.store:
            return x
        if self.store.type == "cpu" and x.device.type == "cuda":
            return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x)
        return x.to(self.store)

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """A stored activation on the device the layers run on."""
        return x.to(self.device, non_blocking=True)


CALIB_ATTENTION = "lqe_calibration_sdpa"


def sdpa_repeated_kv(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention with the key/value heads of grouped-query attention repeated up front."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        b, h, t, d = key.shape
        key = key[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)
        value = value[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, :key.shape[-2]]
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=is_causal)
    return out.transpose(1, 2).contiguous(), None


def use_repeated_kv_attention(model: nn.Module) -> None:
    """Run ``model``'s sdpa attention through :func:`sdpa_repeated_kv`. On CUDA, fp32 sdpa with grouped-query
    attention (``enable_gqa``) falls back to the math kernel, which materializes ``[batch, heads, T, T]`` scores
    (4 GiB for 8 x 2048 tokens of Llama-3-8B, twice that with the softmax); with the heads repeated the
    memory-efficient kernel runs. (The CPU keeps transformers' own sdpa: the reference numerics.)"""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:  # a transformers without attention registries: its sdpa stays
        logger.warning("calibration keeps transformers' sdpa attention (%s): fp32 grouped-query attention may take "
                       "the math kernel and much GPU memory", e)
        return
    AttentionInterface.register(CALIB_ATTENTION, sdpa_repeated_kv)
    AttentionMaskInterface.register(CALIB_ATTENTION, sdpa_mask)
    configs = {id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}
    for cfg in configs.values():
        if getattr(cfg, "_attn_implementation", None) == "sdpa":
            cfg._attn_implementation = CALIB_ATTENTION


@contextmanager
def input_hooks(layer: nn.Module, names: tuple[str, ...] | list[str],
                fn: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call ``fn(name, input)`` for every forward of the named linears of ``layer``."""
    modules = dict(layer.named_modules())
    handles = [modules[n].register_forward_pre_hook(lambda m, args, n=n: fn(n, args[0].detach())) for n in names]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
