"""A 2-rank data-parallel job fails and restarts on 1 rank: it resumes with the same global batch and loss."""

import math

import pytest

from benchmarks.common.processes import tiny_config
from conftest import run_job
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.recovery import read_reports


def losses_by_iteration(run) -> dict[int, list[float]]:
    """Rank 0's journaled losses, each iteration's in the order the attempts trained it."""
    losses = {}
    for e in read_journal(journal_path(str(run), 0)):
        losses.setdefault(e.iteration, []).append(e.loss)
    return losses


# ZeRO-1 (the pipeline engine's only ZeRO stage) also fails a second time on the smaller world;
# without ZeRO one restart shows the batch kept (a second start costs time the suite has not).
@pytest.mark.parametrize("zero_stage, kills", [(1, [12, 16]), (0, [12])])
def test_a_job_shrunk_to_one_rank_resumes_with_the_same_batches(tmp_path, zero_stage, kills):
    run = tmp_path / "run"
    config = tiny_config(run, stages=1, zero_stage=zero_stage, recovery={"mode": "recompute"},
                         faults={"kill_rank": 0, "kill_at_iteration": kills})
    config["cpsr"]["checkpoint"].update(interval=5, strategy="torch")  # committed before the kill
    iters = ("--train-iters", kills[-1] + 2, "--eval-interval", 100)
    first = run_job(tmp_path, config, *iters, nprocs=2, check=False)
    assert first.returncode != 0, first.stdout[-3000:]
    # The same config on one rank (supervised where it fails again): it recovers and finishes.
    second = run_job(tmp_path, config, *iters, nprocs=1, supervised=len(kills) > 1)
    assert "ZeRORuntimeException" not in second.stdout + second.stderr
    assert "gradient accumulation 2 -> 4, keeping the global batch of 16 sequences" in second.stdout

    fresh, shrunk, *later = read_reports(str(run))
    assert fresh.method == "fresh"
    assert (shrunk.method, shrunk.reached, shrunk.checkpoint) == ("recompute", 12, 10)
    assert "data-parallel degree 2 -> 1" in shrunk.world_change
    assert (run / "journal" / "retired" / "attempt2" / "rank00001.csv").exists()
    if later:  # f from the one rank left, not the departed rank's journal that ends at 12
        assert [(r.reached, r.checkpoint, r.lost_iterations, r.world_change) for r in later] == [(16, 15, 1, None)]
        assert "1 iterations to redo" in second.stdout

    # Iterations 11 and 12, trained by two ranks and again by one: the same sequences, the same state.
    losses = losses_by_iteration(run)
    for iteration in (11, 12):
        two_ranks, one_rank = losses[iteration][:2]
        assert math.isfinite(one_rank) and one_rank == pytest.approx(two_ranks, rel=1e-4), (iteration, losses[iteration])
