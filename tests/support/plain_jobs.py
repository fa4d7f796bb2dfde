"""The plain-engine job tests' failure-free reference and what they read of a run."""

from conftest import run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from support.plain import plain_config

ITERS = 12


def losses_by_iteration(run_dir, rank=0):
    """The last loss journaled for each iteration (a recomputed iteration overwrites the failed run's)."""
    return {e.iteration: e.loss for e in read_journal(journal_path(str(run_dir), rank))}


def reference(tmp_path_factory, script: str, zero_stage: int):
    """A failure-free run of ``script`` (tests/jobs/plain_job.py) for ITERS iterations on 2 data-parallel ranks; each
    rank's own share (under ZeRO its partition) saved after 6, 9 and 11 in states/ beside the run directory, which
    is returned."""
    tmp = tmp_path_factory.mktemp(f"reference_zero{zero_stage}")
    (tmp / "states").mkdir()
    run_job(tmp, plain_config(tmp / "run", zero_stage=zero_stage), "--train-iters", ITERS,
            "--dump-own", tmp / "states", "--dump-at", 6, 9, 11, script=script)
    return tmp / "run"
