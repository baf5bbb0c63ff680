"""Rotations of the residual stream absorbed into the weights (QuaRot, Ashkboos et al. 2024; SpinQuant R1/R2,
Liu et al. 2024), written from the papers: the float model computes the same function, but every linear that
reads or writes the residual stream sees its weights multiplied by an orthogonal ``Q``, which spreads outlier
input channels over all channels and makes the weights far easier to quantize. Nothing is added at run time:
the checkpoint keeps the architecture and its config keys.

With ``x' = x Q`` for the residual stream (``Q`` orthogonal, so ``rms(x Q) = rms(x)`` and RMSNorm commutes with
the rotation once its weight ``gamma`` is folded into the next linears):

* embedding ``E -> E Q``;
* per decoder layer: ``input_layernorm`` folded into q/k/v and ``post_attention_layernorm`` into gate/up (their
  weights set to 1), then readers ``W -> W Q`` (torch layout ``[N, K]``) and writers o_proj / down_proj
  ``W -> Q^T W``, ``b -> b Q``; optionally (R2) one ``head_dim`` rotation ``R`` per head between v_proj and
  o_proj: v rows ``W_h -> R^T W_h``, o_proj columns ``W[:, h] -> W[:, h] R``;
* the final norm folded into the LM head, ``W -> W diag(gamma) Q``. Tied embeddings are untied (the head
  ``E diag(gamma) Q`` differs from the rotated embedding ``E Q``): ``lm_head.weight`` is written and
  ``tie_word_embeddings`` becomes false.

Each step is its own function (:func:`rotate_embedding`, :func:`rotate_layer`, :func:`rotate_head`), so a caller
that loads the model layer by layer rotates each layer when it arrives. Arithmetic is float64.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lqe.kernels import hadamard as _hd
from lqe.kernels.hadamard import ROTATIONS
from tools.convert.spec import ConvertError

READERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
WRITERS = ("self_attn.o_proj", "mlp.down_proj")


def hadamard(n: int) -> torch.Tensor:
    """An ``n x n`` Hadamard matrix (:func:`lqe.kernels.hadamard.hadamard`); ConvertError when none is known."""
    try:
        return _hd.hadamard(n)
    except ValueError as e:
        raise ConvertError(f"{e}; use --rotate orthogonal") from None


def rotation_matrix(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    """Orthogonal ``[n, n]`` float64 (:func:`lqe.kernels.hadamard.rotation_matrix`); ConvertError on a bad kind or
    an order without a Hadamard matrix."""
    if kind not in ROTATIONS:
        raise ConvertError(f"unknown rotation {kind!r}; choose one of {ROTATIONS}")
    if kind == "hadamard":
        hadamard(n)  # the ConvertError with its hint
    return _hd.rotation_matrix(kind, n, seed)


@dataclass(slots=True)
class Rotation:
    """The residual-stream rotation ``q [hidden, hidden]`` and the optional per-head rotation ``head [d, d]``."""
    q: torch.Tensor
    head: torch.Tensor | None = None

    @classmethod
    def build(cls, kind: str, hidden: int, head_dim: int | None = None, seed: int = 0) -> "Rotation":
        return cls(rotation_matrix(kind, hidden, seed),
                   None if head_dim is None else rotation_matrix(kind, head_dim, seed + 1))

    def to(self, device: torch.device | str) -> "Rotation":
        return Rotation(self.q.to(device), None if self.head is None else self.head.to(device))


def _mul_(param: torch.Tensor, fn) -> None:
    with torch.no_grad():
        param.copy_(fn(param.detach().double()).to(param.dtype))


def fold_norm(norm: nn.Module, linears: list[nn.Linear]) -> None:
    """``W -> W diag(gamma)`` for the linears reading ``norm``'s output; ``gamma -> 1`` (same float function)."""
    gamma = norm.weight.detach().double()
    for lin in linears:
        g = gamma.to(lin.weight.device)
        _mul_(lin.weight, lambda w: w * g[None, :])
    with torch.no_grad():
        norm.weight.fill_(1.0)


