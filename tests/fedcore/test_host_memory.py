"""`fedcore.host_memory`: a process that keeps its freed host memory serves a large tensor from its heap
and keeps the pages once the tensor is freed, so the next one of that size faults none in; the C
library's own policy maps such a tensor afresh and unmaps it. Each case runs in a fresh Python process
(the setting is the process's, for the rest of its life), and reads glibc's own account of its memory
(`mallinfo2`) and the process's page faults, not a time."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import typing

import pytest
import torch

from fedmq.experiments import build, local
from fedmq.experiments.config import SimulationConfig
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.host_memory import HostMemory, set_host_memory
from tests.experiments.test_simulate_cudnn import _config

MIB = 1 << 20
SIZE = 64 * MIB
"""Above glibc's largest mmap threshold (32 MiB), as one layer of a stacked ResNet-18's weights is."""
PAGES = SIZE // os.sysconf("SC_PAGE_SIZE")

PROBE = """
import ctypes, json, resource, sys
import torch
from fedmq.fedcore.host_memory import set_host_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
def info():
    m = libc.mallinfo2()
    return {"heap": m.arena, "mapped": m.hblkhd, "free_in_heap": m.fordblks}
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

taken = set_host_memory(sys.argv[1])
size = int(sys.argv[2])
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = info()
top = libc.malloc(size)  # first, so that nothing lies after it: once freed, the heap's top, which glibc may trim
ctypes.memset(top, 1, size)
top_alive = info()
libc.free(top)
top_freed = info()
first = torch.ones(size, dtype=torch.uint8)  # every page written
alive = info()
del first
freed = info()
for _ in range(10):  # steps: glibc may place the next few above (the alignment's room, small chunks between)
    step = torch.ones(size, dtype=torch.uint8)
    del step
start = faults()
later = torch.ones(size, dtype=torch.uint8)  # a later step's tensor of the same size
again = faults() - start
print(json.dumps({"taken": taken, "before": before, "alive": alive, "freed": freed, "faults_again": again,
                  "top_alive": top_alive, "top_freed": top_freed}))
"""


def probe(mode: str) -> dict[str, typing.Any]:
    """The probe's figures in a fresh process with `mode`."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(SIZE)], capture_output=True, text=True, check=True, timeout=120
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def huge_pages_always() -> bool:
    """Whether the kernel backs every anonymous mapping with transparent huge pages where it can."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return "[always]" in setting.read()
    except OSError:
        return False


needs_glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only: mallinfo2 and mallopt"
)


@needs_glibc
def test_keep_serves_a_large_tensor_from_the_heap_and_keeps_its_pages_once_freed() -> None:
    figures = probe("keep")
    assert figures["taken"] is True
    before, alive, freed = figures["before"], figures["alive"], figures["freed"]
    assert alive["mapped"] - before["mapped"] < SIZE  # not a mapping of its own
    assert alive["heap"] - before["heap"] >= SIZE  # the heap grew to hold it
    assert freed["heap"] == alive["heap"]  # not trimmed once freed
    assert freed["free_in_heap"] >= SIZE  # its pages wait in the heap for the next tensor
    assert figures["faults_again"] < PAGES // 100  # and a later one of its size faults (almost) none in
    top_alive, top_freed = figures["top_alive"], figures["top_freed"]
    assert top_alive["mapped"] == before["mapped"] and top_freed["heap"] == top_alive["heap"]  # the top not trimmed


@needs_glibc
def test_the_c_library_s_own_policy_maps_it_and_unmaps_it() -> None:
    """What `keep` changes: the same probe with glibc's defaults."""
    figures = probe("system")
    assert figures["taken"] is False
    before, alive, freed = figures["before"], figures["alive"], figures["freed"]
    assert alive["mapped"] - before["mapped"] >= SIZE
    assert freed["mapped"] == before["mapped"]  # unmapped on free: the next tensor maps and faults afresh
    if not huge_pages_always():  # else a fresh mapping may fault in 2 MiB at a time
        assert figures["faults_again"] >= PAGES // 2


def test_an_unknown_mode_is_refused_and_the_setting_is_validated() -> None:
    with pytest.raises(ValueError, match="expected keep or system"):
        set_host_memory("free")  # type: ignore[arg-type]
    field = SimulationConfig.model_fields["host_memory"]
    assert typing.get_args(field.annotation) == typing.get_args(HostMemory) and field.default == "keep"
    with pytest.raises(ConfigError, match=r"simulation\.host_memory: Input should be 'keep' or 'system'"):
        _config("simulation.host_memory=free")


def test_the_built_federation_applies_the_config_s_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(local, "set_host_memory", asked.append)
    local.build_local(_config("rounds=1", "simulation.host_memory=system"), device=torch.device("cpu"))
    local.build_local(_config("rounds=1"), device=torch.device("cpu"))
    assert asked == ["system", "keep"]


def test_node_processes_keep_the_c_library_s_policy_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon hands large freed tensors back between tasks by default; `hosting.host_memory: keep` (and
    only the experiment's setting) makes its process keep them, as a simulation does."""
    asked: list[str] = []
    monkeypatch.setattr(build, "set_host_memory", asked.append)
    cpu = torch.device("cpu")
    build.build_nodes(_config(), "mqtt://127.0.0.1:1", ["node-000"], device=cpu)  # never connected: only built
    build.build_nodes(_config("hosting.host_memory=keep"), "mqtt://127.0.0.1:1", ["node-000"], device=cpu)
    assert asked == ["system", "keep"]
    with pytest.raises(ConfigError, match=r"hosting\.host_memory: Input should be 'keep' or 'system'"):
        _config("hosting.host_memory=always")
