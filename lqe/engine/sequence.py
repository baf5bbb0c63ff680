"""One sequence being generated: its tokens, KV blocks, progress and sampling state."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from lqe.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # position among the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, found in the prefix cache at admission
    num_hashed_blocks: int = 0  # leading full blocks registered in the prefix cache
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # outputs
    output_logprobs: list[dict[int, tuple[float, int]]] = field(default_factory=list)  # token -> (logprob, rank)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] = field(default_factory=list)
    output_text: str = ""
    # incremental detokenizer state
    prefix_offset: int = 0
    read_offset: int = 0
    first_token_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
