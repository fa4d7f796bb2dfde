"""The plans of a run beside the checkpoints it took: ``python -m cpsr_ds plan RUN_DIR [--plot FILE.png]``.

Reads the run directory's records (runlog: plans.jsonl, measurements/) and, for the
plot, its losses (the journal of rank 0, validation.csv). A record that cannot be read
is a problem in the report, never an exception: the report shows what is there.

A checkpoint belongs to the plan in force when it was taken: the last plan (in the
order written) made before it, by (attempt, iteration); a plan made after the
checkpoint of iteration c governs the checkpoints after c.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from dataclasses import dataclass
from typing import Optional

from cpsr_ds import runlog
from cpsr_ds.checkpoint.capture.journal import VALIDATION_FILE, read_progress, read_validation
from cpsr_ds.runlog import CostRow, PlanRow, StateRow

JOURNAL_RANK = 0  # whose journal losses the plot shows
# The plan's inputs the table shows, by their PlanRow.inputs key.
INPUT_COLUMNS = (("lambda_per_hour", "lambda/h"), ("T_s", "T_s it"), ("persist", "persist it"), ("alpha1", "alpha1"),
                 ("tau1", "tau1"), ("xi", "xi"), ("N_p", "N_p"), ("d_max", "d_max it"))
# Every field a checkpoint's StateRow and CostRow give, None where its row is missing.
CHECKPOINT_FIELDS = tuple(dict.fromkeys(f.name for cls in (StateRow, CostRow) for f in dataclasses.fields(cls)
                                        if f.name != "kind"))
MEDIANS = ("slowdown_s", "stall_s", "persist_s")


def governing(plans: list[PlanRow], attempt: int, iteration: int) -> Optional[PlanRow]:
    """The plan in force at the checkpoint of (attempt, iteration); None before any plan."""
    made_before = [p for p in plans if (p.attempt, p.iteration) < (attempt, iteration)]
    return made_before[-1] if made_before else None


def checkpoint_rows(rows, plans: list[PlanRow]) -> list[dict]:
    """One entry per checkpoint and stage (StateRow and CostRow merged), with the phase of its plan."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        key = (row.attempt, row.iteration, row.stage)
        entry = merged.setdefault(key, dict.fromkeys(CHECKPOINT_FIELDS))
        entry.update({k: v for k, v in dataclasses.asdict(row).items() if k != "kind"})
    out = []
    for (attempt, iteration, _), entry in sorted(merged.items()):
        plan = governing(plans, attempt, iteration)
        out.append({**entry, "phase": None if plan is None else plan.phase})
    return out


