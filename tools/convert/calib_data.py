"""Calibration inputs: seeded random windows of ``seq_len`` tokens, tokenized with the model's own tokenizer.

Where the text comes from (``--calib``):

* not given: ``../shared/data/wikitext2-valid.tokens`` beside the repository when it exists (this workspace's
  WikiText-2 validation split, which must not be copied into the repository), else ``self`` below, so calibration
  works in a fresh clone with no external file;
* ``FILE``: ``.txt`` / ``.tokens`` / ``.raw`` (or anything else: read as UTF-8 text, ``.gz`` decompressed),
  ``.jsonl`` (the ``text`` field of each line), ``.parquet`` (its ``text`` column; needs ``pyarrow``);
* ``self``: ``num_samples`` sequences sampled from the model itself through lqe's engine (temperature 1, the
  given seed), no external text at all.
"""
from __future__ import annotations

import gzip
import json
import os

import torch

from tools.convert.spec import ConvertError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the README's benchmark rows were calibrated on it
SHARED_CALIB = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "wikitext2-valid.tokens"))
SELF = "self"


def default_calib_path() -> str:
    """The calibration source used when ``--calib`` is not given: the shared WikiText-2 file, else ``"self"``."""
    return SHARED_CALIB if os.path.isfile(SHARED_CALIB) else SELF


def check_calib_arg(calib: str | None) -> None:
    """Fail before any model is loaded when ``--calib`` names something unreadable."""
    if calib is None or calib == SELF:
        return
    if not os.path.isfile(calib):
        raise ConvertError(f"calibration file {calib!r} does not exist (give a .txt/.jsonl/.parquet file, 'self', "
                           "or omit --calib)")
    if calib.endswith(".parquet"):
        _require_pyarrow(calib)


def _require_pyarrow(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConvertError(f"reading {path!r} needs pyarrow, which is not installed: `pip install pyarrow`, or "
                           "convert the file to .txt / .jsonl") from None
    return pq


def _open_text(path: str):
    return gzip.open(path, "rt", encoding="utf-8-sig") if path.endswith(".gz") else open(path, encoding="utf-8-sig")


def read_calib_text(path: str) -> str:
    """The calibration text of ``path`` by its extension (documents joined with blank lines)."""
    base = path[:-3] if path.endswith(".gz") else path
    if base.endswith(".jsonl"):
        docs = []
        with _open_text(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ConvertError(f"{path}:{i}: not a JSON line ({e})") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise ConvertError(f"{path}:{i}: each line must be a JSON object with a string 'text' field")
                docs.append(row["text"])
        return "\n\n".join(docs)
    if base.endswith(".parquet"):
        pq = _require_pyarrow(path)
        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise ConvertError(f"{path}: no 'text' column (columns: {table.column_names})")
        return "\n\n".join(t for t in table.column("text").to_pylist() if isinstance(t, str))
    try:
        with _open_text(path) as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ConvertError(f"calibration file {path!r} is not UTF-8 text ({e}); give .txt, .jsonl or .parquet") from None


def calibration_ids(model_dir: str, path: str | None, num_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``[num_samples, seq_len]`` token ids (windows may overlap; the same seed gives the same windows)."""
    if num_samples < 1 or seq_len < 2:
        raise ConvertError(f"--num-samples ({num_samples}) must be >= 1 and --seq-len ({seq_len}) >= 2")
    if path is None:
        path = default_calib_path()
        if path == SELF:
            print(f"tools.convert: no --calib and no {SHARED_CALIB}: calibrating on text sampled from the model "
                  "itself (--calib self); pass --calib FILE for your own text")
    if path == SELF:
        return self_generated_ids(model_dir, num_samples, seq_len, seed)
    check_calib_arg(path)
    from transformers import AutoTokenizer

    text = read_calib_text(path)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if ids.numel() < seq_len:
        raise ConvertError(f"calibration file {path!r} has only {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len + 1, (num_samples,), generator=gen)
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


def self_generated_ids(model_dir: str, num_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``num_samples`` sequences of ``seq_len`` tokens sampled from the float model itself (lqe's engine, fp32,
    temperature 1, request seeds ``seed + i``), each starting from the BOS token when the model has one."""
    from lqe import LLM, SamplingParams

    batch = min(num_samples, 64)
    llm = LLM(model_dir, dtype="float32", max_model_len=seq_len + 1, max_num_seqs=batch, seed=seed,
              enable_prefix_caching=False, block_size=16, num_kv_blocks=batch * -(-(seq_len + 1) // 16) + 1)
    tok = llm.get_tokenizer()
    bos = getattr(tok, "bos_token_id", None) if tok is not None else None
    bos = 0 if bos is None else bos
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=seq_len - 1, ignore_eos=True)
              for i in range(num_samples)]
    outs = llm.generate([[int(bos)]] * num_samples, params, use_tqdm=False)
    rows = [[int(bos)] + list(o.outputs[0].token_ids) for o in outs]
    return torch.tensor([r[:seq_len] for r in rows], dtype=torch.long)
