"""The run directory: metrics, participation, summary and checkpoints, each written atomically.

Checkpoints are safetensors files (tensors plus a JSON string in the metadata): no pickle is needed
to read them back, and any safetensors reader can open them.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fedmq.coordinator.errors import CoordinatorError
from fedmq.coordinator.storage.eventlog import FILENAME as EVENT_LOG

CHECKPOINT = "checkpoint.safetensors"


def _atomic_write(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """`text` into `path` atomically: a process reading it meanwhile (a node host reading the run's
    config.yaml while the coordinator writes it again) sees the old file or the new, never an empty one."""
    _atomic_write(path, lambda tmp: tmp.write_text(text))


def write_json(path: Path, data: Any) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n"))


def _whole_lines(text: str) -> list[str]:
    """The non-empty lines of a record log, less a last line a killed run left half-written."""
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except ValueError:
            lines.pop()
    return [line for line in lines if line]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines log; a torn last line (a crash mid-write) is left out."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


class RunDir:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.root / "metrics.jsonl"

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        self.append_records("metrics", [record])

    def append_records(self, name: str, records: Sequence[Mapping[str, Any]]) -> None:
        """Append `records` (each with a "round") to ``<name>.jsonl``: metrics, KDIA's teacher weights."""
        if not name.isidentifier():
            raise ValueError(f"a record log needs a plain name, not {name!r}")
        with (self.root / f"{name}.jsonl").open("a") as fh:
            fh.write("".join(json.dumps(record, sort_keys=True) + "\n" for record in records))

    def truncate_metrics_after(self, round: int) -> None:
        """On resume, drop lines of rounds after the checkpoint from every record log (metrics and
        the algorithm's), so no round appears twice."""
        for path in sorted(self.root.glob("*.jsonl")):
            if path.name == EVENT_LOG:
                continue  # not a record log: the resumed run appends to it after a line that says so
            kept = [line for line in _whole_lines(path.read_text()) if json.loads(line)["round"] <= round]
            _atomic_write(path, lambda tmp, kept=kept: tmp.write_text("".join(f"{line}\n" for line in kept)))

    def write_json(self, name: str, data: Any) -> None:
        write_json(self.root / name, data)

    def save_checkpoint(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Write atomically; the caller's tensors must not change during the call (the coordinator
        passes copies, so that the next round can run meanwhile)."""
        flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        _atomic_write(
            self.root / CHECKPOINT, lambda tmp: save_file(flat, str(tmp), metadata={"fedmq": json.dumps(meta)})
        )

    def load_checkpoint(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        path = self.root / CHECKPOINT
        if not path.exists():
            return None
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as fh:
                meta = json.loads((fh.metadata() or {})["fedmq"])
            return load_file(str(path)), meta
        except (SafetensorError, KeyError, ValueError, OSError) as exc:
            raise CoordinatorError(f"checkpoint {path} cannot be read ({exc}); move it away to start afresh") from exc
