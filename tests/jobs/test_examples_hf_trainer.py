"""examples/hf_gpt2/train_trainer.py, a Hugging Face GPT-2 through the Hugging Face Trainer with ``--deepspeed``
(ZeRO-3) and cpsr_ds's CPSRTrainer, in a job of 2 processes under DeepSpeed's launcher."""

import ast
import json
import os
import re

import pytest

from conftest import ROOT, recomputed_from, run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.checkpoint.storage.catalog import loadable_checkpoints

EXAMPLE = os.path.join(ROOT, "examples", "hf_gpt2")
STEPS, INTERVAL, KILL_AT = 6, 3, 5


def logged_losses(stdout: str) -> list[float]:
    """The training losses the Trainer logged, in order (rounded to 4 decimals, as it logs them)."""
    return [ast.literal_eval(logs)["loss"] for logs in re.findall(r"^(\{'loss': .*\})$", stdout, re.MULTILINE)]


def trainer_job(tmp_path, supervised: bool = False, strategy: str = "cpsr", **cpsr):
    """train_trainer.py for STEPS steps, checkpointing every INTERVAL into tmp_path/run with ``strategy``; (run_dir,
    the job's output)."""
    with open(os.path.join(EXAMPLE, "ds_config_trainer.json")) as f:
        config = json.load(f)
    run_dir = tmp_path / "run"
    config["cpsr"].update(checkpoint={"dir": str(run_dir), "interval": INTERVAL, "strategy": strategy}, **cpsr)
    result = run_job(tmp_path, config, "--output_dir", tmp_path / "out", "--max_steps", STEPS,
                     "--per_device_train_batch_size", 4, "--learning_rate", 1e-3, "--logging_steps", 1,
                     "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
                     script=os.path.join(ROOT, "tests", "jobs", "hf_trainer_job.py"), supervised=supervised)
    return run_dir, result.stdout


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("failure_free")
    return tmp_path, *trainer_job(tmp_path)


def test_trainer_checkpoints_through_cpsr_ds_and_journals_its_losses(failure_free):
    """The script saves the model after training (trainer.save_model, DeepSpeed's save_checkpoint under ZeRO-3)
    and then ends the engine."""
    tmp_path, run_dir, stdout = failure_free
    # Every checkpoint is cpsr_ds's, committed; the last one at the Trainer's last step.
    checkpoints = loadable_checkpoints(str(run_dir))
    assert [(c.kind, c.iteration) for c in checkpoints] == [("cpsr", i) for i in range(INTERVAL, STEPS + 1, INTERVAL)]
    assert len(list((run_dir / f"global_step{STEPS}").glob("*zero_pp_rank_*optim_states.pt"))) == 2
    # The script's own save after training, committed by the engine's end.
    assert [(c.kind, c.iteration) for c in loadable_checkpoints(str(tmp_path / "out"))] == [("cpsr", STEPS)]
    # The journal holds the Trainer's steps and the losses it logged (the mean over both ranks).
    entries = read_journal(journal_path(str(run_dir), 0))
    logged = logged_losses(stdout)
    assert [e.iteration for e in entries] == list(range(1, STEPS + 1)) and len(logged) == STEPS
    for entry, loss in zip(entries, logged):
        assert abs(entry.loss - loss) <= 5e-5, (entry, loss)


def test_restarted_trainer_continues_at_the_recovered_step_with_its_batches(failure_free, tmp_path):
    """Rank 1 killed after KILL_AT, the job restarted by the supervisor and recomputed from c: the Trainer counts
    on from c (it logs only the steps after c, and stops at max_steps) and draws the batches it drew there in
    the failure-free run, so each step's loss is the failure-free one."""
    # Synchronous saves: the checkpoint of INTERVAL is committed before the kill, however loaded the machine.
    run_dir, stdout = trainer_job(tmp_path, supervised=True, strategy="torch", faults={"kill_rank": 1, "kill_at_iteration": KILL_AT},
                                  recovery={"mode": "recompute"})
    assert "restart 1 of 2" in stdout and "restart 2 of 2" not in stdout
    c = recomputed_from(stdout, run_dir, KILL_AT, STEPS)
    assert c == INTERVAL
    restarted = stdout[stdout.index("restart 1 of 2"):]
    assert logged_losses(restarted) == pytest.approx(logged_losses(failure_free[2])[c:], abs=1e-4)
    expected = {e.iteration: e.loss for e in read_journal(journal_path(str(failure_free[1]), 0))}
    for entry in read_journal(journal_path(str(run_dir), 0))[KILL_AT:]:
        assert entry.loss == pytest.approx(expected[entry.iteration], rel=1e-6), entry.iteration
