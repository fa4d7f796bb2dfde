"""bench_recovery's multi-process layouts: real jobs killed, restarted and measured by the protocol of docs/design/measurement-protocols.md.

    python -m benchmarks.bench_recovery --layouts pp2 dp2 crash [pp2dp2] [zero3] [--quick] [--json PATH]

Every job is ``examples/gpt/train_gpt.py`` under DeepSpeed's launcher (``deepspeed --num_gpus N``,
one thread per process, gloo; ``zero3`` runs it with ``--plain``, the GPT as one module on DeepSpeed's plain engine), with the product's defaults apart from what a layout
or method names. Per seed and T_c:

1. The reference: the failure-free job, a checkpoint every T_c iterations (all kept),
   the validation loss every ``--eval-every`` iterations and at every point a recovered
   run is compared at.
2. Per failure (c, d) (bench_recovery's: 25/50/75 % of training, d in {T_c/2, T_c - 1}):
   the failed job. Its run directory starts as the reference's was after iteration c
   (checkpoints up to c, each rank's journal and measurements to c, the predictor's
   summaries), so the job resumes at c, trains the reference's batches to f = c + d,
   and then rank ``kill_rank`` SIGKILLs itself (``cpsr.faults``); the launcher stops the
   others with SIGTERM, and they dump their state (survivor dumps).
3. Per method, a copy of that directory (and of the dumps) is restarted: the product's
   recovery runs at the start of ``train_gpt.py``, and the job trains to f + 4d (to the
   end of training with ``to_end``), evaluated at bench_recovery's points k after f.

Methods: ``recompute`` (its lag is d by construction: the state of c, the reference's
batches), ``predict_all`` (every source but the checkpoints off: survivor dumps ignored,
every stage predicted, what recovery did before the sources existed) and ``sources``
(the product's defaults: survivor dumps, replicas and host snapshots where they exist,
prediction of the rest). ``crash`` takes host snapshots every ``MEMORY_INTERVAL``
iterations in the failed job; its restart finds the killed rank's snapshot in shared
memory, as on a node that survived a process crash.

Per case, besides bench_recovery's fields: ``restart_s``, from launching the restart to
its first training step, the validation at k = 0 (which ``train_gpt.py`` times) taken
out; ``bytes_read``, what recovery read (every rank, the recovery report's), beside
``checkpoint_bytes``, c's size; ``lost``, the iterations between f and the iteration the
job resumed at; and for a predicting case ``cost_model``: the recovery's own estimate of
the lag and the share of the parameters it predicted, which the summary checks against
the measured lags (Spearman's rho, median ratio estimate / measured, per method).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from benchmarks.common.paths import ROOT
from benchmarks.common.processes import free_port
from benchmarks.common.recovery_cases import (Case, ds_config, estimate, evaluation_points, failures, interval, pct,
                                              print_cases, recomputed, reduction_summary, reference_fit)
from cpsr_ds.planning import cost_model# noqa: E402
from cpsr_ds.checkpoint.capture.journal import JOURNAL_DIR, journal_path, read_journal, read_validation  # noqa: E402
from cpsr_ds.checkpoint.storage.catalog import list_checkpoints  # noqa: E402
from cpsr_ds.checkpoint.storage.ondisk import LATEST  # noqa: E402
from cpsr_ds.recovery import read_reports  # noqa: E402
from cpsr_ds.recovery.sources.summaries import SUMMARIES_DIR  # noqa: E402
from cpsr_ds.runtime.rundir import ATTEMPT  # noqa: E402
from cpsr_ds.runlog import MEASUREMENTS_DIR  # noqa: E402

MEMORY_INTERVAL = 5  # crash: iterations between host snapshots
NEVER = 10**6  # an evaluation interval that never comes
JOB_TIMEOUT_S = 1800
FINISHED = '{"final_iteration": '  # train_gpt.py's last line, once it trained to its end
EVAL_LINE = re.compile(r"iteration\s+(\d+) \| validation loss \S+ \| evaluated in ([\d.]+) s")


@dataclass(frozen=True)
class Layout:
    stages: int
    procs: int
    zero_stage: int
    kill_rank: int
    methods: tuple[str, ...]
    memory_interval: int | None = None
    plain: bool = False  # one plain module on DeepSpeed's plain engine (train_gpt.py --plain), no pipeline


LAYOUTS = {
    # The killed rank holds the last stage; stage 0's rank survives it.
    "pp2": Layout(stages=2, procs=2, zero_stage=0, kill_rank=1, methods=("predict_all", "sources")),
    # Plain data parallelism: the survivor's dump is the lost rank's exact state too.
    "dp2": Layout(stages=1, procs=2, zero_stage=0, kill_rank=1, methods=("sources",)),
    # Two replicas per stage under ZeRO-1: the lost rank's optimizer partition is on no replica, so its fp32 masters
    # come from its replica's dumped weights and its moments are predicted.
    "pp2dp2": Layout(stages=2, procs=4, zero_stage=1, kill_rank=3, methods=("predict_all", "sources")),
    # A process crash on a node that survived: the killed rank's host snapshot is still in shared memory.
    "crash": Layout(stages=2, procs=2, zero_stage=0, kill_rank=1, methods=("sources",), memory_interval=MEMORY_INTERVAL),
    # ZeRO-3 on the plain engine: each rank owns half of every parameter and its moments; the survivor's own
    # partition comes from its dump, the lost rank's is predicted from its own checkpointed partitions.
    "zero3": Layout(stages=1, procs=2, zero_stage=3, kill_rank=1, methods=("predict_all", "sources"), plain=True),
}

METHODS = {"predict_all": {"checkpoint": {"survivor": False}}, "sources": {}}


def merged(base: dict, extra: dict) -> dict:
    """``base`` with ``extra``'s keys set, nested blocks merged."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def link_or_copy(src: str, dst: str) -> str:
    """Checkpoint files are never written again, so they are linked; anything a job appends to is copied."""
    if f"{os.sep}global_step" in src:
        os.link(src, dst)
        return dst
    return shutil.copy2(src, dst)


