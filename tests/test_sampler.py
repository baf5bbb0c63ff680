import pytest
import torch

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
        num_logprobs=kw.get("num_logprobs", [None] * n))


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
