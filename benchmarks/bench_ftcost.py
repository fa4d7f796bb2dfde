"""Total fault-tolerance cost T_l (the paper's Eq. 1) in real training runs, by the protocol of docs/design/measurement-protocols.md.

    python -m benchmarks.bench_ftcost [--quick] [--json PATH] [--plot PATH] [--out-dir DIR] [--traces N] ...
    python -m benchmarks.bench_ftcost --quick | tee benchmarks/results/bench_ftcost/bench_ftcost_quick.txt

Without --json and --plot it writes both into benchmarks/results/bench_ftcost/ (``_quick`` with --quick;
``bench_ftcost_pp2``, ``bench_ftcost_dp2`` with ``--layout``).

The tiny GPT of ``examples/gpt/train_gpt.py`` (DeepSpeed's pipeline engine, the product's checkpoint
engines; ``--layout``: one process with one stage, or two under DeepSpeed's launcher, two pipeline
stages or two data-parallel replicas, every failure killing rank 1) trains to the same end under
every strategy:

- ``torch``, ``checkfreq``, ``pccheck``: ``interval: auto`` (their own overhead-budget rule,
  ``checkpoint.overhead_budget`` 2 %, the paper's setting), ``recovery.mode: recompute``;
- ``in_memory`` (what Gemini and DLRover's flash checkpoint do): a host snapshot every iteration
  (``memory_interval: 1``; one due while the one before is still being written is skipped, so the
  interval stretches to the write time, as Gemini interleaves its traffic) and storage by
  ``checkfreq``'s rule, ``recovery.mode: recompute``;
- ``cpsr``: every source on and both intervals planned: ``interval: auto`` (the planner, against the
  lost nodes' rate), ``memory_interval: auto`` (against the crashes'), ``recovery.mode: auto``;
- ``cpsr_fix`` (the paper's CPSR_FIX): ``cpsr`` at the interval the ``checkfreq`` run on the
  same trace used: the median gap between consecutive checkpoints within one attempt of
  that run, read from its CostRows (so ``checkfreq`` runs before ``cpsr_fix`` on each trace).

Failures: each trace is a Poisson process over iterations, seeded (``failure_trace``),
given to every strategy as ``faults.kill_at_iteration`` (each fires once per run
directory), so all strategies fail after the same iterations. Each failure has a class, drawn by its share
(``--crash-share``, by default the Llama 3 report's, ``cpsr_ds.planning.failure_mix``): a
``process_crash`` restarts the job on its live node; a ``node_lost`` also removes the node's
memory first (the run's ``checkpoint.survivor_dir``, where host snapshots and survivor dumps lie),
so only storage serves it. lambda makes the expected
number of failures ``--failures-per-run`` (4) over the part of training where a failure
can be measured, and a trace with fewer than 3 is drawn again from the next seed. That
part ends ``TAIL`` of the run before its end, so that the transient after the last
failure has passed before the window where the lag is measured. A killed job is
restarted at once, until it reaches the end. A failure-free run with no checkpoints is
the reference for the loss and the lag, and its time is the failure-free job time.
The validation set (512 sequences, as bench_recovery's) is evaluated only where it is
needed, so that evaluations do not mix with the checkpoints' costs: every run over the
lag window, the reference over the span its fit covers (``train``).

Storage: every strategy writes through the same ``checkpoint.write_mbps`` limit, set so
that persisting one checkpoint takes as many iterations as on the paper's A30 server
(see ``write_limit``, whose arithmetic the benchmark prints with the measured inputs).

T_l per run = checkpoint cost + recovery cost, in seconds and as % of the failure-free time:

- checkpoint cost: the sum over the run's checkpoints (every attempt) of the training
  slowdown each caused (runlog CostRow.slowdown_s; with several measuring ranks, the
  slowest stage's per checkpoint: the pipeline waits for it). A checkpoint committed
  but killed, or left at the run's end, before its cost was bracketed has no CostRow:
  it counts at the median of the run's measured ones (the table shows how many were
  measured). A checkpoint killed before it committed counts in neither. A run without
  CostRows stops the benchmark with an error naming the file: there is no number to put instead.
  A run whose measured slowdowns sum below their stalls (``implausible_checkpoint_cost``) has
  an unmeasurable checkpoint cost, and so T_l, with the reason, out of every mean, median and ratio;
- recovery cost: d iterations per RB-R recovery (recovery.jsonl; a restart with no
  checkpoint yet recomputes from 0); PB-R recoveries cost the run's lag behind the
  reference at the end of training (``end_lag``: ``benchmarks.common.lag``'s estimator over the
  last ``WINDOW`` of training), which holds every PB-R recovery's lag together. A run
  that only recomputed is the reference from every restored checkpoint on, so its lag
  is 0 by construction (its final loss shows it). An unmeasurable lag (the reference's
  fit flat or rising over the window, a loss beyond its range) leaves the run's T_l
  unmeasurable, with the reason, and out of every mean, median and ratio;
- snapshot cost (strategies with host snapshots): the training they slowed, (the run's clean
  iteration time - that of the runs without snapshots just before and after it on the trace,
  ``neighbour_base_s``) x the iterations it trained, plus a sparse snapshot's own stall
  (``snapshot_cost``); for the strategies without snapshots the same difference is shown as the
  measurement's noise;
- iterations become seconds at the reference's iteration time (the median of its
  journal's iteration-to-iteration wall times).

Per failure class: the failures, the iterations each recovery recomputed and its share of the lag
(a run's end lag split over its predicting recoveries by their d), against what the model expected: for cpsr
what its plans in force at each failure expected (``planned_per_failure``: the memory plan's k / 2 for a crash,
the storage plan's guarded expectation for a lost node), for the strategies that make no plan of their own the
two-level model's at the intervals the run used (``expected_per_failure``).

Beside T_l: the restart downtime (from the last iteration a killed job journaled to the
first one its restart journaled), the number of checkpoints (commits, as the job's log has them), the final
validation loss against the reference's. Summaries over the traces: mean and its
Student-t 95 % interval, median; cpsr's reduction of T_l against the better of
checkfreq and pccheck on the same trace, and of the number of checkpoints against each.

A projection follows, labelled as a model: the planner's cost rates with the measured
components (T_s, stall and persist in iterations, cpsr's measured share of d saved, rho)
at the paper's scale (``projection``).

``--from-runs`` summarises the runs of ``--out-dir`` again (its manifest.json), e.g. after a
change to the estimator. ``--fixed-interval N`` makes every strategy checkpoint every N
iterations: a smoke test of the harness, whose output says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import glob
import shutil
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from benchmarks.common.jobs import Child, finish_benchmark, tail  # noqa: E402  (first: it sets the jobs' environment)

from benchmarks.common.paths import ROOT, with_default_outputs  # noqa: E402
from benchmarks.common.processes import JOB_ENV, free_port, local_launch, remove_shm_buffers  # noqa: E402
from examples.gpt import train_gpt  # noqa: E402

from cpsr_ds.planning import fault_tolerance_cost, planner, units  # noqa: E402
from cpsr_ds.planning.failure_mix import CLASSES, LLAMA3_SHARES, NODE_LOST, PROCESS_CRASH  # noqa: E402
from cpsr_ds.checkpoint.capture import dumps  # noqa: E402
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal, read_validation  # noqa: E402
from cpsr_ds.checkpoint.storage.catalog import list_checkpoints  # noqa: E402
from cpsr_ds.config import CheckpointConfig, PlannerConfig, PredictorConfig  # noqa: E402
from cpsr_ds.planning.calibration import MEASURED_REDUCTION  # noqa: E402
from benchmarks.common.lag import Unmeasurable, late_lag  # noqa: E402
from benchmarks.common.lag import summarize as summarize_values  # noqa: E402
from cpsr_ds.planning.fitter import fit_curve  # noqa: E402
from cpsr_ds.recovery import read_reports  # noqa: E402
from cpsr_ds.recovery.sources.host_snapshot import SOURCE as HOST_SNAPSHOT  # noqa: E402
from cpsr_ds.recovery.sources.in_flight import SOURCE as IN_FLIGHT  # noqa: E402
from cpsr_ds import runlog  # noqa: E402
from cpsr_ds.runlog import CostRow, measurements_path, read_measurements  # noqa: E402
from cpsr_ds.runtime.faults import kill_marker  # noqa: E402

# In the order they run on each trace: each run with host snapshots between two without, whose clean iteration
# times, measured minutes apart on a shared machine, are its baseline (neighbour_base_s).
STRATEGIES = ("torch", "checkfreq", "in_memory", "pccheck", "cpsr", "cpsr_fix")
BASELINES = ("checkfreq", "pccheck")  # what cpsr is compared with, the better of the two per trace ...
IN_MEMORY = "in_memory"  # ... and this one
MEMORY_INTERVAL = {IN_MEMORY: 1, "cpsr": "auto"}  # the strategies with host snapshots
CLASS_STREAM = 7919  # the random stream of a trace's failure classes, apart from its failure times
MIN_FAILURES = 3
NEVER = 10**9  # the reference's checkpoint interval: it takes none
TAIL = 0.3  # no failure in the last 30 % of training: the lag window and the transient before it
WINDOW = 0.2  # the lag is measured over the last 20 % of training ...
FIT_SPAN = 3  # ... against the reference's fit over the last 3 windows
EVALS_PER_WINDOW = 10
# bench_recovery's GPT and batch, its optimizer and warmup (configs/gpt_tiny_cpu.json) and its learning rate
# decay (a cosine over the run to 10 % of the peak): small enough for many runs on 2 cores.
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}
MICRO_BATCH = 16
BASE_CONFIG = os.path.join(ROOT, "configs", "gpt_tiny_cpu.json")
COS_MIN_RATIO = 0.1
JOB_TIMEOUT_S = 1800

# The paper's A30 server (VI-A) and GPT2-0.35B (Table III). Assumed: the checkpoint holds fp32
# master weights and Adam's two moments, 12 bytes per parameter (bf16 weights would add 2 more).
PAPER_PARAMS = 350e6
PAPER_BYTES_PER_PARAM = 12
PAPER_WRITE_MBPS = 250.0
# Table III: CheckFreq's interval for GPT2-0.35B at the 2 % budget, which VI-C2 chose so that
# the intervals stay within the storage bandwidth: one checkpoint persists in about this many iterations.
PAPER_PERSIST_ITERATIONS = 19
PAPER_FAILURES_PER_HOUR = 0.08
PAPER_STORAGE_MBPS = (250.0, 2000.0)  # the A30 and H100 servers
PAPER_JOBS_S = {"VGG16": 61 * 3600 + 10 * 60, "GPT2-0.35B": 7 * 3600 + 41 * 60, "GPT3-3.35B": 10 * 3600 + 55 * 60}


# The checkpoint engines' log line for each commit (cpsr_ds.checkpoint.engines.persist, torch_engine).
COMMITTED = re.compile(r"checkpoint global_step\d+ committed")


class NoCostRows(RuntimeError):
    """A run left no CostRow: its checkpoint cost is unknown."""


# ---------------------------------------------------------------- pure parts

def paper_persist_s() -> float:
    """Persisting GPT2-0.35B's checkpoint on the A30 server: 350e6 x 12 B / 250 MB/s = 16.8 s."""
    return PAPER_PARAMS * PAPER_BYTES_PER_PARAM / (PAPER_WRITE_MBPS * 1e6)


