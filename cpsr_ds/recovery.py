"""Recovery on restart: find the failure point, choose how to recover, resume there.

The progress journal says the failed job reached iteration f; the last committed
checkpoint is c <= f. Recompute-based recovery (RB-R, the paper's Section IV-A)
restores c and lets the training loop recompute c..f, paying d = f - c
iterations; since batch i is a function of i, the recomputed iterations are
bit-for-bit those of the failure-free run.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpsr_ds.checkpoint.journal import reached_iteration
from cpsr_ds.checkpoint.store import select_checkpoint

@dataclass(frozen=True)
class RecoveryReport:
    method: str  # "fresh" (nothing to recover), "restart" (no checkpoint yet) or "recompute"
    reached: int | None  # f: the last iteration every rank finished before the failure
    checkpoint: int | None  # c: the iteration of the restored checkpoint
    resume_iteration: int  # the next batch index the training loop must feed

    @property
    def lost_iterations(self) -> int:
        """Iterations the job must redo: f - c (f for a restart from scratch)."""
        if self.reached is None:
            return 0
        return self.reached - (self.checkpoint or 0)

    def describe(self) -> str:
        if self.method == "fresh":
            return "cpsr recovery: no earlier progress, starting at iteration 0"
        if self.method == "restart":
            return f"cpsr recovery: job reached iteration {self.reached} but no checkpoint was committed; restarting from iteration 0"
        return (
            f"cpsr recovery: job reached iteration {self.reached}, last checkpoint {self.checkpoint}; "
            f"recompute (RB-R): {self.lost_iterations} iterations to redo, {self.checkpoint} saved against a restart from scratch"
        )


def recover(engine, directory: str) -> RecoveryReport:
    """Restore ``engine`` from ``directory`` if an earlier run left progress there."""
    reached = reached_iteration(directory)
    # Every rank verifies the same shared directory and so picks the same tag.
    tag = select_checkpoint(directory)
    if tag is None:
        return RecoveryReport("fresh" if reached is None else "restart", reached, None, 0)
    load_path, _client_state = engine.load_checkpoint(directory, tag=tag)
    if load_path is None:
        raise RuntimeError(f"cpsr recovery: DeepSpeed could not load checkpoint {tag} in {directory}")
    return RecoveryReport("recompute", reached, engine.global_steps, engine.global_steps)
