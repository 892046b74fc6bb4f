"""Experiments: the experiment file, the `fedmq` command line, the local runner and its reports."""
