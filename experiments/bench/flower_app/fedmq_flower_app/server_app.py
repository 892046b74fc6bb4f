"""Flower ServerApp: Flower's FedAvg strategy loop, with fedmq's aggregation and evaluation.

It records, for the suite, when each round's global model was evaluated and its accuracy, as JSON
lines in the run config's ``results`` file (wall-clock times: the suite compares them with when it
launched the run).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedmq.experiments.bench.flower_workload import NodeResult, Workload
from fedmq_flower_app.task import workload

app = ServerApp()


class FedmqFedAvg(FedAvg):
    """Flower's FedAvg whose averaging step is fedmq's (node-id order, `weighted_average`). A failed or
    missing reply stops the run: the comparison is only fair when both sides average every node."""

    def __init__(self, work: Workload) -> None:
        n = len(work.node_ids)
        super().__init__(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n)
        self.work = work

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, errors = self._check_and_log_replies(replies, is_train=True)
        if errors or len(valid) != len(self.work.node_ids):
            reasons = "; ".join(m.error.reason for m in errors)
            raise RuntimeError(
                f"round {server_round}: {len(valid)} of {len(self.work.node_ids)} nodes replied ({reasons})"
            )
        results = [
            NodeResult(
                node_id=self.work.node_id(int(m.content["metrics"]["partition-id"])),
                state=dict(m.content["arrays"].to_torch_state_dict()),
                num_samples=int(m.content["metrics"]["num-examples"]),
                loss=float(m.content["metrics"]["train-loss"]),
            )
            for m in valid
        ]
        total = sum(r.num_samples for r in results)
        loss = sum(r.loss * r.num_samples for r in results) / total
        return ArrayRecord(self.work.aggregate(results)), MetricRecord({"train-loss": loss})


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    work = workload(str(config["workload"]), int(config["torch-threads"]))
    if config["method"] != work.cfg.method.name:
        raise ValueError(f"run config method {config['method']!r} is not the workload's {work.cfg.method.name!r}")
    results = Path(str(config["results"]))

    def record(**fields: object) -> None:
        with results.open("a") as out:
            out.write(json.dumps({"time": time.time(), **fields}) + "\n")

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if server_round == 0:  # the initial model: rounds start now
            record(event="start")
            return MetricRecord({})
        accuracy, loss = work.evaluate(dict(arrays.to_torch_state_dict()))
        record(event="round", round=server_round - 1, accuracy=accuracy, loss=loss)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    FedmqFedAvg(work).start(
        grid=grid,
        initial_arrays=ArrayRecord(work.initial_state()),
        num_rounds=work.cfg.rounds,
        evaluate_fn=evaluate,
    )
    record(event="done")
