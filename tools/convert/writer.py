"""Reading a float HF checkpoint and writing a converted one: sharded safetensors (+ index), config files,
tokenizer / generation files, all into a temporary directory beside ``out`` that is moved into place at the end."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tools.convert.spec import ConvertError

WEIGHT_INDEX = "model.safetensors.index.json"
COPY_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".py")
SKIP_FILES = ("config.json", "quantize_config.json", "quant_config.json", WEIGHT_INDEX)


def safetensors_files(model_dir: str) -> list[str]:
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ConvertError(f"{model_dir!r} is not a Hugging Face model directory (no config.json)")
    index = os.path.join(model_dir, WEIGHT_INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ConvertError(f"{model_dir!r} holds no *.safetensors weights (convert .bin checkpoints with save_pretrained first)")
    return [os.path.join(model_dir, f) for f in files]


def load_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                sd[key] = f.get_tensor(key)
    return sd


# safetensors dtype names (``PySafeSlice.get_dtype()``) -> torch
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointReader:
    """A safetensors checkpoint read lazily: construction reads the shard headers only (``meta``: every tensor as a
    meta tensor of its shape and dtype, in the order :func:`load_state_dict` gives); :meth:`get` / :meth:`get_many`
    read the tensors asked for, one shard opened at a time."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.files: dict[str, str] = {}
        self.meta: dict[str, torch.Tensor] = {}
        for path in safetensors_files(model_dir):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    dtype = ST_DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise ConvertError(f"{path}: tensor {key!r} has dtype {sl.get_dtype()}, which tools.convert "
                                           "does not read")
                    self.files[key] = path
                    self.meta[key] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")

    def keys(self) -> list[str]:
        return list(self.meta)

    def __contains__(self, key: str) -> bool:
        return key in self.meta

    def float_dtype(self) -> torch.dtype:
        """The first floating tensor's dtype: what :func:`tools.convert.export.write_checkpoint` calls the source dtype."""
        return next((t.dtype for t in self.meta.values() if t.is_floating_point()), torch.float32)

    def get_many(self, keys: list[str], device: torch.device | str | None = None,
                 float_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``keys`` read from their shards onto ``device``, floating tensors cast to ``float_dtype`` (on the device)."""
        self.check_keys(keys)
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.files[k], []).append(k)
        out: dict[str, torch.Tensor] = {}
        for path, ks in by_file.items():
            with safe_open(path, framework="pt") as f:
                for k in ks:
                    t = f.get_tensor(k)
                    if device is not None:
                        t = t.to(device)
                    out[k] = t.to(float_dtype) if float_dtype is not None and t.is_floating_point() else t
        return {k: out[k] for k in keys}

    def check_keys(self, keys: list[str]) -> None:
        """Raise naming the tensors ``keys`` asks for that the checkpoint does not have."""
        missing = [k for k in keys if k not in self.meta]
        if missing:
            raise ConvertError(f"{self.model_dir}: the checkpoint has no tensor {', '.join(missing[:4])}"
                               f"{' ...' if len(missing) > 4 else ''}")

    def get(self, key: str, device: torch.device | str | None = None,
            float_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.get_many([key], device, float_dtype)[key]


def quantized_weight(key: str, quantized: Mapping[str, Any]) -> bool:
    """``key`` is the float weight of a layer in ``quantized`` (prefix -> quantized form): not written."""
    prefix, _, leaf = key.rpartition(".")
    return leaf == "weight" and prefix in quantized


def writer_tensors(reader: CheckpointReader, state: dict[str, torch.Tensor],
                   quantized: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The float tensors :func:`~tools.convert.export.write_checkpoint` stores beside the packed layers, in the
    checkpoint's order: every checkpoint tensor but the quantized linears' weights, as calibration left it (``state``,
    cast back to the checkpoint's dtype) or else read from its shard; then tensors calibration added (an untied
    lm_head), unless one is another name of a tensor already there (a tied lm_head is the embedding again)."""
    out: dict[str, torch.Tensor] = {}
    for key, src in reader.meta.items():
        if quantized_weight(key, quantized):
            continue
        t = state.get(key)
        out[key] = reader.get(key) if t is None else t.to(src.dtype) if t.is_floating_point() else t
    seen = {t.data_ptr() for k, t in state.items() if k in out and t.numel()}
    for key, t in state.items():
        if key not in out and not quantized_weight(key, quantized) and not (t.numel() and t.data_ptr() in seen):
            out[key] = t
    return out


def read_config(model_dir: str) -> dict[str, Any]:
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ConvertError(f"{model_dir!r} is not a Hugging Face model directory (no config.json)")
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)) and not overwrite:
        raise ConvertError(f"output directory {out_dir!r} exists and is not empty; pass --overwrite to replace it")


@contextmanager
def staging_dir(out_dir: str, overwrite: bool) -> Iterator[str]:
    """A temporary directory beside ``out_dir``; on success it replaces ``out_dir``, on failure it is removed."""
    check_out_dir(out_dir, overwrite)
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(os.path.abspath(out_dir)) + ".tmp-", dir=parent)
    mask = _umask()
    os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes 0700: the checkpoint gets a directory's usual permissions
    try:
        yield tmp
        for name in os.listdir(tmp):  # and its files a file's (safetensors writes 0600)
            os.chmod(os.path.join(tmp, name), 0o666 & ~mask)
        if os.path.exists(out_dir):
            old = tmp + ".old"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_shards(out_dir: str, tensors: dict[str, torch.Tensor], max_shard_size: int) -> list[str]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index when over ``max_shard_size``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        if shards[-1] and size + _nbytes(t) > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += _nbytes(t)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())}, "weight_map": weight_map}
    with open(os.path.join(out_dir, WEIGHT_INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return names


def copy_side_files(model_dir: str, out_dir: str) -> None:
    """Tokenizer, generation config, chat template ... (everything small that is not weights or configs)."""
    for f in os.listdir(model_dir):
        src = os.path.join(model_dir, f)
        if os.path.isfile(src) and f.endswith(COPY_SUFFIXES) and f not in SKIP_FILES:
            shutil.copy(src, os.path.join(out_dir, f))


def write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
