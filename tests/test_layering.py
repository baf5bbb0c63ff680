"""The package's import directions (DESIGN.md layout): layers never import the engine, kernels never import
quant layers, layers or the engine (shared types such as CanonicalWeight live in lqe/kernels), and the forward context sits at the package top level where both can reach it."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "lqe"

FORBIDDEN = {  # package -> packages its modules must not import
    "layers": ("lqe.engine", "lqe.entrypoints", "lqe.llm"),
    "kernels": ("lqe.engine", "lqe.layers", "lqe.quant_layers", "lqe.loaders", "lqe.entrypoints", "lqe.models", "lqe.llm"),
    "quant_layers": ("lqe.engine", "lqe.entrypoints", "lqe.models", "lqe.llm"),
    "models": ("lqe.engine", "lqe.entrypoints", "lqe.llm"),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_directions(package):
    bad = []
    for path in sorted((PKG / package).rglob("*.py")):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(PKG.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_gpu_tests_live_in_tests_gpu():
    """benchmarks/run_gpu.sh runs ``pytest -m gpu tests/gpu``: a gpu-marked test elsewhere would never run."""
    tests = PKG.parent / "tests"
    stray = [str(p.relative_to(tests)) for p in tests.rglob("*.py")
             if "gpu" not in p.relative_to(tests).parts[:1] and p.name != "test_layering.py"
             and "mark." + "gpu" in p.read_text()]
    assert not stray, stray
