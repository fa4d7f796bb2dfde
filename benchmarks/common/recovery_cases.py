"""bench_recovery's cases and their summaries, shared by its single-process runs (bench_recovery.py) and its
multi-process layouts (recovery_jobs.py): one failure's measured lag and what its report prints."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from benchmarks.common.lag import Unmeasurable, late_lag, transient
from benchmarks.common.lag import summarize as summarize_values
from cpsr_ds.planning.fitter import fit_curve


@dataclass
class Case:
    seed: int
    method: str
    Tc: int
    c: int
    d: int
    # The lag fields are None where the lag is unmeasurable.
    lag_iters: float | None  # the protocol's estimate, the primary figure
    reduction: float | None  # 1 - lag_iters / d
    lag_paired_iters: float | None  # paired with the reference's deviation at the same iteration (lag.lag_at)
    reduction_paired: float | None
    gap_after_restore: float  # validation loss right after restoring minus the reference's at f
    transient_iters: int | None
    window_end_excess: float  # (recovered - reference) / reference validation loss at f + 4d
    decision: str = ""
    final_loss_excess: float | None = None  # the same at the end of training (the default's runs go on to it)
    curve: dict = field(default_factory=dict)  # k -> validation loss
    unmeasurable: str = ""  # why there is no lag (Unmeasurable.kind); "" where there is one
    unmeasurable_reason: str = ""  # the same in full
    # A predicting case's cost-model check: "estimates" (model -> lag or None), "reasons" (why None),
    # "inputs" (the paper model's fits, or why it has none); {} where the method did not predict.
    cost_model: dict = field(default_factory=dict)
    # Multi-process layouts (recovery_jobs.py): seconds from launching the restart to its first step, the bytes
    # recovery read on every rank together, c's size, and the iterations between f and the resume iteration.
    restart_s: float | None = None
    bytes_read: int | None = None
    checkpoint_bytes: int | None = None
    lost: int | None = None


SCHEDULES = ("cosine", "linear", "constant", "wsd")
WSD_DECAY = 0.2  # the share of the run a warmup-stable-decay schedule decays over, at its end


def ds_config(args, run_dir: str, interval: int, train_iters: int, cpsr: dict) -> dict:
    """The config of a one-stage run: ``args``'s model batch, schedule (``args.schedule``, default cosine) and peak
    learning rate (``args.lr``, default the config's), the checkpoint every ``interval``, and the ``cpsr`` block."""
    with open(args.config) as f:
        config = json.load(f)
    config.pop("gpt", None)
    config.update(train_micro_batch_size_per_gpu=args.micro_batch, gradient_accumulation_steps=1)
    lr = getattr(args, "lr", None) or config["optimizer"]["params"]["lr"]
    config["optimizer"]["params"]["lr"] = lr
    warmup = config.get("scheduler", {}).get("params", {}).get("warmup_num_steps", 0)
    schedule = getattr(args, "schedule", "cosine")
    # GPT training decays the learning rate, and a run that ends at a low rate is what a
    # user's final validation loss is measured on.
    config["scheduler"] = {
        "cosine": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": train_iters, "warmup_num_steps": warmup, "cos_min_ratio": args.cos_min_ratio}},
        "linear": {"type": "WarmupDecayLR", "params": {
            "total_num_steps": train_iters, "warmup_num_steps": warmup, "warmup_max_lr": lr}},
        "constant": {"type": "WarmupLR", "params": {"warmup_num_steps": warmup, "warmup_max_lr": lr}},
        "wsd": None,  # the user's own LambdaLR: user_scheduler
    }[schedule]
    if config["scheduler"] is None:
        del config["scheduler"]
    config["pipeline"] = {"stages": 1}
    config["cpsr"] = {"checkpoint": {"dir": run_dir, "interval": interval, "keep_last": 10**6}, **cpsr}
    if schedule == "wsd":  # a LambdaLR does not say where it ends
        config["cpsr"]["planner"] = {**config["cpsr"].get("planner", {}), "train_iters": train_iters}
    return config


def user_scheduler(args, train_iters: int):
    """For ``--schedule wsd``, the scheduler a user passes to initialize: a function of the optimizer giving a
    LambdaLR that warms up linearly over the config's warm-up, holds, and decays linearly to 0 over the last
    WSD_DECAY of the run; None for the schedules the config's "scheduler" block makes."""
    if getattr(args, "schedule", "cosine") != "wsd":
        return None
    with open(args.config) as f:
        warmup = max(1, json.load(f).get("scheduler", {}).get("params", {}).get("warmup_num_steps", 1))
    decay_from = int(train_iters * (1 - WSD_DECAY))

    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        return 1.0 if k < decay_from else max(0.0, (train_iters - k) / (train_iters - decay_from))

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def evaluation_points(d: int) -> list[int]:
    """k after the restart: right after restoring, through the transient, and 5 over the late window."""
    early = [0, max(1, d // 2), d]
    late = [int(round(2 * d + j * 2 * d / 4)) for j in range(5)]
    return sorted(set(early + late))


def recomputed(seed: int, method: str, Tc: int, c: int, d: int, decision: str) -> Case:
    """RB-R's cost is d by construction (the recomputed run is the reference)."""
    return Case(seed, method, Tc, c, d, float(d), 0.0, float(d), 0.0, 0.0, 0, 0.0, decision, 0.0)


def reference_fit(eval_every: int, reference: dict, Tc: int, c: int, d: int):
    """The reference's validation curve fitted over a span around a failure at c + d."""
    its, losses = zip(*sorted(reference.items()))
    return fit_curve(its, losses, lo=max(eval_every, c - 2 * Tc), hi=c + 5 * d + Tc)


def estimate(fit, f: int, d: int, curve: dict[int, float], reference: dict[int, float], margin: float) -> dict:
    """A case's lag fields from a recovered run's validation ``curve`` (k -> loss); None and the reason where
    the lag is unmeasurable."""
    try:
        lag = late_lag(fit, f, d, curve, margin)
        paired = late_lag(fit, f, d, curve, margin, reference=reference)
    except Unmeasurable as why:
        return dict(lag_iters=None, reduction=None, lag_paired_iters=None, reduction_paired=None,
                    transient_iters=None, unmeasurable=why.kind, unmeasurable_reason=str(why))
    return dict(lag_iters=lag, reduction=1.0 - lag / d, lag_paired_iters=paired, reduction_paired=1.0 - paired / d,
                transient_iters=transient(fit, f, d, curve, paired, margin, reference=reference),
                unmeasurable="", unmeasurable_reason="")


def failures(args, Tc: int) -> list[tuple[int, int]]:
    """(c, d): failures at 25/50/75 % of training, d in {T_c/2, T_c - 1}."""
    return [(int(round(share * args.intervals_per_run)) * Tc, d) for share in (0.25, 0.5, 0.75) for d in (Tc // 2, Tc - 1)]


def print_cases(cases) -> None:
    for case in cases:
        lag = (f"lag unmeasurable ({case.unmeasurable})" if case.unmeasurable else
               f"lag {case.lag_iters:6.1f} (paired {case.lag_paired_iters:6.1f})")
        transient_iters = "-" if case.transient_iters is None else case.transient_iters
        print(f"  seed {case.seed} Tc {case.Tc:4d} c {case.c:5d} d {case.d:3d} {case.method:10s} {lag} "
              f"gap {case.gap_after_restore:+.4f} transient {transient_iters:>4} at f+4d {case.window_end_excess:+.3%}"
              + ("" if case.final_loss_excess is None else f" at the end {case.final_loss_excess:+.3%}")
              + ("" if case.curve else f" | {case.decision}")
              + (f" | {case.unmeasurable_reason}" if case.unmeasurable else ""), flush=True)


def reduction_summary(cases, field: str) -> dict:
    """The summary of the reductions in ``field`` (lag.summarize), with the 95 % interval's half-width
    (in units of d: the mean lag/d's too)."""
    out = summarize_values([getattr(c, field) for c in cases if not c.unmeasurable],
                           [c.unmeasurable for c in cases if c.unmeasurable])
    lo, hi = out["ci95"] or (None, None)
    out["half"] = None if lo is None else (hi - lo) / 2 if math.isfinite(hi) else math.inf
    return out


def pct(value: float | None, width: int, spec: str = ".1%") -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}{spec}}"


def interval(summary: dict) -> str:
    lo, hi = summary["ci95"] or (None, None)
    return f"{pct(summary['mean'], 7)} [{pct(lo, 7)}, {pct(hi, 7)}] {pct(summary['half'], 6)}"
