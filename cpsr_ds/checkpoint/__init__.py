"""Checkpoints and what else is captured for recovery: the engines (engines/), storage (storage/), capture (capture/)."""
