"""Runs a coordinator and node daemons as separate processes, as `fedmq run` does, for tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml


class Federation:
    def __init__(self, tmp_path: Path, broker_url: str, config: dict[str, Any]) -> None:
        self.dir = tmp_path
        self.url = broker_url
        self.federation = f"it-{os.urandom(4).hex()}"
        self.config = {"federation": self.federation, **config}
        self.config_path = tmp_path / "exp.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.out = tmp_path / "run"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.coordinator: subprocess.Popen[bytes] | None = None

    def _start(self, args: list[str], log: str, config: Path | None = None) -> subprocess.Popen[bytes]:
        config_path = str(config or self.config_path)
        with (self.dir / log).open("ab") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "experiments", *args, "--config", config_path, "--threads", "1", "-v"],
                stdout=fh, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def start_coordinator(self, *extra: str) -> subprocess.Popen[bytes]:
        self.coordinator = self._start(
            ["coordinator", "--broker", self.url, "--out", str(self.out), *extra], "coordinator.log"
        )
        return self.coordinator

    def start_nodes(
        self, *node_ids: str, log: str | None = None, changes: dict[str, Any] | None = None
    ) -> subprocess.Popen[bytes]:
        """Node daemons for `node_ids` in one process; `changes` start them from an experiment file of
        their own, the federation's with these top-level keys replaced."""
        ids = [a for n in node_ids for a in ("--node-id", n)]
        config = None
        if changes:
            config = self.dir / f"exp-{node_ids[0]}.yaml"
            config.write_text(yaml.safe_dump({**self.config, **changes}))
        args = ["node", "--broker", self.url, *ids, "--exit-when-done"]
        return self._start(args, log or f"{node_ids[0]}.log", config)

    def wait(self, timeout: float = 120) -> int:
        assert self.coordinator is not None
        try:
            code = self.coordinator.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"coordinator did not finish in {timeout} s:\n{self.log('coordinator.log')}") from None
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        return code

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def wait_for_metrics(self, rounds: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.metrics()) >= rounds:
                return
            time.sleep(0.05)
        raise AssertionError(f"fewer than {rounds} rounds logged in {timeout} s:\n{self.log('coordinator.log')}")

    def log(self, name: str) -> str:
        path = self.dir / name
        return path.read_text(errors="replace")[-6000:] if path.exists() else "(no log)"

    def metrics(self) -> list[dict[str, Any]]:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def summary(self) -> dict[str, Any]:
        return json.loads((self.out / "summary.json").read_text())

    def participation(self) -> dict[str, Any]:
        return json.loads((self.out / "participation.json").read_text())


def base_config(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "name": "it",
        "seed": 1,
        "nodes": 4,
        "fraction": 1.0,
        "rounds": 4,
        "deadline_s": 20,
        "data": {"dataset": "digits"},
        "partition": {"kind": "dirichlet", "alpha": 0.5, "min_samples": 10},
        "model": {"name": "mlp", "options": {"hidden": [64]}},
        "train": {"local_epochs": 2, "batch_size": 16, "lr": 0.1, "momentum": 0.5},
        "policy": {"ack_timeout_s": 3},
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config
