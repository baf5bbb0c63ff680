"""``python -m tools.convert {export,quantize,verify}``: export custom-calibrated weights, calibrate with
RTN / GPTQ / AWQ / SmoothQuant, and verify GPTQ / AWQ / compressed-tensors checkpoints (DESIGN.md)."""
from tools.convert.export import ExportReport, export_checkpoint, write_checkpoint
from tools.convert.fakequant import recover_grid
from tools.convert.packers import pack_layer
from tools.convert.params import canonical_from_params, load_params
from tools.convert.spec import ConvertError, ExportSpec

__all__ = ["ConvertError", "ExportReport", "ExportSpec", "canonical_from_params", "export_checkpoint", "load_params",
           "pack_layer", "recover_grid", "write_checkpoint"]