def write_limit(nbytes: int, iteration_time_s: float, iterations: float = PAPER_PERSIST_ITERATIONS) -> float:
    """``checkpoint.write_mbps`` (10^6 B/s) at which one checkpoint of ``nbytes`` per rank persists in ``iterations``.

    The paper gives no iteration time; it persists GPT2-0.35B's ~4.2 GB in ~16.8 s at 250 MB/s
    and set CheckFreq's budget so that its interval, 19 iterations (Table III), stays within the
    bandwidth: one persist takes about 19 iterations, which this limit reproduces here.
    """
    if nbytes <= 0 or iteration_time_s <= 0 or iterations <= 0:
        raise ValueError(f"need positive bytes, iteration time and iterations, got {nbytes}, {iteration_time_s}, "
                         f"{iterations}")
    return nbytes / (iterations * iteration_time_s) / 1e6


def write_limit_text(nbytes: int, iteration_time_s: float) -> str:
    mbps = write_limit(nbytes, iteration_time_s)
    return (f"storage: the paper's GPT2-0.35B checkpoint, {PAPER_PARAMS:.3g} parameters x {PAPER_BYTES_PER_PARAM} B "
            f"(fp32 weights + two Adam moments) = {PAPER_PARAMS * PAPER_BYTES_PER_PARAM / 1e9:.1f} GB, persists in "
            f"{paper_persist_s():.1f} s at {PAPER_WRITE_MBPS:.0f} MB/s, about CheckFreq's {PAPER_PERSIST_ITERATIONS} "
            f"iterations (Table III, VI-C2).\n  Here: {nbytes} B per rank / ({PAPER_PERSIST_ITERATIONS} x "
            f"{iteration_time_s * 1e3:.2f} ms per iteration) = write_mbps {mbps:.3f} MB/s")


def failure_trace(seed: int, stop: int, expected: float, min_failures: int = MIN_FAILURES) -> list[int]:
    """Failure iterations in [1, stop], sorted and distinct: a Poisson process of ``expected / stop`` failures per
    iteration, from ``(seed, draw)``; a draw with fewer than ``min_failures`` is replaced by the next one."""
    if stop < min_failures or expected <= 0:
        raise ValueError(f"cannot place {min_failures} failures in [1, {stop}] at {expected} expected")
    rate = expected / stop
    for draw in range(10_000):
        rng = np.random.default_rng([seed, draw])
        times = np.cumsum(rng.exponential(1 / rate, size=int(4 * expected) + 20))
        trace = sorted({int(math.ceil(t)) for t in times if t <= stop})
        if len(trace) >= min_failures:
            return trace
    raise ValueError(f"no trace with {min_failures} failures in 10000 draws at {expected} expected")


def failure_classes(seed: int, count: int, crash_share: float) -> list[str]:
    """Each of a trace's ``count`` failures' class: a process crash with probability ``crash_share``, else a lost
    node; seeded by the trace's seed on a stream of its own."""
    if not 0 <= crash_share <= 1:
        raise ValueError(f"the crashes' share must be in [0, 1], got {crash_share!r}")
    crash = np.random.default_rng([seed, CLASS_STREAM]).random(count) < crash_share
    return [PROCESS_CRASH if c else NODE_LOST for c in crash]


def cost_rows(run_dir: str) -> list[CostRow]:
    """The run's CostRows; :class:`NoCostRows`, naming the file, where it left none."""
    rows, problems = read_measurements(run_dir)
    costs = [r for r in rows if isinstance(r, CostRow)]
    if not costs:
        raise NoCostRows(f"{run_dir}: no CostRow in {measurements_path(run_dir, 0)} (nor any other rank's file in "
                         f"{os.path.dirname(measurements_path(run_dir, 0))}): the checkpoint cost of this run is "
                         f"unknown" + (f"; problems: {'; '.join(problems)}" if problems else ""))
    return costs


def checkpoint_cost(rows: list[CostRow], committed: int | None = None) -> tuple[float, int, int]:
    """(summed slowdown, seconds; checkpoints; those measured): per checkpoint (attempt, iteration), the slowest
    measuring rank's.

    ``committed``: the run's commits (:func:`committed_checkpoints`). A checkpoint gets no CostRow where its
    process is killed, or the run ends, before the clean iterations after its persist arrive, which happens most
    to a strategy whose persists overlap; each such commit is charged the median of the run's measured ones.
    """
    per_checkpoint = slowest_rank(rows, "slowdown_s")
    measured = len(per_checkpoint)
    unmeasured = max(0, (committed or 0) - measured)
    seconds = sum(per_checkpoint.values()) + unmeasured * (statistics.median(per_checkpoint.values()) if measured else 0.0)
    return seconds, measured + unmeasured, measured


def slowest_rank(rows: list[CostRow], field: str) -> dict[tuple[int, int], float]:
    """Per checkpoint (attempt, iteration), the largest ``field`` of its measuring ranks: the pipeline waits for the
    slowest stage."""
    out: dict[tuple[int, int], float] = {}
    for r in rows:
        key = (r.attempt, r.iteration)
        out[key] = max(out.get(key, -math.inf), getattr(r, field))
    return out


