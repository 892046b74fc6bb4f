"""Compressed updates over each real broker: the quickstart with int8 blocks of deltas runs to the end
through the daemons, the coordinator receives fewer bytes than the updates' raw float32 tensors
alone would take, and `fedmq replay` recomputes every compressed update bit for bit in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 4
MODEL_BYTES = 38_282 * 4
"""The quickstart CNN's float32 parameters (tests/fedcore/test_core.py counts them)."""


def _fedmq(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "fedmq", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


def test_int8_block_quickstart_over_a_broker_shrinks_the_updates_and_replays(broker_url: str, tmp_path: Path) -> None:
    """Four quickstart rounds with compression.mode int8-block: every update accepted, each a little
    over a quarter of the float32 model, the coordinator's bytes in below the raw updates' size, and
    the run replayed to the final model's hash."""
    out = tmp_path / "run"
    done = _fedmq(
        "run", str(ROOT / "experiments" / "quickstart.yaml"), "--set", f"rounds={ROUNDS}",
        "--set", "compression.mode=int8-block", "--broker", broker_url, "--out", str(out), "--processes", "2",
        "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["rounds_completed"] == ROUNDS
    assert summary["bus"]["rejected"] == {}

    lines = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    updates = [x for x in lines if x.get("ev") == "UpdateArrived"]
    refused = [x for x in lines if x.get("cmd") == "Refused"]
    assert len(updates) == 5 * ROUNDS and refused == []
    for update in updates:
        assert update["meta"]["compression"] == {"mode": "int8-block", "delta": True, "block": 256}
        assert MODEL_BYTES / 4 < update["bytes"] < 0.27 * MODEL_BYTES  # int8 codes and one scale per 256
    # everything the coordinator received (updates, acknowledgements, statuses) is less than the
    # updates' float32 tensors alone would have been
    assert summary["bus"]["bytes_in"] < len(updates) * MODEL_BYTES

    replayed = _fedmq("replay", str(out), "--out", str(tmp_path / "replay"))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    report = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert report["ok"] and report["final_model_sha256"] == summary["model_sha256"]
    assert report["updates_matched"] == len(updates)
