"""Recovery cost of every method, by the protocol of docs/design/measurement-protocols.md: the lag behind the reference.

    python -m benchmarks.bench_recovery [--quick] [--json PATH] [--plot PATH] [--data DIR]
        [--num-layers L --hidden-size H --num-attention-heads A --seq-length S] [--seeds N] ...
    python -m benchmarks.bench_recovery --merge A.json B.json ... [--json PATH] [--plot PATH]

Without --json and --plot a run writes both into benchmarks/results/bench_recovery/
(``bench_recovery[_LAYOUTS][_quick]``; no plot for --layouts); --merge writes only what it names.

A run can be split by seed across processes or machines (``--first-seed``, ``--seeds``)
and the parts summarised together with ``--merge``; where parts hold the same case (seed,
T_c, failure, method), the later part's replaces the earlier's, so that some methods
can be measured again (``--methods``) without running the others.

For each seed and each T_c a failure-free reference run of K * T_c iterations trains
the GPT through ``cpsr_ds.initialize`` (single process, DeepSpeed pipeline engine with
one stage, the product's checkpoint engine, a checkpoint every T_c iterations, all
retained, the ``vitp`` predictor learning a fixed number of steps after each
checkpoint), and evaluates a fixed
validation set every few iterations. Then, for each failure at 25/50/75 % of training
and each d in {T_c/2, T_c - 1}: a run directory holds the reference's checkpoints up
to c and a journal that reached f = c + d, exactly what a killed job leaves.
For every method the product's recovery runs on it (``Runtime`` -> ``recovery.recover``:
checkpoint engine load, predictor, state written into the DeepSpeed engine), training
resumes with batches from f on, and the validation loss is measured after restoring,
through the transient and over the late window k in [2d, 4d].

Noise sets the settings: the lag is a loss difference divided by the curve's slope, so
the validation set is large (512 sequences), batches hold 16 sequences, and the
learning rate follows GPT training's warmup and cosine decay over the reference's
length; in a pilot these cut the lag's noise per evaluation from 11-28 iterations
(8 sequences, 128 for validation, constant rate) to 5-12. The run length sets the
other side: the loss a lag leaves grows with the loss's fall over d iterations, so a
run of K = 40 intervals (a real run has hundreds) keeps that fall near 1 % at the
earliest failure, where 20 intervals gave 2 %.

The final validation loss is compared with the reference's at the end of the measured
window (f + 4d) for every method, and for the default also at the end of training
(not with ``--quick``); there its predicting recoveries are also charged as
bench_ftcost charges them, the lag at the end of training that their final loss
excess amounts to, by the failure's place in training (``end_of_training``).

A case whose lag the reference's fit cannot tell (the fit flat or rising around the
window, or a loss beyond its range: ``benchmarks.common.lag.Unmeasurable``) has no lag, only the
reason; the summary counts such cases per method and reason and keeps them out of the
median, the mean and its interval. Their loss excess at f + 4d is reported all the same.
``--merge`` estimates every stored case again from its validation curve, so that
results measured before a change to the estimator are summarised by the current one.

The recovery cost models (``cpsr_ds.planning.cost_model``) are checked against the measured lags:
for every case a predictor recovered, each model's estimate of the lag is stored beside
it (``cost_model`` in the case's record, with the paper model's inputs), and the summary
reports per model and predictor Spearman's rank correlation and the median ratio
estimate / measured (JSON field ``cost_model``). The paper model's inputs come offline
from the reference, which keeps every checkpoint: Eq. 11 fitted on the reference's
training losses up to f, Eq. 8 on the predictor's held-out errors (Eq. 9) at the last
``HELD_OUT_POINTS`` checkpoints up to c, each predicted by a fresh predictor from the
checkpoints before it, and xi (Eq. 7) of checkpoint c. ``vitp`` has no paper estimate:
its held-out error needs a trained network at every checkpoint. The empirical model is
checked out of sample, leaving one seed out: a case's estimate is (1 - rho) d with rho
its predictor's mean reduction over the other seeds' cases (the product's rho,
calibration.MEASURED_REDUCTION, were measured on the full benchmark's cases).

Methods: ``recompute`` (RB-R; its cost is d by construction: verified once per seed by
comparing the recomputed losses with the reference's), each predictor forced to PB-R,
and ``default`` (the config's defaults, ``recovery.mode: auto``: the controlled choice;
when it picks a predictor its run is that predictor's run, which is deterministic, and
when it picks RB-R its cost is d).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import statistics
import time
from dataclasses import asdict

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402

import cpsr_ds  # noqa: E402
from cpsr_ds.planning import cost_model# noqa: E402
from cpsr_ds.checkpoint.capture.journal import ProgressJournal, journal_path, read_journal  # noqa: E402
from cpsr_ds.checkpoint.storage.catalog import list_checkpoints  # noqa: E402
from cpsr_ds import predictor  # noqa: E402
from cpsr_ds.predictor import NotReady  # noqa: E402
from cpsr_ds.config import CPSRConfig, PredictorConfig  # noqa: E402
from cpsr_ds.planning.fitter import fit_loss_o, fit_loss_p, held_out_error, stage_xi  # noqa: E402
from examples.gpt.corpus import Batches, load_corpus  # noqa: E402
from examples.gpt.model import GPTConfig, gpt_pipeline  # noqa: E402
from cpsr_ds.runtime.runtime import Runtime  # noqa: E402
from cpsr_ds.recovery import engine_state, new_predictor  # noqa: E402
from benchmarks.common.lag import Unmeasurable, lag_at  # noqa: E402
from benchmarks.common.lag import summarize as summarize_values  # noqa: E402
from cpsr_ds.planning.fitter import fit_curve  # noqa: E402

from benchmarks.common import recovery_jobs  # noqa: E402
from benchmarks.common.paths import ROOT, with_default_outputs  # noqa: E402
from benchmarks.common.processes import free_port  # noqa: E402
from benchmarks.common.recovery_cases import (  # noqa: E402
    SCHEDULES, Case, ds_config, estimate, evaluation_points, failures, interval, pct, print_cases, recomputed,
    reduction_summary, reference_fit, user_scheduler)

PREDICTORS = tuple(predictor.PREDICTORS)
NEVER = 10**9  # a checkpoint interval that never comes: recovered runs write no checkpoints
# The paper model's accuracy fit takes the held-out errors at the last 8 checkpoints up to c:
# each costs loading the checkpoints a fresh predictor learns from, and Eq. 8 is fitted on a recent window.
HELD_OUT_POINTS = 8
# bench_ftcost charges a predicting recovery its lag at the end of training, against the reference's fit over the
# last 60 % of it (3 windows of 20 %): end_of_training charges the default's recoveries the same way.
END_FIT_FROM = 0.4
NEEDS_TRAINING = {"vitp": "vitp's held-out error needs a trained network at every checkpoint"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="T_c = 50 only, 10 vitp steps, the default's runs stop at f + 4d "
                   "(within 15 minutes on 2 cores)")
    p.add_argument("--json", help="write the results here (default, where no output is "
                   "named: into benchmarks/results/NAME/)")
    p.add_argument("--plot", help="write the validation curves around each failure here (PNG)")
    p.add_argument("--data", help="corpus directory (default: the Python standard library's sources)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "bench_recovery"))
    p.add_argument("--seeds", type=int, default=3, help="how many seeds, from --first-seed on")
    p.add_argument("--first-seed", type=int, default=1000)
    p.add_argument("--merge", nargs="+", metavar="JSON", help="summarise the cases of these results instead of running")
    p.add_argument("--intervals", type=int, nargs="+", help="T_c values (default: 50 100; --quick: 50)")
    p.add_argument("--intervals-per-run", type=int, default=40, help="K: each reference trains K x T_c iterations "
                   "(at least 20, so that the failure at 75 %% has 4d iterations after it)")
    p.add_argument("--vitp-steps", type=int, help="vitp: predictor training steps after each checkpoint (a step "
                   "count, not seconds, so that the machine's load does not change the result). Default 20: vitp is "
                   "ready from the 10th checkpoint on, the first failure; --quick: 10, ready from the 15th")
    p.add_argument("--eval-every", type=int, default=20, help="reference evaluation interval, iterations")
    p.add_argument("--valid-sequences", type=int, default=512,
                   help="validation set size: at 512 the reference's residual from its fit is about 0.2 %% of the loss")
    p.add_argument("--methods", nargs="+", default=list(PREDICTORS))
    p.add_argument("--layouts", nargs="+", choices=["pp2", "dp2", "pp2dp2", "crash", "zero3"],
                   help="instead of the single-process methods: real multi-process jobs killed and restarted "
                   "(benchmarks/common/recovery_jobs.py)")
    p.add_argument("--cost-model", action=argparse.BooleanOptionalAction, default=True,
                   help="check the recovery cost models against the lags (their inputs load up to 8 checkpoints "
                   "before each failure)")
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_tiny_cpu.json"),
                   help="DeepSpeed config: optimizer and warmup (the pipeline is one stage, one process)")
    p.add_argument("--cos-min-ratio", type=float, default=0.1,
                   help="the learning rate decays along a cosine over the reference's length to this share of its peak")
    p.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                   help="the learning-rate schedule after the config's warm-up: cosine (to --cos-min-ratio), linear "
                   "(DeepSpeed's WarmupDecayLR, to 0), constant (WarmupLR), wsd (warmup-stable-decay: a torch LambdaLR "
                   "decaying linearly to 0 over the last 20 %%, passed to initialize as a user's own scheduler)")
    p.add_argument("--lr", type=float, help="the peak learning rate (default: the config's)")
    model = p.add_argument_group("model (defaults: a GPT small enough for many runs on 2 cores)")
    model.add_argument("--num-layers", type=int, default=2)
    model.add_argument("--hidden-size", type=int, default=64)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--seq-length", type=int, default=64)
    model.add_argument("--micro-batch", type=int, default=16)
    args = p.parse_args(argv)
    args.intervals = args.intervals or ([50] if args.quick else [50, 100])
    args.vitp_steps = args.vitp_steps or (10 if args.quick else 20)
    if args.layouts and (args.merge or args.plot):
        p.error("--layouts is measured and summarised on its own: no --merge, no --plot")
    if args.intervals_per_run < 20:
        p.error("--intervals-per-run must be at least 20")
    return args


class Seed:
    """One seed's reference run for one T_c, and the engine every recovery of it is written into."""

    def __init__(self, args, seed: int, Tc: int, corpus):
        self.args, self.seed, self.Tc = args, seed, Tc
        self.train_iters = args.intervals_per_run * Tc
        self.ref_dir = os.path.join(args.out_dir, f"seed{seed}-Tc{Tc}", "reference")
        shutil.rmtree(os.path.dirname(self.ref_dir), ignore_errors=True)
        gpt = GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length)
        torch.manual_seed(seed)
        model = gpt_pipeline(gpt, num_stages=1, seed=seed)
        config = ds_config(args, self.ref_dir, Tc, self.train_iters,
                           {"predictor": {"name": "vitp", "history": 8, "train_budget_s": None,
                                          "train_steps": args.vitp_steps}})
        self.engine, *_ = cpsr_ds.initialize(model=model, model_parameters=model.parameters(), config=config,
                                             lr_scheduler=user_scheduler(args, self.train_iters))
        self.batches = Batches(*corpus, seq_length=args.seq_length, micro_batch=args.micro_batch, grad_accum=1,
                               seed=seed, valid_sequences=args.valid_sequences)
        # One stage: evaluation takes micro-batches of any size, and larger ones run faster.
        self.validation = dataclasses.replace(self.batches, micro_batch=64).validation()
        self.reference: dict[int, float] = {}
        self.states: dict[int, dict] = {}

    def checkpoint_state(self, iteration: int) -> dict:
        """The reference's checkpoint at ``iteration`` as recovery loads it (``engine_state``), loaded once."""
        if iteration not in self.states:
            tag = self.tag_of(iteration)
            load_path, _ = self.engine.load_checkpoint(self.ref_dir, tag=tag)
            if load_path is None:
                raise RuntimeError(f"could not load the reference's checkpoint {tag} in {self.ref_dir}")
            self.states[iteration] = engine_state(self.engine)
        return self.states[iteration]

    def tag_of(self, iteration: int) -> str:
        """The tag of the reference's checkpoint at ``iteration``."""
        return next(ck.tag for ck in list_checkpoints(self.ref_dir, read_data=False)
                    if ck.valid and ck.iteration == iteration)

    def checkpoint_iterations(self) -> list[int]:
        return sorted(ck.iteration for ck in list_checkpoints(self.ref_dir, read_data=False) if ck.valid)

    def evaluate(self) -> float:
        return float(self.engine.eval_batch(iter(self.validation), num_micro_batches=len(self.validation)))

    def train(self, start: int, stop: int, evaluate_at=()) -> dict[int, float]:
        """Train batches ``start``..``stop - 1``; validation loss after each iteration in ``evaluate_at``."""
        losses = {start: self.evaluate()} if start in evaluate_at else {}
        for iteration in range(start, stop):
            self.engine.train_batch(iter(self.batches.micro_batches(iteration)))
            if iteration + 1 in evaluate_at:
                losses[iteration + 1] = self.evaluate()
        return losses

    def run_reference(self, failures) -> None:
        """Train the reference; evaluate it regularly and wherever a recovered run will be compared with it."""
        n, every = self.train_iters, self.args.eval_every
        at = set(range(0, n + 1, every)) | {c + d + k for c, d in failures for k in evaluation_points(d)}
        self.reference = self.train(0, n, evaluate_at=at)
        self.engine.checkpoint_engine.flush()
        self.ref_losses = {e.iteration: e.loss for e in read_journal(journal_path(self.ref_dir, 0))}

    def failure_dir(self, c: int, f: int, name: str) -> str:
        """What a job killed after iteration f leaves: the checkpoints up to c, a journal to f."""
        run_dir = os.path.join(os.path.dirname(self.ref_dir), name)
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        for ck in list_checkpoints(self.ref_dir, read_data=False):
            if ck.valid and ck.iteration <= c:
                shutil.copytree(os.path.join(self.ref_dir, ck.tag), os.path.join(run_dir, ck.tag), copy_function=os.link)
        journal = ProgressJournal(run_dir, rank=0)
        for iteration in range(1, f + 1):
            journal.append(iteration, self.ref_losses[iteration])
        journal.close()
        return run_dir

    def recover(self, run_dir: str, cpsr: dict):
        """The product's recovery on ``run_dir``, into this seed's engine, as ``cpsr_ds.initialize`` runs it."""
        block = ds_config(self.args, run_dir, NEVER, self.train_iters, cpsr)["cpsr"]
        block["checkpoint"]["keep_last"] = max(block.get("predictor", {}).get("history", 4), 8)
        self.engine.cpsr.journal.close()
        self.engine.cpsr = Runtime(self.engine, CPSRConfig.parse_block(block))
        return self.engine.cpsr.recovery

    def close(self) -> None:
        self.engine.cpsr.journal.close()
        self.engine.checkpoint_engine.cleanup()