def _kv_layout(layer: nn.Module) -> tuple[int, int]:
    attn = layer.self_attn
    d = getattr(attn, "head_dim", None) or attn.config.hidden_size // attn.config.num_attention_heads
    return d, attn.o_proj.in_features // d


@torch.no_grad()
def rotate_layer(layer: nn.Module, rot: Rotation) -> None:
    """Rotate one Llama/Qwen decoder layer in place (norms folded into their readers first)."""
    mods = dict(layer.named_modules())
    missing = [n for n in (*READERS, *(r for rs in READERS.values() for r in rs), *WRITERS) if n not in mods]
    if missing:
        raise ConvertError(f"--rotate needs a Llama/Qwen decoder layer; {type(layer).__name__} lacks {', '.join(missing)}")
    rot = rot.to(mods["self_attn.o_proj"].weight.device)
    q = rot.q
    for norm, readers in READERS.items():
        lins = [mods[n] for n in readers]
        if getattr(mods[norm], "bias", None) is not None:
            raise ConvertError(f"--rotate: {norm} has a bias (LayerNorm); only RMSNorm models can be rotated")
        fold_norm(mods[norm], lins)
        for lin in lins:
            _mul_(lin.weight, lambda w: w @ q)
    for name in WRITERS:
        lin = mods[name]
        _mul_(lin.weight, lambda w: q.t() @ w)
        if lin.bias is not None:
            _mul_(lin.bias, lambda b: b @ q)
    if rot.head is not None:
        r = rot.head
        d, heads = _kv_layout(layer)
        v, o = mods["self_attn.v_proj"], mods["self_attn.o_proj"]
        if r.shape[0] != d or v.out_features % d:
            raise ConvertError(f"--rotate-heads: head_dim {d} does not match the head rotation {tuple(r.shape)}")
        _mul_(v.weight, lambda w: (r.t() @ w.reshape(-1, d, w.shape[1])).reshape(w.shape))
        if v.bias is not None:
            _mul_(v.bias, lambda b: (b.reshape(-1, d) @ r).reshape(-1))
        _mul_(o.weight, lambda w: (w.reshape(w.shape[0], heads, d) @ r).reshape(w.shape))


def _untie(model: nn.Module) -> None:
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is emb.weight:
        head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    text = getattr(model.config, "get_text_config", lambda: None)()
    if text is not None:
        text.tie_word_embeddings = False


def rotate_embedding(model: nn.Module, rot: Rotation) -> None:
    """``E -> E Q`` (the head is untied first when it shares the embedding's tensor)."""
    _untie(model)
    emb = model.get_input_embeddings().weight
    q = rot.q.to(emb.device)
    _mul_(emb, lambda e: e @ q)


def rotate_head(model: nn.Module, rot: Rotation) -> None:
    """Fold the final norm into the LM head and rotate it: ``W -> W diag(gamma) Q`` (untied first)."""
    _untie(model)
    inner = getattr(model, "model", model)
    norm, head = inner.norm, model.get_output_embeddings()
    if getattr(norm, "bias", None) is not None:
        raise ConvertError("--rotate: the final norm has a bias (LayerNorm); only RMSNorm models can be rotated")
    fold_norm(norm, [head])
    q = rot.q.to(head.weight.device)
    _mul_(head.weight, lambda w: w @ q)


def rotate_model(model: nn.Module, rot: Rotation) -> None:
    """The whole float model at once (embedding, every decoder layer, head)."""
    from tools.convert.blocks import decoder_layers

    rotate_embedding(model, rot)
    for layer in decoder_layers(model):
        rotate_layer(layer, rot)
    rotate_head(model, rot)


def model_rotation(model: nn.Module, kind: str, heads: bool = False, seed: int = 0) -> Rotation:
    """The :class:`Rotation` for ``model``'s hidden size (and head_dim with ``heads``)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Rotation.build(kind, cfg.hidden_size, head_dim if heads else None, seed)
