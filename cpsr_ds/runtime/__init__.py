"""CPSR's runtime on a DeepSpeed engine.

session.py: what ``cpsr_ds.initialize`` runs (rundir.py claims the run directory, elastic.py checks that the
launcher can restart the job). runtime.py: ``engine.cpsr``, which recovers the engine and runs the iteration
hooks (hooks.py) after every iteration: the cost meter (measurements.py), the journal, the planner (plans.py),
the checkpoint step (checkpoints.py, with schedule.py, the one answer to when the next checkpoint is due), the
predictor's work (predictor_work.py), host snapshots and fault injection (faults.py). ending.py bounds an
engine's end at interpreter exit; monitor.py writes to DeepSpeed's monitor.
"""
