"""Pure-torch ground truth for every format lqe reads or writes (DESIGN.md rule 5).

Tests, the converter (``tools/convert``) and the CUDA kernels' tests all use these functions, so the
converter and the kernels cannot drift apart. Nothing here is fast; everything here is exact.

* :mod:`.packing` — int32 bit packing (2/3/4/8 bits), signed-word handling.
* :mod:`.gptq` — ``decode_gptq`` / ``encode_gptq`` (v1 ``gptq`` and ``gptq_v2``), zero-point rules.
* :mod:`.awq` — ``decode_awq`` / ``encode_awq`` (GEMM layout, interleave ``[0,2,4,6,1,3,5,7]``).
* :mod:`.ct` — compressed-tensors ``pack_to_int32``, ``decode_ct_packed`` / ``encode_ct_packed``, int8/fp8.
* :mod:`.rtn` — round-to-nearest quantization to a CanonicalWeight.
* :mod:`.w8a8` — per-token / static int8 activation quantization and the int8 GEMM with its epilogue.
"""
from lqe.quant_layers.reference.awq import AWQ_BITS, AWQ_ORDER, AWQ_REVERSE_ORDER, decode_awq, encode_awq, pack_awq, unpack_awq
from lqe.quant_layers.reference.ct import (
    FP8_E4M3_MAX, decode_ct_packed, dequant_ct_int, dequant_fp8, encode_ct_packed, expand_scale, pack_to_int32,
    quantize_fp8, quantize_int8_per_channel, unpack_from_int32,
)
from lqe.quant_layers.reference.gptq import (
    GPTQ_FORMATS, decode_gptq, encode_gptq, gptq_sym_stored_zero, gptq_true_zeros, num_groups, unpack_gptq_qweight,
    unpack_gptq_qzeros, v1_zero_corruption,
)
from lqe.quant_layers.reference.packing import (
    SUPPORTED_BITS, pack_int32, packed_size, to_int32, to_uint32, unpack_int32, values_per_block,
)
from lqe.quant_layers.reference.rtn import rtn_quantize
from lqe.quant_layers.reference.w8a8 import int8_gemm_ref, per_token_quant_int8, static_quant_int8, w8a8_linear_ref

__all__ = [
    "AWQ_BITS", "AWQ_ORDER", "AWQ_REVERSE_ORDER", "FP8_E4M3_MAX", "GPTQ_FORMATS", "SUPPORTED_BITS",
    "decode_awq", "decode_ct_packed", "decode_gptq", "dequant_ct_int", "dequant_fp8", "encode_awq", "encode_ct_packed",
    "encode_gptq", "expand_scale", "gptq_sym_stored_zero", "gptq_true_zeros", "int8_gemm_ref", "num_groups", "pack_awq",
    "pack_int32", "pack_to_int32", "packed_size", "per_token_quant_int8", "quantize_fp8", "quantize_int8_per_channel",
    "rtn_quantize", "static_quant_int8", "to_int32", "to_uint32", "unpack_awq", "unpack_from_int32", "unpack_gptq_qweight",
    "unpack_gptq_qzeros", "unpack_int32", "v1_zero_corruption", "values_per_block", "w8a8_linear_ref",
]