def lines_upto(src: str, dst: str, keep) -> None:
    """Copy the lines of ``src`` for which ``keep(line)`` holds."""
    with open(src) as f, open(dst, "w") as out:
        out.writelines(line for line in f if line.strip() and keep(line))


class Layouts:
    """One layout's jobs for one seed and T_c, in ``out_dir/<layout>-seed<seed>-Tc<T_c>``."""

    def __init__(self, args, name: str, seed: int, Tc: int):
        self.args, self.name, self.layout, self.seed, self.Tc = args, name, LAYOUTS[name], seed, Tc
        self.train_iters = args.intervals_per_run * Tc
        self.dir = os.path.join(args.out_dir, f"{name}-seed{seed}-Tc{Tc}")
        # Survivor dumps and host snapshots go where the product puts them: shared memory.
        self.shm = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else self.dir,
                                f"cpsr-bench-{os.getuid()}-{os.getpid()}", f"{name}-seed{seed}-Tc{Tc}")
        for path in (self.dir, self.shm):
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
        self.ref_dir = os.path.join(self.dir, "reference")
        self.reference: dict[int, float] = {}

    def config(self, run_dir: str, survivor_dir: str, cpsr: dict) -> dict:
        layout = self.layout
        config = ds_config(self.args, run_dir, self.Tc, self.train_iters, {})
        config["pipeline"] = {"stages": layout.stages}
        config["zero_optimization"] = {"stage": layout.zero_stage}
        config["gpt"] = {"num_layers": self.args.num_layers, "hidden_size": self.args.hidden_size,
                         "num_attention_heads": self.args.num_attention_heads, "seq_length": self.args.seq_length}
        block = {"checkpoint": {"survivor_dir": survivor_dir}}
        if layout.memory_interval:
            block["checkpoint"]["memory_interval"] = layout.memory_interval
        config["cpsr"] = merged(merged(config["cpsr"], block), cpsr)
        return config

    def launch(self, name: str, config: dict, train_iters: int, *extra) -> tuple[int, float, str]:
        """Run one job to its end: (exit code, when it was launched, its output)."""
        path = os.path.join(self.dir, f"{name}.json")
        with open(path, "w") as f:
            json.dump(config, f, indent=1)
        log = os.path.join(self.dir, f"{name}.log")
        command = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(self.layout.procs),
                   "--master_port", str(free_port()), os.path.join(ROOT, "examples", "gpt", "train_gpt.py"),
                   "--deepspeed_config", path, "--seed", str(self.seed), "--train-iters", str(train_iters),
                   "--valid-sequences", str(self.args.valid_sequences), "--log-interval", str(NEVER),
                   *(["--plain"] if self.layout.plain else []), *map(str, extra)]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
                   PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
        launched = time.time()
        with open(log, "w") as out:
            code = subprocess.call(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   timeout=JOB_TIMEOUT_S)
        with open(log, errors="replace") as f:
            return code, launched, f.read()

    def run_reference(self, cases: list[tuple[int, int]]) -> None:
        at = {c + d + k for c, d in cases for k in evaluation_points(d)}
        config = self.config(self.ref_dir, os.path.join(self.shm, "reference"), {})
        config["cpsr"]["checkpoint"]["keep_last"] = NEVER
        code, _, output = self.launch("reference", config, self.train_iters, "--eval-interval", self.args.eval_every,
                                      "--eval-at", *sorted(at))
        if code != 0:
            raise RuntimeError(f"{self.name}: the reference job failed (exit code {code}): {output[-3000:]}")
        self.reference = read_validation(self.ref_dir)

    def as_after(self, c: int, run_dir: str) -> None:
        """``run_dir`` as the reference's was right after iteration c."""
        os.makedirs(run_dir)
        for ck in list_checkpoints(self.ref_dir, read_data=False):
            if ck.valid and ck.iteration <= c:
                shutil.copytree(os.path.join(self.ref_dir, ck.tag), os.path.join(run_dir, ck.tag),
                                copy_function=os.link)
        with open(os.path.join(run_dir, LATEST), "w") as f:
            f.write(f"global_step{c}")
        shutil.copy2(os.path.join(self.ref_dir, ATTEMPT), run_dir)
        for sub in (JOURNAL_DIR, MEASUREMENTS_DIR):
            os.makedirs(os.path.join(run_dir, sub))
            for name in os.listdir(os.path.join(self.ref_dir, sub)):
                src, dst = os.path.join(self.ref_dir, sub, name), os.path.join(run_dir, sub, name)
                if sub == JOURNAL_DIR:
                    lines_upto(src, dst, lambda line: int(line.split(",")[0]) <= c)
                else:
                    lines_upto(src, dst, lambda line: json.loads(line)["iteration"] <= c)
        summaries = os.path.join(self.ref_dir, SUMMARIES_DIR)
        for rank in os.listdir(summaries) if os.path.isdir(summaries) else []:
            os.makedirs(os.path.join(run_dir, SUMMARIES_DIR, rank))
            for name in os.listdir(os.path.join(summaries, rank)):
                if int(name.split("-")[0]) <= c:
                    shutil.copy2(os.path.join(summaries, rank, name), os.path.join(run_dir, SUMMARIES_DIR, rank))

    def fail(self, c: int, d: int) -> str:
        """The failed job of the failure at f = c + d; its run directory."""
        f, name = c + d, f"failed-c{c}-d{d}"
        run_dir = os.path.join(self.dir, name)
        self.as_after(c, run_dir)
        config = self.config(run_dir, os.path.join(self.shm, name), {})
        config["cpsr"]["faults"] = {"kill_rank": self.layout.kill_rank, "kill_at_iteration": f}
        code, _, output = self.launch(name, config, f + 4 * d, "--eval-interval", NEVER)
        reached = read_journal(journal_path(run_dir, self.layout.kill_rank))[-1].iteration
        if code == 0 or reached != f:
            raise RuntimeError(f"{self.name}: the job to be killed after {f} ended with code {code}, its rank "
                               f"{self.layout.kill_rank} at {reached}: {output[-3000:]}")
        return run_dir

    def restart(self, failed: str, method: str, c: int, d: int, to_end: bool, in_place: bool) -> Case:
        """Restart the failed job with ``method``. A copy of its directory is a run of its own, whose survivors'
        dumps recovery (rightly) refuses; so the last method of a failure restarts ``failed`` itself."""
        f, name = c + d, f"{method}-c{c}-d{d}"
        survivors = os.path.join(self.shm, os.path.basename(failed))
        if in_place:
            run_dir, survivor_dir = failed, survivors
        else:
            run_dir, survivor_dir = os.path.join(self.dir, name), os.path.join(self.shm, name)
            shutil.copytree(failed, run_dir, copy_function=link_or_copy)
            shutil.copytree(survivors, survivor_dir)
        config = self.config(run_dir, survivor_dir, METHODS[method])
        end = self.train_iters if to_end else f + 4 * d
        code, launched, output = self.launch(name, config, end, "--eval-interval", NEVER,
                                             "--eval-at", *(f + k for k in evaluation_points(d)))
        shutil.rmtree(survivor_dir, ignore_errors=True)
        if code != 0 and FINISHED not in output:
            raise RuntimeError(f"{self.name}: the restart {name} failed (exit code {code}): {output[-3000:]}")
        if code != 0:  # what it measured is complete; gloo's teardown at exit can still abort a finished process
            print(f"    {name}: exit code {code} after the job's last line (a teardown abort)", flush=True)
        report = read_reports(run_dir)[-1]
        first_step = next(e for e in read_journal(journal_path(run_dir, 0)) if e.wall_time >= launched)
        evaluated = sum(float(s) for i, s in EVAL_LINE.findall(output) if int(i) == report.resume_iteration)
        timing = dict(restart_s=first_step.wall_time - launched - evaluated, bytes_read=report.bytes_read,
                      checkpoint_bytes=report.checkpoint_bytes, lost=f - report.resume_iteration)
        # The recovery's own estimate of the lag, checked against the measured one in the summary.
        estimated = {} if report.method != "predict" or report.cost_model is None else {
            "estimates": {report.cost_model: report.estimated_cost}, "predicted_share": report.predicted_share}
        if report.method != "predict":
            # Recomputing from c (or from a host snapshot) trains the reference's batches from there: its lag is
            # the iterations it redoes.
            case = recomputed(self.seed, method, self.Tc, c, d, report.describe())
            lag = float(f - report.resume_iteration)
            return dataclasses.replace(case, lag_iters=lag, lag_paired_iters=lag, reduction=1 - lag / d,
                                       reduction_paired=1 - lag / d, final_loss_excess=None, **timing)
        validation = read_validation(run_dir)
        curve = {i - f: loss for i, loss in validation.items() if i >= f}
        ref = self.reference
        fit = reference_fit(self.args.eval_every, ref, self.Tc, c, d)
        excess = lambda i: (curve[i - f] - ref[i]) / ref[i]  # noqa: E731
        return Case(self.seed, method, self.Tc, c, d, **estimate(fit, f, d, curve, ref, 2 * self.Tc),
                    gap_after_restore=curve[0] - ref[f], window_end_excess=excess(f + 4 * d),
                    decision=report.describe(), final_loss_excess=excess(end) if to_end else None, curve=curve,
                    cost_model=estimated, **timing)

    def close(self) -> None:
        shutil.rmtree(os.path.dirname(self.shm) if self.shm.startswith("/dev/shm") else self.shm, ignore_errors=True)