def implausible_checkpoint_cost(rows: list[CostRow]) -> str:
    """Why the run's measured slowdowns cannot be its checkpoint cost; "" where they can.

    A checkpoint's slowdown is an estimate that noise may take below its stall, the time the training loop was
    blocked by it, which is measured directly. Summed over a run's checkpoints the noise averages out, so the sum
    is at least the summed stall (per checkpoint the slowest rank's of each). A sum below that is no estimate: the
    baselines bracketing the checkpoints came from clean iterations far from them (persists overlapping one
    another) while the host's speed moved, as for pccheck in two traces of the run at 734202b, whose checkpoints
    summed to -4.14 s and -1.71 s.
    """
    slowdown = slowest_rank(rows, "slowdown_s")
    measured, floor = sum(slowdown.values()), sum(slowest_rank(rows, "stall_s").values())
    if measured >= floor:
        return ""
    return (f"its {len(slowdown)} measured checkpoints' slowdowns sum to {measured:.2f} s, below their stalls' "
            f"{floor:.2f} s, the time the training loop was blocked: the baselines bracketing them failed")


def committed_checkpoints(log_path: str) -> int:
    """The commits a one-process run's jobs logged (every attempt, appended to one log)."""
    with open(log_path, errors="replace") as f:
        return sum(1 for line in f if COMMITTED.search(line))


def used_interval(rows: list[CostRow]) -> int:
    """The interval a run checkpointed at: the median gap between consecutive checkpoints within an attempt."""
    by_attempt: dict[int, set[int]] = {}
    for r in rows:
        by_attempt.setdefault(r.attempt, set()).add(r.iteration)
    gaps = [b - a for its in by_attempt.values() for a, b in zip(sorted(its), sorted(its)[1:])]
    if not gaps:
        raise ValueError("fewer than two checkpoints in every attempt: no interval to read")
    return max(1, int(round(statistics.median(gaps))))


def recoveries(reports) -> dict:
    """From recovery.jsonl's reports (the first is the job's fresh start): failures, the iterations RB-R
    recomputed (a restart without a checkpoint recomputes from 0), all iterations lost (d summed, from the state
    restored), PB-R count, and how many recomputed from the parameters of the checkpoint in flight (not exact)."""
    after = reports[1:]
    recomputing = [r for r in after if r.method in ("recompute", "restart")]
    return {"n_failures": len(after), "recomputed_iters": sum(r.lost_iterations for r in recomputing),
            "lost_iters": sum(r.lost_iterations for r in after),
            "predicted": sum(r.method == "predict" for r in after),
            "in_flight": sum(IN_FLIGHT in (r.sources or {}).values() for r in after)}


def downtimes(entries, trace: list[int]) -> list[float]:
    """Seconds from each failure's last journaled iteration to the restarted job's first one.

    ``entries``: the journal in file order. Each failure of the trace fired after the first
    time the run reached its iteration past the previous failure; the next line is the restart's.
    """
    return [entries[k].wall_time - entries[k - 1].wall_time for k in restart_lines(entries, trace)]


def restart_lines(entries, trace: list[int]) -> list[int]:
    """The index in ``entries`` of each restart's first line: the line after its failure's."""
    out, k = [], 0
    for failure in trace:
        while k < len(entries) and entries[k].iteration != failure:
            k += 1
        if k + 1 >= len(entries):
            raise ValueError(f"the journal has no restart after the failure at iteration {failure}")
        out.append(k + 1)
        k += 1
    return out


def iteration_seconds(entries, trace: list[int]) -> list[float]:
    """The wall seconds between consecutive journal lines of one attempt: each trained iteration's time with
    whatever a checkpoint added to it (evaluations included), not the restarts after the ``trace``'s failures.

    ``entries``: the journal in file order; a restart's first line follows its failure's line, as in
    :func:`downtimes`, and may be the next iteration (a prediction resumes at the failure point).
    """
    restarts = set(restart_lines(entries, trace))
    return [entries[i].wall_time - entries[i - 1].wall_time for i in range(1, len(entries))
            if i not in restarts and entries[i].iteration == entries[i - 1].iteration + 1]


def clean_iteration_s(rows: list[CostRow]) -> float:
    """A run's iteration time with no checkpoint in flight: the mean of its checkpoints' baselines (each the median
    of the clean iterations around one, host snapshots in them where they are on)."""
    return statistics.mean(r.iteration_time_s for r in rows)


def snapshot_plan(run_dir: str) -> Optional[tuple[int, float]]:
    """memory_interval auto's last plan in a run's plans.jsonl: (k, a snapshot's stall in seconds); None where
    it made none."""
    found, _ = runlog.read_memory_plans(run_dir)
    return (found[-1].interval, found[-1].stall_s) if found else None


def snapshot_cost(clean_s: float, base_s: float, trained: int, k: int, stall_s: float) -> float:
    """Seconds host snapshots cost a run that trained ``trained`` iterations every ``k`` (one each, stall
    ``stall_s``): the excess of its clean iteration time over the same trace's runs without snapshots
    (``base_s``), plus, with k > 1, each snapshot's stall, which the clean iterations' medians leave out."""
    return (clean_s - base_s) * trained + (stall_s * trained / k if k > 1 else 0.0)


def inexact(report) -> bool:
    """A recovery that leaves a lag: predicted, or from the parameters of the checkpoint in flight."""
    return report.method == "predict" or IN_FLIGHT in (report.sources or {}).values()


def per_class(reports, classes: list[str], downtime_s: list[float], lag_iters: Optional[float],
              expected: list[Optional[float]]) -> dict:
    """Per failure class, summed over its failures: failures, iterations lost (d) and recomputed, recoveries that
    left a lag (``inexact``) or read a host snapshot, the share of the end lag (split over the inexact
    recoveries by their d), recovery iterations (recomputed + that share; None where the lag is
    unmeasurable and the class has a share of it), restart downtime and the iterations the model expected
    (``expected_iters``; None where any of its failures has no expectation).

    ``reports``: recovery.jsonl's (the first is the fresh start), one per failure after it, in the order of
    ``classes``, ``downtime_s`` and ``expected``.
    """
    after = reports[1:]
    lagging_d = sum(r.lost_iterations for r in after if inexact(r))
    out = {c: {"failures": 0, "lost_iters": 0, "recomputed_iters": 0, "inexact": 0, "host_snapshot": 0,
               "lag_iters": 0.0, "downtime_s": 0.0, "expected_iters": 0.0} for c in CLASSES}
    for report, cls, down, exp in zip(after, classes, downtime_s, expected, strict=True):
        row, d = out[cls], report.lost_iterations
        row["failures"] += 1
        row["lost_iters"] += d
        row["downtime_s"] += down
        row["expected_iters"] = None if exp is None or row["expected_iters"] is None else row["expected_iters"] + exp
        row["recomputed_iters"] += d if report.method in ("recompute", "restart") else 0
        row["host_snapshot"] += HOST_SNAPSHOT in (report.sources or {}).values()
        if inexact(report):
            row["inexact"] += 1
            row["lag_iters"] = None if lag_iters is None or row["lag_iters"] is None else \
                row["lag_iters"] + (lag_iters * d / lagging_d if lagging_d else 0.0)
    for row in out.values():
        row["recovery_iters"] = None if row["lag_iters"] is None else row["recomputed_iters"] + row["lag_iters"]
    return out


def expected_per_failure(k: Optional[float], n: float, persist: float, rho: float) -> dict:
    """The model's iterations lost per failure of each class, first order (planning/levels.py's F(k, n), with the
    write floor of fault_tolerance_cost.guarded_cost_rate) at snapshot interval ``k`` (None: no snapshots),
    storage interval ``n`` and ``persist`` iterations from a checkpoint's start to durable: a crash k / 2 since
    its newest snapshot; a lost node (and a crash without snapshots) (1 - rho) (n / 2 + persist) since its newest
    durable checkpoint. For the strategies that make no plan of their own (the baselines, cpsr_fix)."""
    storage = (1 - rho) * (n / 2 + persist)
    return {PROCESS_CRASH: storage if k is None else k / 2, NODE_LOST: storage}


def planned_per_failure(run_dir: str, reports, classes: list[str], first_interval: int,
                        snapshots: bool) -> list[Optional[float]]:
    """Per failure, the iterations the plans in force when it came expected it to cost (a planning run's: cpsr's).

    Failure j ended attempt j (the first start is attempt 1); in force is that attempt's newest plan made at or
    before the failure's iteration. A crash with host snapshots: the memory plan's per_crash (k / 2; before any,
    first_interval / 2); any other failure: the storage plan's per_failure (runlog.PlanRow's stages, the
    guarded model's at its T_c: online_planner), at warm-up T_c / 2 (nothing measured, so no persist), None
    under a plan without one (the paper's models).
    """
    plans, _ = runlog.read_plans(run_dir)
    memory, _ = runlog.read_memory_plans(run_dir)

    def in_force(rows, attempt: int, f: int):
        return next((r for r in reversed(rows) if r.attempt == attempt and r.iteration <= f), None)

    out = []
    for attempt, (report, cls) in enumerate(zip(reports[1:], classes, strict=True), start=1):
        f = report.reached
        if cls == PROCESS_CRASH and snapshots:
            plan = in_force(memory, attempt, f)
            out.append(plan.per_crash if plan is not None else first_interval / 2)
            continue
        plan = in_force(plans, attempt, f)
        stages = [s["per_failure"] for s in plan.stages if "per_failure" in s] if plan is not None else []
        out.append(max(stages) if stages else plan.T_c / 2 if plan is not None and plan.reason == "warm-up" else None)
    return out