def one_reference(out_dir: str, port: str, extra_failures=()) -> Seed:
    """The reference of seed 1000 at T_c 50 (the other settings bench_recovery's defaults), trained in this process
    as its only rank, evaluated where bench_recovery measures its failures and ``extra_failures`` ((c, d) pairs):
    what the benchmarks that follow one failure to the end of training start from (divergence_floor.py,
    early_prediction.py)."""
    args = parse_args(["--intervals", "50", "--seeds", "1", "--first-seed", "1000", "--out-dir", out_dir])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    seed = Seed(args, 1000, 50, load_corpus(args.data))
    seed.run_reference(failures(args, 50) + list(extra_failures))
    return seed


def verify_recompute(seed: Seed, c: int, d: int) -> bool:
    """RB-R is the reference from c on: recompute c..f + 2 and compare the journaled losses."""
    f = c + d
    run_dir = seed.failure_dir(c, f, "verify")
    report = seed.recover(run_dir, {"recovery": {"mode": "recompute"}})
    assert report.method == "recompute" and report.resume_iteration == c, report
    seed.train(c, f + 2)
    got = {e.iteration: e.loss for e in read_journal(journal_path(run_dir, 0)) if e.iteration > c}
    got = {i: got[i] for i in range(c + 1, f + 3)}
    return all(abs(got[i] - seed.ref_losses[i]) <= 1e-6 * abs(seed.ref_losses[i]) for i in got)


