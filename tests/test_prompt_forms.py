"""vLLM's prompt forms (str, token ids, TextPrompt, TokensPrompt, lists of them) and generation_config.json
defaults when no SamplingParams is given."""
import json
import os
import shutil

import pytest

from lqe import LLM, SamplingParams, TextPrompt, TokensPrompt
from lqe.inputs import parse_prompts


def greedy(n=6):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_every_prompt_form_gives_the_same_tokens(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    text = "Hello there, how are"
    ids = tok.encode(text)
    ref = tiny_llm.generate(text, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    forms = [ids, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids), {"prompt": text},
             {"prompt_token_ids": ids}]
    outs = tiny_llm.generate(forms, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref] * len(forms)
    assert [o.prompt_token_ids for o in outs] == [ids] * len(forms)
    assert outs[1].prompt == text and outs[2].prompt is None
    # a single dict is one prompt, not a list
    one = tiny_llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == ref
    # stream takes the same forms
    chunks = list(tiny_llm.stream(TokensPrompt(prompt_token_ids=ids), greedy()))
    assert chunks[-1].outputs[0].token_ids == ref


@pytest.mark.parametrize("bad", [3.5, [1.0, 2.0], {"text": "hi"}, {"prompt_token_ids": "1 2 3"}, {"prompt": 5},
                                 [["a"]], None, [{"prompt_token_ids": [1, "2"]}]])
def test_bad_prompt_forms_are_type_errors_naming_the_forms(bad):
    with pytest.raises(TypeError, match="TokensPrompt|prompt_token_ids|'prompt' must"):
        parse_prompts(bad)


def test_bad_forms_through_llm(tiny_llm):
    with pytest.raises(TypeError, match="TextPrompt"):
        tiny_llm.generate([object()], greedy(), use_tqdm=False)
    with pytest.raises(TypeError, match="one prompt"):
        tiny_llm.stream(["a", "b"], greedy())
    with pytest.raises(ValueError, match="multi_modal_data"):
        tiny_llm.generate({"prompt": "x", "multi_modal_data": {"image": 1}}, greedy(), use_tqdm=False)
    assert tiny_llm.generate([], greedy(), use_tqdm=False) == []


def test_generation_config_gives_the_defaults(tiny_llama_dir, tmp_path):
    d = str(tmp_path / "m")
    shutil.copytree(tiny_llama_dir, d)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                   "max_new_tokens": 7, "bos_token_id": 1, "eos_token_id": 2}, f)
    llm = LLM(d, kv_cache_memory_bytes=1 << 24, max_model_len=128)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.6, 0.9, 20, 1.1, 7)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 7
    assert out.finish_reason == "length" or out.token_ids[-1] == 2
    # explicit params win over the file
    assert len(llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    # stream and the engine use the same defaults
    assert len(list(llm.stream([5, 6, 7]))[-1].outputs[0].token_ids) <= 7


def test_bad_generation_config_values_are_dropped(tmp_path):
    from lqe.loaders.generation_config import read_generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_k": 5, "max_new_tokens": 0}))
    assert read_generation_defaults(str(tmp_path)) == {"top_k": 5}
    assert read_generation_defaults(str(tmp_path / "missing")) == {}


def test_no_generation_config_keeps_sampling_params_defaults(tiny_llm):
    assert tiny_llm.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
