"""The README's Python example runs as written (the demo model, on CPU) and prints what it says it prints."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _python_blocks() -> list[str]:
    with open(README, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


@pytest.mark.slow
def test_readme_python_example_runs_as_written(tmp_path):
    block = _python_blocks()[0]
    assert 'LLM("smollm2-135m-instruct")' in block
    script = tmp_path / "readme_example.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "Paris" in out  # the greedy completion of "The capital of France is" (float and int8)
    assert out.count("Paris") >= 2
