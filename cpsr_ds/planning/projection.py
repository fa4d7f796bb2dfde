"""At scale, on paper: T_l per strategy for a cluster the user describes (``python -m cpsr_ds plan --simulate``).

Each strategy is a pair of intervals and a recovery on the same cost model (levels.cost_rates): CheckFreq
and PCcheck checkpoint to storage by their overhead-budget rules and recompute; the in-memory baseline
(Gemini, DLRover's flash checkpoint) snapshots every iteration to host memory and checkpoints to storage
by CheckFreq's rule; cpsr plans both intervals (levels.plan_levels) and predicts the lost node's state
(rho). T_l is the run's hours times the cost rate. Stalls are the device-to-host copy of a GPU's share
of the state, the persist the whole state over storage's bandwidth; a restart is the process start plus
the read from where the state is (host memory, or storage, after a replacement node for a lost one).
"""

from __future__ import annotations

from dataclasses import dataclass

from cpsr_ds.planning import failure_mix, levels, planner, units


@dataclass(frozen=True)
class Cluster:
    """A job and its cluster: sizes in GB (10^9 bytes), bandwidths in GB/s, times in seconds."""

    gpus: int
    state_gb: float  # the whole training state: parameters, gradients' optimizer state
    storage_gbps: float  # the job's aggregate write and read bandwidth to storage
    host_copy_gbps: float  # one GPU's device-to-host copy bandwidth
    iteration_s: float
    failures_per_hour: float  # the whole job's
    shares: dict  # failure class -> share (failure_mix)
    run_hours: float
    process_start_s: float = 60.0
    node_replace_s: float = 300.0
    rho: float = 0.5  # cpsr: share of a lost node's lost iterations prediction saves
    budget: float = 0.02
    in_flight: int = 2

    def __post_init__(self):
        units.whole("gpus", self.gpus)
        for name in ("state_gb", "storage_gbps", "host_copy_gbps", "iteration_s", "run_hours"):
            units.positive(name, getattr(self, name))
        for name in ("failures_per_hour", "process_start_s", "node_replace_s"):
            units.non_negative(name, getattr(self, name))
        failure_mix.check_shares(self.shares)


def _it(c: Cluster, seconds: float) -> float:
    return units.iterations(seconds, c.iteration_s)


def seconds(c: Cluster) -> dict:
    """The stall of a copy to host, the persist, and the restart per class, seconds."""
    stall = c.state_gb / c.gpus / c.host_copy_gbps
    persist = c.state_gb / c.storage_gbps
    return {"stall": stall, "persist": persist, "restart_from_memory": c.process_start_s + stall,
            "restart_from_storage": c.process_start_s + persist,
            "restart_node": c.process_start_s + c.node_replace_s + persist}


def rates(c: Cluster) -> dict:
    """Failures per iteration by class."""
    return failure_mix.class_rates(c.failures_per_hour * c.iteration_s / 3600, c.shares)


def _costs(c: Cluster, rho: float, in_flight: int) -> levels.LevelCosts:
    s = seconds(c)
    return levels.LevelCosts(snapshot=_it(c, s["stall"]), checkpoint=_it(c, s["stall"]),
                             snapshot_write=_it(c, s["stall"]), persist=_it(c, s["persist"]), in_flight=in_flight,
                             restart_crash=_it(c, s["restart_from_memory"]),
                             restart_storage=_it(c, s["restart_from_storage"]),
                             restart_node=_it(c, s["restart_node"]), rho=rho)


def strategies(c: Cluster) -> dict:
    """Strategy -> (k or None, n, LevelCosts)."""
    s = seconds(c)
    checkfreq = planner.checkfreq_interval(c.iteration_s, s["stall"], s["persist"], c.budget)
    pccheck = planner.pccheck_interval(c.iteration_s, s["stall"], s["persist"], c.in_flight, c.budget,
                                       storage_s=s["persist"] / c.iteration_s)
    memory = max(1.0, _it(c, s["stall"]))
    cpsr_costs = _costs(c, c.rho, 1)
    plan = levels.plan_levels(rates(c), cpsr_costs)
    return {"checkfreq": (None, checkfreq, _costs(c, 0.0, 1)),
            "pccheck": (None, pccheck, _costs(c, 0.0, c.in_flight)),
            "in-memory": (memory, checkfreq, _costs(c, 0.0, 1)),
            "cpsr": (plan.memory_interval, plan.storage_interval, cpsr_costs)}


def project(c: Cluster) -> list[dict]:
    """Per strategy: its intervals (iterations), and T_l in hours over the run, in all and per term."""
    r, rows = rates(c), []
    for name, (k, n, costs) in strategies(c).items():
        terms = {t: float(v) * c.run_hours for t, v in levels.cost_rates(k, n, r, costs).items()}
        rows.append({"strategy": name, "memory_interval": k, "storage_interval": n,
                     "T_l_hours": sum(terms.values()), "hours": terms})
    return rows
