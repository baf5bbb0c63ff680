"""Turns the logits of the sampled rows into next tokens (and their logprobs).

Order of processing (as in vLLM / HF): penalties on raw logits, min_tokens masking, the structured-output token
mask, temperature, then
top-k / top-p / min-p masks, then one draw per row from that row's own ``torch.Generator`` so a seeded
request gives the same tokens whatever else is in the batch. Logprobs are those of the raw model
distribution (before penalties and temperature).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
    vocab = logits.shape[1]
    out_counts = torch.zeros_like(logits)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for i, (out_ids, prompt_ids) in enumerate(zip(batch.output_token_ids, batch.prompt_token_ids)):
        if out_ids:
            ids = torch.tensor(out_ids, device=logits.device).clamp_(max=vocab - 1)
            out_counts[i].index_add_(0, ids, torch.ones(len(out_ids), device=logits.device))
        if batch.repetition_penalty[i] != 1 and prompt_ids:
            seen[i, torch.tensor(prompt_ids, device=logits.device).clamp_(max=vocab - 1)] = True
    seen |= out_counts > 0
    rep = batch.repetition_penalty.to(logits.device)[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - batch.frequency_penalty.to(logits.device)[:, None] * out_counts
    logits = logits - batch.presence_penalty.to(logits.device)[:, None] * (out_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (set to -inf) the tokens outside each row's top-k, nucleus top-p and min-p sets."""
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, vocab).to(logits.device)[:, None]
        drop = ranks >= k
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs
        drop |= cum_before >= top_p.to(logits.device)[:, None]  # keeps at least the top token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.to(logits.device)[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> torch.Tensor:
    """Add each row's ``{token: bias}`` to its logits (ids past the vocabulary are refused upstream)."""
    rows, cols, vals = [], [], []
    for i, bias in enumerate(biases):
        for tid, v in (bias or {}).items():
            if tid < logits.shape[1]:
                rows.append(i), cols.append(tid), vals.append(v)
    if rows:
        logits = logits.clone()
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
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
        for i, banned in enumerate(batch.banned_token_ids):
            if banned:
                logits[i, banned] = float("-inf")
        if batch.token_bitmask is not None:  # structured output: xgrammar's kernel sets the disallowed tokens to -inf
            import xgrammar

            xgrammar.apply_token_bitmask_inplace(logits, batch.token_bitmask.to(logits.device),
                                                 vocab_size=logits.shape[1])
        tokens = logits.argmax(dim=-1)  # the greedy rows' answer (top-k/p/min-p never drop the top token)
        rows = torch.nonzero(~greedy).flatten().tolist()
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            sub = logits[idx] / batch.temperature[rows].to(logits.device)[:, None]
            sub = apply_top_k_top_p_min_p(sub, batch.top_k[rows], batch.top_p[rows], batch.min_p[rows])
            probs = sub.softmax(dim=-1)
            for j, i in enumerate(rows):
                # exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p
                e = torch.empty_like(probs[j]).exponential_(generator=batch.generators[i])
                tokens[i] = (probs[j] / e).argmax()
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
