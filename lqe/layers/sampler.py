"""Turns the logits of the sampled rows into next tokens (and their logprobs).

Order of processing (as in vLLM / HF): penalties on raw logits, min_tokens masking, the structured-output token
mask, temperature, then
top-k / top-p / min-p masks, then one draw per row from that row's own ``torch.Generator`` so a seeded
request gives the same tokens whatever else is in the batch. Logprobs are those of the raw model
distribution (before penalties and temperature).

The per-row parameters arrive as host tensors and lists; everything the device needs from them is packed on the
host and sent with non-blocking copies (:func:`to_device`), so a sampling step never makes the host wait for the
GPU: the step's one device-to-host copy (``ModelRunner.to_host_start``) stays the only synchronization.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def host_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a new host tensor bound for ``device``: in pinned memory when that is a GPU, so that
    :func:`to_device` can copy it without blocking."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device`` without making the host wait: a non-blocking copy, from pinned memory on
    CUDA (a pageable source would make the copy wait for the stream). Safe with a tensor the caller drops at once:
    pinned memory comes from PyTorch's caching host allocator, which hands a block out again only after the copies
    recorded on it have finished, so a later step cannot overwrite a buffer while its copy is in flight."""
    if t.device == device:
        return t
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _flat_pairs(per_row: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows, token ids)`` of every ``(i, t)`` with ``t`` in ``per_row[i]``, as host tensors, for one indexing op
    over the whole batch; ``None`` when there is none."""
    rows, ids = [], []
    for i, toks in enumerate(per_row):
        if toks:
            rows += [i] * len(toks)
            ids += toks
    if not rows:
        return None
    return host_tensor(rows, torch.long, device), host_tensor(ids, torch.long, device)


@dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B]
    presence_penalty: torch.Tensor  # [B]
    frequency_penalty: torch.Tensor  # [B]
    generators: list[torch.Generator]
    output_token_ids: list[list[int]]  # per row, for presence/frequency/repetition penalties
    prompt_token_ids: list[list[int]]  # per row, for the repetition penalty
    banned_token_ids: list[list[int]]  # per row: EOS / stop ids while below min_tokens
    num_logprobs: list[int | None]  # per row: None = no logprobs wanted
    token_bitmask: torch.Tensor | None = None  # [B, ceil(V/32)] int32 allowed-token bits (structured output)
    logit_bias: list[dict[int, float] | None] | None = None  # per row: token id -> added to the logit

    @property
    def needs_penalties(self) -> bool:
        return bool((self.repetition_penalty != 1).any() or (self.presence_penalty != 0).any()
                    or (self.frequency_penalty != 0).any())


@dataclass(slots=True)
class TokenLogprobs:
    token_logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    vocab, dev = logits.shape[1], logits.device
    out_counts = torch.zeros_like(logits)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    outs = _flat_pairs(batch.output_token_ids, dev)
    if outs is not None:  # integer counts: exact whatever the order of the additions
        rows, ids = to_device(outs[0], dev), to_device(outs[1].clamp_(max=vocab - 1), dev)
        out_counts.index_put_((rows, ids), torch.ones((), dtype=logits.dtype, device=dev), accumulate=True)
    reps = batch.repetition_penalty.tolist()  # a host tensor: no sync
    prompts = _flat_pairs([p if r != 1 else None for r, p in zip(reps, batch.prompt_token_ids)], dev)
    if prompts is not None:
        rows, ids = to_device(prompts[0], dev), to_device(prompts[1].clamp_(max=vocab - 1), dev)
        seen[rows, ids] = True
    seen |= out_counts > 0
    rep, freq, pres = to_device(torch.stack([batch.repetition_penalty, batch.frequency_penalty,
                                             batch.presence_penalty]), dev)[:, :, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - freq * out_counts
    logits = logits - pres * (out_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (set to -inf) the tokens outside each row's top-k, nucleus top-p and min-p sets."""
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = to_device(torch.where(top_k > 0, top_k, vocab), logits.device)[:, None]
        drop = ranks >= k
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs
        drop |= cum_before >= to_device(top_p, logits.device)[:, None]  # keeps at least the top token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * to_device(min_p, logits.device)[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> torch.Tensor:
    """Add each row's ``{token: bias}`` to its logits (ids past the vocabulary are refused upstream)."""
    vocab, dev = logits.shape[1], logits.device
    kept = [{t: v for t, v in b.items() if t < vocab} if b else None for b in biases]
    pairs = _flat_pairs([list(b) if b else None for b in kept], dev)
    if pairs is None:
        return logits
    vals = [v for b in kept if b for v in b.values()]
    rows, cols = (to_device(t, dev) for t in pairs)
    logits = logits.clone()
    logits.index_put_((rows, cols), to_device(host_tensor(vals, logits.dtype, dev), dev), accumulate=True)
    return logits


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        tokens, raw_logprobs = self.sample_tokens(logits, batch)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self.logprobs(raw_logprobs, token_list, batch))

    def sample_tokens(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled token ids ``[B]`` (on the logits' device: nothing waits for the GPU) and, when a row wants
        logprobs, the raw log-softmax for :meth:`logprobs`."""
        greedy = batch.temperature == 0
        wants_logprobs = any(n is not None for n in batch.num_logprobs)
        if (bool(greedy.all()) and not wants_logprobs and not any(batch.banned_token_ids)
                and not batch.needs_penalties and batch.token_bitmask is None and not batch.logit_bias):
            return logits.argmax(dim=-1), None  # the common greedy step: argmax of the raw logits
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None
        if batch.needs_penalties:
            logits = apply_penalties(logits, batch)
        if batch.logit_bias:
            logits = apply_logit_bias(logits, batch.logit_bias)
        dev = logits.device
        banned = _flat_pairs([[t for t in b if t < logits.shape[1]] for b in batch.banned_token_ids], dev)
        if banned is not None:
            ban_rows, ban_ids = (to_device(t, dev) for t in banned)
            logits[ban_rows, ban_ids] = float("-inf")
        if batch.token_bitmask is not None:  # structured output: xgrammar's kernel sets the disallowed tokens to -inf
            import xgrammar

            xgrammar.apply_token_bitmask_inplace(logits, to_device(batch.token_bitmask, dev),
                                                 vocab_size=logits.shape[1])
        rows = torch.nonzero(~greedy).flatten().tolist()  # a host tensor: no sync
        if not rows:
            return logits.argmax(dim=-1), raw_logprobs
        idx = None if len(rows) == len(greedy) else to_device(host_tensor(rows, torch.long, dev), dev)
        sub = logits if idx is None else logits[idx]
        sub = sub / to_device(batch.temperature[rows], dev)[:, None]
        sub = apply_top_k_top_p_min_p(sub, batch.top_k[rows], batch.top_p[rows], batch.min_p[rows])
        probs = sub.softmax(dim=-1)
        # exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p. Each row's noise comes from its own
        # generator (one call per row, the same draws as a tensor of its own); the rest is batched
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            noise[j].exponential_(generator=batch.generators[i])
        drawn = (probs / noise).argmax(dim=-1)
        if idx is None:
            return drawn, raw_logprobs
        tokens = logits.argmax(dim=-1)  # the greedy rows' answer (top-k/p/min-p never drop the top token)
        tokens[idx] = drawn
        return tokens, raw_logprobs

    @staticmethod
    def logprobs(raw_logprobs: torch.Tensor | None, token_list: list[int],
                 batch: SamplingBatch) -> list[TokenLogprobs | None]:
        logprobs: list[TokenLogprobs | None] = [None] * len(token_list)
        if raw_logprobs is not None:
            for i, n in enumerate(batch.num_logprobs):
                if n is None:
                    continue
                row = raw_logprobs[i]
                lp = row[token_list[i]]
                rank = int((row > lp).sum()) + 1
                top = row.topk(n) if n > 0 else None
                logprobs[i] = TokenLogprobs(float(lp), rank, top.indices.tolist() if top is not None else [],
                                            top.values.tolist() if top is not None else [])
        return logprobs
