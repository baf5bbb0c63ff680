"""Check compiled SASS for uniform registers that are read but never written in their function.

Why: ptxas 13.0 compiled ``cp.async.cg.shared.global.L2::cache_hint`` with a shared-memory address whose uniform part
it had folded into the instruction (SASS ``LDGSTS.E.BYPASS.128 [R118+UR0], desc[UR1][R6.64]``) so that the
instruction read UR0 and the descriptor pair UR1:UR2, registers no instruction of the kernel ever writes. On the H200
every launch of lqe-w4a16-mma then died with "an illegal instruction was encountered" (compute-sanitizer: the first
weight copy, w4a16_mma.cu's cp16_l2_hint; stop 38). Nothing short of running the kernel showed it, so every CUDA
source's SASS is checked here at compile time (.ci/compile_cuda.sh).

A uniform register counts as written where it is the destination (the first operand) of an instruction; a 64-bit
destination (``.64``, ``.WIDE``) writes the pair. A read is any other ``URn`` operand; ``desc[URn]`` reads the pair
``URn``, ``URn+1`` (a 64-bit memory descriptor). The check is per function and ignores order, so it only flags a
register that is never written at all, never a false alarm from control flow.

Second check, programmatic dependent launch (PDL): in a function with a ``griddepcontrol.wait`` (SASS ``ACQBULK``),
every path from the entry passes one before any global memory access or ``EXIT``, except the accesses a PDL kernel
may make while the kernel before it still runs: weight copies and streaming weight loads (``LDGSTS``,
``LDG.*.NA.*.128``), prefetches (``CCTL``) and cp.async bookkeeping (``LDGDEPBAR`` / ``DEPBAR``). A load of the
activations hoisted above the wait would read the previous kernel's output before it is written, and a block that
exits without waiting breaks the ordering for the kernel after it (csrc/gemm/gemm_common.cuh). The control flow
follows ``BRA`` targets (a predicated one also falls through), ``CALL`` (to its target and past it) and ``EXIT``
(a predicated one falls through); an indirect branch in such a function is reported.

    cuobjdump -sass file.o | python .ci/sass_check.py [--name file.cu]   # exit 1 and a report when one is found
"""
from __future__ import annotations

import argparse
import re
import sys

_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
# "/*07a0*/    @!P1 LDGSTS.E.BYPASS.128 [R13], desc[UR16][R8.64] ;": pc, predicate, opcode, operands
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_UR = re.compile(r"\bUR(\d+)\b")
_DESC = re.compile(r"desc\[UR(\d+)\]")


def _writes(opcode: str, operands: str) -> set[int]:
    first = operands.split(",", 1)[0].strip()
    m = re.fullmatch(r"UR(\d+)", first)
    if not m:
        return set()
    n = int(m.group(1))
    wide = ".64" in opcode or "WIDE" in opcode
    return {n, n + 1} if wide else {n}


def _reads(operands: str) -> tuple[set[int], set[int]]:
    """(plain reads, descriptor bases) of one instruction's operands, its destination left out."""
    parts = operands.split(",", 1)
    rest = parts[1] if len(parts) > 1 and re.fullmatch(r"\s*UR\d+\s*", parts[0]) else operands
    desc = {int(d) for d in _DESC.findall(rest)}
    plain = {int(r) for r in _UR.findall(_DESC.sub("", rest))}
    return plain, desc


def _functions(sass: str) -> list[tuple[str, list[tuple[int, bool, str, str]]]]:
    """Each function of cuobjdump's listing: its name and its instructions as (pc, predicated, opcode, operands)."""
    funcs: list[tuple[str, list[tuple[int, bool, str, str]]]] = []
    for line in sass.splitlines():
        fm = _FUNC.match(line)
        if fm:
            funcs.append((fm.group(1), []))
            continue
        im = _INSN.match(line)
        if im and funcs:
            funcs[-1][1].append((int(im.group(1), 16), im.group(2) is not None, im.group(3), im.group(4)))
    return funcs