def read_ratio(case: Case) -> str:
    if not case.bytes_read or not case.checkpoint_bytes:
        return "-"
    return f"{case.bytes_read / case.checkpoint_bytes:.2f}x"


def run(args) -> dict:
    """Every layout in ``args.layouts``: its cases, keyed by layout."""
    out = {}
    for name in args.layouts:
        cases: list[Case] = []
        references = {}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for Tc in args.intervals:
                t0 = time.time()
                jobs = Layouts(args, name, seed, Tc)
                try:
                    jobs.run_reference(failures(args, Tc))
                    references[f"{seed}-Tc{Tc}"] = jobs.reference
                    print(f"{name}: seed {seed} T_c {Tc}: reference {jobs.train_iters} iterations in "
                          f"{time.time() - t0:.0f} s", flush=True)
                    for c, d in failures(args, Tc):
                        failed = jobs.fail(c, d)
                        here = [recomputed(seed, "recompute", Tc, c, d, "RB-R")]
                        methods = jobs.layout.methods
                        here += [jobs.restart(failed, method, c, d, to_end=not args.quick and method == "sources",
                                              in_place=method == methods[-1]) for method in methods]
                        print_cases(here)
                        for case in here[1:]:
                            print(f"    {case.method}: restart {case.restart_s:.1f} s, read {read_ratio(case)} one checkpoint, "
                                  f"lost {case.lost} | {case.decision}", flush=True)
                        cases += here
                finally:
                    jobs.close()
        out[name] = {"cases": cases, "references": references, "layout": dataclasses.asdict(LAYOUTS[name])}
    return out


