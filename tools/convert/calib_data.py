"""Calibration inputs: seeded random windows of ``seq_len`` tokens, tokenized with the model's own tokenizer.

Where the text comes from (``--calib``):

* not given, or ``default``: ``tools/convert/data/calib_default.txt.gz``, shipped inside the package (324 KB of
  public-domain / CC0 English prose: CIA World Factbook country backgrounds, Python PEPs, and three
  Project Gutenberg books; sources and licenses in ``tools/convert/data/ATTRIBUTION.md``), so a fresh clone or a
  ``pip install`` calibrates exactly as this workspace does;
* ``wikitext2``: ``../shared/data/wikitext2-valid.tokens`` beside the repository (this workspace's WikiText-2
  validation split, CC BY-SA, which must not be copied into the repository; the README's benchmark rows were
  calibrated on it), only where that file exists;
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
# shipped with the package (package data, see pyproject.toml); what no --calib means
PACKAGED_CALIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "calib_default.txt.gz")
# this workspace's WikiText-2 validation split: the README's benchmark rows were calibrated on it (--calib wikitext2)
SHARED_CALIB = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "wikitext2-valid.tokens"))
SELF = "self"
DEFAULT = "default"
WIKITEXT2 = "wikitext2"


def default_calib_path() -> str:
    """The calibration text used when ``--calib`` is not given: the packaged ``calib_default.txt.gz``."""
    return PACKAGED_CALIB


def resolve_calib(calib: str | None) -> str:
    """``--calib`` as a path, or ``"self"``: None / ``default`` -> the packaged text, ``wikitext2`` -> the shared
    WikiText-2 validation file (an error where it does not exist), anything else unchanged."""
    if calib is None or calib == DEFAULT:
        if not os.path.isfile(PACKAGED_CALIB):
            raise ConvertError(f"the packaged calibration text {PACKAGED_CALIB} is missing (a broken install?): "
                               "pass --calib FILE or --calib self")
        return PACKAGED_CALIB
    if calib == WIKITEXT2:
        if not os.path.isfile(SHARED_CALIB):
            raise ConvertError(f"--calib wikitext2 reads {SHARED_CALIB}, which does not exist here; pass the path "
                               "of your own copy of the WikiText-2 validation split, or omit --calib for the "
                               "packaged default")
        return SHARED_CALIB
    return calib


def check_calib_arg(calib: str | None) -> None:
    """Fail before any model is loaded when ``--calib`` names something unreadable."""
    path = resolve_calib(calib)
    if path == SELF:
        return
    if not os.path.isfile(path):
        raise ConvertError(f"calibration file {path!r} does not exist (give a .txt/.jsonl/.parquet file, 'self', "
                           "'wikitext2', or omit --calib for the packaged default text)")
    if path.endswith(".parquet"):
        _require_pyarrow(path)


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
        print("tools.convert: no --calib: calibrating on the packaged default text (tools/convert/data/"
              "calib_default.txt.gz, public-domain / CC0 prose, see ATTRIBUTION.md there); pass --calib FILE for "
              "your own text, --calib wikitext2 for this workspace's WikiText-2 validation split")
    path = resolve_calib(path)
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
