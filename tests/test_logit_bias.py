"""logit_bias (OpenAI / vLLM): a per-request {token id: bias} added to the logits before sampling."""
import pytest

from lqe import SamplingParams

PROMPT = [1, 520, 3100, 28, 9874, 41]


def test_logit_bias_moves_greedy_choice(tiny_llm):
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    base = tiny_llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    top, second = sorted(base.logprobs[0].items(), key=lambda kv: -kv[1].logprob)[:2]
    # a -100 bias on the greedy token makes the runner-up win; logprobs stay those of the raw model
    out = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2,
                                                     logit_bias={top[0]: -100}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == second[0]
    assert out.logprobs[0][second[0]].logprob == pytest.approx(second[1].logprob, abs=1e-5)
    # a +100 bias forces a token; other requests in the same batch are unaffected
    forced = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={42: 100})
    both = tiny_llm.generate([PROMPT, PROMPT], [forced, greedy], use_tqdm=False)
    assert both[0].outputs[0].token_ids == [42, 42, 42]
    assert both[1].outputs[0].token_ids == base.token_ids


@pytest.mark.parametrize("bias", [{"a": 1}, {-1: 1}, {5: float("nan")}, {5: 101}, [1, 2]])
def test_logit_bias_checked(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_token_outside_vocab_is_an_error(tiny_llm):
    with pytest.raises(ValueError, match="logit_bias"):
        tiny_llm.generate([PROMPT], SamplingParams(logit_bias={10**7: 1}), use_tqdm=False)
