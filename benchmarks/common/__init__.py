"""Code that several benchmarks share."""
