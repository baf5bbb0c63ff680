"""Quantization-config discovery and the `quantization=` argument."""
import json

import pytest

from lqe.quant_layers import QUANT_METHODS, AWQConfig, CompressedTensorsConfig, GPTQConfig, resolve_quant_config

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM"}
CT = {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                              "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}


def test_discovery_order(tmp_path):
    assert isinstance(resolve_quant_config(str(tmp_path), {"quantization_config": GPTQ}, None), GPTQConfig)
    assert isinstance(resolve_quant_config(str(tmp_path), {"compression_config": CT}, None), CompressedTensorsConfig)
    assert isinstance(resolve_quant_config(str(tmp_path), {"text_config": {"quantization_config": AWQ}}, None), AWQConfig)
    assert resolve_quant_config(str(tmp_path), {}, None) is None
    (tmp_path / "quantize_config.json").write_text(json.dumps({k: v for k, v in GPTQ.items() if k != "quant_method"}))
    assert isinstance(resolve_quant_config(str(tmp_path), {}, "gptq"), GPTQConfig)


def test_legacy_awq_quant_config_json(tmp_path):
    (tmp_path / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}))
    c = resolve_quant_config(str(tmp_path), {}, None)
    assert isinstance(c, AWQConfig) and c.group_size == 64


@pytest.mark.parametrize("hf,requested,match", [
    ({"quantization_config": AWQ}, "gptq", "quantized with 'awq'"),
    ({"quantization_config": GPTQ}, "awq", "quantized with 'gptq'"),
    ({}, "gptq", "it is unquantized"),
    ({"quantization_config": GPTQ}, "bitsandbytes", r"unknown quantization method 'bitsandbytes'; supported: .*'awq'"),
    ({"quantization_config": {"quant_method": "hqq"}}, None, r"'hqq' .* not supported; lqe supports"),
    ({"quantization_config": CT}, "fp8", "holds schemes"),
])
def test_mismatch_errors(tmp_path, hf, requested, match):
    with pytest.raises(ValueError, match=match):
        resolve_quant_config(str(tmp_path), hf, requested)


def test_aliases_and_registry(tmp_path):
    assert set(QUANT_METHODS) == {"gptq", "awq", "compressed-tensors", "fp8"}
    assert isinstance(resolve_quant_config(str(tmp_path), {"quantization_config": CT}, "w8a8"), CompressedTensorsConfig)
    assert isinstance(resolve_quant_config(str(tmp_path), {"quantization_config": CT}, "Compressed-Tensors"), CompressedTensorsConfig)
