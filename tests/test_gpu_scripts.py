"""The GPU device scripts (benchmarks/run_gpu.sh and benchmarks/stages/*.sh), checked on the CPU: a GPU session has
30 minutes and one call is 600 s, so a script that breaks on a typo, names a flag or a file that does not exist, or
runs past the call's limit costs a whole iteration there."""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = sorted((ROOT / "benchmarks" / "stages").glob("*.sh"))
SCRIPTS = [ROOT / "benchmarks" / "run_gpu.sh", ROOT / "benchmarks" / "w4a16_ptxas.sh", *STAGES]


def _commands(path: Path) -> list[str]:
    """The script's lines with backslash continuations joined."""
    return path.read_text().replace("\\\n", " ").splitlines()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_budget_cuts_timeouts_and_skips_steps():
    def run(body: str, budget_s: int, skip: str = "") -> list[str]:
        env = {**os.environ, "LQE_BUDGET_S": str(budget_s), "LQE_SKIP": skip}
        out = subprocess.run(["bash", "-c", f"source benchmarks/stages/budget.sh; {body}"], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True)
        return out.stdout.split()

    assert run("budget 100", 570) == ["100"]  # a step's own limit when the budget has room
    assert int(run("budget 900", 570)[0]) in (564, 565)  # else what is left, 5 s kept for the summary
    assert run("budget 100", 3) == ["1"]  # never 0 or negative (timeout 0 would mean no limit)
    assert run("skip tests && echo yes || echo no", 570) == ["no"]
    assert run("skip tests && echo yes || echo no", 570, skip="kernels tests") == ["yes"]
    assert run("skip tests && echo yes || echo no", 20)[-1] == "yes"  # under 30 s left: skipped, and it says why


@pytest.mark.parametrize("script", [ROOT / "benchmarks" / "run_gpu.sh", *STAGES], ids=lambda p: p.name)
def test_every_timeout_is_cut_to_the_budget(script):
    raw = [line.strip() for line in _commands(script) if re.search(r"\btimeout\s", line)
           and not line.lstrip().startswith("#") and 'timeout "$(budget ' not in line]
    assert not raw, f"{script.name}: a timeout outside the stage budget (use \"$(budget N)\"): {raw}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_named_files_exist(script):
    text = "\n".join(line for line in script.read_text().splitlines() if not line.lstrip().startswith("#"))
    named = set(re.findall(r"\b((?:tests|benchmarks)/[\w/.-]+\.(?:py|sh))", text))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{script.name} names files that do not exist: {missing}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_python_flags_exist(script):
    """Every --flag a script passes to ``python benchmarks/X.py`` is one X.py's argument parser defines, and every
    shape / variant / method it names is one X.py knows."""
    bad = []
    for line in _commands(script):
        for m in re.finditer(r"python (benchmarks/\w+\.py)([^|;>&]*)", line):
            source = (ROOT / m.group(1)).read_text()
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(2)):
                if f'"{flag}"' not in source:
                    bad.append(f"{m.group(1)} {flag}")
            for flag, names in re.findall(r"(--variants|--methods|--shape|--shapes) ([\w.,+-]+)", m.group(2)):
                bad += [f"{m.group(1)} {flag} {n}" for n in names.split(",") if f'"{n}"' not in source
                        and not re.fullmatch(r"\d+x\d+", n)]  # kernels.py --shapes KxN
    assert not bad, f"{script.name} passes flags the scripts do not define: {bad}"