def window(iters: int) -> tuple[int, int]:
    """(first iteration of the lag window, evaluation interval); the window ends at ``iters``."""
    every = max(1, int(round(WINDOW * iters / EVALS_PER_WINDOW)))
    return iters - every * EVALS_PER_WINDOW, every


def end_lag(reference: dict[int, float], run: dict[int, float], iters: int) -> dict:
    """The run's lag behind the reference over the last ``WINDOW`` of training (``benchmarks.common.lag.late_lag``).

    The estimator's window k in [2d, 4d] after f is placed on the end: d = W / 2, f = end - 2W.
    Fields: lag_iters (the protocol's), lag_paired_iters, or None with unmeasurable (kind) and its reason.
    """
    start, _ = window(iters)
    width = iters - start
    d, f = width / 2, iters - 2 * width
    fit = fit_curve(*zip(*sorted(reference.items())), lo=iters - FIT_SPAN * width, hi=iters)
    points = {i - f: loss for i, loss in run.items() if start <= i <= iters}
    try:
        lag = late_lag(fit, f, d, points, margin=width)
        paired = late_lag(fit, f, d, points, margin=width, reference=reference)
    except Unmeasurable as why:
        return {"lag_iters": None, "lag_paired_iters": None, "unmeasurable": why.kind, "unmeasurable_reason": str(why)}
    return {"lag_iters": lag, "lag_paired_iters": paired, "unmeasurable": "", "unmeasurable_reason": ""}


def ft_cost(checkpoint_s: float | None, recomputed_iters: float, lag_iters: float | None, iteration_time_s: float,
            failure_free_s: float, snapshot_s: float = 0.0) -> dict:
    """T_l (Eq. 1): checkpoint cost (host snapshots' included) + recovery cost (recomputed iterations and the
    lag at the iteration time), seconds and % of the failure-free time; None where the lag or the checkpoint
    cost (None) is unmeasurable."""
    recovery_s = None if lag_iters is None else (recomputed_iters + lag_iters) * iteration_time_s
    total = None if recovery_s is None or checkpoint_s is None else checkpoint_s + snapshot_s + recovery_s
    return {"checkpoint_cost_s": checkpoint_s, "snapshot_cost_s": snapshot_s, "recovery_cost_s": recovery_s,
            "ft_cost_s": total, "ft_cost_pct": None if total is None else 100 * total / failure_free_s}


def over_traces(values) -> dict:
    """Median, mean and its 95 % interval of the measured values (None: unmeasurable, counted)."""
    return summarize_values([v for v in values if v is not None], ["unmeasurable"] * sum(v is None for v in values))


def reductions(mine: list, theirs: list) -> dict:
    """1 - mine / theirs per trace, over the traces where both are measured."""
    return over_traces([None if a is None or b is None or b == 0 else 1 - a / b for a, b in zip(mine, theirs)])


def projected_components(measured: dict, storage_mbps: float) -> dict:
    """A strategy's measured components (iterations; persist as at 250 MB/s) at ``storage_mbps``: the persist
    time scales with the bandwidth; so do torch's stall and T_s, which are its synchronous write; the
    asynchronous strategies' are a host copy and are kept."""
    scale = PAPER_WRITE_MBPS / storage_mbps
    sync = scale if measured["strategy"] == "torch" else 1.0
    return {"T_s": measured["T_s"] * sync, "stall": measured["stall"] * sync, "persist": measured["persist"] * scale,
            "in_flight": measured["in_flight"]}


def baseline_interval(c: dict, budget: float) -> float:
    """The overhead-budget rule of torch, checkfreq (one checkpoint persisting) and pccheck (``in_flight``).

    The persist time is the storage's (bytes at its bandwidth), which checkpoints in flight share.
    """
    return planner.pccheck_interval(1.0, c["stall"], c["persist"], c["in_flight"], budget, storage_s=c["persist"])


def strategy_cost(strategy: str, c: dict, lam: float, rho: float):
    """The cost rate as a function of T_c: PB-R by the empirical model for cpsr, else recomputing."""
    if strategy in ("cpsr", "cpsr_fix"):
        return lambda T_c: fault_tolerance_cost.empirical_cost_rate(T_c, lam, c["T_s"], rho, c["persist"],
                                                                    c["in_flight"])
    return lambda T_c: fault_tolerance_cost.recompute_cost_rate(T_c, lam, c["T_s"], c["persist"], c["in_flight"])


def projected_interval(strategy: str, comps: dict[str, dict], cost, budget: float) -> float:
    """cpsr: the cost rate's minimum; cpsr_fix: CheckFreq's interval; the others: their own rule."""
    if strategy == "cpsr":
        return planner.minimize_interval(cost)
    return baseline_interval(comps["checkfreq" if strategy == "cpsr_fix" else strategy], budget)


def projection(measured: dict[str, dict], rho: float, budget: float) -> list[dict]:
    """The planner's cost model at the paper's scale: per storage, strategy and job of Table III, the interval,
    the cost rate (% of the job), T_l in hours and the number of checkpoints.

    One iteration is GPT2-0.35B's on the A30 server as ``write_limit`` reconstructs it (16.8 s / 19), for
    every job (the other models' own sizes and iteration times are not modelled): the cost rate is then
    the same for every job, and T_l grows with its length. lambda 0.08 per hour. ``measured`` needs
    checkfreq's components where it has cpsr_fix.
    """
    iteration_s = paper_persist_s() / PAPER_PERSIST_ITERATIONS
    lam = units.failure_rate_per_iteration(PAPER_FAILURES_PER_HOUR, iteration_s)
    rows = []
    for storage in PAPER_STORAGE_MBPS:
        comps = {s: projected_components(m, storage) for s, m in measured.items()}
        for strategy, c in comps.items():
            cost = strategy_cost(strategy, c, lam, rho)
            T_c = projected_interval(strategy, comps, cost, budget)
            rate = float(cost(np.array([T_c]))[0])
            for job, seconds in PAPER_JOBS_S.items():
                rows.append({"job": job, "storage_mbps": storage, "strategy": strategy, "T_c": T_c,
                             "cost_pct": 100 * rate, "ft_cost_h": rate * seconds / 3600,
                             "checkpoints": seconds / iteration_s / T_c,
                             "expected_failures": PAPER_FAILURES_PER_HOUR * seconds / 3600})
    return rows


# ---------------------------------------------------------------- running jobs

def train(config: str, iters: int, eval_from: int, every: int, valid_sequences: int) -> None:
    """Child: train_gpt's job to ``iters``, evaluating at 0 and every ``every`` iterations from ``eval_from`` on."""
    job = train_gpt.setup(["--deepspeed_config", config, "--train-iters", str(eval_from), "--eval-interval",
                           str(eval_from), "--log-interval", str(iters), "--valid-sequences", str(valid_sequences)])
    train_gpt.train(job)
    job.args.train_iters, job.args.eval_interval = iters, every
    train_gpt.train(job)
    train_gpt.finish(job)


@dataclass(frozen=True)
class Layout:
    """How a run's job is laid out: pipeline stages, processes, and the rank its failures kill."""

    stages: int
    procs: int
    kill_rank: int


LAYOUTS = {
    # One process, trained in a child of the benchmark: a lost node leaves storage alone.
    "one": Layout(stages=1, procs=1, kill_rank=0),
    # Two pipeline stages under DeepSpeed's launcher: the other stage's rank survives each failure and dumps its
    # exact state (survivor dumps); a lost node takes only the killed rank's memory.
    "pp2": Layout(stages=2, procs=2, kill_rank=1),
    # Two data-parallel replicas: the survivor's dump is the killed rank's exact state too.
    "dp2": Layout(stages=1, procs=2, kill_rank=1),
}


