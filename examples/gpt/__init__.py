"""The example the demo, tests and benchmarks train: a small GPT on a text corpus, under DeepSpeed."""
