import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lqe.layers.sampler import Sampler, SamplingBatch, apply_penalties, apply_top_k_top_p_min_p
from lqe.sampling_params import SamplingParams


def batch(n, **kw) -> SamplingBatch:
    def t(name, default, dtype=torch.float32):
        return torch.tensor(kw.get(name, [default] * n), dtype=dtype)
    return SamplingBatch(
        temperature=t("temperature", 1.0), top_k=t("top_k", 0, torch.long), top_p=t("top_p", 1.0), min_p=t("min_p", 0.0),
        repetition_penalty=t("repetition_penalty", 1.0), presence_penalty=t("presence_penalty", 0.0),
        frequency_penalty=t("frequency_penalty", 0.0),
        generators=kw.get("generators", [torch.Generator().manual_seed(i) for i in range(n)]),
        output_token_ids=kw.get("output_token_ids", [[] for _ in range(n)]),
        prompt_token_ids=kw.get("prompt_token_ids", [[] for _ in range(n)]),
        banned_token_ids=kw.get("banned_token_ids", [[] for _ in range(n)]),
        num_logprobs=kw.get("num_logprobs", [None] * n), token_bitmask=kw.get("token_bitmask"),
        logit_bias=kw.get("logit_bias"))


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    out = apply_top_k_top_p_min_p(logits.clone(), torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.75, 1.0]),
                                  torch.tensor([0.0, 0.0, 0.35]))
    kept = torch.isfinite(out)
    assert kept[0].tolist() == [True, True, False, False, False]  # top-2
    assert kept[1].tolist() == [True, True, True, False, False]  # 0.5+0.2 < 0.75 -> third needed
    assert kept[2].tolist() == [True, True, False, False, False]  # >= 0.35 * 0.5
    assert torch.equal(out[kept], logits[kept])


def test_top_p_always_keeps_the_top_token():
    logits = torch.log(torch.tensor([[0.9, 0.05, 0.05]]))
    out = apply_top_k_top_p_min_p(logits, torch.tensor([0]), torch.tensor([0.01]), torch.tensor([0.0]))
    assert torch.isfinite(out).tolist() == [[True, False, False]]


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    b = batch(1, repetition_penalty=[2.0], presence_penalty=[0.5], frequency_penalty=[0.25],
              output_token_ids=[[0, 0, 1]], prompt_token_ids=[[2]])
    out = apply_penalties(logits, b)
    assert out[0].tolist() == pytest.approx([2.0 / 2 - 0.5 - 0.5, -2.0 * 2 - 0.25 - 0.5, 1.0 / 2, 0.5])


def test_greedy_and_banned_tokens():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 2.0, 1.0]])
    out = Sampler()(logits, batch(2, temperature=[0.0, 0.0], banned_token_ids=[[], [0]]))
    assert out.token_ids == [1, 1]


def test_seeded_sampling_is_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    def draw(rows, seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return Sampler()(logits[rows], batch(len(rows), generators=gens)).token_ids
    together = draw([0, 1, 2, 3], [7, 8, 9, 10])
    alone = [draw([i], [s])[0] for i, s in zip(range(4), [7, 8, 9, 10])]
    assert together == alone
    assert draw([0, 1, 2, 3], [7, 8, 9, 10]) == together
    assert len({tuple(draw([0], [s])) for s in range(30)}) > 3, "different seeds give different draws"


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        tok = Sampler()(probs.log()[None], batch(1, generators=[gen])).token_ids[0]
        counts[tok] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_logprobs_are_raw_model_logprobs_with_rank():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = Sampler()(logits, batch(1, temperature=[0.0], num_logprobs=[2], presence_penalty=[2.0],
                                 output_token_ids=[[1]]))
    lp = out.logprobs[0]
    ref = logits.log_softmax(-1)[0]
    assert out.token_ids == [2]  # the penalty moved the choice ...
    assert lp.token_logprob == pytest.approx(ref[2].item()) and lp.rank == 2  # ... but not the reported logprobs
    assert lp.top_ids == [1, 2]


@pytest.mark.parametrize("kw, match", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -3}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"), ({"logprobs": 50}, "logprobs"), ({"n": 0}, "n="), ({"presence_penalty": 3}, "presence"),
])
def test_invalid_sampling_params_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_each_row_draws_from_its_own_generator():
    """The contract that keeps seeded outputs stable: row ``i`` samples ``argmax(p_i / E)`` with ``E`` one
    ``exponential_`` draw of a fresh vocabulary-sized tensor from row ``i``'s generator, whatever the batching."""
    torch.manual_seed(1)
    logits = torch.randn(5, 300) * 2
    temps = [0.6, 0.0, 1.0, 0.6, 1.3]
    got = Sampler()(logits, batch(5, temperature=temps, generators=[torch.Generator().manual_seed(40 + i)
                                                                   for i in range(5)])).token_ids
    want = []
    for i, t in enumerate(temps):
        if t == 0:
            want.append(int(logits[i].argmax()))
            continue
        e = torch.empty(300).exponential_(generator=torch.Generator().manual_seed(40 + i))
        want.append(int(((logits[i] / t).softmax(-1) / e).argmax()))
    assert got == want


