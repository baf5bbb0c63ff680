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
``e2e_gpu.py``'s merge: e.g. ``--quick`` runs no llama3-8b row), and new rows with no committed one.

Rows that must be measured: ``--requested`` takes the rows the new file lists under ``requested`` (``e2e_gpu.py``
writes there the shape x variant rows it was asked for, whatever its flags), ``--shapes A,B --variants x,y`` names
them by hand (variants as row labels, e.g. ``bf16+piecewise``). Each of them fails the comparison when this run did
not measure it: listed under ``failures`` in the new file (``e2e_gpu.py`` records there every variant that raised or
was skipped), absent, or carried over unchanged from the committed file. Committed rows outside those are only
listed. ``--strict`` requires every committed row (and every row under ``failures``) too.

    python benchmarks/compare_e2e.py                                  # the e2e-*.json in $OUT (else benchmarks/results)
                                                                      # vs the file of the same name at git HEAD
    python benchmarks/compare_e2e.py /out/e2e-nvidia-h100-80gb-hbm3.json --old old.json
    python benchmarks/compare_e2e.py NEW --rev 339e013               # the committed file at another commit
    python benchmarks/compare_e2e.py NEW --old OLD --requested       # every row the run was asked for is new
    python benchmarks/compare_e2e.py NEW --old OLD --shapes smollm2-135m,qwen2.5-0.5b --variants bf16,w4a16,w8a8

