"""Which layers a GPTQ checkpoint quantizes, and how: GPTQModel ``dynamic`` overrides, ``lm_head`` and the
HF/optimum ``modules_in_block_to_quantize`` list (FORMATS.md §1.1)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lqe.quant_layers.prefixes import is_lm_head, resolve_shards, shard_prefixes

OVERRIDABLE = ("bits", "group_size", "desc_act", "sym")
SKIP = "skip"
NO_MATCH = "no-match"


@dataclass(slots=True)
class DynamicRule:
    pattern: re.Pattern[str]
    negative: bool
    overrides: dict[str, Any] = field(default_factory=dict)


def parse_dynamic(dynamic: dict[str, Any] | None) -> list[DynamicRule]:
    """``{"-:regex": {}, "+:regex": {...}, "regex": {...}}`` -> rules in file order (first match wins)."""
    rules: list[DynamicRule] = []
    for key, overrides in (dynamic or {}).items():
        negative = key.startswith("-:")
        pattern = key[2:] if key[:2] in ("-:", "+:") else key
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"quantization_config.dynamic: invalid regex {pattern!r}: {e}") from None
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(OVERRIDABLE) - {"pack_dtype"})
        if unknown:
            raise ValueError(f"quantization_config.dynamic[{key!r}]: unsupported override keys {unknown}; lqe reads {list(OVERRIDABLE)}")
        rules.append(DynamicRule(compiled, negative, {k: overrides[k] for k in OVERRIDABLE if k in overrides}))
    return rules


def match_dynamic(rules: list[DynamicRule], name: str) -> str | tuple[tuple[str, Any], ...]:
    """SKIP, NO_MATCH, or the sorted override items of the first rule whose regex ``re.match``es ``name``."""
    for rule in rules:
        if rule.pattern.match(name):
            return SKIP if rule.negative else tuple(sorted(rule.overrides.items()))
    return NO_MATCH


def dynamic_for_layer(rules: list[DynamicRule], prefix: str) -> str | dict[str, Any]:
    """Rule outcome for a (possibly fused) layer: its shard names must agree; when none of them matches,
    the fused name itself (``...qkv_proj``) is tried, as vLLM does."""
    if not rules:
        return NO_MATCH
    result = resolve_shards(prefix, lambda n: match_dynamic(rules, n), "GPTQ `dynamic` rules")
    if result == NO_MATCH and shard_prefixes(prefix) != [prefix]:
        result = match_dynamic(rules, prefix)
    return result if isinstance(result, str) else dict(result)


def in_block_list(block_lists: list[list[str]] | None, prefix: str) -> bool:
    """``modules_in_block_to_quantize`` (e.g. ``[["self_attn.q_proj", ...], ["mlp.down_proj"]]``): is the layer
    one of them? Absent list => every linear layer is quantized."""
    if not block_lists:
        return True
    names = [n for group in block_lists for n in ([group] if isinstance(group, str) else group)]

    def listed(shard: str) -> bool:
        return any(shard == n or shard.endswith("." + n) for n in names)

    return resolve_shards(prefix, listed, "`modules_in_block_to_quantize` membership")


def layer_quantized(prefix: str, lm_head: bool, block_lists: list[list[str]] | None) -> bool:
    if is_lm_head(prefix):
        return lm_head
    return in_block_list(block_lists, prefix)
