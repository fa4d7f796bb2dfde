"""What is captured for recovery besides checkpoints: the journal, survivor dumps, host snapshots, rng, the exit path."""