def ds_config(iters: int, run_dir: str, cpsr: dict, stages: int = 1) -> dict:
    with open(BASE_CONFIG) as f:
        config = json.load(f)
    warmup = config.get("scheduler", {}).get("params", {}).get("warmup_num_steps", 0)
    config.update(train_micro_batch_size_per_gpu=MICRO_BATCH, gradient_accumulation_steps=1)
    config["scheduler"] = {"type": "WarmupCosineLR", "params": {
        "total_num_steps": iters, "warmup_num_steps": warmup, "cos_min_ratio": COS_MIN_RATIO}}
    config["pipeline"] = {"stages": stages}
    config["gpt"] = dict(MODEL)
    config["cpsr"] = {**cpsr, "checkpoint": {"dir": run_dir, **cpsr.get("checkpoint", {})}}
    return config


def node_dir(run_dir: str) -> str:
    """The run's node memory: its ``checkpoint.survivor_dir``, which a lost node takes with it."""
    return f"{run_dir}.node"


def strategy_block(strategy: str, interval, write_mbps: float | None, trace: list[int],
                   failures_per_hour: float | None = None, crash_share: float | None = None,
                   run_dir: str | None = None, kill_rank: int = 0) -> dict:
    """The ``cpsr`` block of one strategy's run.

    ``failures_per_hour``: the trace's rate, as ``planner.failure_rate_per_hour``, and ``crash_share`` its mix,
    as ``planner.failure_mix``: a user sets their cluster's there, and the planner (cpsr's intervals; the
    baselines' rules ignore them) starts from them. ``run_dir``: host snapshots and dumps go to its node_dir.
    """
    engine = {"cpsr_fix": "cpsr", IN_MEMORY: "checkfreq"}.get(strategy, strategy)
    mode = "auto" if engine == "cpsr" else "recompute"
    checkpoint = {"strategy": engine, "interval": interval}
    if write_mbps is not None:
        checkpoint["write_mbps"] = write_mbps
    if strategy in MEMORY_INTERVAL:
        checkpoint["memory_interval"] = MEMORY_INTERVAL[strategy]
    if run_dir is not None:
        checkpoint["survivor_dir"] = node_dir(run_dir)
    block = {"checkpoint": checkpoint, "recovery": {"mode": mode},
             "faults": {"kill_at_iteration": trace or None, "kill_rank": kill_rank}}
    planning = {}
    if failures_per_hour is not None:
        planning["failure_rate_per_hour"] = failures_per_hour
    if crash_share is not None:
        planning["failure_mix"] = {PROCESS_CRASH: crash_share, NODE_LOST: 1 - crash_share}
    if planning:
        block["planner"] = planning
    return block


def lose_node(run_dir: str, rank: int) -> None:
    """Remove what rank ``rank``'s node held in memory: its survivor dump, host snapshots and the mark a restart
    tells a crash from a lost node by (recovery/failure_class.py), under node_dir."""
    for path in glob.glob(dumps.dump_dir(node_dir(run_dir), "*", rank) + "*"):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def launched_attempt(log: str, config: str, iters: int, evaluations: tuple[int, int, int], procs: int) -> int:
    """One attempt of ``procs`` ranks under DeepSpeed's per-node launcher, its output appended to ``log``; its
    exit code. Evaluations as :func:`train`'s, at the iterations they fall on."""
    eval_from, every, valid = evaluations
    port = free_port()
    command = [*local_launch(procs, port), train_gpt.__file__, "--deepspeed_config", config, "--train-iters",
               str(iters), "--eval-interval", str(NEVER), "--eval-at", *map(str, range(eval_from, iters + 1, every)),
               "--log-interval", str(iters), "--valid-sequences", str(valid)]
    with open(log, "a") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=JOB_TIMEOUT_S,
                                  env=dict(os.environ, **JOB_ENV)).returncode
        except subprocess.TimeoutExpired:
            code = None
    remove_shm_buffers(port)
    return code


def run_job(run_dir: str, cpsr: dict, iters: int, evaluations: tuple[int, int, int], classes: list[str],
            layout: Layout = LAYOUTS["one"]) -> float:
    """Train in ``run_dir`` to ``iters``, restarting the job after each of its kills, one per failure of
    ``classes``, in order; a lost node's memory (``lose_node``) is removed before its restart. Wall seconds.

    ``evaluations``: (from, every, validation sequences). The DeepSpeed config and the jobs' log lie beside it.
    """
    failures = len(classes)
    for directory in (run_dir, node_dir(run_dir)):
        shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(run_dir)
    config, log = f"{run_dir}.json", f"{run_dir}.log"
    with open(config, "w") as f:
        json.dump(ds_config(iters, run_dir, cpsr, layout.stages), f)
    start = time.time()
    for attempt in range(failures + 1):
        if layout.procs == 1:
            code = Child(log, train, config, iters, *evaluations).wait(JOB_TIMEOUT_S)
            killed = code == -signal.SIGKILL
        else:
            code = launched_attempt(log, config, iters, evaluations, layout.procs)
            # The launcher exits with the killed rank's status: the failure is the one whose marker is there.
            killed = code != 0 and attempt < failures and os.path.exists(
                kill_marker(run_dir, cpsr["faults"]["kill_at_iteration"][attempt], layout.kill_rank))
        if code == 0:
            break
        if not killed or attempt == failures:
            with open(log, errors="replace") as f:
                output = f.read()
            raise RuntimeError(f"{run_dir}: attempt {attempt + 1} ended with exit code {code} (the trace has "
                               f"{failures} failures; log {log}): {tail(output)}")
        if classes[attempt] == NODE_LOST:
            lose_node(run_dir, layout.kill_rank)
    last = read_journal(journal_path(run_dir, 0))[-1].iteration
    if last != iters:
        raise RuntimeError(f"{run_dir}: the journal ends at iteration {last}, not {iters} (log {log})")
    return time.time() - start


def run_iteration_seconds(run_dir: str, trace: list[int]) -> list[float]:
    """:func:`iteration_seconds` of the run in ``run_dir`` (rank 0's journal)."""
    return iteration_seconds(read_journal(journal_path(run_dir, 0)), trace)


def median_iteration_s(run_dir: str) -> float:
    """The median wall time between consecutive journal lines of one attempt (evaluations and restarts are few)."""
    return statistics.median(run_iteration_seconds(run_dir, []))


def checkpoint_bytes(run_dir: str, procs: int = 1) -> int:
    """A rank's share of the run's newest valid checkpoint: all its files over ``procs``."""
    tag = max((c for c in list_checkpoints(run_dir, read_data=False) if c.valid), key=lambda c: c.iteration).tag
    top = os.path.join(run_dir, tag)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(top) for f in fs) // procs


def warm_up(args) -> dict:
    """A short run without a write limit: this model's checkpoint bytes and iteration time, and write_mbps."""
    run_dir = os.path.join(args.out_dir, "warm-up")
    iters = 3 * args.warm_up_interval
    cpsr = {"checkpoint": {"strategy": "cpsr", "interval": args.warm_up_interval}}
    layout = LAYOUTS[args.layout]
    run_job(run_dir, cpsr, iters, (iters, iters, args.valid_sequences), [], layout)
    nbytes, iteration_s = checkpoint_bytes(run_dir, layout.procs), median_iteration_s(run_dir)
    return {"checkpoint_bytes": nbytes, "iteration_time_s": iteration_s, "write_mbps": write_limit(nbytes, iteration_s)}


