"""A fresh interpreter, for what a process imports: standard library only, so that the tests using it
also run on the GPU machine, which lacks most of fedmq's test dependencies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def fresh_python(code: str) -> str:
    """`code` run by a fresh interpreter in the repository (what a daemon's process imports shows in its
    sys.modules): its stdout. A failure fails the test, with the interpreter's stderr."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout
