"""The checkpoint engines DeepSpeed saves through, one file per strategy, and what they share."""
