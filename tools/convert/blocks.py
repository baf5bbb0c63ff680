"""Run a HF causal LM block by block on calibration inputs, so only one decoder layer's activations live at a
time: capture the first layer's inputs (hidden states + the keyword arguments HF passes: mask, rotary
embeddings ...), then for each layer collect what a method needs through forward hooks on its linears,
quantize it, and feed the quantized layer's outputs to the next one."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

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


def linear_groups(layer: nn.Module) -> list[tuple[str, ...]]:
    """Known groups first, then any other linear alone (module order)."""
    linears = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
    groups = [tuple(n for n in grp if n in linears) for grp in SEQUENTIAL]
    groups = [g for g in groups if g]
    seen = {n for g in groups for n in g}
    return groups + [(n,) for n in linears if n not in seen]


class BlockRunner:
    def __init__(self, model: nn.Module, input_ids: torch.Tensor, batch_size: int = 8) -> None:
        self.model = model
        self.layers = decoder_layers(model)
        self.inputs: list[torch.Tensor] = []
        self.kwargs: list[dict] = []
        first = self.layers[0]

        def catch(module, args, kwargs):
            self.inputs.append(args[0] if args else kwargs.pop("hidden_states"))
            self.kwargs.append({k: v for k, v in kwargs.items() if k != "hidden_states"})
            raise _Stop

        handle = first.register_forward_pre_hook(catch, with_kwargs=True)
        try:
            with torch.no_grad():
                for i in range(0, input_ids.shape[0], batch_size):
                    try:
                        model(input_ids[i:i + batch_size], use_cache=False)
                    except _Stop:
                        pass
        finally:
            handle.remove()

    def run(self, layer: nn.Module, keep_outputs: bool = False,
            stop_at: nn.Module | None = None) -> list[torch.Tensor] | None:
        """Run ``layer`` on every stored batch; with ``stop_at``, abandon each forward once that submodule's input
        is known (hooks registered before this call still see it): what comes after is not needed."""
        if keep_outputs and stop_at is not None:
            raise ValueError("keep_outputs needs the whole forward; drop stop_at")
        outs = []
        handle = stop_at.register_forward_pre_hook(_raise_stop) if stop_at is not None else None
        try:
            with torch.no_grad():
                for x, kw in zip(self.inputs, self.kwargs):
                    try:
                        y = layer(x, **kw)
                    except _Stop:
                        continue
                    if keep_outputs:
                        outs.append(y[0] if isinstance(y, tuple) else y)
        finally:
            if handle is not None:
                handle.remove()
        return outs if keep_outputs else None

    def advance(self, layer: nn.Module) -> None:
        """Replace the stored inputs by ``layer``'s outputs (call after quantizing it)."""
        self.inputs = self.run(layer, keep_outputs=True)


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
