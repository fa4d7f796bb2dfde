"""Calibration: every constant of cpsr_ds that a measurement set, with the command and result file it came from.

Commands run from the repository root; result files are under ``benchmarks/results/``. To calibrate again, run
the command, check the result file's figure and copy it here: tests/unit/test_calibration.py checks that each
constant agrees with the file named beside it.
"""

# The recovery benchmark: GPT, 4000 iterations, 3 seeds, T_c 50 and 100, failures at 25, 50 and 75 % of training,
# d = T_c / 2 and T_c - 1 (36 failures per predictor, each forced to predict). About 2.5 hours on 2 cores.
BENCH_RECOVERY = "python -m benchmarks.bench_recovery --json benchmarks/results/bench_recovery/bench_recovery.json"
BENCH_RECOVERY_RESULT = "benchmarks/results/bench_recovery/bench_recovery.json"

# rho per predictor, for cost_model.EmpiricalModel (T_p = (1 - rho) d): the mean share of d a prediction saved.
# BENCH_RECOVERY_RESULT, field mean_reduction (its summary table in benchmarks/results/bench_recovery/bench_recovery.txt).
MEASURED_REDUCTION = {"trend": 0.690, "linear": 0.484, "vitp": 0.407, "ridge": 0.274, "damped": 0.255, "skip": 0.191}

# rho at the end of training (the lag a prediction leaves on the final loss, bench_ftcost's charge) by the failure's
# place in a run whose learning rate decays to its planned end (cosine decay to 10 % of the peak): (place, rho).
# BENCH_RECOVERY_RESULT, field end_of_training["25 %" | "50 %" | "75 %"]["end"]["mean"]: the default's (trend's)
# predicting recoveries trained to the end, 5, 10 and 12 cases. An early prediction leaves a loss excess that the
# flat end of the schedule needs more than d iterations to make up, a late one less
# (python -m benchmarks.early_prediction, benchmarks/results/early_prediction/early_prediction.txt).
END_OF_TRAINING_REDUCTION = {"trend": ((0.25, -0.343), (0.50, 0.615), (0.75, 0.906))}
# The schedule they were measured under: WarmupCosineLR to this share of the peak rate (bench_recovery's
# --cos-min-ratio default; its 20 warm-up iterations left out). cost_model reads each place as the share of the
# learning-rate area still ahead there (lr_schedule.py), which other schedules are compared by.
END_OF_TRAINING_COS_MIN_RATIO = 0.1

# The loss-excess guard's lag over the empirical model's estimate (cost_model.recovery_choice): the measured lag
# over (1 - rho) d, rho as above, is at most 1.63 in 90 % of the 216 predicting cases of the six predictors in
# BENCH_RECOVERY_RESULT (fields cases[].lag_iters, cases[].d, mean_reduction), and at most 1.66 in 80 % of trend's.
PESSIMISM = 1.6
