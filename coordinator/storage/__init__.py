"""What a run keeps on disk: its directory (`run_dir`), checkpoints and their persistence, the
event log, and the model versions an update may still be based on."""
