"""Runs a coordinator and node daemons as separate processes, as `fedmq run` does, for tests."""

from __future__ import annotations

import json
import os
import pwd
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
                [sys.executable, "-m", "fedmq", *args, "--config", config_path, "--threads", "1", "-v"],
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
        "rounds": 4,
        "data": {"dataset": "digits"},
        "partition": {"kind": "dirichlet", "alpha": 0.5, "min_samples": 10},
        "model": {"name": "mlp", "options": {"hidden": [64]}},
        "train": {"local_epochs": 2, "batch_size": 16, "lr": 0.1, "momentum": 0.5},
        "policy": {"fraction": 1.0, "deadline_s": 20, "ack_timeout_s": 3},
    }
    for name in ("fraction", "deadline_s"):  # the policy's, given on their own for short
        if name in changes:
            changes["policy"] = {**changes.get("policy", {}), name: changes.pop(name)}
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


class Hierarchy(Federation):
    """A hierarchical federation as processes: a central mosquitto with the coordinator, and per site a
    mosquitto bridged to it (`broker.servers.bridge`), its aggregator worker(s) and one node host for its nodes."""

    def __init__(self, tmp_path: Path, config: dict[str, Any]) -> None:
        from fedmq.broker.servers.mosquitto import free_port, render_config, start_mosquitto

        tmp_path.mkdir(parents=True, exist_ok=True)
        self.central_port = free_port()
        central = tmp_path / "central.conf"
        central.write_text(render_config(port=self.central_port))
        self.brokers: dict[str, subprocess.Popen[bytes]] = {
            "central": start_mosquitto(self.central_port, config_file=central)
        }
        super().__init__(tmp_path, f"mqtt://127.0.0.1:{self.central_port}", config)
        self.site_ports: dict[str, int] = {}
        self.site_configs: dict[str, Path] = {}

    def start_site_broker(self, site: str) -> str:
        from fedmq.broker.servers.bridge import render_site_config
        from fedmq.broker.servers.mosquitto import free_port, start_mosquitto

        port = self.site_ports.setdefault(site, free_port())
        state = self.dir / "brokers" / site
        state.mkdir(parents=True, exist_ok=True)
        path = self.site_configs[site] = state / "mosquitto.conf"
        path.write_text(
            render_site_config(
                port=port, central=("127.0.0.1", self.central_port), federation=self.federation, site=site,
                persistence_dir=state.resolve(), user=pwd.getpwuid(os.geteuid()).pw_name,
            )
        )  # fmt: skip
        self.brokers[site] = start_mosquitto(port, config_file=path)
        return f"mqtt://127.0.0.1:{port}"

    def restart_site_broker(self, site: str, down_s: float = 0.5) -> None:
        """SIGTERM (mosquitto saves its sessions and queues), a pause, the same config again."""
        from fedmq.broker.servers.mosquitto import start_mosquitto

        proc = self.brokers[site]
        proc.terminate()
        proc.wait(10)
        time.sleep(down_s)
        self.brokers[site] = start_mosquitto(self.site_ports[site], config_file=self.site_configs[site])

    def start_site(self, site: str, node_ids: list[str], *, workers: int = 1) -> list[subprocess.Popen[bytes]]:
        url = self.start_site_broker(site)
        aggregators = []
        for worker in range(workers):
            out = self.out / "sites" / (site if workers == 1 else f"{site}-w{worker}")
            args = ["aggregator", "--broker", url, "--site", site, "--worker", str(worker), "--out", str(out)]
            aggregators.append(self._start([*args, "--exit-when-done"], f"aggregator-{site}-{worker}.log"))
        ids = [a for n in node_ids for a in ("--node-id", n)]
        args = ["node", "--broker", url, "--federation", f"{self.federation}.{site}", *ids, "--exit-when-done"]
        self._start(args, f"nodes-{site}.log")
        return aggregators

    def site_metrics(self, name: str) -> list[dict[str, Any]]:
        path = self.out / "sites" / name / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        super().stop()
        for proc in self.brokers.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
