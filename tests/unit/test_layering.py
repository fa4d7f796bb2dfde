"""The package's layering: DeepSpeed's private API used in one package only, nothing in checkpoint/ reaching up
into recovery/, and ``engine.cpsr`` the only attribute CPSR sets on an engine."""

import ast
import pathlib

from benchmarks.common.processes import tiny_config
from conftest import ROOT
from support.training import build, process_group, random_batches  # noqa: F401 (process_group: the autouse fixture)

PACKAGE = pathlib.Path(ROOT) / "cpsr_ds"
INTEGRATION = PACKAGE / "integration" / "deepspeed"
PRIVATE = ("_INSTRUCTION_MAP", "_take_model_step", "_load_zero_checkpoint", "create_checkpoint_engine")


def modules(under: pathlib.Path) -> list[pathlib.Path]:
    return sorted(under.rglob("*.py"))


def imported(path: pathlib.Path) -> set[str]:
    """The modules ``path`` imports, by their full names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return names


def test_deepspeeds_private_names_are_used_in_the_integration_package_only():
    outside = {str(path.relative_to(ROOT)): [name for name in PRIVATE if name in path.read_text()]
               for path in modules(PACKAGE) if INTEGRATION not in path.parents}
    assert {path: names for path, names in outside.items() if names} == {}


def test_nothing_in_checkpoint_imports_recovery():
    found = {str(path.relative_to(ROOT)): sorted(n for n in imported(path) if n.startswith("cpsr_ds.recovery"))
             for path in modules(PACKAGE / "checkpoint")}
    assert {path: names for path, names in found.items() if names} == {}


def test_engine_cpsr_is_the_only_attribute_cpsr_sets_on_an_engine(tmp_path):
    """An engine of cpsr_ds.initialize, trained with checkpoints, host snapshots and survivor dumps on, holds the
    attributes of DeepSpeed's own engine that did the same training and saving, and ``cpsr``."""
    config = tiny_config(tmp_path / "run", stages=1)
    config["cpsr"]["checkpoint"].update(interval=2, memory_interval=2, survivor_dir=str(tmp_path / "survivors"))
    ours, *_ = build(config)
    del config["cpsr"], config["gpt"]
    theirs, *_ = build(config)
    for engine in (ours, theirs):
        batches = random_batches(engine)
        for _ in range(3):
            engine.train_batch(iter(batches))
    theirs.save_checkpoint(str(tmp_path / "theirs"))
    assert set(vars(ours)) - set(vars(theirs)) == {"cpsr"}
    assert set(vars(ours.module)) == set(vars(theirs.module))
    ours.destroy()
    theirs.destroy()
