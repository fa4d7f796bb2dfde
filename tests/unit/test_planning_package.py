"""cpsr_ds/planning/ reads one job per module: none over 500 lines, and one Eq. 8 fit for the planner and recovery."""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules(*parts):
    return sorted(glob.glob(os.path.join(ROOT, "cpsr_ds", *parts, "*.py"), recursive=True))


def test_no_planning_module_is_over_500_lines():
    lengths = {os.path.basename(path): sum(1 for _ in open(path)) for path in modules("planning")}
    assert lengths and {name: n for name, n in lengths.items() if n > 500} == {}


def test_the_accuracy_curve_is_fitted_in_one_place():
    """Eq. 8 fitted from held-out errors once (fitter.accuracy_fit), not again by the planner or recovery."""
    fits = []
    for path in modules("**"):
        with open(path) as fh:
            tree = ast.parse(fh.read())
        fits += [os.path.relpath(path, ROOT) for node in ast.walk(tree)
                 if isinstance(node, ast.FunctionDef) and node.name == "accuracy_fit"]
    assert fits == [os.path.join("cpsr_ds", "planning", "fitter.py")]
