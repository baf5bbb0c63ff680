"""The LLM facade on a tiny model: outputs, stop conditions, streaming, chat, logprobs, and bad input."""
import pytest
import torch

from helpers import build_tiny_model
from lqe import LLM, SamplingParams
from lqe.engine.detokenizer import decode_new_text, init_offsets
from lqe.engine.sequence import Sequence


def greedy(n=12, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_generate_text_matches_token_ids(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    out = tiny_llm.generate(["Hello there, how are"], greedy(), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 12 and c.finish_reason == "length"
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert out.prompt_token_ids == tok.encode("Hello there, how are")


def test_stop_token_ids_and_eos(tiny_llm):
    base = tiny_llm.generate([[5, 6, 7]], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = base[4]
    c = tiny_llm.generate([[5, 6, 7]], greedy(stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    first = base.index(stop_tok)
    assert c.token_ids == base[:first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    # the same token treated as EOS, but min_tokens forbids it until 8 tokens are out
    c = tiny_llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok],
                                                      min_tokens=8), use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 8 and stop_tok not in c.token_ids[:8]


def test_stop_strings_truncate_text(tiny_llm):
    full = tiny_llm.generate([[5, 6, 7]], greedy(20), use_tqdm=False)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    c = tiny_llm.generate([[5, 6, 7]], greedy(20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[:full.index(stop)]
    c = tiny_llm.generate([[5, 6, 7]], greedy(20, stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert c.text == full[:full.index(stop) + len(stop)]


def test_streaming_yields_growing_prefixes(tiny_llm):
    final = tiny_llm.generate([[9, 10, 11]], greedy(10), use_tqdm=False)[0].outputs[0]
    chunks = list(tiny_llm.stream([9, 10, 11], greedy(10)))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert chunks[-1].outputs[0].token_ids == final.token_ids
    for a, b in zip(chunks, chunks[1:]):
        assert b.outputs[0].text.startswith(a.outputs[0].text)
    assert len(chunks) == 10


def test_n_completions_and_logprobs(tiny_llm):
    out = tiny_llm.generate([[3, 4, 5]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                                                        logprobs=3), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == 6
        for tok, step in zip(c.token_ids, c.logprobs):
            assert tok in step and len(step) >= 3
        assert c.cumulative_logprob == pytest.approx(sum(s[t].logprob for t, s in zip(c.token_ids, c.logprobs)), abs=1e-4)


def test_chat_uses_the_template(tiny_llm):
    msgs = [{"role": "user", "content": "Hi"}]
    ids = tiny_llm.apply_chat_template(msgs)
    assert "<|im_start|>assistant" in tiny_llm.get_tokenizer().decode(ids)
    out = tiny_llm.chat(msgs, greedy(4), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="messages is empty"):
        tiny_llm.chat([], greedy(4), use_tqdm=False)


def test_incremental_detokenization_of_multibyte_text(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    text = " héllo wörld — 日本語のテキスト 🎉 done"
    ids = tok.encode(text)
    prompt = tok.encode("Say:")
    s = Sequence(0, "x", 0, prompt, SamplingParams(), torch.Generator())
    init_offsets(s)
    pieces = []
    for t in ids:
        s.append_token(t)
        piece = decode_new_text(tok, s)
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) == tok.decode(ids)


def test_bad_input_errors(tiny_llm, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([[]], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="600 tokens.*max_model_len=512"):
        tiny_llm.generate([[5] * 600], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate([[5, 10**7]], greedy(), use_tqdm=False)
    with pytest.raises(TypeError, match="max_num_seq.*Did you mean 'max_num_seqs'"):
        LLM("whatever", max_num_seq=3)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    assert not tiny_llm.llm_engine.has_unfinished(), "failed requests leave nothing behind"


def test_unsupported_architecture_lists_supported(tmp_path):
    d = build_tiny_model(str(tmp_path), "llama")
    import json, os
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(d, kv_cache_memory_bytes=8 << 20)


def test_kv_cache_too_small_names_memory(tiny_llama_dir):
    with pytest.raises(MemoryError, match="needs 32 blocks.*MiB"):
        LLM(tiny_llama_dir, num_kv_blocks=4, block_size=16, max_model_len=512)


def test_corrupt_checkpoint_is_named(tmp_path):
    d = build_tiny_model(str(tmp_path), "llama")
    import os
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match="model.safetensors.*corrupt or truncated"):
        LLM(d, kv_cache_memory_bytes=8 << 20)


def test_abort_frees_blocks(tiny_llm):
    eng = tiny_llm.llm_engine
    free = eng.block_manager.num_free_blocks
    eng.add_request("abort-me", [5] * 40, greedy(50))
    eng.step()
    assert eng.block_manager.num_free_blocks < free
    eng.abort_request("abort-me")
    assert eng.block_manager.num_free_blocks == free and not eng.has_unfinished()
