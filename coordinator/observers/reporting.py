"""What a run reports: evaluation of the half's models, summary.json, participation.json and nodes.json.

The engine decides when to evaluate and what each metrics line says; this module computes the
figures (in a worker thread) and writes the files at the end of the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedmq.coordinator.engine.base import Engine
from fedmq.coordinator.registry import NodeRegistry
from fedmq.coordinator.storage.run_dir import RunDir
from fedmq.fedcore.algorithms.base import CoordinatorHalf
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.privacy import NodePrivacy
from fedmq.fedcore.tensors import model_sha256
from fedmq.fedcore.training import evaluate

MEASURED_FIELDS = ("cpu_s",)
"""Metrics-line fields the daemon measures of its own process (CPU seconds so far): no replay or
in-process run reproduces them, so comparisons of metrics lines leave them out."""


def reproducible(metrics: Mapping[str, Any], half: CoordinatorHalf) -> dict[str, Any]:
    """`metrics` without what the run measured of itself (`MEASURED_FIELDS`, the half's own
    `measured_metrics`: wall times): what a replay can compare."""
    measured = {*MEASURED_FIELDS, *half.measured_metrics}
    return {k: v for k, v in metrics.items() if k not in measured}


class Evaluator:
    """Test accuracy and loss of every model the half offers (the first unsuffixed), and their
    validation accuracy when a validation split exists; the final model is chosen on the latter."""

    def __init__(
        self, half: CoordinatorHalf, test: TensorDataset | None, val: TensorDataset | None, device: str = "cpu"
    ) -> None:
        self.half = half
        self.test = test
        self.val = val
        self.device = torch.device(device)
        self.last_models: dict[str, dict[str, float]] = {}
        self._on_device: dict[str, TensorDataset] = {}

    def _there(self, name: str, data: TensorDataset) -> TensorDataset:
        """`data` on the evaluation device, moved there once (compact, as stored: CIFAR's test set is
        30 MiB of uint8) so that each evaluation normalises its batches on the device, not on the host
        before sending them over as float32 (four times the bytes, at every evaluation of every model)."""
        if data.x.device == self.device:
            return data
        if name not in self._on_device:
            self._on_device[name] = data.to(self.device)
        return self._on_device[name]

    def __call__(self) -> dict[str, float]:
        """Runs in a worker thread, while nothing changes the half's models."""
        assert self.test is not None
        test = self._there("test", self.test)
        val = self._there("val", self.val) if self.val is not None else None
        out: dict[str, float] = {}
        models: dict[str, dict[str, float]] = {}
        for i, (name, model) in enumerate(self.half.evaluation_models().items()):
            accuracy, loss = evaluate(model, test, device=self.device)
            suffix = "" if i == 0 else f"_{name}"
            out[f"accuracy{suffix}"] = accuracy
            out[f"loss{suffix}"] = loss
            models[name] = {"test_accuracy": accuracy}
            if val is not None:
                val_accuracy, _ = evaluate(model, val, device=self.device)
                models[name]["val_accuracy"] = out[f"val_accuracy{suffix}"] = val_accuracy
        self.last_models = models
        return out

    def final_model(self) -> dict[str, Any]:
        """The model a user should deploy: the best on the validation split at the last evaluation
        (never chosen on the test set); the first model when there is no validation split."""
        if not self.last_models:
            return {}
        names = list(self.last_models)
        chosen = names[0]
        if self.val is not None:
            chosen = max(names, key=lambda n: (self.last_models[n]["val_accuracy"], -names.index(n)))
        return {
            "final_model": chosen,
            "final_model_accuracy": self.last_models[chosen]["test_accuracy"],
            "models": self.last_models,
        }


def outcome_fields(
    engine: Engine, evaluator: Evaluator | None, half: CoordinatorHalf, node_privacy: NodePrivacy | None = None
) -> dict[str, Any]:
    """What summary.json says of a run's outcome, for a daemon's run and an in-process one alike:
    the engine's counts, final and best accuracy, the model to deploy, the final model's hash."""
    accuracies = engine.accuracies
    return {
        **engine.summary_fields(),
        "final_accuracy": accuracies[-1][1] if accuracies else None,
        "best_accuracy": max((a for _, a in accuracies), default=None),
        **(evaluator.final_model() if evaluator is not None else {}),
        "model_sha256": model_sha256(half.model),
        "participation_totals": participation_totals(engine.participation),
        **privacy_fields(engine, half),
        **({"privacy": node_privacy.summary(engine.participation)} if node_privacy is not None else {}),
    }


def privacy_fields(engine: Engine, half: CoordinatorHalf) -> dict[str, Any]:
    """The privacy spent by the rounds completed, where the averaging rule is a private one (`fedcore.privacy`)."""
    summary = getattr(half.average, "summary", None)
    if summary is None:
        return {}
    completed = engine.summary_fields().get("rounds_completed", 0)
    return {"privacy": summary(int(completed))}


def participation_totals(record: ParticipationRecord) -> dict[str, int]:
    return {
        "accepted": sum(n.count for n in record),
        "late": sum(n.late for n in record),
        "lost": sum(n.lost for n in record),
        "rejected": sum(n.rejected for n in record),
        "failed": sum(n.failed for n in record),
    }


def write_run_files(
    run_dir: RunDir, summary: Mapping[str, Any], record: ParticipationRecord, registry: NodeRegistry
) -> None:
    """summary.json, participation.json and nodes.json, each atomically."""
    run_dir.write_json("summary.json", dict(summary))
    run_dir.write_json("participation.json", record.to_json())
    run_dir.write_json(
        "nodes.json",
        [
            {
                "node_id": n.node_id,
                "online": n.online,
                "device": n.device,
                "num_samples": n.num_samples,
                "label_histogram": n.label_histogram,
            }
            for n in registry.all()
        ],
    )
