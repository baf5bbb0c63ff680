"""Tensor parallelism on CPU with gloo: 2 ranks (the test process + one spawned worker) give the same greedy
tokens (and prompt logprobs) as 1, for float, GPTQ (sym, asym, act-order), AWQ, compressed-tensors W4A16 / W8A8 /
FP8, ``quant_method: fp8`` and quantize-on-load models; failures are clear and leave no worker behind."""
from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
import torch

from helpers import build_tiny_model, write_quantized_checkpoint
from lqe import LLM, SamplingParams
from lqe.quant_layers import reference as ref

PROMPTS = [[1, 520, 3100, 28, 9874, 41, 1023, 77, 4500, 12, 650], [1, 5, 6, 7], list(range(3, 40))]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KW = dict(kv_cache_memory_bytes=8 << 20, max_model_len=128)


def _run(model_dir: str, tp: int, **kw) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of every prompt and the prompt logprobs of the first one."""
    llm = LLM(model_dir, tensor_parallel_size=tp, **KW, **kw)
    try:
        sp = [SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0)] + [SamplingParams(temperature=0, max_tokens=6)] * 2
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        lp = torch.tensor([outs[0].prompt_logprobs[j][PROMPTS[0][j]].logprob for j in range(1, len(PROMPTS[0]))])
        return [list(o.outputs[0].token_ids) for o in outs], lp
    finally:
        llm.llm_engine.shutdown()


def _assert_tp2_matches_tp1(model_dir: str, **kw) -> None:
    tok1, lp1 = _run(model_dir, 1, **kw)
    tok2, lp2 = _run(model_dir, 2, **kw)
    assert tok2 == tok1
    assert (lp1 - lp2).abs().max().item() < 1e-3


def _workers(llm: LLM) -> list:
    return list(llm.llm_engine.tp.procs)


def _assert_all_gone(procs) -> None:
    for p in procs:
        p.join(timeout=10)
        assert not p.is_alive(), f"worker pid {p.pid} is still running"


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),                                   # 4 heads, 2 KV heads: KV heads split
    ("llama", {"num_key_value_heads": 1}),           # 1 KV head: replicated on both ranks
    ("qwen2", {"num_key_value_heads": 4}),           # qkv bias (column-parallel bias), MHA
    ("qwen3", {"tie_word_embeddings": False}),       # qk-norm, head_dim 32, untied LM head
])
def test_float_tp2_matches_tp1(arch, overrides, tmp_path):
    d = build_tiny_model(str(tmp_path / arch), arch, tokenizer=False, **overrides)
    tok1, lp1 = _run(d, 1)
    tok2, lp2 = _run(d, 2)
    assert tok2 == tok1
    assert (lp1 - lp2).abs().max().item() < 1e-4


def _quant_checkpoint(base: str, out: str, encode, qcfg: dict) -> str:
    return write_quantized_checkpoint(base, out, lambda _name, w: encode(w), qcfg)


def _gptq_checkpoint(base: str, out: str, sym: bool, act: bool, group: int = 32) -> str:
    def encode(t):
        k = t.shape[1]
        g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(k)) // group).to(torch.int32) if act else None
        return ref.encode_gptq(ref.rtn_quantize(t, 4, group, sym, g_idx=g_idx), "gptq_v2")

    return _quant_checkpoint(base, out, encode, {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                                                 "desc_act": act, "checkpoint_format": "gptq_v2"})


def _ct(weights, acts, fmt):
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def _w8a8(t):
    q, s = ref.quantize_int8_per_channel(t)
    return {"weight": q, "weight_scale": s}


def _w8a8_static(t):
    q, s = ref.quantize_int8_per_channel(t)
    return {"weight": q, "weight_scale": s, "input_scale": torch.tensor([0.05])}


_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
OTHER_FORMATS = {
    "awq": (lambda t: ref.encode_awq(ref.rtn_quantize(t, 4, 32, False)),
            {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "GEMM"}),
    "w8a8-dynamic": (_w8a8, _ct(_INT8, {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
                                "int-quantized")),
    "w8a8-static": (_w8a8_static, _ct(_INT8, {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                                              "dynamic": False}, "int-quantized")),
}


@pytest.fixture(scope="module")
def gptq_base(tmp_path_factory):
    # intermediate 128: down_proj's K splits into 2 x 64 rows, on group-32 boundaries
    return build_tiny_model(str(tmp_path_factory.mktemp("gptq-base")), "llama", tokenizer=False, intermediate_size=128)


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_gptq_tp2_matches_tp1(sym, gptq_base, tmp_path):
    _assert_tp2_matches_tp1(_gptq_checkpoint(gptq_base, str(tmp_path / "q"), sym, act=False))


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_gptq_act_order_tp2_matches_tp1(sym, gptq_base, tmp_path):
    """Act-order rows read groups anywhere in K: a row-parallel rank loads every group's scales / zeros and keeps
    global group ids (vLLM's rule), so o_proj / down_proj give the same partial sums."""
    _assert_tp2_matches_tp1(_gptq_checkpoint(gptq_base, str(tmp_path / "q"), sym, act=True))


def test_shard_canonical_act_order_and_plain_rows():
    """Unit check of the row-parallel rule without processes: each rank's canonical weight, stacked over the ranks,
    dequantizes to the whole layer's weight, for act-order and plain g_idx, aligned or not."""
    from types import SimpleNamespace

    from lqe.quant_layers.weight_only import shard_canonical

    k, n, g = 96, 8, 32
    w = torch.randn(k, n)
    for act in (False, True):
        g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(1)) // g).int() if act else None
        cw = ref.rtn_quantize(w.t().contiguous(), 4, g, False, g_idx=g_idx)
        full = cw.dequantize()
        for tp in (2, 3):  # 48 rows per rank (not a group boundary for rank 1), 32 rows (boundaries)
            parts = []
            for r in range(tp):
                rows = slice(r * k // tp, (r + 1) * k // tp)
                layer = SimpleNamespace(tp_mode="row", tp_size=tp, tp_rank=r, input_size=k // tp, prefix="x")
                gi = None if cw.g_idx is None else cw.g_idx[rows]
                part = shard_canonical(layer, cw.codes[rows], cw.scales, cw.zeros, gi, 4, g)
                assert (part.g_idx is None) == (not act and (r * k // tp) % g == 0)
                parts.append(part.dequantize())
            assert torch.equal(torch.cat(parts), full)


def test_group_boundary_error(tmp_path):
    base = build_tiny_model(str(tmp_path / "b"), "llama", tokenizer=False, intermediate_size=160)  # 80 rows per rank
    d = _gptq_checkpoint(base, str(tmp_path / "q"), True, act=False)
    with pytest.raises(ValueError, match="group_size=32 boundaries"):
        LLM(d, tensor_parallel_size=2, **KW)


def test_heads_not_divisible_is_a_clear_error(tmp_path):
    d = build_tiny_model(str(tmp_path / "m"), "llama", tokenizer=False, hidden_size=48, num_attention_heads=3,
                         num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads=3 is not divisible by tensor_parallel_size=2"):
        LLM(d, tensor_parallel_size=2, **KW)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM(d, tensor_parallel_size=0)


def test_killed_worker_gives_clear_error_and_no_orphans(tmp_path):
    d = build_tiny_model(str(tmp_path / "m"), "llama", tokenizer=False)
    llm = LLM(d, tensor_parallel_size=2, **KW)
    procs = _workers(llm)
    assert llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].join(timeout=10)
    with pytest.raises(RuntimeError, match=r"worker rank 1 exited with code -9"):
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    _assert_all_gone(procs)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)


def test_busy_port_is_a_clear_error(tmp_path, monkeypatch):
    d = build_tiny_model(str(tmp_path / "m"), "llama", tokenizer=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setenv("LQE_TP_PORT", str(s.getsockname()[1]))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="cannot bind its rendezvous port"):
            LLM(d, tensor_parallel_size=2, **KW)
        assert time.monotonic() - t0 < 30
    assert not [p for p in __import__("multiprocessing").active_children() if p.name.startswith("lqe-tp")]


def test_shutdown_stops_workers(tmp_path):
    d = build_tiny_model(str(tmp_path / "m"), "llama", tokenizer=False)
    llm = LLM(d, tensor_parallel_size=2, **KW)
    procs = _workers(llm)
    assert all(p.is_alive() for p in procs)
    llm.llm_engine.shutdown()
    _assert_all_gone(procs)
    assert all(p.exitcode == 0 for p in procs)  # a clean stop, not a kill




def _ct_w4a16(act: bool):
    def encode(t):
        k = t.shape[1]
        g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(k)) // 32).to(torch.int32) if act else None
        return ref.encode_ct_packed(ref.rtn_quantize(t, 4, 32, False, g_idx=g_idx))

    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
               **({"actorder": "group"} if act else {})}
    return encode, _ct(weights, None, "pack-quantized")


def _fp8_channel(t):
    q, s = ref.quantize_fp8(t, per_channel=True)
    return {"weight": q, "weight_scale": s.reshape(-1, 1).float()}


def _fp8_block(t, b=16):
    """128x128-style block scales, with 16x16 blocks so every tensor-parallel shard of the tiny model holds whole
    blocks."""
    n, k = t.shape
    blocks = t.reshape(n // b, b, k // b, b)
    s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0
    q = (blocks / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(n, k)
    return {"weight": q.contiguous(), "weight_scale_inv": s}


_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
MORE_FORMATS = {
    "ct-w4a16": _ct_w4a16(False),
    "ct-w4a16-actorder": _ct_w4a16(True),
    "ct-fp8-channel": (_fp8_channel, _ct(_FP8, {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                                "dynamic": True}, "float-quantized")),
    "fp8-block": (_fp8_block, {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}),
    "fp8-tensor": (lambda t: (lambda q, s: {"weight": q, "weight_scale": s.float().max().reshape(1)})(
        *ref.quantize_fp8(t, per_channel=False)), {"quant_method": "fp8", "activation_scheme": "dynamic"}),
}


@pytest.mark.parametrize("fmt", list(OTHER_FORMATS) + list(MORE_FORMATS))
def test_other_formats_tp2_matches_tp1(fmt, gptq_base, tmp_path):
    # dynamic per-token int8 activations of row-parallel layers use the whole row's range (all-reduced min/max)
    encode, qcfg = {**OTHER_FORMATS, **MORE_FORMATS}[fmt]
    _assert_tp2_matches_tp1(_quant_checkpoint(gptq_base, str(tmp_path / "q"), encode, qcfg))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantize_on_load_tp2_matches_tp1(kind, gptq_base):
    _assert_tp2_matches_tp1(gptq_base, quantization=kind)


def test_fp8_block_shard_error(tmp_path):
    base = build_tiny_model(str(tmp_path / "b"), "llama", tokenizer=False, intermediate_size=128)
    encode, qcfg = (lambda t: _fp8_block(t, 32)), {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                    "weight_block_size": [32, 32]}
    d = _quant_checkpoint(base, str(tmp_path / "q"), encode, qcfg)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 leaves shard sizes \[16, 16\], which must be multiples of 32"):
        LLM(d, tensor_parallel_size=2, **KW)
    assert not [p for p in __import__("multiprocessing").active_children() if p.name.startswith("lqe-tp")]


def test_method_without_tp_support_is_a_clear_error(monkeypatch):
    from lqe.layers import linear
    from lqe.quant_layers.base import QuantConfig
    from lqe.quant_layers.unquantized import UnquantizedLinearMethod

    class NoTP(UnquantizedLinearMethod):
        supports_tensor_parallel = False

    class Cfg(QuantConfig):
        name = "no-tp"

        @classmethod
        def from_hf_config(cls, cfg):
            return cls()

        def get_linear_method(self, layer, prefix):
            return NoTP()

    monkeypatch.setattr(linear, "get_tp_size", lambda: 2)
    monkeypatch.setattr(linear, "get_tp_rank", lambda: 0)
    with pytest.raises(ValueError, match="NoTP layers cannot be sharded for tensor_parallel_size=2"):
        linear.RowParallelLinear(64, 64, False, Cfg(), "model.layers.0.mlp.down_proj", torch.float32)


def test_server_with_tp2_matches_tp1(tmp_path):
    """`lqe serve --tensor-parallel-size 2`: the OpenAI server on a 2-rank engine answers as the 1-rank one,
    streaming included, and closing the server stops the worker."""
    import argparse

    import httpx

    from lqe.entrypoints.engine_args import ENGINE_ARGS
    from lqe.entrypoints.openai_server import add_serve_args
    from test_server_reliability import serve

    model = build_tiny_model(str(tmp_path / "m"), "llama")
    args = add_serve_args(argparse.ArgumentParser()).parse_args([model, "--tensor-parallel-size", "2", "--device",
                                                                 "cpu", "--max-model-len", "128"])
    assert args.tensor_parallel_size == 2
    body = {"model": "tiny", "prompt": [1, 520, 3100, 28, 9874], "max_tokens": 8, "temperature": 0}
    texts, workers = {}, []
    for tp in (1, 2):
        with serve(model, tensor_parallel_size=tp) as (url, engine, _):
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            chunks = []
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
                for line in s.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:])["choices"][0]["text"])
            texts[tp] = (r.json()["choices"][0]["text"], "".join(chunks))
            if tp == 2:
                workers = list(engine.engine.tp.procs)
                assert all(p.is_alive() for p in workers)
    assert texts[2] == texts[1] and texts[1][0] == texts[1][1]
    assert "tensor_parallel_size" in ENGINE_ARGS  # build_engine hands the flag to EngineConfig
    deadline = time.monotonic() + 10
    while any(p.is_alive() for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(p.is_alive() for p in workers)


def test_tp1_runs_no_distributed_code(gptq_base, monkeypatch):
    """tensor_parallel_size=1 (the default) never touches torch.distributed: no group, no collective, no broadcast;
    the one-rank engine is the same code path as before tensor parallelism existed."""
    import torch.distributed as dist

    def forbidden(*a, **k):
        raise AssertionError("torch.distributed was called with tensor_parallel_size=1")

    for name in ("init_process_group", "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
                 "broadcast_object_list", "barrier"):
        monkeypatch.setattr(dist, name, forbidden)
    d = _gptq_checkpoint(gptq_base, os.path.join(os.path.dirname(gptq_base), "tp1-act"), False, act=True)
    tokens, _ = _run(d, 1)
    assert all(len(t) == 6 for t in tokens)
    assert not dist.is_initialized()


_CTRL_C_SCRIPT = r"""
import sys, time
from lqe import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory_bytes=8 << 20, max_model_len=128)
    print("PIDS", " ".join(str(p.pid) for p in llm.llm_engine.tp.procs), flush=True)
    while True:
        llm.generate([[1, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
"""


def test_ctrl_c_stops_every_rank(tmp_path):
    """SIGINT to the process group (what a terminal's Ctrl-C sends) while rank 0 is generating: the driver and
    every worker exit, no orphan is left."""
    import subprocess
    import sys

    d = build_tiny_model(str(tmp_path / "m"), "llama", tokenizer=False)
    script = tmp_path / "run.py"
    script.write_text(_CTRL_C_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, str(script), d], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        pids = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("PIDS"):
                pids = [int(x) for x in line.split()[1:]]
                break
            if not line and proc.poll() is not None:
                break
        assert pids, f"the driver never started its workers: {proc.stderr.read()[-2000:]}"
        time.sleep(1.0)  # inside generate
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)

        def alive(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            try:  # a zombie (exited, not yet reaped by its dead parent) counts as gone
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().split(")")[-1].split()[0] != "Z"
            except FileNotFoundError:
                return False

        deadline = time.monotonic() + 20
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)], "a worker outlived Ctrl-C"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
