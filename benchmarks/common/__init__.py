"""What several benchmarks share: the repository's paths, training jobs in forked children, processes started and
reaped in groups, and bench_recovery's cases and multi-process layouts."""
