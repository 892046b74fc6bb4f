"""Flower ClientApp: one fedmq node's step for the round Flower asks for.

``method = "noop"`` returns the model it received, as fedmq's ``noop`` nodes do, without importing
torch or loading data: what is left of a round is then Flower's own cost, at its lowest.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the node of this SuperNode's partition (Flower counts rounds from 1, fedmq from 0)."""
    partition = int(context.node_config["partition-id"])
    if context.run_config["method"] == "noop":
        # the replies all carry the same model, so their weights do not change the average
        metrics = MetricRecord({"num-examples": 1, "partition-id": partition, "train-loss": 0.0})
        return Message(content=RecordDict({"arrays": msg.content["arrays"], "metrics": metrics}), reply_to=msg)

    from fedmq_flower_app.task import workload

    work = workload(str(context.run_config["workload"]), int(context.run_config["torch-threads"]))
    state = msg.content["arrays"].to_torch_state_dict()
    server_round = int(msg.content["config"]["server-round"])
    result = work.train(work.node_id(partition), state, server_round - 1)
    metrics = MetricRecord({"num-examples": result.num_samples, "partition-id": partition, "train-loss": result.loss})
    return Message(content=RecordDict({"arrays": ArrayRecord(result.state), "metrics": metrics}), reply_to=msg)
