"""The tutorials' code runs as the pages show it.

A fenced ``bash`` or ``python`` block on a tutorial page (docs/tutorials/*.md) is preceded by a marker
line, an HTML comment that the site does not show:
- ``<!-- test: run -->``: this test runs it, in page order, in an empty folder of its own per page
  (``experiments/`` there is the repository's, so the pages' paths work as in a checkout; the
  environment's ``bin`` comes first on PATH, so ``fedmq`` is the one under test). A bash block runs
  with ``set -euo pipefail``; a python block runs in fresh globals (it holds its own imports), in one
  interpreter a page so that torch is imported once. ``PORT`` is a free port, for a page that starts
  a broker.
- ``<!-- test: file PATH -->``: the block is a file the page asks the reader to write; the test writes
  it at PATH (relative, inside the page's folder) when it gets there.
- ``<!-- test: show (why) -->``: shown only, with the reason (it installs, or needs a GPU).
A block with neither fails the test, so no command on a tutorial page goes untested by accident.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fedmq.broker.servers.mosquitto import free_port

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
MARKER = re.compile(r"<!--\s*test:\s*(run|show|file)\b(.*?)-->")
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    language: str
    marker: str | None  # "run", "show", "file" or None
    reason: str  # show: why; file: the path
    code: str


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a page, with the marker on the line right above it (blank lines between
    allowed)."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    marker: tuple[str, str] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = MARKER.search(line)
        if m:
            marker = (m.group(1), m.group(2).strip())
            i += 1
            continue
        fence = FENCE.match(line.strip())
        if fence:
            close, start = fence.group(1), i
            body: list[str] = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(close):
                body.append(lines[i])
                i += 1
            kind, reason = marker or (None, "")
            found.append(Block(path.name, start + 1, fence.group(2), kind, reason, "\n".join(body) + "\n"))
            marker = None
        elif line.strip():
            marker = None  # a marker belongs to the block right below it
        i += 1
    return found


def test_every_block_is_marked() -> None:
    assert TUTORIALS, "no tutorial pages found"
    unmarked = [
        f"{b.page}:{b.line}"
        for page in TUTORIALS
        for b in blocks(page)
        if b.language in ("bash", "sh", "shell", "python", "py") and b.marker is None
    ]
    assert not unmarked, f"blocks without <!-- test: run --> or <!-- test: show (why) -->: {unmarked}"
    unexplained = [
        f"{b.page}:{b.line}" for page in TUTORIALS for b in blocks(page) if b.marker == "show" and not b.reason
    ]
    assert not unexplained, f"<!-- test: show --> without a reason: {unexplained}"
    unnamed = [f"{b.page}:{b.line}" for page in TUTORIALS for b in blocks(page) if b.marker == "file" and not b.reason]
    assert not unnamed, f"<!-- test: file --> without a path: {unnamed}"
    executed = [b for b in blocks(ROOT / "docs" / "tutorials" / "first-federation.md") if b.marker == "run"]
    assert executed, "the first tutorial runs nothing"


PYTHON_HOST = r"""
import json, sys, traceback
for line in sys.stdin:
    block = json.loads(line)
    status = "ok"
    try:
        exec(compile(block["code"], block["name"], "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        status = "ok" if exc.code in (None, 0) else "failed"
    except BaseException:
        traceback.print_exc()
        status = "failed"
    sys.stdout.flush()
    sys.stderr.flush()
    print("\0" + status, flush=True)
"""
"""Runs a page's python blocks one after the other in one interpreter (torch and fedmq are imported
once a page, not once a block), each in fresh globals: a block must import what it uses, as a reader
pasting it into a new interpreter would."""


class Python:
    """The interpreter a page's python blocks run in, started in the page's folder."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", PYTHON_HOST],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def run(self, block: Block) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"code": block.code, "name": f"{block.page}:{block.line}"}) + "\n")
        self.process.stdin.flush()
        output: list[str] = []
        for line in self.process.stdout:
            if line.startswith("\0"):
                assert line.strip("\0\n") == "ok", (
                    f"{block.page}:{block.line} failed\n{block.code}\n{''.join(output)[-4000:]}"
                )
                return
            output.append(line)
        raise AssertionError(f"{block.page}:{block.line}: the interpreter exited\n{''.join(output)[-4000:]}")

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def _bash(block: Block, cwd: Path, env: dict[str, str]) -> None:
    argv = ["bash", "-euo", "pipefail", "-c", block.code]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (
        f"{block.page}:{block.line} exited {done.returncode}\n{block.code}\n"
        f"--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-3000:]}"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", [p for p in TUTORIALS if any(b.marker == "run" for b in blocks(p))], ids=lambda p: p.stem
)
def test_tutorial_runs(page: Path, tmp_path: Path) -> None:
    (tmp_path / "experiments").symlink_to(ROOT / "experiments", target_is_directory=True)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["MPLBACKEND"] = "Agg"
    env["PORT"] = str(free_port())  # for a page that starts a broker of its own
    env.pop("FEDMQ_LOG_FORMAT", None)
    python = Python(tmp_path, env)
    try:
        for block in blocks(page):
            if block.marker == "run" and block.language in ("python", "py"):
                python.run(block)
            elif block.marker == "run" and block.language in ("bash", "sh", "shell"):
                _bash(block, tmp_path, env)
            elif block.marker == "run":
                raise AssertionError(f"{block.page}:{block.line}: cannot run a {block.language!r} block")
            elif block.marker == "file":
                path = (tmp_path / block.reason).resolve()
                assert block.reason and path.is_relative_to(tmp_path.resolve()), f"{block.page}:{block.line}: bad path"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(block.code)
    finally:
        python.close()
