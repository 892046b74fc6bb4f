"""Resident memory of a benchmark's processes (the broker, the coordinator, the node hosts), sampled
from /proc while a federation runs. Linux only, like the rest of the suite's process handling."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

ROLES = ("node-hosts", "coordinator", "broker")


class ProcStat(NamedTuple):
    ppid: int
    started: int
    """Start time in clock ticks since boot: with the pid, names one process (pids are reused)."""
    state: str
    """R, S, D, Z (a zombie), ..."""


def proc_stat(pid: int) -> ProcStat | None:
    """Fields of /proc/PID/stat; None once the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return ProcStat(int(fields[1]), int(fields[19]), fields[0])
    except (OSError, IndexError, ValueError):
        return None


def self_status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now; VmHWM: the peak since start or the
    last reset through /proc/self/clear_refs)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) is not None:
            children[stat.ppid].append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def role(pid: int) -> str | None:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [w.decode(errors="replace") for w in cmd]
    if any(w.endswith("mosquitto") for w in words[:1]) or "broker" in words[2:4]:
        return "broker"
    if "node" in words[2:4]:
        return "node-hosts"
    if "coordinator" in words[2:4]:
        return "coordinator"
    return None


class MemorySampler:
    """Every `interval_s`, the summed RSS of each role below this process; keeps each role's peak."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.peak: dict[str, int] = dict.fromkeys(ROLES, 0)
        self.last: dict[str, int] = dict.fromkeys(ROLES, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="memory-sampler")

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> dict[str, int]:
        totals = dict.fromkeys(ROLES, 0)
        for pid in descendants(os.getpid()):
            which = role(pid)
            if which is not None:
                totals[which] += rss_bytes(pid)
        return totals

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            totals = self.sample()
            if totals["node-hosts"]:
                self.last = totals
            for name, value in totals.items():
                self.peak[name] = max(self.peak[name], value)
