"""Calibration inputs: seeded random windows of ``seq_len`` tokens from a text file, tokenized with the model's
own tokenizer. Default text: ``../shared/data/wikitext2-valid.tokens`` beside the repository, if it exists."""
from __future__ import annotations

import os

import torch

from tools.convert.spec import ConvertError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CALIB = os.path.join(REPO, "..", "shared", "data", "wikitext2-valid.tokens")


def default_calib_path() -> str | None:
    path = os.path.normpath(DEFAULT_CALIB)
    return path if os.path.isfile(path) else None


def calibration_ids(model_dir: str, path: str | None, num_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``[num_samples, seq_len]`` token ids (windows may overlap; the same seed gives the same windows)."""
    path = path or default_calib_path()
    if path is None:
        raise ConvertError(f"no calibration text: pass --calib FILE (the default {os.path.normpath(DEFAULT_CALIB)} does not exist)")
    if not os.path.isfile(path):
        raise ConvertError(f"calibration file {path!r} does not exist")
    if num_samples < 1 or seq_len < 2:
        raise ConvertError(f"--num-samples ({num_samples}) must be >= 1 and --seq-len ({seq_len}) >= 2")
    from transformers import AutoTokenizer

    with open(path, encoding="utf-8") as f:
        text = f.read()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if ids.numel() < seq_len:
        raise ConvertError(f"calibration file {path!r} has only {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len + 1, (num_samples,), generator=gen)
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
