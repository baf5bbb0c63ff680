"""``lqe generate`` end to end on a tiny model (the README demo's path), and the engine flags it shares with
``lqe serve`` reaching the engine."""
from __future__ import annotations

import pytest

from lqe.entrypoints import cli


def test_generate_prints_each_completion(tiny_llama_dir, capsys):
    rc = cli.main(["generate", "--model", tiny_llama_dir, "--device", "cpu", "--prompt", "hello", "--prompt", "a b",
                   "--max-tokens", "5", "--max-model-len", "128"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("### ") == 2 and "### hello\n" in out and "### a b\n" in out
    assert out.count("[5 tokens, finish_reason=length]") == 2


def test_generate_takes_the_serve_engine_flags(tiny_llama_dir, monkeypatch):
    """Flags given reach the engine; flags left out are not passed, so the engine's defaults hold."""
    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(model, **kwargs):
        seen.update(kwargs, model=model)
        raise Stop

    monkeypatch.setattr("lqe.LLM", fake_llm)
    with pytest.raises(Stop):
        cli.main(["generate", "--model", tiny_llama_dir, "--prompt", "x", "--block-size", "8", "--num-kv-blocks",
                  "64", "--no-enable-prefix-caching", "-q", "gptq", "--kv-cache-dtype", "fp8", "--seed", "3"])
    assert seen == {"model": tiny_llama_dir, "block_size": 8, "num_kv_blocks": 64, "enable_prefix_caching": False,
                    "quantization": "gptq", "kv_cache_dtype": "fp8"}  # --seed is the requests' sampling seed


@pytest.mark.parametrize("argv,message", [
    (["--max-num-seqs", "0"], "expected a positive integer, got 0"),
    (["--quantization", "int3"], "unknown quantization method 'int3'"),
    (["--cudagraph-mode", "piecewise"], "'piecewise' is not a CUDA-graph mode"),
])
def test_bad_engine_flags_fail_at_parse_time(argv, message, capsys):
    for cmd in (["generate"], ["chat"], ["serve", "m"]):
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args([*cmd, *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_bad_engine_value_is_an_error_not_a_traceback(tiny_llama_dir, capsys):
    rc = cli.main(["generate", "--model", tiny_llama_dir, "--prompt", "x", "--gpu-memory-utilization", "1.5"])
    assert rc == 2 and "gpu_memory_utilization=1.5 must be in (0, 1]" in capsys.readouterr().err


def test_stated_defaults_are_the_engines():
    """A flag left out takes EngineConfig's default; its help must state that same value."""
    import argparse
    import dataclasses
    import re

    from lqe.config import EngineConfig
    from lqe.entrypoints.engine_args import ENGINE_ARGS, add_engine_args

    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    words = {True: "on", False: "off"}
    checked = 0
    for action in add_engine_args(argparse.ArgumentParser())._actions:
        if action.dest not in ENGINE_ARGS:
            continue
        assert action.default is None, f"--{action.dest} must default to None so the engine's default applies"
        default = fields[action.dest]
        if default is None:
            continue
        m = re.search(r"\(default:? ([^ ,:;)]+)", action.help)
        assert m, f"--{action.dest}: help states no default"
        stated = words[default] if isinstance(default, bool) else str(default)
        assert m.group(1) == stated, (action.dest, m.group(1), default)
        checked += 1
    assert checked >= 15
