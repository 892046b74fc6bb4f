"""The coordinator daemon: node registry, participation record, rounds, aggregation, checkpoints."""
