"""Helpers and fixtures that several test modules share, by what they build: checkpoints and their engines
(:mod:`support.checkpoints`), engines trained in the test's process (:mod:`support.training`)."""
