"""Token-count buckets for graph-replayed mixed and prefill steps (issue 26): the bookkeeping half of piecewise
CUDA graphs.

Design (vLLM's piecewise graphs, without torch.compile): a mixed or prefill step of ``T`` flat tokens is padded
to the smallest bucket ``>= T`` (:func:`token_bucket_for`; :func:`lqe.engine.step_inputs.fill_host` with
``pad_tokens``: padding tokens follow the real ones, belong to no sequence, store nothing). Everything except
attention is row-wise (embedding, norms, linear layers, rotary, SiLU-mul), so each bucket can be captured as
``layers + 1`` CUDA graphs -- the ops before layer 0's attention, those between two attentions, and those after
the last -- cut at each ``Attention`` call (end one capture, record the layer's static ``q``/``k``/``v``, begin
the next), sharing one memory pool. Replay alternates graph ``i`` and layer ``i``'s attention, run eagerly on the
static tensors with the step's real metadata (its grid follows the real sequences; padding rows are left
untouched and stay in their own rows). LM head and sampling run eagerly on the sampled rows. Host cost per step:
``layers + 1`` replays plus the attention launches, in place of every op of every layer.

Which step takes which path (:func:`plan_step`): decode-only steps within the decode buckets replay the decode
graphs (:mod:`lqe.engine.cuda_graph`); other steps up to the largest token bucket take a token bucket; larger
steps, ``enforce_eager`` and tensor-parallel engines run eagerly. Buckets step by 64 tokens up to 512, then by
about a quarter (padding costs at most 1/8 of a step past 512), capped at ``max_num_batched_tokens``.
Capture and replay: :mod:`lqe.engine.piecewise` (CUDA graphs on a GPU; on CPU the pieces are recorded as aten
ops over the same static tensors, so tests/test_piecewise.py checks the whole path against the eager step); the
padding it relies on: tests/test_token_buckets.py (a padded step gives the unpadded step's hidden states and KV).
"""
from __future__ import annotations

from lqe.engine.cuda_graph import bucket_for, graphable
from lqe.engine.scheduler import SchedulerOutput


def token_buckets(max_tokens: int, step: int = 64, linear_up_to: int = 512) -> list[int]:
    """Ascending bucket sizes: multiples of ``step`` up to ``linear_up_to``, then 1.25x / 1.5x / 1.75x / 2x of each
    power of two, capped at ``max_tokens`` (always a bucket)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1 (max_num_batched_tokens)")
    sizes = list(range(step, min(max_tokens, linear_up_to) + 1, step))
    p = linear_up_to
    while p < max_tokens:
        sizes += [s for s in (p * 5 // 4, p * 3 // 2, p * 7 // 4, 2 * p) if s <= max_tokens]
        p *= 2
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sorted(set(sizes))


def token_bucket_for(num_tokens: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``num_tokens`` tokens, or ``None`` when the step is larger than all."""
    return bucket_for(num_tokens, buckets)


def plan_step(sched: SchedulerOutput, decode_buckets: list[int], tok_buckets: list[int]) -> tuple[str, int | None]:
    """``("decode", batch bucket)``, ``("piecewise", token bucket)`` or ``("eager", None)`` for a step."""
    if graphable(sched):
        b = bucket_for(len(sched.scheduled), decode_buckets)
        if b is not None:
            return "decode", b
    if any(s.seq.wants_prompt_logprobs for s in sched.scheduled):
        return "eager", None  # prompt logprobs read hidden rows by sequence: kept on the plain path
    t = token_bucket_for(sched.num_batched_tokens, tok_buckets)
    return ("piecewise", t) if t is not None else ("eager", None)