def run_all(args) -> dict:
    """Every run; the manifest that ``summarize`` reads (written to the out dir as it grows)."""
    os.makedirs(args.out_dir, exist_ok=True)
    manifest = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "from_runs")},
                "warm_up": warm_up(args), "traces": []}
    print(write_limit_text(manifest["warm_up"]["checkpoint_bytes"], manifest["warm_up"]["iteration_time_s"]),
          flush=True)
    write_mbps = manifest["warm_up"]["write_mbps"]
    eval_from, every = window(args.iters)
    ref_dir = os.path.join(args.out_dir, "reference")
    # The reference evaluates over the span its fit covers; every evaluation of a run is one of its.
    ref_from = args.iters - FIT_SPAN * (args.iters - eval_from)
    layout = LAYOUTS[args.layout]
    seconds = run_job(ref_dir, {"checkpoint": {"strategy": "cpsr", "interval": NEVER}}, args.iters,
                      (ref_from, every, args.valid_sequences), [], layout)
    manifest["reference"] = {"dir": ref_dir, "wall_s": seconds}
    print(f"reference: {args.iters} iterations without checkpoints or failures in {seconds:.0f} s", flush=True)
    stop = int(args.iters * (1 - TAIL))
    for number in range(args.traces):
        seed = args.seed + number
        trace = failure_trace(seed, stop, args.failures_per_run)
        classes = failure_classes(seed, len(trace), args.crash_share)
        entry = {"seed": seed, "failures": trace, "classes": classes, "rate_per_iteration": args.failures_per_run / stop,
                 "runs": {}}
        manifest["traces"].append(entry)
        print(f"trace {number} (seed {seed}): failures after iterations "
              + ", ".join(f"{f} ({c})" for f, c in zip(trace, classes)), flush=True)
        for strategy in STRATEGIES:
            interval = args.fixed_interval or ("auto" if strategy != "cpsr_fix"
                                               else used_interval(cost_rows(entry["runs"]["checkfreq"]["dir"])))
            run_dir = os.path.join(args.out_dir, f"trace{number}", strategy)
            block = strategy_block(strategy, interval, write_mbps, trace,
                                   entry["rate_per_iteration"] * 3600 / manifest["warm_up"]["iteration_time_s"],
                                   args.crash_share, run_dir, layout.kill_rank)
            seconds = run_job(run_dir, block, args.iters, (eval_from, every, args.valid_sequences), classes, layout)
            entry["runs"][strategy] = {"dir": run_dir, "interval": interval, "wall_s": seconds}
            print(f"  {strategy:9s} interval {interval}: {seconds:.0f} s", flush=True)
            with open(os.path.join(args.out_dir, "manifest.json"), "w") as f:
                json.dump(manifest, f, indent=1)
    return manifest


def components(rows: list[CostRow], strategy: str) -> dict:
    """A run's checkpoint costs in iterations (medians over its checkpoints)."""
    def per_iteration(field):
        return statistics.median(getattr(r, field) / r.iteration_time_s for r in rows)

    in_flight = CheckpointConfig().max_in_flight if strategy == "pccheck" else 1
    return {"strategy": strategy, "T_s": per_iteration("slowdown_s"), "stall": per_iteration("stall_s"),
            "persist": per_iteration("persist_s"), "in_flight": in_flight}


def snapshots_of(strategy: str, run_dir: str) -> tuple[Optional[int], float]:
    """(k, a snapshot's stall in seconds) of a strategy's run: k None without snapshots; memory_interval auto's
    as its log has the plan (planner.first_interval, stall unknown, where it logged none)."""
    k = MEMORY_INTERVAL.get(strategy)
    if k != "auto":
        return k, 0.0
    return snapshot_plan(run_dir) or (PlannerConfig().first_interval, 0.0)


def neighbour_base_s(strategy: str, clean_s: dict) -> float:
    """A run's baseline iteration time: the mean clean iteration time (``clean_s``: strategy -> seconds) of the runs
    without host snapshots just before and just after it on its trace (STRATEGIES' order; one at either end),
    itself left out. For a run with snapshots the excess over it is their cost; for one without, the noise."""
    plain = [s for s in STRATEGIES if s not in MEMORY_INTERVAL and s != strategy]
    at = STRATEGIES.index(strategy)
    before = [s for s in plain if STRATEGIES.index(s) < at][-1:]
    after = [s for s in plain if STRATEGIES.index(s) > at][:1]
    return statistics.mean(clean_s[s] for s in before + after)


def run_summary(run_dir: str, strategy: str, trace: list[int], classes: list[str], reference: dict, iters: int,
                iteration_s: float, failure_free_s: float, rows: list[CostRow], base_s: float) -> dict:
    """One run's T_l and its parts (``rows``: its :func:`cost_rows`; ``base_s``: its :func:`neighbour_base_s`), per
    failure class too."""
    checkpoint_s, checkpoints, measured = checkpoint_cost(rows, committed_checkpoints(f"{run_dir}.log"))
    recovered = recoveries(read_reports(run_dir))
    if recovered["n_failures"] != len(trace):
        raise RuntimeError(f"{run_dir}: recovery.jsonl has {recovered['n_failures']} restarts, the trace "
                           f"{len(trace)} failures")
    validation = read_validation(run_dir)
    if recovered["predicted"] or recovered["in_flight"]:
        lag = end_lag(reference, validation, iters)
    else:
        lag = {"lag_iters": 0.0, "lag_paired_iters": 0.0, "unmeasurable": "", "unmeasurable_reason": "",
               "lag_note": "only exact recoveries: the reference from each restored checkpoint on"}
    implausible = implausible_checkpoint_cost(rows)
    entries = read_journal(journal_path(run_dir, 0))
    clean_s = clean_iteration_s(rows)
    k, stall_s = snapshots_of(strategy, run_dir)
    snapshot_s = 0.0 if k is None else snapshot_cost(clean_s, base_s, len(entries), k, stall_s)
    cost = ft_cost(None if implausible else checkpoint_s, recovered["recomputed_iters"], lag["lag_iters"],
                   iteration_s, failure_free_s, snapshot_s)
    saved = None if lag["lag_iters"] is None or not recovered["lost_iters"] else \
        1 - (recovered["recomputed_iters"] + lag["lag_iters"]) / recovered["lost_iters"]
    down = downtimes(entries, trace)
    final = validation[iters]
    try:
        interval = used_interval(rows)
    except ValueError:  # no attempt took two checkpoints
        interval = None
    rho = MEASURED_REDUCTION[PredictorConfig().name] if strategy in ("cpsr", "cpsr_fix") else 0.0
    costs = components(rows, strategy)
    reports = read_reports(run_dir)
    if strategy == "cpsr":
        expected = planned_per_failure(run_dir, reports, classes, PlannerConfig().first_interval, k is not None)
    else:
        model = None if interval is None else expected_per_failure(k, interval, costs["persist"], rho)
        expected = [None if model is None else model[c] for c in classes]
    return {**recovered, **lag, **cost, "checkpoint_unmeasurable_reason": implausible,
            "summed_slowdown_s": checkpoint_s, "checkpoints": checkpoints, "measured_checkpoints": measured,
            "used_interval": interval, "rho": saved, "memory_interval": k, "snapshot_stall_s": stall_s,
            "clean_iteration_excess": clean_s / base_s - 1,
            "per_class": per_class(reports, classes, down, lag["lag_iters"], expected),
            "restart_downtime_s": sum(down), "downtimes_s": down, "final_val_loss": final,
            "final_loss_excess": final / reference[iters] - 1, "components": costs}


def mean_of(runs: list[dict], key: str) -> float | None:
    """The mean of ``key`` over the runs where it was measured."""
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.mean(values) if values else None


def measured_rho(cpsr_runs: list[dict]) -> tuple[float, str]:
    """The projection's rho: the share of the lost iterations cpsr's recoveries saved, median over its runs
    (recomputed failures saved none); bench_recovery's for the default predictor where no run has one.

    A median below 0 (the predictions cost more than recomputing would have) is projected as 0: with an
    estimate not below d, recovery.mode auto recomputes, and the empirical model is defined for rho in [0, 1).
    """
    rhos = [r["rho"] for r in cpsr_runs if r["rho"] is not None]
    if rhos:
        rho, source = statistics.median(rhos), f"measured: median over {len(rhos)} cpsr runs of 1 - recovery cost / d lost"
        return (rho, source) if rho >= 0 else (0.0, f"{source}, {rho:.3f}: below 0, so recomputing")
    predictor = PredictorConfig().name
    return MEASURED_REDUCTION[predictor], f"no cpsr run with a measurable lag: bench_recovery's rho of {predictor}"


def class_summary(runs: list[dict]) -> dict:
    """Per failure class over one strategy's runs: its failures; over the runs where both are known, the recovery
    iterations per failure measured and the model's expected (per_class's ``expected_iters``) and their ratio;
    the recoveries that read a host snapshot or left a lag, the restart downtime per failure."""
    out = {}
    for c in CLASSES:
        rows = [r["per_class"][c] for r in runs if r["per_class"][c]["failures"]]
        known = [row for row in rows if row["recovery_iters"] is not None and row["expected_iters"] is not None]
        n = sum(row["failures"] for row in known)
        measured = sum(row["recovery_iters"] for row in known) / n if n else None
        expected = sum(row["expected_iters"] for row in known) / n if n else None
        failures = sum(row["failures"] for row in rows)
        out[c] = {"failures": failures, "compared_failures": n, "recovery_iters_per_failure": measured,
                  "expected_iters_per_failure": expected,
                  "measured_over_expected": measured / expected if measured is not None and expected else None,
                  "host_snapshot": sum(row["host_snapshot"] for row in rows),
                  "inexact": sum(row["inexact"] for row in rows),
                  "downtime_s_per_failure": sum(row["downtime_s"] for row in rows) / failures if failures else None}
    return out


