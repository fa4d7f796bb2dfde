"""The measurements behind the project's figures, each run from the repository root as ``python -m benchmarks.NAME``.

Code that several benchmarks share is in :mod:`benchmarks.common`; each benchmark writes its current result
into ``benchmarks/results/NAME/`` (``RESULTS.md`` lists the headline figures).
"""
