"""Checkpoint side effects: the progress journal and (with the checkpoint engine) storage."""