Without a .git (a GPU machine's copy of the tree) the committed file is ``benchmarks/results/<same name>`` in the
working tree, when that is not the new file itself. Exit status: 0 pass, 1 a row slower or a required row not
measured (``--requested``, ``--shapes``/``--variants``, ``--strict``), 2 nothing to compare (no file, no committed row
measured again, or ``--requested`` on a file that lists none).
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


def compare(old_rows: list[dict], new_rows: list[dict], threshold: float = 0.95,
            required: list[tuple[str, str]] | None = None, failures: list[dict] | None = None) -> dict:
    """Match rows by (model_shape, variant): ``{"rows": {key: compare_row result}, "unmeasured": [committed keys with
    no new measurement], "carried": [those of them the new file holds unchanged], "added": [new keys],
    "missing": {key: why}}``. ``missing``: the keys of ``required`` that this run did not measure: listed in the new
    file's ``failures`` (``failures``: e2e_gpu.py records each variant that raised or was skipped there), absent from
    it, or carried over unchanged from the committed file."""
    old = {row_key(r): r for r in old_rows}
    new = {row_key(r): r for r in new_rows}
    out = {"rows": {}, "unmeasured": [], "carried": [], "added": sorted(k for k in new if k not in old), "missing": {}}
    for key, o in old.items():
        n = new.get(key)
        if n is None or n == o:  # absent, or kept as it was by e2e_gpu.py's merge
            out["unmeasured"].append(key)
            if n is not None:
                out["carried"].append(key)
            continue
        out["rows"][key] = compare_row(o, n, threshold)
    failed = {(f.get("model_shape"), f.get("variant")): f for f in failures or []}
    for key in required or []:
        if key in failed:  # a stale row of an earlier run may stand in the file: the failure decides
            f = failed[key]
            out["missing"][key] = f"{f.get('kind', 'failed')} in this run: {str(f.get('error', ''))[:160]}"
        elif key not in new:
            out["missing"][key] = "absent"
        elif key in old and new[key] == old[key]:
            out["missing"][key] = "carried over unchanged"
    return out


def required_keys(shapes: str | None, variants: str | None) -> list[tuple[str, str]]:
    """The rows a run was asked for: every ``--shapes`` x ``--variants`` pair (comma lists, as e2e_gpu.py takes
    them; a variant is the row's label, e.g. ``bf16+piecewise``)."""
    split = lambda v: [x for x in (v or "").split(",") if x]  # noqa: E731
    return [(s, v) for s in split(shapes) for v in split(variants)]


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
    """The lines to print and the exit status: 1 when a row is slower, a required row (``result["missing"]``) was
    not measured, or, ``strict``, a committed row was not; else 2 when no row was measured again; else 0."""
    lines, failed = [], False
    missing = result.get("missing", {})
    for key, r in result["rows"].items():
        cols = "  ".join(f"{c} {v:.3f}x" for c, v in r["ratios"].items())
        verdict = f"SLOWER ({', '.join(r['slower'])} under {threshold}x)" if r["slower"] else "ok"
        failed |= bool(r["slower"])
        lines.append(f"{_fmt(key):<32} {verdict}\n    {cols or 'no column to compare'}")
        if r["throughput"]:
            lines.append(f"    throughput: {r['throughput']}")
    for key in result["unmeasured"]:
        how = missing.get(key) or ("carried over unchanged" if key in result["carried"] else "absent")
        fail = strict or key in missing
        lines.append(f"{_fmt(key):<32} {'FAIL' if fail else 'not measured'}: no new measurement ({how})")
        failed |= fail
    for key, why in missing.items():
        if key not in result["unmeasured"]:  # requested, with no committed row (or a stale one) and no measurement
            lines.append(f"{_fmt(key):<32} FAIL: requested, not measured in this run ({why})")
            failed = True
    for key in result["added"]:
        if key not in missing:
            lines.append(f"{_fmt(key):<32} new row (no committed one)")
    slower = sum(bool(r["slower"]) for r in result["rows"].values())
    lines.append(f"== {len(result['rows'])} rows compared, {slower} slower than {threshold}x, "
                 f"{len(result['unmeasured'])} committed rows not measured, {len(result['added'])} new"
                 + (f", {len(missing)} requested rows not measured" if missing else ""))
    if failed:
        return lines, 1
    if not result["rows"]:
        lines.append("== no row was measured again: nothing is checked")
        return lines, 2
    return lines, 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("new", nargs="?", help="the new e2e JSON (default: the one e2e-*.json in $OUT, else "
                                           "benchmarks/results)")
    ap.add_argument("--old", help="the committed e2e JSON (default: the new file's name at --rev)")
    ap.add_argument("--rev", default="HEAD", help="the commit whose benchmarks/results/<name> is the committed file")
    ap.add_argument("--threshold", type=float, default=0.95, help="the least speed ratio that passes (0.95)")
    ap.add_argument("--strict", action="store_true", help="a committed row with no new measurement fails too, and so "
                                                           "does every row the new file lists under failures")
    ap.add_argument("--shapes", help="comma list: with --variants, the rows the run was asked for (e2e_gpu.py's "
                                     "--shapes); each must be measured in this run or the comparison fails")
    ap.add_argument("--variants", help="comma list of row variants (labels, e.g. bf16+piecewise), with --shapes")
    ap.add_argument("--requested", action="store_true",
                    help="the rows the new file lists under requested (those e2e_gpu.py was asked for) must each be "
                         "measured in this run, or the comparison fails")
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
    if bool(args.shapes) != bool(args.variants):
        print("compare_e2e: --shapes and --variants go together (the rows required are their pairs)", file=sys.stderr)
        return 2
    failures = new_doc.get("failures", [])
    required = required_keys(args.shapes, args.variants)
    if args.requested:
        if "requested" not in new_doc:
            print(f"compare_e2e: --requested, but {new_path} lists no requested rows (written by an e2e_gpu.py "
                  f"before they were recorded?)", file=sys.stderr)
            return 2
        required += [(r.get("model_shape"), r.get("variant")) for r in new_doc["requested"]]
    if args.strict:  # every committed row, and every row this run failed
        required += [row_key(r) for r in old_doc.get("rows", [])]
        required += [(f.get("model_shape"), f.get("variant")) for f in failures]
    required = list(dict.fromkeys(required))
    lines, rc = report(compare(old_doc.get("rows", []), new_doc.get("rows", []), args.threshold, required, failures),
                       args.threshold, args.strict)
    print("\n".join(lines))
    return rc


if __name__ == "__main__":
    sys.exit(main())