def measure(seed: Seed, fit, method: str, cpsr: dict, c: int, d: int, margin: float, to_end: bool = False) -> Case:
    """Recover a failure at f = c + d as ``cpsr`` configures, train to f + 4d (``to_end``: to the end)."""
    f, Tc = c + d, seed.Tc
    run_dir = seed.failure_dir(c, f, f"{method}-c{c}-d{d}")
    report = seed.recover(run_dir, cpsr)
    if report.method != "predict":
        return recomputed(seed.seed, method, Tc, c, d, report.describe())
    end = seed.train_iters
    curve = seed.train(f, end if to_end else f + 4 * d, evaluate_at={f + k for k in evaluation_points(d)} | {end})
    curve = {i - f: loss for i, loss in curve.items()}
    ref = seed.reference
    excess = lambda i: (curve[i - f] - ref[i]) / ref[i]  # noqa: E731
    return Case(seed.seed, method, Tc, c, d, **estimate(fit, f, d, curve, ref, margin),
                gap_after_restore=curve[0] - ref[f], window_end_excess=excess(f + 4 * d), decision=report.describe(),
                final_loss_excess=excess(end) if to_end else None, curve=curve)


def run(args, seed_class=Seed, on_cases=lambda cases: None) -> dict:
    """Every seed's reference and failures (``seed_class``: a :class:`Seed`); ``on_cases`` is given each failure's
    cases as soon as they are measured."""
    corpus = load_corpus(args.data)
    cases: list[Case] = []
    verified = []
    references = {}
    for number in range(args.first_seed, args.first_seed + args.seeds):
        for Tc in args.intervals:
            t0 = time.time()
            seed = seed_class(args, number, Tc, corpus)
            seed.run_reference(failures(args, Tc))
            references[f"{seed.seed}-Tc{Tc}"] = seed.reference
            losses = [loss for _, loss in sorted(seed.reference.items())]
            print(f"seed {seed.seed} T_c {Tc}: reference {seed.train_iters} iterations in {time.time() - t0:.0f} s, "
                  f"validation {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
            verified.append((seed.seed, Tc, verify_recompute(seed, *failures(args, Tc)[0])))
            for c, d in failures(args, Tc):
                measured = measure_failure(args, seed, c, d)
                on_cases(measured)
                cases += measured
            seed.close()
    return summarize(args, cases, verified, references)


def predicted_with(decision: str) -> str | None:
    """The predictor a recovery's decision names, None where it recomputed."""
    found = re.search(r"predict \(PB-R\) with (\w+):", decision)
    return found and found.group(1)


def predictor_block(method: str) -> dict:
    """The ``cpsr.predictor`` block a forced prediction with ``method`` runs with."""
    return {"name": method, **({"history": 8} if method == "vitp" else {})}


def held_out_points(make, checkpoints: list[int], state_at, c: int, last: int = HELD_OUT_POINTS) -> list:
    """(k, Eq. 9 error of predicting checkpoint k) for the ``last`` checkpoints k <= c, each predicted by a
    fresh predictor (``make()``) fed the checkpoints before k; k without enough of them is left out."""
    upto = [k for k in checkpoints if k <= c]
    points = []
    for j in range(max(0, len(upto) - last), len(upto)):
        predictor = make()
        before = upto[max(0, j - predictor.history.capacity):j]
        if len(before) < predictor.min_history:
            continue
        for k in before:
            predictor.observe(k, state_at(k))
        try:
            predicted = predictor.predict(upto[j])
        except NotReady:
            continue
        points.append((upto[j], held_out_error(predicted, state_at(upto[j]))))
    return points


def fit_record(fit) -> dict:
    return {"fitted": bool(fit), **asdict(fit)}


def cost_model_record(method: str, f: int, c: int, Tc: int, losses: dict, points, curvature) -> dict:
    """Each model's estimate of a predicting case's lag, and the paper model's inputs (``points``: held-out
    errors, None where the method's need training)."""
    models = [cost_model.EmpiricalModel()]
    inputs = {"skipped": NEEDS_TRAINING.get(method, "")}
    if points is not None:
        loss, accuracy = fit_loss_o(losses, f), fit_loss_p(points, Tc)
        inputs = {"held_out": [list(p) for p in points], "loss_o": fit_record(loss),
                  "loss_p": fit_record(accuracy), "xi": fit_record(curvature)}
        models += [cost_model.paper_model(loss, accuracy, curvature, exact) for exact in (True, False)]
    estimates = {model.name: model.estimate(f, c, method) for model in models}
    return {"estimates": {name: e.lag for name, e in estimates.items()},
            "reasons": {name: e.reason for name, e in estimates.items() if not e},
            "inputs": inputs}


def with_cost_model(seed: Seed, case: Case) -> Case:
    """``case`` with its cost-model record where its method predicted."""
    if predicted_with(case.decision) != case.method:
        return case
    c, f = case.c, case.c + case.d
    points = None
    if case.method not in NEEDS_TRAINING:
        make = lambda: new_predictor(CPSRConfig.parse_block({"predictor": predictor_block(case.method)}))  # noqa: E731
        points = held_out_points(make, seed.checkpoint_iterations(), seed.checkpoint_state, c)
    curvature = stage_xi(seed.checkpoint_state(c))
    return dataclasses.replace(case, cost_model=cost_model_record(
        case.method, f, c, seed.Tc, {i: v for i, v in seed.ref_losses.items() if i <= f}, points, curvature))


def measure_failure(args, seed: Seed, c: int, d: int) -> list[Case]:
    """Every method on one failure: recompute, each predictor forced to PB-R, and the default."""
    Tc, margin = seed.Tc, 2 * seed.Tc
    fit = reference_fit(args.eval_every, seed.reference, Tc, c, d)
    # The product's defaults, recovery.mode auto: the controlled choice.
    default = measure(seed, fit, "default", {}, c, d, margin, to_end=not args.quick)
    here = [recomputed(seed.seed, "recompute", Tc, c, d, "RB-R")]
    for method in args.methods:
        if predicted_with(default.decision) == method:
            # Same predictor, same history, same failure: the very state the default run restored.
            here.append(Case(**{**asdict(default), "method": method, "final_loss_excess": None}))
            continue
        cpsr = {"predictor": predictor_block(method), "recovery": {"mode": "predict"}}
        here.append(measure(seed, fit, method, cpsr, c, d, margin))
    here = [with_cost_model(seed, case) if case.method in PREDICTORS and args.cost_model else case for case in here]
    here.append(default)
    print_cases(here)
    return here


def end_excess(rows) -> str:
    finals = [c.final_loss_excess for c in rows if c.final_loss_excess is not None]
    return f"{max(finals):+.3%}" if finals else "-"


def unmeasurable_text(counts: dict) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in counts["by_reason"].items()) or "-"


