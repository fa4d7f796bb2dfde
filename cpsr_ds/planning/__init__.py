"""Planning: when to checkpoint (Section V-C) and what a recovery costs (Section V-B), one module per job.

- units: the iteration, the planner's unit, and the checks of its inputs;
- fitter: the curves the models read (Eq. 7, 8, 9, 11) and the training phases;
- calibration: every measured constant, with the command and result file that measured it;
- cost_model: the PB-R cost of one failure (Eq. 13, 14, the empirical model) and the guard recovery chooses by;
- fault_tolerance_cost: the cost rates an interval is planned by (Eq. 15);
- planner: the interval minimising them (Theorem 1, Eq. 16, or numerically), per stage and per job;
- failure_mix: the failure classes (process crash, node lost) and their shares (the Llama 3 trace);
- levels: the host-snapshot and storage intervals planned together against the failure mix;
- projection: ``python -m cpsr_ds plan --simulate``, T_l per strategy for a described cluster;
- checkpoint_cost, failure_rate: T_s, the persist time and lambda, measured while the job runs;
- online_planner: what ``checkpoint.interval: auto`` plans from those measurements, and when;
- plan_report: ``python -m cpsr_ds plan RUN_DIR``, the plans beside the checkpoints taken.
"""
