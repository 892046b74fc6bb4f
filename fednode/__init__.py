"""The node daemon: announces itself, waits for tasks, trains with an algorithm's node half."""