def out_of_seed_reductions(cases) -> dict[int, dict[str, float]]:
    """seed -> predictor -> rho measured without that seed: the predictor's mean reduction over the other seeds'
    predicting cases with a measurable lag (a predictor with none there is left out)."""
    measured = [c for c in cases if c.cost_model and c.reduction is not None]
    rho = {}
    for seed in sorted({c.seed for c in cases if c.cost_model}):
        others: dict[str, list[float]] = {}
        for c in measured:
            if c.seed != seed:
                others.setdefault(c.method, []).append(c.reduction)
        rho[seed] = {method: statistics.fmean(values) for method, values in others.items()}
    return rho


def with_out_of_seed_empirical(cases, rho: dict) -> list[Case]:
    """The predicting cases with the empirical model's estimate from ``rho`` (out_of_seed_reductions), its
    reason where it has none."""
    out = []
    for case in cases:
        if case.cost_model:
            estimate = cost_model.EmpiricalModel(rho[case.seed]).estimate(case.c + case.d, case.c, case.method)
            record = case.cost_model
            reasons = {k: v for k, v in record.get("reasons", {}).items() if k != estimate.model}
            case = dataclasses.replace(case, cost_model={
                **record, "estimates": {**record["estimates"], estimate.model: estimate.lag},
                "reasons": {**reasons, **({} if estimate else {estimate.model: estimate.reason})}})
        out.append(case)
    return out


