"""examples/hf_gpt2/train_trainer.py, a Hugging Face GPT-2 through the Hugging Face Trainer with ``--deepspeed``
(ZeRO-3) and cpsr_ds's CPSRTrainer, in a job of 2 processes under DeepSpeed's launcher."""

import ast
import json
import os
import re

from conftest import ROOT, run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.checkpoint.storage.catalog import loadable_checkpoints

EXAMPLE = os.path.join(ROOT, "examples", "hf_gpt2")
STEPS, INTERVAL = 6, 3


def logged_losses(stdout: str) -> list[float]:
    """The training losses the Trainer logged, in order (rounded to 4 decimals, as it logs them)."""
    return [ast.literal_eval(logs)["loss"] for logs in re.findall(r"^(\{'loss': .*\})$", stdout, re.MULTILINE)]


def test_trainer_checkpoints_through_cpsr_ds_and_journals_its_losses(tmp_path):
    """The script saves the model after training (trainer.save_model, DeepSpeed's save_checkpoint under ZeRO-3)
    and then ends the engine."""
    with open(os.path.join(EXAMPLE, "ds_config_trainer.json")) as f:
        config = json.load(f)
    run_dir = tmp_path / "run"
    config["cpsr"]["checkpoint"] = {"dir": str(run_dir), "interval": INTERVAL}
    result = run_job(tmp_path, config, "--output_dir", tmp_path / "out", "--max_steps", STEPS,
                     "--per_device_train_batch_size", 4, "--learning_rate", 1e-3, "--logging_steps", 1,
                     "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
                     script=os.path.join(ROOT, "tests", "jobs", "hf_trainer_job.py"))

    # Every checkpoint is cpsr_ds's, committed; the last one at the Trainer's last step.
    checkpoints = loadable_checkpoints(str(run_dir))
    assert [(c.kind, c.iteration) for c in checkpoints] == [("cpsr", i) for i in range(INTERVAL, STEPS + 1, INTERVAL)]
    assert len(list((run_dir / f"global_step{STEPS}").glob("*zero_pp_rank_*optim_states.pt"))) == 2
    # The script's own save after training, committed by the engine's end.
    assert [(c.kind, c.iteration) for c in loadable_checkpoints(str(tmp_path / "out"))] == [("cpsr", STEPS)]
    # The journal holds the Trainer's steps and the losses it logged (the mean over both ranks).
    entries = read_journal(journal_path(str(run_dir), 0))
    logged = logged_losses(result.stdout)
    assert [e.iteration for e in entries] == list(range(1, STEPS + 1)) and len(logged) == STEPS
    for entry, loss in zip(entries, logged):
        assert abs(entry.loss - loss) <= 5e-5, (entry, loss)
