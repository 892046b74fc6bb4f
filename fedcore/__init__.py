"""What both daemons share: models, datasets, partitions, training loops and the algorithms."""