def cost_model_check(cases) -> dict:
    """``cost_model.evaluate`` over the predicting cases (``cases``: with_out_of_seed_empirical's): all predictors
    together, and per predictor."""
    checked = [cost_model.Case(c.method, c.lag_iters, c.cost_model["estimates"]) for c in cases if c.cost_model]
    return {"all": cost_model.evaluate(checked),
            "by_predictor": {p: cost_model.evaluate([c for c in checked if c.predictor == p])
                             for p in dict.fromkeys(c.predictor for c in checked)},
            "in_sample": [],
            "empirical_rho": "leave one seed out: rho of a case's predictor, its mean reduction on the other seeds' cases",
            "held_out_points": HELD_OUT_POINTS,
            "no_paper_estimate": NEEDS_TRAINING}


def print_cost_model(check: dict) -> None:
    print("\nRecovery cost models against the measured lags (cases a predictor recovered; Spearman's rho and the "
          "median ratio estimate / measured).")
    print(f"Empirical: rho left one seed out, each case's from its predictor's mean reduction on the other seeds' "
          f"cases (rho by left-out seed below). The paper model's accuracy fit uses the held-out errors at the last "
          f"{HELD_OUT_POINTS} checkpoints up to c.")
    for method, why in NEEDS_TRAINING.items():
        print(f"{method}: no paper estimate ({why}).")
    print(f"{'model':10s} {'predictor':9s} | {'n':>3s} {'spearman':>8s} {'median est/meas':>15s} | "
          f"{'no estimate':>11s} {'unmeasurable':>12s}")
    rows = [("all", check["all"]), *check["by_predictor"].items()]
    for model in sorted(check["all"]):
        for predictor_name, report in rows:
            r = report.get(model)
            if r is None:
                continue
            rho = "-" if r["spearman"] is None else f"{r['spearman']:+.2f}"
            ratio = "-" if r["median_ratio"] is None else f"{r['median_ratio']:.3g}"
            print(f"{model:10s} {predictor_name:9s} | {r['n']:3d} {rho:>8s} {ratio:>15s} | "
                  f"{r['no_estimate']:11d} {r['unmeasurable']:12d}")
    print("\nempirical rho without the seed (predictor: rho)")
    for seed, rho in check["empirical_rho_by_left_out_seed"].items():
        print(f"  seed {seed}: " + ", ".join(f"{p} {value:.3f}" for p, value in rho.items()))


