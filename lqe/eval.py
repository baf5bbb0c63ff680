"""Scoring text through the engine: perplexity windows, perplexity from ``prompt_logprobs``, and the full
``[L, vocab]`` next-token log-probabilities of a window computed by the engine's own ModelRunner (same model,
same quantized kernels, same paged KV cache), for KL divergence and top-1 agreement between two engines.

Windows follow the GPTQ/AWQ protocol: the file's lines joined with "\\n\\n", tokenized once with the
tokenizer's defaults, cut into consecutive non-overlapping windows of ``seq_len`` tokens, nothing prepended.
Window position ``p`` predicts token ``p + 1``, so a window of ``L`` tokens scores ``L - 1`` tokens.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from lqe.engine.scheduler import ScheduledSeq, SchedulerOutput
from lqe.engine.sequence import Sequence
from lqe.sampling_params import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATASET = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "wikitext2-test.raw"))


def read_text(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset {path!r} does not exist; pass --dataset FILE (any text file)")
    with open(path, encoding="utf-8") as f:
        return "\n\n".join(f.read().splitlines())


def make_windows(token_ids: list[int], seq_len: int, max_windows: int | None = None) -> list[list[int]]:
    """Consecutive non-overlapping windows of exactly ``seq_len`` tokens (the short tail is dropped)."""
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2 (a window of L tokens scores L - 1 of them)")
    n = len(token_ids) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one window of seq_len={seq_len}")
    return [list(token_ids[i * seq_len:(i + 1) * seq_len]) for i in range(n)]


def load_windows(tokenizer, path: str, seq_len: int, max_windows: int | None = None) -> list[list[int]]:
    ids = tokenizer(read_text(path))["input_ids"]
    return make_windows(list(ids), seq_len, max_windows)


@dataclass(slots=True)
class PerplexityResult:
    ppl: float
    nll_sum: float
    tokens: int
    windows: int

    def as_dict(self) -> dict:
        return {"ppl": self.ppl, "nll": self.nll_sum / self.tokens, "tokens": self.tokens, "windows": self.windows}


def perplexity(llm, windows: list[list[int]]) -> PerplexityResult:
    """exp(mean NLL) over every scored token, from the engine's ``prompt_logprobs`` (one request per window)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    nll, tokens = 0.0, 0
    for w in windows:  # one at a time: the engine holds one window's logprobs, never all of them
        out = llm.generate([w], params, use_tqdm=False)[0]
        lps = out.prompt_logprobs
        for p in range(1, len(w)):
            nll -= lps[p][w[p]].logprob
        tokens += len(w) - 1
    return PerplexityResult(math.exp(nll / tokens), nll, tokens, len(windows))


@torch.inference_mode()
def window_logprobs(engine, token_ids: list[int]) -> torch.Tensor:
    """``[L, vocab]`` fp32 log-softmax of the next-token logits at every position of ``token_ids``.

    Runs on an idle ``LLMEngine`` (``llm.llm_engine``): a temporary sequence takes blocks from the engine's
    BlockManager, the window is prefilled in chunks of ``max_num_batched_tokens`` through the ModelRunner's
    model under a forward context, logits are computed for every row, and the blocks are freed afterwards."""
    if engine.has_unfinished():
        raise RuntimeError("window_logprobs needs an idle engine: finish or abort its requests first")
    runner, bm = engine.runner, engine.block_manager
    L = len(token_ids)
    if L > engine.max_model_len:
        raise ValueError(f"window of {L} tokens exceeds max_model_len={engine.max_model_len}")
    seq = Sequence(-1, "lqe-eval", 0, [int(t) for t in token_ids], SamplingParams(max_tokens=1),
                   torch.Generator(device=engine.device))
    need = bm.blocks_needed(seq, L)
    if not bm.can_allocate(need):
        raise MemoryError(f"window of {L} tokens needs {need} KV blocks; only {bm.num_free_blocks} are free")
    bm.allocate(seq, L)
    try:
        chunk = engine.config.max_num_batched_tokens
        parts = []
        for start in range(0, L, chunk):
            hidden, _ = runner.forward(SchedulerOutput([ScheduledSeq(seq, start, min(chunk, L - start))]))
            for r in range(0, hidden.shape[0], 512):  # bound the [rows, vocab] temporaries
                parts.append(runner.model.compute_logits(hidden[r:r + 512]).float().log_softmax(-1).cpu())
        return torch.cat(parts)
    finally:
        bm.free_seq(seq)


@dataclass(slots=True)
class CompareResult:
    ppl: float  # of the quantized model, from the full distributions
    ref_ppl: float
    kl: float  # mean over scored positions of KL(reference || quantized), nats
    top1_agree: float
    tokens: int
    windows: int


def compare(engine, ref, windows: list[list[int]]) -> CompareResult:
    """KL(ref || engine) and top-1 agreement of the next-token distributions on the scored positions
    (``0 .. L-2`` of each window), plus both perplexities. ``ref`` is the reference engine (its distributions are
    recomputed window by window, so one window's distributions are in memory at a time) or a list holding
    ``window_logprobs(ref_engine, w)[:-1]`` for every window; ``engine=None`` scores that list against itself."""
    nll = ref_nll = kl = 0.0
    agree = tokens = 0
    for i, w in enumerate(windows):
        lr = ref[i] if isinstance(ref, list) else window_logprobs(ref, w)[:-1]
        lq = lr if engine is None else window_logprobs(engine, w)[:-1]
        tgt = torch.tensor(w[1:])[:, None]
        nll -= float(lq.gather(1, tgt).sum(dtype=torch.float64))
        ref_nll -= float(lr.gather(1, tgt).sum(dtype=torch.float64))
        kl += float(torch.nn.functional.kl_div(lq, lr, reduction="sum", log_target=True))
        agree += int((lq.argmax(-1) == lr.argmax(-1)).sum())
        tokens += len(w) - 1
        del lq, lr
    return CompareResult(math.exp(nll / tokens), math.exp(ref_nll / tokens), kl / tokens, agree / tokens, tokens,
                         len(windows))