def summarize(manifest: dict) -> dict:
    settings = manifest["settings"]
    iters = settings["iters"]
    ref_dir = manifest["reference"]["dir"]
    iteration_s = median_iteration_s(ref_dir)
    failure_free_s = iters * iteration_s
    reference = read_validation(ref_dir)
    rows = [{s: cost_rows(run["dir"]) for s, run in t["runs"].items()} for t in manifest["traces"]]
    clean = [{s: clean_iteration_s(r) for s, r in trace_rows.items()} for trace_rows in rows]
    runs = {s: [run_summary(t["runs"][s]["dir"], s, t["failures"], t["classes"], reference, iters, iteration_s,
                            failure_free_s, r[s], neighbour_base_s(s, c))
                for t, r, c in zip(manifest["traces"], rows, clean)]
            for s in STRATEGIES}
    for s in STRATEGIES:
        for run, trace in zip(runs[s], manifest["traces"]):
            run["interval"] = trace["runs"][s]["interval"]
    stats = {s: over_traces([r["ft_cost_pct"] for r in rs]) for s, rs in runs.items()}
    better = [None if None in pair else min(pair) for pair in zip(*([r["ft_cost_s"] for r in runs[b]] for b in BASELINES))]
    rho, rho_source = measured_rho(runs["cpsr"])
    # The projection's model has no host snapshots: in_memory is projected by `cpsr_ds plan --simulate`.
    measured = {s: {k: statistics.median(r["components"][k] for r in rs) if k != "strategy" else s
                    for k in runs[s][0]["components"]} for s, rs in runs.items() if s != IN_MEMORY}
    budget = CheckpointConfig().overhead_budget
    return {
        "ft_cost_s": {s: mean_of(rs, "ft_cost_s") for s, rs in runs.items()},
        "ft_cost_pct": {s: stats[s]["mean"] for s in STRATEGIES},
        "median_ft_cost_pct": {s: stats[s]["median"] for s in STRATEGIES},
        "ci95_ft_cost_pct": {s: stats[s]["ci95"] for s in STRATEGIES},
        "unmeasurable": {s: stats[s]["unmeasurable"] for s in STRATEGIES},
        "n_traces_measured": {s: stats[s]["measured"] for s in STRATEGIES},
        "checkpoints": {s: mean_of(rs, "checkpoints") for s, rs in runs.items()},
        "final_val_loss": {"reference": reference[iters], **{s: mean_of(rs, "final_val_loss") for s, rs in runs.items()}},
        "worst_final_loss_excess": {s: max(abs(r["final_loss_excess"]) for r in rs) for s, rs in runs.items()},
        "restart_downtime_s": {s: mean_of(rs, "restart_downtime_s") for s, rs in runs.items()},
        "n_failures": {s: sum(r["n_failures"] for r in rs) for s, rs in runs.items()},
        "reduction_ft_cost_vs_better_baseline": {s: reductions([r["ft_cost_s"] for r in runs[s]], better)
                                                 for s in ("cpsr", "cpsr_fix")},
        "reduction_ft_cost_vs_in_memory": {s: reductions([r["ft_cost_s"] for r in runs[s]],
                                                         [r["ft_cost_s"] for r in runs[IN_MEMORY]])
                                           for s in ("cpsr", "cpsr_fix")},
        "per_class": {s: class_summary(rs) for s, rs in runs.items()},
        "reduction_checkpoints": {s: {b: reductions([r["checkpoints"] for r in runs[s]],
                                                    [r["checkpoints"] for r in runs[b]]) for b in BASELINES}
                                  for s in ("cpsr", "cpsr_fix")},
        "iteration_time_s": iteration_s,
        "failure_free_s": failure_free_s,
        "warm_up": manifest["warm_up"],
        "traces": [{"seed": t["seed"], "failures": t["failures"], "classes": t["classes"],
                    "rate_per_iteration": t["rate_per_iteration"], "clean_iteration_s": c,
                    "runs": {s: runs[s][i] for s in STRATEGIES}} for i, (t, c) in enumerate(zip(manifest["traces"], clean))],
        "projection": {"rows": projection(measured, rho, budget), "components": measured, "rho": rho,
                       "rho_source": rho_source, "budget": budget,
                       "iteration_s": paper_persist_s() / PAPER_PERSIST_ITERATIONS,
                       "failures_per_hour": PAPER_FAILURES_PER_HOUR},
        "settings": settings,
    }


# ---------------------------------------------------------------- output

def num(value, spec: str, width: int) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}{spec}}"


def interval_text(summary: dict, spec: str = ".1%") -> str:
    lo, hi = summary["ci95"] or (None, None)
    return f"median {num(summary['median'], spec, 7)}, mean {num(summary['mean'], spec, 7)} " \
           f"[{num(lo, spec, 7)}, {num(hi, spec, 7)}] over {summary['measured']}" + \
           (f" ({summary['unmeasurable']['count']} unmeasurable)" if summary["unmeasurable"]["count"] else "")


def print_result(result: dict) -> None:
    if result["settings"]["fixed_interval"]:
        print(f"\nSMOKE TEST: every strategy checkpointed every {result['settings']['fixed_interval']} iterations "
              f"(--fixed-interval), not by its own rule: these are not the benchmark's results")
    print(f"\nfailure-free: {result['failure_free_s']:.1f} s ({result['settings']['iters']} iterations of "
          f"{result['iteration_time_s'] * 1e3:.2f} ms); reference final validation loss "
          f"{result['final_val_loss']['reference']:.4f}")
    head = (f"{'strategy':9s} | {'T_c':>5s} {'k':>4s} {'ckpts':>5s} {'meas':>5s} {'fails':>5s} {'PB-R':>4s} {'infl':>4s} {'snap':>4s} | "
            f"{'ckpt s':>7s} {'snap s':>6s} {'base':>6s} "
            f"{'recomp':>6s} {'lag it':>7s} {'recov s':>7s} | {'T_l s':>7s} {'T_l %':>6s} | {'down s':>6s} | "
            f"final loss (vs ref)")
    print("T_c: the interval used (median gap between checkpoints); ckpts: commits, meas: those with a measured "
          "cost (the rest count at its median); infl: recoveries from the parameters of the "
          "checkpoint in flight; snap: recoveries from a host snapshot; k: the host-snapshot interval; snap s: "
          "what the snapshots cost; base: the clean iteration time over that of the runs without snapshots just "
          "before and after it (the noise where there are none); recomp: iterations recomputed; lag it: the lag at the end; recov s: "
          "both at the iteration time; down s: restart downtime, beside T_l")
    for number, trace in enumerate(result["traces"]):
        print(f"\ntrace {number} (seed {trace['seed']}), failures after "
              + ", ".join(f"{f} ({c})" for f, c in zip(trace["failures"], trace["classes"])))
        print(head)
        for s, r in trace["runs"].items():
            lag = f"{'unmeas.':>7s}" if r["unmeasurable"] else num(r["lag_iters"], ".1f", 7)
            snap = sum(c["host_snapshot"] for c in r["per_class"].values())
            print(f"{s:9s} | {num(r['used_interval'], 'd', 5)} {num(r['memory_interval'], 'd', 4)} {r['checkpoints']:5d} "
                  f"{r['measured_checkpoints']:5d} {r['n_failures']:5d} {r['predicted']:4d} {r['in_flight']:4d} {snap:4d} | "
                  f"{num(r['checkpoint_cost_s'], '.2f', 7)} {r['snapshot_cost_s']:6.2f} {r['clean_iteration_excess']:+6.1%} "
                  f"{r['recomputed_iters']:6d} {lag} {num(r['recovery_cost_s'], '.2f', 7)}"
                  f" | {num(r['ft_cost_s'], '.2f', 7)} {num(r['ft_cost_pct'], '.2f', 6)} | "
                  f"{r['restart_downtime_s']:6.1f} | {r['final_val_loss']:.4f} ({r['final_loss_excess']:+.3%})"
                  + (f" | lag unmeasurable: {r['unmeasurable_reason']}" if r["unmeasurable"] else "")
                  + (f" | checkpoint cost unmeasurable: {r['checkpoint_unmeasurable_reason']}"
                     if r["checkpoint_unmeasurable_reason"] else ""))
    print("\nT_l (% of the failure-free time) over the traces: median, mean [95 % interval]; means of the rest")
    for s in STRATEGIES:
        summary = {"median": result["median_ft_cost_pct"][s], "mean": result["ft_cost_pct"][s],
                   "ci95": result["ci95_ft_cost_pct"][s], "measured": result["n_traces_measured"][s],
                   "unmeasurable": result["unmeasurable"][s]}
        print(f"{s:9s} | T_l % {interval_text(summary, '.2f')} | T_l {num(result['ft_cost_s'][s], '.2f', 7)} s | "
              f"ckpts {result['checkpoints'][s]:6.1f} | downtime {result['restart_downtime_s'][s]:6.1f} s | "
              f"final loss {result['final_val_loss'][s]:.4f} (worst |excess| "
              f"{result['worst_final_loss_excess'][s]:.3%}) | failures {result['n_failures'][s]}")
    for s in ("cpsr", "cpsr_fix"):
        print(f"{s} T_l reduction against the better of {' and '.join(BASELINES)} per trace: "
              f"{interval_text(result['reduction_ft_cost_vs_better_baseline'][s])}")
        print(f"{s} T_l reduction against {IN_MEMORY} per trace: "
              f"{interval_text(result['reduction_ft_cost_vs_in_memory'][s])}")
        for b in BASELINES:
            print(f"{s} checkpoints, reduction against {b}: {interval_text(result['reduction_checkpoints'][s][b])}")
    print_classes(result["per_class"])
    print_projection(result["projection"])


