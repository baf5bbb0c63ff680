"""Async scheduling (``async_scheduling=True``, vLLM's idea): step N+1 is scheduled, its inputs built and its
work launched while the device still runs step N; then the host waits for step N's tokens (the step's one
device-to-host sync) and processes them while the device runs step N+1.

How, without N's tokens on the host:

* At launch, each sequence that samples gets a placeholder token (``PLACEHOLDER``, never a real id), so the
  scheduler sees its length grow by one, and ``num_computed_tokens`` advances at once.
* Step N+1's inputs hold the placeholder on the host; :class:`lqe.engine.step_inputs.StepInputBuilder` writes the
  token sampled by step N into that row on the device (a scatter from step N's device token ids), right after the
  step's one host-to-device copy.
* When step N's tokens arrive, each placeholder is replaced and the usual stop checks run. A sequence that stops
  at step N may already be in step N+1: its row there is computed and dropped. Sequences certain to stop
  (``max_tokens`` or ``max_model_len`` reached with the pending token) are not scheduled again.
* A step whose sampling needs the previous tokens on the host (penalties, structured output) or that asks for
  prompt logprobs waits for step N first (no overlap for that step; same schedule, finished sequences dropped).
  A step that asks for prompt logprobs then runs as a synchronous step (``ModelRunner.execute``): they are read from
  the step's hidden states, which only that path keeps.

Tokens are those of the synchronous engine for the same batches; batch composition can differ (a finishing
sequence frees its slot one step later), so only batch-dependent rounding can change a token.
"""
from __future__ import annotations

PLACEHOLDER = -1


class _InFlight:
    __slots__ = ("sched", "pending", "where")

    def __init__(self, sched, pending, where) -> None:
        self.sched, self.pending = sched, pending
        self.where = where  # seq_id -> (position of its placeholder, row in the step's sampled tokens)


def _history_free(sched) -> bool:
    """No sequence of the step needs the previous step's tokens on the host to build its inputs or sampling."""
    for s in sched.scheduled:
        p = s.seq.params
        if (p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
                or p.structured_outputs is not None or s.seq.wants_prompt_logprobs):
            return False
    return True


class AsyncStepper:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.inflight: _InFlight | None = None
        self.overlapped = 0  # steps launched while the previous one was still on the device

    def _will_finish(self, seq) -> bool:
        """A sequence whose pending token ends it by length: not scheduled again."""
        out = seq.output_token_ids
        if not out or out[-1] != PLACEHOLDER:
            return False
        p = seq.params
        return (p.max_tokens is not None and len(out) >= p.max_tokens) or seq.num_tokens >= self.engine.max_model_len

    def step(self) -> list:
        eng = self.engine
        prev = self.inflight
        sched = eng.scheduler.schedule(skip=self._will_finish if prev is not None else None)
        outs = []
        if prev is not None and not (sched.scheduled and _history_free(sched)):
            self.inflight = None
            outs = self._finish(prev)  # no overlap: this step's inputs need the previous tokens
            sched.scheduled = [s for s in sched.scheduled if not s.seq.is_finished]
            prev = None
        if sched.is_empty:
            if prev is not None:
                self.inflight = None
                return self._finish(prev)
            if not outs and eng.scheduler.waiting and not eng.scheduler.running:
                raise RuntimeError("no request could be scheduled although nothing is running (KV cache exhausted)")
            return outs
        if any(s.seq.wants_prompt_logprobs for s in sched.scheduled):  # not history free: nothing is in flight
            now = eng._process(sched, eng.runner.execute(sched, eng._sampling_batch(sched)))
            return list({o.request_id: o for o in outs + now}.values())  # a request's latest output, once
        self.inflight = self._launch(sched, prev)
        if prev is not None:
            self.overlapped += 1
            try:
                outs = self._finish(prev)
            except BaseException:
                self.reset()
                raise
        return outs

    def _launch(self, sched, prev: _InFlight | None) -> _InFlight:
        eng, runner = self.engine, self.engine.runner
        if prev is not None and prev.pending.tokens is not None:
            runner.inputs.pending = (prev.pending.tokens, prev.where)
        samples = [s.samples for s in sched.scheduled]
        pending = runner.execute_async(sched, eng._sampling_batch(sched))
        where, k = {}, 0
        for s, sampled in zip(sched.scheduled, samples):
            seq = s.seq
            seq.num_computed_tokens = s.start + s.num_new_tokens
            if sampled:
                where[seq.seq_id] = (seq.num_tokens, k)
                seq.output_token_ids.append(PLACEHOLDER)
                k += 1
        return _InFlight(sched, pending, where)

    def _finish(self, fl: _InFlight) -> list:
        """Wait for ``fl``'s tokens, put them in place of the placeholders, run the stop checks; the outputs."""
        eng = self.engine
        result = fl.pending.result()
        tails: dict[int, tuple] = {}
        touched: dict[str, None] = {}
        for s in fl.sched.scheduled:
            seq = s.seq
            if s.start < seq.num_prompt_tokens:
                eng.prompt_tokens_total += min(s.num_new_tokens, seq.num_prompt_tokens - s.start)
            w = fl.where.get(seq.seq_id)
            if w is not None and not seq.is_finished:
                j = w[0] - seq.num_prompt_tokens  # the placeholder's index among the outputs
                tails[seq.seq_id] = (seq, seq.output_token_ids[j + 1:])
                del seq.output_token_ids[j:]
                eng._accept_token(seq, result.sampled.token_ids[w[1]], result.sampled.logprobs[w[1]])
                touched[seq.request_id] = None
            if not seq.is_finished:
                eng.block_manager.register_full_blocks(seq)
        for seq, tail in tails.values():
            if not seq.is_finished:
                seq.output_token_ids.extend(tail)
        return [self._output(eng.requests[rid]) for rid in touched if rid in eng.requests]

    def _output(self, req):
        """The request's output without the placeholders of the step in flight."""
        held = []
        for seq in req.seqs:
            out = seq.output_token_ids
            n = len(out)
            while n and out[n - 1] == PLACEHOLDER:
                n -= 1
            held.append(out[n:])
            del out[n:]
        try:
            return self.engine._request_output(req)
        finally:
            for seq, tail in zip(req.seqs, held):
                seq.output_token_ids.extend(tail)

    def reset(self) -> None:
        """After a failed step: drop the step in flight and recompute every sequence with a placeholder."""
        fl, self.inflight = self.inflight, None
        if fl is not None:
            try:
                fl.pending.result()
            except Exception:  # noqa: BLE001 -- its failure is reported by the step that raised
                pass
        sch = self.engine.scheduler
        for seq in list(sch.running) + list(sch.waiting):
            out = seq.output_token_ids
            if PLACEHOLDER in out:
                del out[out.index(PLACEHOLDER):]
                if seq in sch.running:
                    sch.running.remove(seq)
                    sch._preempt(seq)