def median_or_none(values: list) -> float | None:
    return statistics.median(values) if values else None


def summarize(args, measured: dict) -> dict:
    """Per layout and method: the reductions (median, mean and its 95 % interval), the loss excess, the restart
    time, what recovery read and the iterations lost; printed as a table."""
    out = {"layouts": {}, "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")}}
    print("\nMulti-process layouts: reductions (1 - lag/d) over the cases with a measurable lag; the loss excess at "
          "f + 4d (and at the end of training) over every case; restart to first step and bytes read: medians.")
    print(f"{'layout':7s} {'method':11s} | {'median':>7s} {'mean [95% CI]':>26s} {'half/d':>6s} | "
          f"{'excess f+4d: worst / end':>24s} | {'restart s':>9s} {'read/ckpt':>9s} {'lost max':>8s} {'cases':>5s}")
    for name, part in measured.items():
        cases = part["cases"]
        summary = {"median_reduction": {}, "mean_reduction": {}, "ci95_reduction": {}, "unmeasurable": {},
                   "worst_window_end_excess": {}, "worst_final_loss_excess": {}, "median_restart_s": {},
                   "median_bytes_read": {}, "median_read_over_checkpoint": {}, "max_lost": {}}
        for method in dict.fromkeys(c.method for c in cases):
            rows = [c for c in cases if c.method == method]
            plain = reduction_summary(rows, "reduction")
            finals = [c.final_loss_excess for c in rows if c.final_loss_excess is not None]
            timed = [c for c in rows if c.restart_s is not None]
            values = (plain["median"], plain["mean"], plain["ci95"], plain["unmeasurable"],
                      max(c.window_end_excess for c in rows), max(finals) if finals else None,
                      median_or_none([c.restart_s for c in timed]),
                      median_or_none([c.bytes_read for c in timed if c.bytes_read]),
                      median_or_none([c.bytes_read / c.checkpoint_bytes for c in timed
                                      if c.bytes_read and c.checkpoint_bytes]),
                      max(c.lost for c in timed) if timed else None)
            for key, value in zip(summary, values):
                summary[key][method] = value
            ratio = summary["median_read_over_checkpoint"][method]
            read = "-" if ratio is None else f"{ratio:.2f}x"
            end = "-" if not finals else f"{max(finals):+.3%}"
            print(f"{name:7s} {method:11s} | {pct(plain['median'], 7)} {interval(plain)} | "
                  f"{summary['worst_window_end_excess'][method]:+12.3%} / {end:>9s} | "
                  f"{'-' if not timed else format(summary['median_restart_s'][method], '9.1f'):>9s} {read:>9s} "
                  f"{'-' if not timed else summary['max_lost'][method]:>8} {len(rows):5d}")
        check = {method: cost_model.evaluate([cost_model.Case(c.method, c.lag_iters, c.cost_model["estimates"])
                                              for c in cases if c.method == method and c.cost_model])
                 for method in dict.fromkeys(c.method for c in cases if c.cost_model)}
        for method, models in check.items():
            for model, r in models.items():
                spearman = "-" if r["spearman"] is None else f"{r['spearman']:+.2f}"
                ratio = "-" if r["median_ratio"] is None else f"{r['median_ratio']:.2f}"
                print(f"{name:7s} {method:11s} | the {model} model's estimate against the measured lag over "
                      f"{r['n']} predicting cases: Spearman {spearman}, median estimate / measured {ratio}")
        out["layouts"][name] = {
            "cost_model": check,
            **summary, "layout": part["layout"], "references": part["references"],
            "cases": [{k: v for k, v in dataclasses.asdict(c).items() if k != "curve"} for c in cases],
            "curves": [{"seed": c.seed, "method": c.method, "Tc": c.Tc, "c": c.c, "d": c.d, "curve": c.curve}
                       for c in cases if c.curve]}
    return out