def check(sass: str) -> list[str]:
    """One line per read of a never-written uniform register: ``function pc instruction (URn never written)``."""
    problems: list[str] = []
    for name, insns in _functions(sass):
        written: set[int] = set()
        for _, _, op, ops in insns:
            written |= _writes(op, ops)
        for pc, _, op, ops in insns:
            plain, desc = _reads(ops)
            missing = sorted({r for r in plain if r not in written}
                             | {r for d in desc for r in (d, d + 1) if r not in written})
            if missing:
                regs = ", ".join(f"UR{r}" for r in missing)
                problems.append(f"{name} /*{pc:04x}*/ {op} {ops.strip()} ({regs} never written)")
    return problems


_GLOBAL = ("LDG", "STG", "ATOM", "RED", "LD.", "ST.", "LDGSTS", "UBLKCP", "UTMALDG", "UTMASTG", "SULD", "SUST",
           "SUATOM", "SURED")


def _pdl_allowed(op: str) -> bool:
    """What a PDL kernel may do before its wait: copy / stream weights, prefetch, cp.async bookkeeping."""
    return (op.startswith(("LDGSTS", "CCTL", "LDGDEPBAR", "DEPBAR"))
            or (op.startswith("LDG") and ".NA" in op and ".128" in op))


def check_pdl(sass: str) -> list[str]:
    """One line per global access or EXIT that some path from its function's entry reaches without passing an
    ``ACQBULK`` (functions without one are not PDL kernels: skipped)."""
    problems: list[str] = []
    for name, insns in _functions(sass):
        if not any(op == "ACQBULK" for _, _, op, _ in insns):
            continue
        pcs = [pc for pc, *_ in insns]
        succ: dict[int, list[int]] = {pc: [] for pc in pcs}
        for i, (pc, pred, op, ops) in enumerate(insns):
            nxt = pcs[i + 1] if i + 1 < len(pcs) else None
            target = re.findall(r"0x([0-9a-f]+)", ops)
            if op.startswith(("BRX", "JMX", "JMP")):
                problems.append(f"{name} /*{pc:04x}*/ {op} {ops.strip()} (indirect branch: PDL paths not followed)")
            elif op.startswith(("BRA", "CALL")):
                if target:
                    succ[pc].append(int(target[-1], 16))
                if (pred or op.startswith("CALL")) and nxt is not None:
                    succ[pc].append(nxt)
            elif op.startswith(("EXIT", "RET")):
                if pred and nxt is not None:
                    succ[pc].append(nxt)
            elif nxt is not None:
                succ[pc].append(nxt)
        # waited[pc]: every path from the entry to pc passed an unpredicated ACQBULK (a must-analysis)
        waited = {pc: True for pc in pcs}
        waited[pcs[0]] = False
        preds: dict[int, list[int]] = {pc: [] for pc in pcs}
        for a, bs in succ.items():
            for b in bs:
                if b in preds:
                    preds[b].append(a)
        by_pc = {pc: (pred, op) for pc, pred, op, _ in insns}

        def after(pc: int) -> bool:
            pred, op = by_pc[pc]
            return waited[pc] or (op == "ACQBULK" and not pred)

        changed = True
        while changed:
            changed = False
            for pc in pcs[1:]:
                v = all(after(p) for p in preds[pc]) if preds[pc] else True
                if v != waited[pc]:
                    waited[pc], changed = v, True
        seen, stack = set(), [pcs[0]]
        while stack:
            pc = stack.pop()
            if pc not in seen:
                seen.add(pc)
                stack.extend(succ[pc])
        for pc, _, op, ops in insns:
            if pc in seen and not waited[pc] and not _pdl_allowed(op) and (op.startswith(_GLOBAL) or op == "EXIT"):
                problems.append(f"{name} /*{pc:04x}*/ {op} {ops.strip()} (reached before griddepcontrol.wait)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="<stdin>", help="the source the SASS came from (for the report)")
    args = ap.parse_args(argv)
    sass = sys.stdin.read()
    if "Function" not in sass:
        print(f"sass_check: {args.name}: no SASS functions in the input", file=sys.stderr)
        return 2
    problems = check(sass) + check_pdl(sass)
    for p in problems[:20]:
        print(f"sass_check: {args.name}: {p}")
    if len(problems) > 20:
        print(f"sass_check: {args.name}: ... {len(problems) - 20} more")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
