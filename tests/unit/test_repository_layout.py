"""The lab's shape: benchmarks are a package with no import cycle and no import-path edits, each benchmark's current
result in its own folder, and tests in tiers that share helpers through conftest.py and support/ only."""

import ast
import os
import re

import pytest

from conftest import ROOT

BENCHMARKS = os.path.join(ROOT, "benchmarks")
TESTS = os.path.join(ROOT, "tests")


def python_files(top: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(top) for f in files if f.endswith(".py"))


def module_name(path: str) -> str:
    name = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
    return name.removesuffix(".__init__")


def imported(path: str) -> set[str]:
    """The modules ``path`` imports, absolute names (``from benchmarks.common import jobs`` names both)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> the modules it imports), or None."""
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        found = next((c for c in map(visit, sorted(graph[module])) if c), None)
        path.pop()
        done.add(module)
        return found

    return next((c for c in map(visit, sorted(graph)) if c), None)


def test_the_benchmarks_import_each_other_without_a_cycle_and_edit_no_import_path():
    files = python_files(BENCHMARKS)
    modules = {module_name(f): f for f in files}
    graph = {m: {n for n in imported(f) if n in modules and n != m} for m, f in modules.items()}
    assert cycle(graph) is None
    assert "benchmarks.common.recovery_jobs" in graph["benchmarks.bench_recovery"]
    edits = [os.path.relpath(f, ROOT) for f in files + [os.path.join(TESTS, "conftest.py")]
             if "sys.path" in open(f).read()]
    assert edits == []


def test_each_benchmark_s_results_are_in_a_folder_of_its_own_named_after_it():
    results = os.path.join(BENCHMARKS, "results")
    loose = [f for f in os.listdir(results) if not os.path.isdir(os.path.join(results, f))]
    assert loose == []
    for folder in os.listdir(results):
        runnable = os.path.join(BENCHMARKS, folder + ".py") if folder != "gpu" else os.path.join(BENCHMARKS, "gpu")
        assert os.path.exists(runnable), f"benchmarks/results/{folder}/ belongs to no benchmark"
        if folder == "gpu":
            continue  # run.py's measurements, by name
        for name in os.listdir(os.path.join(results, folder)):
            assert re.fullmatch(rf"{folder}(_[a-z0-9]+)*\.(json|txt|png)", name), f"{folder}/{name}"


@pytest.mark.parametrize("tier", ["unit", "jobs", "benchmarks"])
def test_test_modules_import_no_other_test_module(tier):
    for path in python_files(os.path.join(TESTS, tier)):
        assert not [n for n in imported(path) if n.split(".")[0].startswith("test_")], os.path.relpath(path, ROOT)


def sleeps(path: str) -> bool:
    """Whether ``path`` calls time.sleep or imports sleep from time."""
    tree = ast.parse(open(path).read())
    return any(isinstance(n, ast.Attribute) and n.attr == "sleep" and getattr(n.value, "id", None) == "time"
               or isinstance(n, ast.ImportFrom) and n.module == "time" for n in ast.walk(tree))


def test_the_unit_tier_starts_no_process_and_never_sleeps():
    """Nor builds a DeepSpeed op (``deepspeed.ops``: ninja's compiler processes on first use)."""
    for path in python_files(os.path.join(TESTS, "unit")):
        names = imported(path)
        ops = [n for n in names if n.startswith("deepspeed.ops")]
        assert not {"subprocess", "multiprocessing"} & names and not ops and not sleeps(path), os.path.relpath(path, ROOT)


def test_helper_scripts_are_not_named_like_tests_and_sit_beside_the_tests_that_run_them():
    for path in python_files(os.path.join(TESTS, "jobs")):
        name = os.path.basename(path)
        if name.startswith("test_"):
            continue
        users = [t for t in python_files(TESTS) if os.path.basename(t).startswith("test_") and name in open(t).read()]
        assert users and all(os.path.dirname(t) == os.path.dirname(path) for t in users), name
