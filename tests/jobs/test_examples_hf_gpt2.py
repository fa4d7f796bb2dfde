"""examples/hf_gpt2/train.py, a Hugging Face GPT-2 under ZeRO-3 in a plain loop with cpsr_ds, in a job of 2 processes
under DeepSpeed's launcher and the supervisor: a rank killed, the job restarted, the lost iterations recomputed;
and the script's lines changed against the same script without cpsr_ds."""

import ast
import difflib
import json
import os
import re

from conftest import ROOT, run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.checkpoint.storage.catalog import loadable_checkpoints

EXAMPLE = os.path.join(ROOT, "examples", "hf_gpt2")
ITERS, KILL_AT, INTERVAL = 10, 8, 3


def code_lines(path: str) -> list[str]:
    """The script's lines after its module docstring (which names the script itself)."""
    with open(path) as f:
        source = f.read()
    body = ast.parse(source).body
    return source.splitlines()[body[0].end_lineno:]


def changed_lines(before: str, after: str) -> list[str]:
    """The lines of ``after`` that ``before`` does not have, in place: added or replaced."""
    diff = difflib.ndiff(code_lines(before), code_lines(after))
    return [line[2:] for line in diff if line.startswith("+ ")]


def test_the_script_changes_at_most_3_lines_of_the_deepspeed_one():
    changed = changed_lines(os.path.join(EXAMPLE, "train_deepspeed.py"), os.path.join(EXAMPLE, "train.py"))
    assert 0 < len(changed) <= 3, changed
    assert all("cpsr_ds" in line for line in changed), changed


def test_killed_rank_restarts_and_recomputes_from_the_last_committed_checkpoint(tmp_path):
    with open(os.path.join(EXAMPLE, "ds_config.json")) as f:
        config = json.load(f)
    assert config["zero_optimization"]["stage"] == 3
    run_dir = tmp_path / "run"
    config["cpsr"].update(checkpoint={"dir": str(run_dir), "interval": INTERVAL},
                          faults={"kill_rank": 1, "kill_at_iteration": KILL_AT}, recovery={"mode": "recompute"})
    result = run_job(tmp_path, config, "--train-iters", ITERS, script=os.path.join(EXAMPLE, "train.py"),
                     supervised=True)

    assert "restart 1 of 2" in result.stdout and "restart 2 of 2" not in result.stdout
    found = re.search(rf"job reached iteration {KILL_AT}, last checkpoint (\d+); recompute", result.stdout)
    assert found, result.stdout[-3000:]
    c = int(found.group(1))
    assert c in (3, 6)
    # Checkpoints through cpsr_ds, each rank's own ZeRO-3 partition, committed, the last at the end of the run.
    checkpoints = loadable_checkpoints(str(run_dir))
    assert [ckpt.kind for ckpt in checkpoints] == ["cpsr"] * len(checkpoints)
    assert checkpoints[-1].iteration == ITERS // INTERVAL * INTERVAL
    assert len(list((run_dir / f"global_step{c}").glob("*zero_pp_rank_*optim_states.pt"))) == 2

    # The journal: the first attempt up to the kill, the restart from c on; the recomputed iterations' losses are
    # the first attempt's.
    entries = read_journal(journal_path(str(run_dir), 0))
    assert [e.iteration for e in entries] == list(range(1, KILL_AT + 1)) + list(range(c + 1, ITERS + 1))
    first, again = entries[c:KILL_AT], entries[KILL_AT:KILL_AT + (KILL_AT - c)]
    for before, after in zip(first, again):
        assert before.iteration == after.iteration
        assert abs(after.loss - before.loss) <= 1e-6 * abs(before.loss), after.iteration