def summarize(args, cases, verified, references) -> dict:
    methods = ["recompute", *args.methods, "default"]
    out = {"median_reduction": {}, "mean_reduction": {}, "ci95_reduction": {}, "ci95_half_width_over_d": {},
           "median_reduction_paired": {}, "mean_reduction_paired": {}, "ci95_reduction_paired": {},
           "ci95_half_width_over_d_paired": {}, "median_window_end_excess": {}, "worst_final_loss_excess": {},
           "lag_beyond_d_plus_ci": {}, "unmeasurable": {}}
    print()
    print("Reductions (1 - lag/d) over the cases with a measurable lag; the loss excess at f + 4d over every case.")
    print(f"{'method':10s} | {'median':>7s} {'mean [95% CI]':>26s} {'half/d':>6s} | {'paired: median':>14s} "
          f"{'mean [95% CI]':>26s} {'half/d':>6s} | {'loss excess at f+4d: median, worst / end':>40s} "
          f"{'lag > d + CI':>12s} {'cases':>5s} | unmeasurable")
    for method in methods:
        rows = [c for c in cases if c.method == method]
        plain, paired = reduction_summary(rows, "reduction"), reduction_summary(rows, "reduction_paired")
        half = math.inf if plain["half"] is None else plain["half"]
        worse = sum(c.lag_iters > c.d * (1 + half) for c in rows if not c.unmeasurable)
        at_end = [c.window_end_excess for c in rows]
        finals = at_end + [c.final_loss_excess for c in rows if c.final_loss_excess is not None]
        median_excess = statistics.median(at_end)
        values = (plain["median"], plain["mean"], plain["ci95"], plain["half"], paired["median"], paired["mean"],
                  paired["ci95"], paired["half"], median_excess, max(finals), worse, plain["unmeasurable"])
        for key, value in zip(out, values):
            out[key][method] = value
        print(f"{method:10s} | {pct(plain['median'], 7)} {interval(plain)} | {pct(paired['median'], 14)} "
              f"{interval(paired)} | {median_excess:+17.3%}, {max(at_end):+8.3%} / {end_excess(rows):>9s} "
              f"{worse:12d} {len(rows):5d} | {unmeasurable_text(plain['unmeasurable'])}")
    print(f"\nrecompute verified equal to the reference (rel. 1e-6) on seeds: {verified}")
    out["end_of_training"] = end_of_training(cases, references)
    print_end_of_training(out["end_of_training"])
    rho = out_of_seed_reductions(cases)
    cases = with_out_of_seed_empirical(cases, rho)
    check = {**cost_model_check(cases), "empirical_rho_by_left_out_seed": rho}
    print_cost_model(check)
    return {
        "cost_model": check,
        "cases": [{k: v for k, v in asdict(c).items() if k != "curve"} for c in cases],
        **out,
        "default_method": "default",
        "default_predictor": PredictorConfig().name,
        "recompute_verified": verified,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
        "curves": [{"seed": c.seed, "method": c.method, "Tc": c.Tc, "c": c.c, "d": c.d, "curve": c.curve}
                   for c in cases if c.curve and c.method != "default"],
        "references": {str(s): ref for s, ref in references.items()},
    }


