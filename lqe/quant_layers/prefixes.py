"""Module-name helpers: the engine fuses checkpoint modules (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``)
but checkpoint configs name the original modules, so rules are checked against every shard name."""
from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")

FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def shard_prefixes(prefix: str) -> list[str]:
    """``model.layers.0.self_attn.qkv_proj`` -> the three checkpoint module names; other prefixes -> ``[prefix]``."""
    head, _, last = prefix.rpartition(".")
    shards = FUSED_SHARDS.get(last)
    if shards is None:
        return [prefix]
    return [f"{head}.{s}" if head else s for s in shards]


def resolve_shards(prefix: str, fn: Callable[[str], T], what: str) -> T:
    """Evaluate ``fn`` on every shard name of ``prefix`` and require one answer (a fused layer is quantized
    one way). Raises ``ValueError`` naming the shards that disagree."""
    names = shard_prefixes(prefix)
    results = [fn(n) for n in names]
    if any(r != results[0] for r in results[1:]):
        detail = ", ".join(f"{n}: {r!r}" for n, r in zip(names, results))
        raise ValueError(
            f"{prefix}: the checkpoint modules fused into this layer resolve to different {what} ({detail}). "
            "lqe runs them as one fused layer, so they must be quantized alike."
        )
    return results[0]


def is_lm_head(prefix: str) -> bool:
    return prefix.rpartition(".")[2] == "lm_head"
