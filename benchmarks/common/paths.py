"""Where the benchmarks find the repository and write their results."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def result_path(benchmark: str, ext: str, quick: bool = False, variant: str = "") -> str:
    """``benchmarks/results/<benchmark>/<benchmark>[_<variant>][_quick].<ext>``: where a run writes by default, so
    that the current result of each benchmark (and of its --quick mode) is one file per kind."""
    name = benchmark + (f"_{variant}" if variant else "") + ("_quick" if quick else "")
    return os.path.join(RESULTS, benchmark, f"{name}.{ext}")


def with_default_outputs(args, benchmark: str, variant: str = "", plot: bool = False):
    """``args`` with ``json`` (and, with ``plot``, ``plot``) at :func:`result_path` where the command named no
    output at all; a command that names one writes only what it names."""
    if args.json is None and getattr(args, "plot", None) is None:
        args.json = result_path(benchmark, "json", getattr(args, "quick", False), variant)
        if plot:
            args.plot = result_path(benchmark, "png", getattr(args, "quick", False), variant)
    return args
