"""Compare an e2e run's rows with the committed ones (issue 27's gate: every e2e row within 5 % of the committed one,
or faster).

Rows are matched by ``(model_shape, variant)``, the key ``benchmarks/e2e_gpu.py`` merges them by (the variant label
carries ``+piecewise`` / ``+async``). Per matched row, per column, the speed ratio (higher is faster):

* ``decode_tok_s_bs1``, ``decode_tok_s_bs16`` (and their ``_eager`` twins when both rows have them),
  ``throughput_tok_s``, ``total_tok_s``: new / old;
* ``ttft_ms``: old / new (lower is better, so the ratio is still above 1 when the new run is faster).

A row with any ratio under ``--threshold`` (0.95) is flagged ``SLOWER`` and the exit status is 1.

The throughput columns are compared only between runs of the same requests and engine settings: ``throughput_tok_s``
comes from ``workload.workload_256``, which once drew other requests for the same arguments (32 requests: 19,266
output tokens then, 17,947 now), so a row is comparable only when both record the same ``workload_id`` (new rows do,
with ``workload_input_tokens`` / ``workload_output_tokens``) and, where both record them, the same ``max_num_seqs`` and
``max_num_batched_tokens``. Otherwise throughput is reported "not comparable" and the decode and TTFT columns decide.

Also listed: committed rows the new file has no new measurement for (absent, or carried over unchanged by
``e2e_gpu.py``'s merge: e.g. ``--quick`` runs no llama3-8b row), and new rows with no committed one. ``--strict``
makes an unmeasured committed row fail the comparison too.

    python benchmarks/compare_e2e.py                                  # the e2e-*.json in $OUT (else benchmarks/results)
                                                                      # vs the file of the same name at git HEAD
    python benchmarks/compare_e2e.py /out/e2e-nvidia-h100-80gb-hbm3.json --old old.json
    python benchmarks/compare_e2e.py NEW --rev 339e013               # the committed file at another commit

Without a .git (a GPU machine's copy of the tree) the committed file is ``benchmarks/results/<same name>`` in the
working tree, when that is not the new file itself. Exit status: 0 pass, 1 a row slower (or, ``--strict``, a row
unmeasured), 2 nothing to compare (no file, or no committed row measured again).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"

HIGHER = ("decode_tok_s_bs1", "decode_tok_s_bs16", "decode_tok_s_bs1_eager", "decode_tok_s_bs16_eager",
          "throughput_tok_s", "total_tok_s")  # throughput_256_tok_s is throughput_tok_s under its issue-26 name
LOWER = ("ttft_ms",)
WORKLOAD_COLUMNS = ("throughput_tok_s", "total_tok_s")
SETTINGS = ("max_num_seqs", "max_num_batched_tokens")


def row_key(row: dict) -> tuple[str, str]:
    return row["model_shape"], row["variant"]


def throughput_comparable(old: dict, new: dict) -> str | None:
    """``None`` when the two rows' throughput ran the same requests with the same engine settings, else why not."""
    if "workload_id" not in old or "workload_id" not in new:
        side = "committed" if "workload_id" not in old else "new"
        return f"not comparable (workload changed: the {side} row records no workload_id)"
    if old["workload_id"] != new["workload_id"]:
        return (f"not comparable (other requests: {old.get('workload_output_tokens')} -> "
                f"{new.get('workload_output_tokens')} output tokens)")
    for k in SETTINGS:
        if k in old and k in new and old[k] != new[k]:
            return f"not comparable ({k} {old[k]} -> {new[k]})"
    return None


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def compare_row(old: dict, new: dict, threshold: float) -> dict:
    """``{"ratios": {column: speed ratio}, "slower": [columns under threshold], "throughput": None or why not}``."""
    why = throughput_comparable(old, new)
    ratios = {}
    for col in HIGHER + LOWER:
        if why is not None and col in WORKLOAD_COLUMNS:
            continue
        a, b = old.get(col), new.get(col)
        if _positive(a) and _positive(b):
            ratios[col] = b / a if col in HIGHER else a / b
    return {"ratios": ratios, "slower": [c for c, r in ratios.items() if r < threshold], "throughput": why}


def compare(old_rows: list[dict], new_rows: list[dict], threshold: float = 0.95) -> dict:
    """Match rows by (model_shape, variant): ``{"rows": {key: compare_row result}, "unmeasured": [committed keys with
    no new measurement], "carried": [those of them the new file holds unchanged], "added": [new keys]}``."""
    old = {row_key(r): r for r in old_rows}
    new = {row_key(r): r for r in new_rows}
    out = {"rows": {}, "unmeasured": [], "carried": [], "added": sorted(k for k in new if k not in old)}
    for key, o in old.items():
        n = new.get(key)
        if n is None or n == o:  # absent, or kept as it was by e2e_gpu.py's merge
            out["unmeasured"].append(key)
            if n is not None:
                out["carried"].append(key)
            continue
        out["rows"][key] = compare_row(o, n, threshold)
    return out


