"""Recovery on restart: find the failure point, choose how to recover, resume there.

The progress journal says the failed job reached iteration f; the last committed
checkpoint is c <= f, d = f - c iterations were lost. Two ways back (Section IV):

- RB-R, recompute-based: restore c and let the training loop recompute c..f. Costs
  d iterations; since batch i is a function of i, the recomputed iterations are
  bit-for-bit those of the failure-free run.
- PB-R, predicting-based: restore the last checkpoints, let the predictor
  (Section III-A) predict parameters and Adam's moments at f, write them into the
  engine and resume at batch f. Costs the lag T_p the prediction error causes
  (Eq. 13-14), which training heals by itself.

"Controlled": the choice is made by the recovery cost model (cost_model.py, the model
``planner.cost_model`` names) and logged with its numbers: PB-R when its estimated lag
T_p is below d and a pessimistic lag (calibration.PESSIMISM times the sum of T_p and
the lags the run's earlier predictions left: :func:`carried_lag`) leaves a loss excess
at f of at most ``max_loss_excess`` by the job's own loss curve (under a decaying
learning rate a lag stays as a loss excess to the end of training; early in
training, where the loss falls fast, this means RB-R). The predictor's held-out error
``r`` (predicting the newest retained checkpoint from the older ones, relative to not
predicting at all) did not predict the measured lag on the recovery benchmark
(correlation -0.01 over 96 cases), so it serves as a guard against a diverging
prediction: where ``r >= max_relative_error`` the stage's predictor gives way to ``skip`` (c's state taken as
the state at f, what r is measured against), which the cost model weighs like any predictor. An unready
predictor means RB-R.

Modules: ``decision`` (the choice and its guards), ``sources`` (where recovered state
comes from, one file each), ``agree`` (ranks deciding alike), ``report`` (``recovery.jsonl``).
"""

from cpsr_ds.recovery.decision import (
    expected_loss_excess,
    excess_at,
    fallback_reason,
    implausible_reach,
    journal_losses,
    progress_losses,
    recover,
    recovery_model,
    worst_error,
)
from cpsr_ds.integration.deepspeed.engine_state import advance_counters, engine_state, load_engine_state, own_share, state_shapes
from cpsr_ds.recovery.report import REPORTS, RecoveryReport, append_report, carried_lag, earlier_reports, read_reports
from cpsr_ds.recovery.sources.checkpoint import full_zero_state
from cpsr_ds.recovery.sources.prediction import PREDICTOR_STATE, new_predictor

__all__ = [
    "PREDICTOR_STATE", "REPORTS", "RecoveryReport", "advance_counters", "append_report", "carried_lag",
    "earlier_reports", "engine_state", "excess_at", "expected_loss_excess", "fallback_reason", "full_zero_state",
    "implausible_reach", "journal_losses", "load_engine_state", "new_predictor", "own_share", "progress_losses",
    "read_reports", "recover", "recovery_model", "state_shapes", "worst_error",
]
