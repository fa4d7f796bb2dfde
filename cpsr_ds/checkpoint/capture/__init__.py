"""What is captured for recovery besides checkpoints: survivor dumps, host snapshots, the exit path, the journal."""
