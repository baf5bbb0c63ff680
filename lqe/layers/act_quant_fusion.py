"""Post-load pass: let an RMSNorm / SiLU-mul quantize its output for the W8A8 layer that is its only consumer.

A model declares, as data, the ``(producer, consumer)`` pairs of each block whose producer's output feeds that one
linear layer and nothing else: ``act_quant_pairs`` on the block class, names relative to the block (Llama:
``input_layernorm -> self_attn.qkv_proj``, ``post_attention_layernorm -> mlp.gate_up_proj``,
``mlp.act_fn -> mlp.down_proj``). After the weights are processed, :func:`link_act_quant` asks each consumer's
linear method which pre-quantized input it takes (:meth:`~lqe.quant_layers.base.LinearMethod.input_quant`: today
W8A8 int8 with dynamic symmetric per-token activations on the CUDA kernels' path) and, when the producer can emit
that scheme, sets ``producer.output_quant``. The forward code is the same either way: the producer returns a
:class:`~lqe.quant_layers.quantized_activation.QuantizedActivation` that the consumer's method takes as its input.

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
    """Set ``output_quant`` on every declared producer whose consumer takes a pre-quantized input it can emit (and
    clear it on the others); return the fused ``(producer, consumer)`` module names. Logs one line per distinct
    outcome: the pairs fused, or why pairs that could be were not (nothing for models without such a consumer)."""
    from lqe.kernels.fused_quant import unavailable_reason

    disabled = fusion_disabled_reason(tp_size)
    fused: list[tuple[str, str]] = []
    kinds: collections.Counter[str] = collections.Counter()
    declined: collections.Counter[str] = collections.Counter()
    for block_name, block in model.named_modules():
        for prod_name, cons_name in getattr(block, "act_quant_pairs", ()):
            producer, consumer = block.get_submodule(prod_name), block.get_submodule(cons_name)
            producer.output_quant = None
            method = getattr(consumer, "quant_method", None)
            scheme = method.input_quant(consumer) if method is not None else None
            if scheme is None or scheme not in getattr(producer, "supported_output_quant", ()):
                continue
            tensor = next(iter([*consumer.parameters(), *consumer.buffers()]), None)
            why = disabled or (unavailable_reason(tensor.device) if tensor is not None else None)
            if why is not None:
                declined[why] += 1
                continue
            producer.output_quant = scheme
            prefix = f"{block_name}." if block_name else ""
            fused.append((prefix + prod_name, prefix + cons_name))
            kinds[f"{prod_name} -> {cons_name} ({scheme})"] += 1
    lines = []
    if fused:
        lines.append("fused activation quantization: " + ", ".join(f"{k} x{n}" for k, n in kinds.items()))
    lines += [f"fused activation quantization: off for {n} norm/activation -> int8 pairs: {why}"
              for why, n in declined.items()]
    for line in lines:
        if line not in _LOGGED:
            _LOGGED.add(line)
            logger.info("%s", line)
    return fused
