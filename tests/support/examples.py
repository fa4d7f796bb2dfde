"""The examples' scripts (examples/hf_gpt2, examples/megatron_gpt) as the tests run and read them: the lines a
user changes in a DeepSpeed script for cpsr_ds, and a job with a rank killed, restarted by the supervisor."""

import ast
import difflib
import json
import os
import re

from conftest import ROOT, run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.checkpoint.storage.catalog import loadable_checkpoints

ITERS, KILL_AT, INTERVAL = 10, 8, 3


def example_path(*parts: str) -> str:
    return os.path.join(ROOT, "examples", *parts)


def code_lines(path: str) -> list[str]:
    """The script's lines after its module docstring (which names the script itself)."""
    with open(path) as f:
        source = f.read()
    return source.splitlines()[ast.parse(source).body[0].end_lineno:]


def changed_lines(before: str, after: str) -> list[str]:
    """The lines of script ``after`` that script ``before`` does not have: added or replaced."""
    return [line[2:] for line in difflib.ndiff(code_lines(before), code_lines(after)) if line.startswith("+ ")]


def example_config(example: str, run_dir, **cpsr) -> dict:
    """The example's ds_config.json, checkpointing into ``run_dir`` every INTERVAL iterations; ``cpsr``: other
    sections of its "cpsr" block."""
    with open(example_path(example, "ds_config.json")) as f:
        config = json.load(f)
    config["cpsr"].update(checkpoint={"dir": str(run_dir), "interval": INTERVAL}, **cpsr)
    return config


def assert_killed_rank_recomputed(tmp_path, example: str) -> None:
    """examples/``example``/train.py on 2 processes, rank 1 killed at KILL_AT: the supervisor restarts the job once,
    which recomputes from the last committed checkpoint c (each rank's own ZeRO-3 partition, saved through
    cpsr_ds) to the first attempt's losses, and trains to the end."""
    run_dir = tmp_path / "run"
    config = example_config(example, run_dir, faults={"kill_rank": 1, "kill_at_iteration": KILL_AT},
                            recovery={"mode": "recompute"})
    assert config["zero_optimization"]["stage"] == 3
    result = run_job(tmp_path, config, "--train-iters", ITERS, script=example_path(example, "train.py"),
                     supervised=True)

    assert "restart 1 of 2" in result.stdout and "restart 2 of 2" not in result.stdout
    found = re.search(rf"job reached iteration {KILL_AT}, last checkpoint (\d+); recompute", result.stdout)
    assert found, result.stdout[-3000:]
    c = int(found.group(1))
    assert c in (3, 6)
    checkpoints = loadable_checkpoints(str(run_dir))
    assert {ckpt.kind for ckpt in checkpoints} == {"cpsr"}
    assert checkpoints[-1].iteration == ITERS // INTERVAL * INTERVAL
    assert len(list((run_dir / f"global_step{c}").glob("*zero_pp_rank_*optim_states.pt"))) == 2

    entries = read_journal(journal_path(str(run_dir), 0))
    assert [e.iteration for e in entries] == list(range(1, KILL_AT + 1)) + list(range(c + 1, ITERS + 1))
    for before, after in zip(entries[c:KILL_AT], entries[KILL_AT:]):
        assert before.iteration == after.iteration
        assert abs(after.loss - before.loss) <= 1e-6 * abs(before.loss), after.iteration