def print_classes(per_class: dict) -> None:
    print("\nPer failure class, over the traces: recovery iterations per failure (recomputed + the share of the end "
          "lag), measured and expected: cpsr's as its plans in force at each failure expected (the memory plan's "
          "k / 2 for a crash, the storage plan's guarded expectation for a lost node), the others' as the two-level "
          "model expects at the intervals each run used (k / 2 from a snapshot, (1 - rho) (n / 2 + persist) from "
          "storage); snap: recoveries from a host snapshot; lag: recoveries that left a lag")
    print(f"{'strategy':9s} {'class':13s} | {'fails':>5s} {'snap':>4s} {'lag':>4s} | {'measured':>8s} {'expected':>8s} "
          f"{'ratio':>6s} | {'down s':>6s}")
    for s, classes in per_class.items():
        for c, row in classes.items():
            print(f"{s:9s} {c:13s} | {row['failures']:5d} {row['host_snapshot']:4d} {row['inexact']:4d} | "
                  f"{num(row['recovery_iters_per_failure'], '.1f', 8)} {num(row['expected_iters_per_failure'], '.1f', 8)} "
                  f"{num(row['measured_over_expected'], '.2f', 6)} | {num(row['downtime_s_per_failure'], '.1f', 6)}")


def print_projection(p: dict) -> None:
    print(f"\nProjection: a model, not a measurement. The planner's cost rates (recompute_cost_rate; cpsr: the "
          f"empirical model, rho {p['rho']:.3f}, {p['rho_source']}) with the components measured here per strategy "
          f"(medians over checkpoints, iterations; persist as at 250 MB/s: "
          + ", ".join(f"{s} T_s {c['T_s']:.2f} stall {c['stall']:.2f} persist {c['persist']:.1f}"
                      for s, c in p["components"].items())
          + f") at the paper's scale: one iteration {p['iteration_s']:.3f} s (16.8 s / 19), lambda "
          f"{p['failures_per_hour']} per hour, budget {p['budget']:.0%}; at 2 GB/s the persist time is 8 times "
          f"shorter (torch's stall and T_s too). The cost rate does not depend on the job's length.")
    print(f"{'job':11s} {'storage':>8s} {'strategy':9s} | {'T_c':>7s} {'cost %':>7s} {'T_l h':>7s} {'ckpts':>8s} "
          f"{'failures':>8s}")
    for r in p["rows"]:
        print(f"{r['job']:11s} {r['storage_mbps']:5.0f}MB/s {r['strategy']:9s} | {r['T_c']:7.1f} {r['cost_pct']:7.3f} "
              f"{r['ft_cost_h']:7.3f} {r['checkpoints']:8.0f} {r['expected_failures']:8.2f}")


def plot(result: dict, path: str) -> None:
    """T_l per strategy (checkpoint and recovery parts, mean over the traces with the 95 % interval, each trace
    a dot) and the number of checkpoints."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    xs = np.arange(len(STRATEGIES))
    free = result["failure_free_s"] / 100
    parts = {s: [((r["checkpoint_cost_s"] + r["snapshot_cost_s"]) / free, r["recovery_cost_s"] / free) for r in
                 (t["runs"][s] for t in result["traces"]) if r["ft_cost_s"] is not None] for s in STRATEGIES}
    ckpt = [statistics.mean(p[0] for p in parts[s]) if parts[s] else 0 for s in STRATEGIES]
    recov = [statistics.mean(p[1] for p in parts[s]) if parts[s] else 0 for s in STRATEGIES]
    ax.bar(xs, ckpt, label="checkpoint and snapshot cost")
    ax.bar(xs, recov, bottom=ckpt, label="recovery cost")
    for x, s in zip(xs, STRATEGIES):
        lo, hi = result["ci95_ft_cost_pct"][s] or (None, None)
        if lo is not None and math.isfinite(lo):
            ax.errorbar(x, result["ft_cost_pct"][s], yerr=[[result["ft_cost_pct"][s] - lo], [hi - result["ft_cost_pct"][s]]],
                        color="k", capsize=4)
        ax.plot([x] * len(parts[s]), [a + b for a, b in parts[s]], "k.", ms=5)
    ax.set_xticks(xs, STRATEGIES)
    ax.set_ylabel("T_l, % of failure-free time")
    ax.legend(fontsize=8)
    bx.bar(xs, [result["checkpoints"][s] for s in STRATEGIES], color="grey")
    bx.set_xticks(xs, STRATEGIES)
    bx.set_ylabel("checkpoints per run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="800 iterations, 3 traces (within 15 minutes on 2 cores)")
    p.add_argument("--json", help="write the results here (default, where no output is "
                   "named: into benchmarks/results/NAME/)")
    p.add_argument("--plot", help="write T_l and the checkpoints per strategy here (PNG)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "bench_ftcost"))
    p.add_argument("--from-runs", action="store_true",
                   help="summarise the runs of --out-dir (its manifest.json) again instead of running")
    p.add_argument("--iters", type=int, help="iterations per run (default 3000; --quick: 800)")
    p.add_argument("--traces", type=int, help="failure traces (default 5; --quick: 3; at least 3)")
    p.add_argument("--seed", type=int, default=0, help="the first trace's seed")
    p.add_argument("--failures-per-run", type=float, default=4.0,
                   help="expected failures per run (lambda times the span failures are drawn over)")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="one",
                   help="one process (default); pp2: two pipeline stages, dp2: two data-parallel replicas, under "
                   "DeepSpeed's launcher, each failure killing rank 1")
    p.add_argument("--crash-share", type=float, default=LLAMA3_SHARES[PROCESS_CRASH],
                   help="the share of failures that are process crashes on a live node, the rest lost nodes "
                   "(default: the Llama 3 report's, cpsr_ds/planning/failure_mix.py)")
    p.add_argument("--fixed-interval", type=int,
                   help="every strategy checkpoints every N iterations: a smoke test of the harness, not the benchmark")
    p.add_argument("--warm-up-interval", type=int, default=20, help="the warm-up run checkpoints 3 times at this interval")
    p.add_argument("--valid-sequences", type=int, default=512, help="validation set size (as bench_recovery)")
    args = p.parse_args(argv)
    args.iters = args.iters or (800 if args.quick else 3000)
    args.traces = args.traces or (3 if args.quick else 5)
    if args.traces < 3:
        p.error("--traces must be at least 3")
    if not 0 <= args.crash_share <= 1:
        p.error(f"--crash-share must be in [0, 1], got {args.crash_share}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args = with_default_outputs(args, "bench_ftcost", "" if args.layout == "one" else args.layout, plot=True)
    start = time.time()
    if args.from_runs:
        with open(os.path.join(args.out_dir, "manifest.json")) as f:
            manifest = json.load(f)
        print(f"the runs of {args.out_dir} (its manifest.json) summarised again; write_mbps "
              f"{manifest['warm_up']['write_mbps']:.3f}, failures after iterations "
              + "; ".join(str(t["failures"]) for t in manifest["traces"]), flush=True)
    else:
        manifest = run_all(args)
    try:
        result = summarize(manifest)
    except NoCostRows as err:
        raise SystemExit(f"bench_ftcost: {err}") from None
    result["seconds"] = time.time() - start
    print_result(result)
    finish_benchmark("bench_ftcost", result, args.json, args.plot, plot)


if __name__ == "__main__":
    main()
