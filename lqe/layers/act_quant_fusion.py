"""Post-load pass: let an RMSNorm / SiLU-mul quantize its output for the quantized layer(s) that consume it.

A model declares, as data, the ``(producer, consumer)`` pairs of each block whose producer's output feeds those
linear layers and nothing else: ``act_quant_pairs`` on the block class, names relative to the block (Llama:
``input_layernorm -> self_attn.qkv_proj``, ``post_attention_layernorm -> mlp.gate_up_proj``,
``mlp.act_fn -> mlp.down_proj``; a producer may be named in several pairs). After the weights are processed,
:func:`link_act_quant` asks each consumer's linear method which pre-quantized input it takes
(:meth:`~lqe.quant_layers.base.LinearMethod.input_quant`, an :class:`~lqe.quant_layers.quantized_activation.ActQuant`
or None): W8A8 int8 on the CUDA kernels' path with dynamic per-token (symmetric or asymmetric) or static per-tensor
activations, FP8 on the FP8 kernels' path with dynamic per-token or static per-tensor or, for 128x128 block-scaled
weights, per-1x128-group activations. When every consumer of a producer takes the same scheme and the producer can
emit it, the pass sets ``producer.output_quant``; otherwise the producer stays float (mixed consumers, a float /
weight-only consumer, a layer on the torch path). The forward code is the same either way: the producer returns a
:class:`~lqe.quant_layers.quantized_activation.QuantizedActivation` that the consumer's method takes as its input.
On CPU (and wherever a producer's tensors are not on CUDA) the producer runs the torch twin of the fused kernel: the
unfused ops, op for op, so linking changes no bit there either.

Off with ``LQE_FUSED_ACT_QUANT=0``, and with more than one tensor-parallel rank (a row-parallel layer quantizes
with the all-reduced range of the token, which its producer does not see).
"""
from __future__ import annotations

import collections
import logging
import os

from torch import nn

logger = logging.getLogger("lqe")

ENV = "LQE_FUSED_ACT_QUANT"
_LOGGED: set[str] = set()


def fusion_disabled_reason(tp_size: int = 1) -> str | None:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"disabled by {ENV}=0"
    if tp_size > 1:
        return f"tensor_parallel_size={tp_size} (row-parallel layers need the all-reduced range)"
    return None


def link_act_quant(model: nn.Module, tp_size: int = 1) -> list[tuple[str, str]]:
    """Set ``output_quant`` on every declared producer whose consumers all take the same pre-quantized input, which it
    can emit (and clear it on the others); return the fused ``(producer, consumer)`` module names. Logs one line per
    distinct outcome: the pairs fused, or why pairs that could be were not (nothing for models without such a
    consumer)."""
    from lqe.kernels.fused_quant import unavailable_reason

    disabled = fusion_disabled_reason(tp_size)
    fused: list[tuple[str, str]] = []
    kinds: collections.Counter[str] = collections.Counter()
    declined: collections.Counter[str] = collections.Counter()
    for block_name, block in model.named_modules():
        prefix = f"{block_name}." if block_name else ""
        consumers: dict[str, list[str]] = {}
        for prod_name, cons_name in getattr(block, "act_quant_pairs", ()):
            consumers.setdefault(prod_name, []).append(cons_name)
        for prod_name, cons_names in consumers.items():
            producer = block.get_submodule(prod_name)
            producer.output_quant = None
            specs = []
            for cons_name in cons_names:
                consumer = block.get_submodule(cons_name)
                method = getattr(consumer, "quant_method", None)
                specs.append(method.input_quant(consumer) if method is not None else None)
            spec = specs[0]
            if spec is None or spec.scheme not in getattr(producer, "supported_output_quant", ()):
                continue
            if not all(spec.same_as(other) for other in specs[1:]):
                declined[f"its consumers take different inputs ({', '.join(map(str, specs))})"] += 1
                continue
            first = block.get_submodule(cons_names[0])
            tensor = next(iter([*first.parameters(), *first.buffers()]), None)
            why = disabled or (unavailable_reason(tensor.device) if tensor is not None else None)
            if why is not None:
                declined[why] += 1
                continue
            producer.output_quant = spec
            for cons_name in cons_names:
                fused.append((prefix + prod_name, prefix + cons_name))
            kinds[f"{prod_name} -> {', '.join(cons_names)} ({spec})"] += 1
    lines = []
    if fused:
        lines.append("fused activation quantization: " + ", ".join(f"{k} x{n}" for k, n in kinds.items()))
    lines += [f"fused activation quantization: off for {n} norm/activation producers: {why}"
              for why, n in declined.items()]
    for line in lines:
        if line not in _LOGGED:
            _LOGGED.add(line)
            logger.info("%s", line)
    return fused
