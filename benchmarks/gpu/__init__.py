"""Measurements on one GPU (``benchmarks/gpu/run.sh`` runs them all): checkpoint stalls, restarts and recovery at
GPT2-0.35B's and GPT3's shapes."""
