"""The real demo model: greedy output over 32 tokens identical to HF transformers for several prompts."""
import pytest
import torch

from lqe import LLM, SamplingParams
from lqe.loaders.model_source import demo_model_dir

PROMPTS = ["The capital of France is", "def fibonacci(n):", "In 1969, the first humans", "Water boils at"]


@pytest.fixture(scope="module")
def smol():
    return LLM("smollm2-135m-instruct", kv_cache_memory_bytes=128 << 20, max_model_len=2048)


def test_greedy_matches_transformers(smol):
    from transformers import AutoModelForCausalLM

    # min_tokens, like HF's min_new_tokens, forbids EOS so both produce exactly 32 tokens
    outs = smol.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, min_tokens=32), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32)
    tok = smol.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        ref = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref, prompt


def test_chat_answers_paris(smol):
    out = smol.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_rtn_w4_smollm2_is_sensible_and_batch_invariant(tmp_path):
    """SmolLM2 quantized by round-to-nearest (reference codecs via tools.convert) into GPTQ W4 g64 asym."""
    import subprocess
    import sys

    out = tmp_path / "smol-rtn"
    subprocess.run([sys.executable, "-m", "tools.convert", "quantize", "--model", demo_model_dir(), "--out", str(out),
                    "--method", "rtn", "--format", "gptq", "--bits", "4", "--group-size", "64", "--asym"],
                   check=True, capture_output=True)
    llm = LLM(str(out), kv_cache_memory_bytes=128 << 20, max_model_len=1024)
    assert "gptq 4-bit g64 asym" in llm.llm_engine.quant_description()
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    assert "Paris" in answer
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[:2]]
    assert batched[:2] == alone


def test_demo_model_is_built_once_by_concurrent_first_uses(tmp_path, monkeypatch):
    """Two first uses at once (a server and a script started beside it) build the demo model once: the
    second waits for the first's build and loads it, instead of replacing the directory under it."""
    import os
    import threading
    import time

    from lqe.loaders import model_source

    builds = []

    def slow_convert(gguf_dir, gguf_file, out):
        builds.append(out)
        time.sleep(0.3)  # long enough for the other thread to arrive mid-build
        os.makedirs(out)
        open(os.path.join(out, ".complete"), "w").close()

    monkeypatch.setenv("LQE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model_source, "convert_gguf", slow_convert)
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(model_source.demo_model_dir())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(builds) == 1 and got == [builds[0]] * 2
    assert os.path.isfile(os.path.join(builds[0], ".complete"))