class _BlockingCopies(TorchDispatchMode):
    """``meta`` stands in for the GPU: records what would make the host wait for the device in a sampling call.

    A host-to-device copy waits unless it is non-blocking (from pinned memory on CUDA). Copies hidden from the
    dispatcher (``torch.tensor(data, device=...)``, indexing with a Python list, a host tensor given to a device op)
    show up as a device tensor no op produced, or as a host tensor beside device tensors. Reading a device value
    (``.item()``, ``.tolist()``, ``bool()``) fails on meta. Meta tensors cannot draw with a generator: the draws are
    skipped."""

    def __init__(self, *device_inputs: torch.Tensor) -> None:
        super().__init__()
        self.known = {id(t) for t in device_inputs}
        self.keep = list(device_inputs)  # no id reused while the mode runs
        self.blocking: list[str] = []
        self.non_blocking = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type == "meta"]
        copy_in = func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
        if copy_in and str(kwargs.get("device", args[0].device)) == "meta" and tensors[-1].device.type == "cpu":
            if kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
                self.non_blocking += 1
            else:
                self.blocking.append(f"{func}: a blocking host-to-device copy")
        elif on_device:
            if any(id(t) not in self.known for t in on_device):
                self.blocking.append(f"{func}: a device tensor made from host data out of sight")
            if any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
                self.blocking.append(f"{func}: a host tensor given to a device op")
        if func is torch.ops.aten.exponential_.default and args[0].device.type == "meta":
            return args[0]
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self.known.add(id(t))
                self.keep.append(t)
        return out


def test_sampling_makes_no_blocking_host_to_device_copy(monkeypatch):
    """Every per-row parameter (temperature, top-k/p, min-p, penalties, min_tokens bans, logit_bias, the structured
    output bitmask, the sampled rows) reaches the device with a non-blocking copy: on CUDA a blocking one is a stream
    sync, breaking the one device-to-host sync per step and the overlap of async scheduling."""
    import xgrammar

    def fake_bitmask_kernel(logits, mask, vocab_size):  # xgrammar's kernel has no meta implementation
        logits.add_(mask[:, :1].to(logits.dtype) * 0)
    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", fake_bitmask_kernel)
    n, vocab = 6, 64
    b = batch(n, temperature=[0.0, 0.7, 1.0, 0.0, 0.5, 1.2], top_k=[0, 5, 0, 0, 3, 0], top_p=[1.0, 0.9, 1.0, 1.0, 1.0, 0.8],
              min_p=[0.0, 0.0, 0.1, 0.0, 0.0, 0.0], repetition_penalty=[1.0, 1.2, 1.0, 1.0, 1.0, 1.1],
              presence_penalty=[0.0, 0.0, 0.5, 0.0, 0.0, 0.0], frequency_penalty=[0.0, 0.0, 0.0, 0.3, 0.0, 0.0],
              output_token_ids=[[1, 2], [3], [], [4, 4], [5], [6]], prompt_token_ids=[[7, 8]] * n,
              banned_token_ids=[[2], [], [2, 9], [], [], []], num_logprobs=[None, 2, None, None, None, None],
              logit_bias=[None, {3: 1.5}, None, None, {10: -5.0}, None],
              token_bitmask=torch.full((n, 2), -1, dtype=torch.int32))
    for greedy_only in (False, True):
        if greedy_only:
            b.temperature.zero_()
        logits = torch.empty(n, vocab, device="meta")
        with _BlockingCopies(logits) as mode:
            tokens, raw = Sampler().sample_tokens(logits, b)
        assert tokens.device.type == "meta" and raw is not None
        assert mode.blocking == [], mode.blocking
        assert mode.non_blocking > 0
