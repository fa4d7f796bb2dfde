"""The shape of cpsr_ds/checkpoint/: one job per module, storage's file-system effects in one place, no import of
recovery."""

import ast
import pathlib

CHECKPOINT = pathlib.Path(__file__).resolve().parents[2] / "cpsr_ds" / "checkpoint"
MODULES = sorted(CHECKPOINT.rglob("*.py"))
FILESYSTEM = CHECKPOINT / "storage" / "filesystem.py"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _calls(path: pathlib.Path) -> set[str]:
    """``os.fsync``, ``os.O_DIRECT``, ...: every ``os`` attribute the module names."""
    tree = ast.parse(path.read_text())
    return {f"os.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"}


def test_the_three_packages_hold_every_module():
    assert {p.parent.name for p in MODULES if p.parent != CHECKPOINT} == {"engines", "storage", "capture"}
    assert [p.name for p in MODULES if p.parent == CHECKPOINT] == ["__init__.py"]


def test_no_module_over_500_lines():
    long = {str(p.relative_to(CHECKPOINT)): n for p in MODULES if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_nothing_in_checkpoint_imports_recovery():
    offenders = {str(p.relative_to(CHECKPOINT)): sorted(m for m in _imports(p) if m.startswith("cpsr_ds.recovery"))
                 for p in MODULES}
    assert {p: m for p, m in offenders.items() if m} == {}


def test_durable_writes_go_through_the_one_file_system_interface():
    durable = {"os.fsync", "os.O_DIRECT", "os.link"}
    offenders = {str(p.relative_to(CHECKPOINT)): sorted(_calls(p) & durable) for p in MODULES if p != FILESYSTEM}
    assert {p: c for p, c in offenders.items() if c} == {}
    assert durable <= _calls(FILESYSTEM)