def end_lag(reference: dict[int, float], excess: float) -> float | None:
    """The lag at the end of training that a final validation loss ``excess`` (relative to the reference's) amounts
    to: the reference's fit over its last 60 % (END_FIT_FROM), paired at the end (lag.lag_at); None where the fit
    cannot tell (lag.Unmeasurable)."""
    end = max(reference)
    fit = fit_curve(*zip(*sorted(reference.items())), lo=END_FIT_FROM * end, hi=end)
    try:
        return lag_at(fit, end, reference[end] * (1 + excess), margin=end / 5,
                      residual=reference[end] - float(fit(end)))
    except Unmeasurable:
        return None


def end_of_training(cases, references: dict) -> dict:
    """The default's predicting recoveries (its runs go on to the end of training) charged as bench_ftcost charges
    them, the lag at the end of training (end_lag), beside the protocol's lag over [2d, 4d]: reductions 1 - lag / d
    by where in training the failure came (its checkpoint's share of the run, 25, 50 or 75 %).

    Where the two disagree, the cost model (rho from the late window) and T_l (the lag at the end) value the same
    recovery differently.
    """
    rows = []
    for c in cases:
        if c.method != "default" or c.final_loss_excess is None or c.unmeasurable or not predicted_with(c.decision):
            continue
        reference = {int(i): loss for i, loss in references[f"{c.seed}-Tc{c.Tc}"].items()}
        lag = end_lag(reference, c.final_loss_excess)
        rows.append((round(4 * c.c / max(reference)) * 25, c.reduction, None if lag is None else 1 - lag / c.d))
    out = {}
    for share in sorted({r[0] for r in rows}) + ["all"]:
        here = [r for r in rows if share == "all" or r[0] == share]
        unmeasured = ["unmeasurable"] * sum(r[2] is None for r in here)
        out[f"{share} %" if share != "all" else "all"] = {
            "cases": len(here), "window": summarize_values([r[1] for r in here], []),
            "end": summarize_values([r[2] for r in here if r[2] is not None], unmeasured)}
    return out


def print_end_of_training(table: dict) -> None:
    if not table:
        return
    print("\nThe default's predicting recoveries charged at the end of training, as bench_ftcost charges them "
          "(reduction 1 - lag / d)")
    print(f"{'failure in training':>20s} | {'cases':>5s} | {'[2d, 4d]: median':>16s} {'mean':>7s} | "
          f"{'end of training: median':>23s} {'mean [95% CI]':>26s}")
    for share, row in table.items():
        end = row["end"]
        lo, hi = end["ci95"] or (None, None)
        print(f"{'at ' + share:>20s} | {row['cases']:5d} | {pct(row['window']['median'], 16)} "
              f"{pct(row['window']['mean'], 7)} | {pct(end['median'], 23)} {pct(end['mean'], 7)} "
              f"[{pct(lo, 7)}, {pct(hi, 7)}]")


