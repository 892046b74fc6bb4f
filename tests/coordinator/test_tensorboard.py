"""TensorBoard scalars of the metrics lines (`--tensorboard`), read back with TensorBoard's own reader;
without tensorboard installed, a configuration error that says what to install (the command line's
exit code 2 is tested in tests/integration/test_metrics_scrape.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.observers.tensorboard import check_installed, scalars
from fedmq.fedcore.errors import ConfigError

SYNC = [
    {"round": 0, "attempt": 0, "selected": list("abc"), "accepted": list("abc"), "carried": [], "late": [],
     "lost": [], "rejected": [], "failed": [], "live": 3, "aggregated": True, "train_loss": 0.75,
     "accuracy": 0.5, "loss": 1.5, "round_seconds": 2.25, "ended_s": 2.25, "model_version": 1},
    {"round": 1, "attempt": 0, "selected": list("abc"), "accepted": ["a"], "carried": [], "late": ["b"],
     "lost": ["c"], "rejected": [], "failed": [], "live": 2, "aggregated": True, "round_seconds": 10.0,
     "ended_s": 12.25, "model_version": 2},
]  # fmt: skip
ASYNC = {"round": 3, "version": 4, "folded": ["a", "b"], "stale": 1, "expired": 0, "lost": 2, "rejected": 0,
         "failed": 0, "aggregated": True, "flush": False, "staleness_mean": 0.5, "staleness_max": 1,
         "in_flight": 3, "buffered": 1, "live": 5, "round_seconds": 0.125, "ended_s": 9.0, "model_version": 4}  # fmt: skip


def test_scalars_of_a_sync_line_count_nodes_by_outcome_and_keep_its_numbers() -> None:
    """Lists become counts under updates/ and nodes/; numbers keep their name; bookkeeping is left out."""
    assert scalars(SYNC[1]) == {
        "nodes/selected": 3.0, "updates/accepted": 1.0, "updates/carried": 0.0, "updates/late": 1.0,
        "updates/lost": 1.0, "updates/rejected": 0.0, "updates/failed": 0.0, "nodes/live": 2.0,
        "round_seconds": 10.0,
    }  # fmt: skip


def test_scalars_of_an_async_line_take_its_counts_and_folded_as_accepted() -> None:
    assert scalars(ASYNC) == {
        "updates/accepted": 2.0, "updates/stale": 1.0, "updates/expired": 0.0, "updates/lost": 2.0,
        "updates/rejected": 0.0, "updates/failed": 0.0, "staleness_mean": 0.5, "staleness_max": 1.0,
        "nodes/in_flight": 3.0, "updates/buffered": 1.0, "nodes/live": 5.0, "round_seconds": 0.125,
    }  # fmt: skip


def test_tensorboard_watcher_writes_each_line_at_its_round_or_version(tmp_path: Path) -> None:
    """Sync lines at their round, an async line at its version; TensorBoard reads back every value."""
    pytest.importorskip("tensorboard", reason="pip install 'fedmq[tensorboard]' for this test")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedmq.coordinator.observers.tensorboard import TensorBoardScalars

    def read(path: Path) -> dict[str, list[tuple[int, float]]]:
        events = EventAccumulator(str(path))
        events.Reload()
        return {tag: [(s.step, s.value) for s in events.Scalars(tag)] for tag in events.Tags()["scalars"]}

    watcher = TensorBoardScalars(tmp_path / "sync")
    for record in SYNC:
        watcher(0.0, e.Tick(), [c.Record(record)])
    watcher(1.0, e.Tick(), [c.Finish("finished")])
    written = read(tmp_path / "sync")  # Finish flushed it: readable before close
    watcher.close()
    assert written["accuracy"] == [(0, 0.5)] and written["loss"] == [(0, 1.5)] and written["train_loss"] == [(0, 0.75)]
    assert written["updates/accepted"] == [(0, 3.0), (1, 1.0)] and written["updates/late"] == [(0, 0.0), (1, 1.0)]
    assert written["round_seconds"] == [(0, 2.25), (1, 10.0)] and written["nodes/live"] == [(0, 3.0), (1, 2.0)]
    assert set(written) == set(scalars(SYNC[0]))
    watcher = TensorBoardScalars(tmp_path / "async")
    watcher(0.0, e.Tick(), [c.Record(ASYNC)])
    watcher.close()
    written = read(tmp_path / "async")
    assert written == {tag: [(4, v)] for tag, v in scalars(ASYNC).items()}, "not at the version"


@pytest.fixture
def no_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import tensorboard` fails, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)


def test_check_installed_without_tensorboard_says_what_to_install(no_tensorboard: None) -> None:
    with pytest.raises(ConfigError, match=r"pip install 'fedmq\[tensorboard\]'"):
        check_installed()