def _median(values) -> Optional[float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def phase_summary(plans: list[PlanRow], checkpoints: list[dict]) -> list[dict]:
    """Per phase (None: before any plan, or no plans at all): its plans' intervals and its checkpoints'
    measured costs (medians over the measuring ranks' CostRows)."""
    unplanned = [None] if any(c["phase"] is None for c in checkpoints) else []
    summary = []
    for phase in dict.fromkeys(unplanned + [p.phase for p in plans]):
        mine = [c for c in checkpoints if c["phase"] == phase]
        taken = sorted({(c["attempt"], c["iteration"]) for c in mine})
        gaps = [b[1] - a[1] for a, b in zip(taken, taken[1:]) if a[0] == b[0]]
        costed = [c for c in mine if c["slowdown_s"] is not None]
        summary.append({"phase": phase, "T_c": [p.T_c for p in plans if p.phase == phase],
                        "recovery": sorted({p.recovery for p in plans if p.phase == phase}),
                        "checkpoints": len(taken), "iterations": [i for _, i in taken],
                        "median_interval": _median(gaps), "measured": len(costed),
                        **{f"median_{name}": _median(c[name] for c in costed) for name in MEDIANS}})
    return summary


def stage_rows(plans: list[PlanRow]) -> list[dict]:
    """Each plan's per-stage plans, flattened, with the plan's iteration, attempt and phase."""
    return [{"iteration": p.iteration, "attempt": p.attempt, "phase": p.phase, **stage}
            for p in plans for stage in p.stages if isinstance(stage, dict)]


def run_report(run_dir: str) -> dict:
    """The plans, per-stage plans, checkpoints and per-phase costs of a run directory, and the problems met."""
    plans, plan_problems = runlog.read_plans(run_dir)
    memory, _ = runlog.read_memory_plans(run_dir)  # the same file: its problems are plan_problems
    rows, row_problems = runlog.read_measurements(run_dir)
    checkpoints = checkpoint_rows(rows, plans)
    return {"dir": run_dir, "has_plans": os.path.exists(runlog.plans_path(run_dir)),
            "plans": [{k: v for k, v in dataclasses.asdict(p).items() if k not in ("kind", "stages")} for p in plans],
            "memory_plans": [{k: v for k, v in dataclasses.asdict(p).items() if k != "kind"} for p in memory],
            "stages": stage_rows(plans), "checkpoints": checkpoints, "phases": phase_summary(plans, checkpoints),
            "problems": plan_problems + row_problems}


def _num(value) -> str:
    """A number in 4 significant digits; a per-stage list as its values joined by "/"."""
    if value is None:
        return "-"
    if isinstance(value, list):
        return "/".join(_num(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.4g}"
    return str(value)


def _phase_name(phase) -> str:
    return "-" if phase is None else str(phase)


def print_report(report: dict) -> None:
    """The report as tables: the plans (each stage's own interval under its plan), then the checkpoints per phase."""
    if not report["has_plans"]:
        print(f"{report['dir']}: no {runlog.PLANS}: the interval was not planned (a fixed interval, or a run from "
              f"before the planner)")
    else:
        print(f"plans of {report['dir']} ({len(report['plans'])}):")
        print(f"{'iteration':>9} {'attempt':>7}  {'reason':<8} {'phase':>5}  {'model':<10} {'recovery':<9} "
              f"{'T_c':>6}  " + " ".join(f"{title:>9}" for _, title in INPUT_COLUMNS))
        for plan in report["plans"]:
            inputs = plan["inputs"] if isinstance(plan["inputs"], dict) else {}
            print(f"{plan['iteration']:>9} {plan['attempt']:>7}  {plan['reason']:<8} {plan['phase']:>5}  "
                  f"{plan['model']:<10} {plan['recovery']:<9} {plan['T_c']:>6}  "
                  + " ".join(f"{_num(inputs.get(key)):>9}" for key, _ in INPUT_COLUMNS))
            for stage in report["stages"]:
                if (stage["attempt"], stage["iteration"]) == (plan["attempt"], plan["iteration"]):
                    expected = ("" if stage.get("per_failure") is None else
                                f", a failure from storage expected to cost {_num(stage['per_failure'])} iterations")
                    print(f"{'':>20}stage {_num(stage.get('stage'))}: T_c {_num(stage.get('T_c'))} "
                          f"({stage.get('method', '?')}){expected}")
            if plan["fallback"]:
                print(f"{'':>20}fallback: {plan['fallback']}")
        if report["memory_plans"]:
            print(f"\nhost-snapshot plans ({len(report['memory_plans'])}):")
            print(f"{'iteration':>9} {'attempt':>7}  {'reason':<8} {'k':>6} {'stall s':>9} {'iteration s':>11} "
                  f"{'crashes/h':>9} {'per crash':>9}")
            for plan in report["memory_plans"]:
                print(f"{plan['iteration']:>9} {plan['attempt']:>7}  {plan['reason']:<8} {plan['interval']:>6} "
                      f"{_num(plan['stall_s']):>9} {_num(plan['iteration_s']):>11} {_num(plan['crashes_per_hour']):>9} "
                      f"{_num(plan['per_crash']):>9}")
    if not report["checkpoints"]:
        print(f"no checkpoint measured ({os.path.join(report['dir'], runlog.MEASUREMENTS_DIR)} has no records)")
    else:
        print("checkpoints taken, per phase (medians over the measuring ranks, seconds):")
        print(f"{'phase':>5} {'planned T_c':>12} {'taken':>6} {'iterations':>14} {'interval':>9} "
              f"{'slowdown_s':>10} {'stall_s':>8} {'persist_s':>9}")
        for p in report["phases"]:
            if not p["iterations"]:
                continue
            span = f"{min(p['iterations'])}..{max(p['iterations'])}"
            planned = ",".join(str(t) for t in dict.fromkeys(p["T_c"])) or "-"
            print(f"{_phase_name(p['phase']):>5} {planned:>12} {p['checkpoints']:>6} {span:>14} "
                  f"{_num(p['median_interval']):>9} {_num(p['median_slowdown_s']):>10} "
                  f"{_num(p['median_stall_s']):>8} {_num(p['median_persist_s']):>9}")
    for problem in report["problems"]:
        print(f"problem: {problem}")


def read_losses(run_dir: str) -> tuple[dict[int, float], dict[int, float], list[str]]:
    """The journal losses of rank 0 and validation.csv's, by iteration (a recomputed iteration: its last
    loss), and the problems met; a missing file gives no losses."""
    progress = read_progress(run_dir)
    problems = list(progress.problems)
    journal = {e.iteration: e.loss for e in progress.entries.get(JOURNAL_RANK, [])}
    try:
        validation = read_validation(run_dir)
    except FileNotFoundError:
        validation = {}
    except (OSError, ValueError) as err:
        validation = {}
        problems.append(f"{os.path.join(run_dir, VALIDATION_FILE)}: {err}: not plotted")
    return journal, validation, problems


def loss_fit(inputs: dict) -> Optional[tuple[float, float]]:
    """(alpha1, alpha2) of a plan's Eq. 11 fit, None where the plan has none. t is the iteration, as
    fitter.fit_loss_o fits on the journal's iterations."""
    if not isinstance(inputs, dict):
        return None
    alpha = inputs.get("alpha1"), inputs.get("alpha2")
    if all(isinstance(a, (int, float)) and math.isfinite(a) for a in alpha):
        return float(alpha[0]), float(alpha[1])
    return None


def fit_windows(plans: list[PlanRow], last: int) -> list[tuple[PlanRow, int, int]]:
    """(plan, lo, hi) for each plan with a loss fit: from the start of its recent window (f / 2, as
    fitter.fit_loss_o) to where the next plan replaced it (the run's ``last`` iteration for the last plan)."""
    out = []
    for k, plan in enumerate(plans):
        if loss_fit(plan.inputs) is None:
            continue
        following = plans[k + 1].iteration if k + 1 < len(plans) else last
        hi = following if following > plan.iteration else plan.iteration + plan.T_c
        out.append((plan, max(1, plan.iteration // 2), hi))
    return out


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _figure():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise PlotUnavailable(f"--plot needs matplotlib ({err}): pip install matplotlib, or the package's "
                              f"bench extra: pip install -e '.[bench]'") from None
    figure = Figure(figsize=(10, 5.5))
    FigureCanvasAgg(figure)
    return figure


@dataclass
class Plot:
    """The figure and the artists drawn on it: one line per fit, per loss source, the interval steps."""

    figure: object
    losses: list
    fits: list
    checkpoints: object
    interval: object


def draw(report: dict, plans: list[PlanRow], journal: dict[int, float], validation: dict[int, float]) -> Plot:
    """The paper's Fig. 12 with the plan on it: the loss curves, each plan's Eq. 11 fit over its window, the
    checkpoints taken (marks at the bottom), and the planned interval (a step line on the right axis)."""
    import numpy as np

    figure = _figure()
    ax = figure.add_subplot()
    losses = [ax.plot(sorted(d), [d[i] for i in sorted(d)], lw=lw, alpha=a, label=label)[0]
              for d, lw, a, label in ((journal, 0.8, 0.6, f"training loss (rank {JOURNAL_RANK})"),
                                      (validation, 1.5, 1.0, "validation loss")) if d]
    taken = sorted({c["iteration"] for c in report["checkpoints"]})
    last = max(taken + list(journal) + list(validation) + [p.iteration + p.T_c for p in plans], default=1)
    fits = []
    for plan, lo, hi in fit_windows(plans, last):
        alpha1, alpha2 = loss_fit(plan.inputs)
        t = np.linspace(lo, hi, 100)
        fits.append(ax.plot(t, np.exp(-alpha1 * t + alpha2), "--", lw=1.2,
                            label=f"Eq. 11 fit of the plan at {plan.iteration} (alpha1 {alpha1:.3g})")[0])
    marks = ax.plot(taken, [0.02] * len(taken), "|", ms=12, color="dimgray", transform=ax.get_xaxis_transform(),
                    label="checkpoint taken")[0]
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    right = ax.twinx()
    interval = None
    if plans:
        interval = right.plot([p.iteration for p in plans] + [last], [p.T_c for p in plans] + [plans[-1].T_c],
                              drawstyle="steps-post", color="black", lw=1.5, label="planned interval T_c")[0]
    right.set_ylabel("planned interval T_c (iterations)")
    for plan in plans:
        if plan.reason == "phase":
            ax.axvline(plan.iteration, color="grey", lw=0.5, ls=":")
    handles = losses + fits + [marks] + ([interval] if interval is not None else [])
    ax.legend(handles=handles, fontsize="small", loc="best")
    ax.set_title(f"{report['dir']}: loss, fits and planned interval")
    return Plot(figure, losses, fits, marks, interval)


def plot_run(run_dir: str, report: dict, path: str) -> Plot:
    """Draw the run's plot into ``path`` (PNG); the losses' reading problems join ``report['problems']``.
    PlotUnavailable without matplotlib, OSError where ``path`` cannot be written."""
    plans, _ = runlog.read_plans(run_dir)
    journal, validation, problems = read_losses(run_dir)
    report["problems"] += problems
    plot = draw(report, plans, journal, validation)
    plot.figure.savefig(path, dpi=100)
    return plot