def plot(result: dict, path: str) -> None:
    """Validation loss around each failure of the first seed, every method against the reference (Fig. 8)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = min(c["seed"] for c in result["curves"])
    failures = sorted({(c["Tc"], c["c"], c["d"]) for c in result["curves"] if c["seed"] == first})
    cols = 2
    rows = math.ceil(len(failures) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), squeeze=False)
    for ax, (Tc, c, d) in zip(axes.flat, failures):
        f = c + d
        reference = {int(i): v for i, v in result["references"][f"{first}-Tc{Tc}"].items()}
        span = [i for i in sorted(reference) if c - Tc <= i <= f + 4 * d]
        ax.axvspan(f + 2 * d, f + 4 * d, color="0.93", label="late window")
        ax.plot(span, [reference[i] for i in span], "k-", lw=2, label="reference")
        for curve in result["curves"]:
            if curve["seed"] == first and (curve["Tc"], curve["c"], curve["d"]) == (Tc, c, d):
                # Around the failure only: the default's runs go on to the end of training.
                ks = sorted(k for k in map(int, curve["curve"]) if k <= 4 * d)
                ax.plot([f + k for k in ks], [curve["curve"][k] if k in curve["curve"] else curve["curve"][str(k)] for k in ks],
                        "o-", ms=3, label=curve["method"])
        ax.axvline(c, color="grey", ls=":", lw=1)
        ax.axvline(f, color="red", ls="--", lw=1)
        ax.set_title(f"T_c={Tc}, c={c}, d={d} (failure at {f})")
        ax.set_xlabel("iteration")
        ax.set_ylabel("validation loss")
    for ax in list(axes.flat)[len(failures):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def case_key(case: dict) -> tuple:
    return case["seed"], case["Tc"], case["c"], case["d"], case["method"]


def merge(args) -> dict:
    """One summary over the cases of several results files; a later file's case replaces an earlier file's."""
    parts = []
    for path in args.merge:
        with open(path) as f:
            parts.append(json.load(f))
    args.methods = list(dict.fromkeys(m for part in parts for m in part["settings"]["methods"]))
    cases = {case_key(case): case for part in parts for case in part["cases"]}
    verified = {tuple(v[:2]): tuple(v) for part in parts for v in part["recompute_verified"]}
    references = {k: v for part in parts for k, v in part["references"].items()}
    curves = {case_key(curve): curve for part in parts for curve in part["curves"]}
    eval_every = sorted({part["settings"]["eval_every"] for part in parts})
    if len(eval_every) > 1:
        raise SystemExit(f"--merge: the parts evaluate their references at different intervals {eval_every}")
    estimated = [reestimate(case, curves, references, eval_every[0]) for case in cases.values()]
    result = summarize(args, estimated, list(verified.values()), references)
    result["curves"] = list(curves.values())
    result["seconds"] = sum(part["seconds"] for part in parts)
    result["settings"] = {**parts[0]["settings"], "merged": args.merge}
    return result


def reestimate(case: dict, curves: dict, references: dict, eval_every: int) -> Case:
    """A stored case with its lag estimated again from its validation curve (as stored where it has none: RB-R)."""
    method = case["method"] if case["method"] != "default" else predicted_with(case["decision"])
    stored = curves.get((*case_key(case)[:4], method))
    if stored is None:
        return Case(**case)
    seed, Tc, c, d, _ = case_key(case)
    reference = {int(i): loss for i, loss in references[f"{seed}-Tc{Tc}"].items()}
    curve = {int(k): loss for k, loss in stored["curve"].items()}
    fit = reference_fit(eval_every, reference, Tc, c, d)
    return Case(**{**case, **estimate(fit, c + d, d, curve, reference, 2 * Tc)})


def main(argv=None, **run_options) -> None:
    """``run_options``: :func:`run`'s."""
    args = parse_args(argv)
    if not args.merge:  # a merge of chosen files is written only where asked
        args = with_default_outputs(args, "bench_recovery", "_".join(args.layouts or []), plot=not args.layouts)
    if args.merge:
        result = merge(args)
    elif args.layouts:
        start = time.time()
        result = recovery_jobs.summarize(args, recovery_jobs.run(args))
        result["seconds"] = time.time() - start
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="gloo")
        start = time.time()
        result = run(args, **run_options)
        result["seconds"] = time.time() - start
        # Left to the interpreter's teardown, gloo's threads can abort a process that finished (see train_gpt.finish).
        torch.distributed.destroy_process_group()
    print(f"\nbench_recovery: {result['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