def committed_doc(new_path: Path, rev: str = "HEAD", root: Path = ROOT) -> tuple[dict, str]:
    """The committed file of ``new_path``'s name: ``git show REV:benchmarks/results/<name>``, or, without git, the
    working tree's ``benchmarks/results/<name>`` when that is another file than ``new_path``; ``(doc, where)``."""
    rel = f"{RESULTS}/{new_path.name}"
    try:
        proc = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=root, capture_output=True, text=True)
        if proc.returncode == 0:
            return json.loads(proc.stdout), f"{rev}:{rel}"
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"git show exited {proc.returncode}"
    except OSError as e:
        why = str(e)
    tree = root / rel
    if tree.exists() and tree.resolve() != new_path.resolve():
        return json.loads(tree.read_text()), f"{rel} (working tree; git: {why})"
    raise FileNotFoundError(f"no committed {rel} to compare with (git: {why}); pass --old PATH")


def default_new(out_dir: str | None = None) -> Path:
    """The one ``e2e-*.json`` in ``$OUT`` (the GPU scripts' output folder) or else benchmarks/results."""
    folder = Path(out_dir or os.environ.get("OUT") or ROOT / RESULTS)
    found = sorted(folder.glob("e2e-*.json"))
    if len(found) != 1:
        raise FileNotFoundError(f"{len(found)} e2e-*.json files in {folder}: name the new one")
    return found[0]


def _fmt(key: tuple[str, str]) -> str:
    return f"{key[0]}/{key[1]}"


def report(result: dict, threshold: float, strict: bool) -> tuple[list[str], int]:
    lines, failed = [], False
    for key, r in result["rows"].items():
        cols = "  ".join(f"{c} {v:.3f}x" for c, v in r["ratios"].items())
        verdict = f"SLOWER ({', '.join(r['slower'])} under {threshold}x)" if r["slower"] else "ok"
        failed |= bool(r["slower"])
        lines.append(f"{_fmt(key):<32} {verdict}\n    {cols or 'no column to compare'}")
        if r["throughput"]:
            lines.append(f"    throughput: {r['throughput']}")
    for key in result["unmeasured"]:
        how = "carried over unchanged" if key in result["carried"] else "absent"
        lines.append(f"{_fmt(key):<32} {'FAIL' if strict else 'not measured'}: no new measurement ({how})")
        failed |= strict
    for key in result["added"]:
        lines.append(f"{_fmt(key):<32} new row (no committed one)")
    slower = sum(bool(r["slower"]) for r in result["rows"].values())
    lines.append(f"== {len(result['rows'])} rows compared, {slower} slower than {threshold}x, "
                 f"{len(result['unmeasured'])} committed rows not measured, {len(result['added'])} new")
    if not result["rows"]:
        lines.append("== no row was measured again: nothing is checked")
        return lines, 2
    return lines, int(failed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("new", nargs="?", help="the new e2e JSON (default: the one e2e-*.json in $OUT, else "
                                           "benchmarks/results)")
    ap.add_argument("--old", help="the committed e2e JSON (default: the new file's name at --rev)")
    ap.add_argument("--rev", default="HEAD", help="the commit whose benchmarks/results/<name> is the committed file")
    ap.add_argument("--threshold", type=float, default=0.95, help="the least speed ratio that passes (0.95)")
    ap.add_argument("--strict", action="store_true", help="a committed row with no new measurement fails too")
    args = ap.parse_args(argv)
    try:
        new_path = Path(args.new) if args.new else default_new()
        new_doc = json.loads(new_path.read_text())
        if args.old:
            old_doc, where = json.loads(Path(args.old).read_text()), args.old
        else:
            old_doc, where = committed_doc(new_path, args.rev)
    except (OSError, ValueError) as e:
        print(f"compare_e2e: {e}", file=sys.stderr)
        return 2
    print(f"== e2e rows: {new_path} vs {where} (speed ratios, higher is faster: new/old, ttft old/new)")
    lines, rc = report(compare(old_doc.get("rows", []), new_doc.get("rows", []), args.threshold), args.threshold,
                       args.strict)
    print("\n".join(lines))
    return rc


if __name__ == "__main__":
    sys.exit(main())
