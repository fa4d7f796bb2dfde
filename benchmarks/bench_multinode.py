"""Multi-node recovery: storage layout x launch path x failure kind, each scenario's outcome and restart time.

    python -m benchmarks.bench_multinode [--quick] [--repeats N] [--json PATH] [--out-dir DIR]
        [--layouts shared node_local] [--launches torchrun ssh] [--failures killed dir_lost shrunk]
    python -m benchmarks.bench_multinode | tee benchmarks/results/bench_multinode/bench_multinode.txt

Without --json it writes benchmarks/results/bench_multinode/bench_multinode.json (``_quick`` with --quick).

Two nodes on one machine, on 127.0.0.1, one process each, train the tiny GPT of
``examples/gpt/train_gpt.py`` for ITERATIONS iterations, checkpointing every INTERVAL.

Layouts (``checkpoint.storage``): ``shared``, one directory both nodes see; ``node_local``,
a directory per node (``--checkpoint-dir`` per node), each rank's part replicated to the
other node before the checkpoint commits.

Launch paths, each restarting the whole job after a failure:

- ``torchrun``: each node's elastic agent, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun
  --nnodes 2 --node_rank N --max-restarts 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P``;
- ``ssh``: the head node's ``launch/resilient.sh --max-restarts 2 -- deepspeed --hostfile H``
  over an sshd on 127.0.0.1 (launch/loopback_ssh.sh; hosts node0 and node1), skipped with
  the reason where sshd or pdsh is missing. Node-local directories: ``--checkpoint-dir
  DIR/node%n`` (pdsh puts each node's rank for ``%n``).

Per-node launchers (``deepspeed --no_ssh --node_rank N``, each under resilient.sh) are not
a scenario: nothing restarts the other node's launcher when one node's job fails.

Failure kinds:

- ``killed``: rank 1 (node 1) SIGKILLed after iteration KILL_AT (``cpsr.faults``); the
  launch path restarts the job;
- ``dir_lost`` (node_local only; n/a with one shared directory): the same, and node 0's
  directory deleted between the failure and the restart (benchmarks/common/lose_node_dir.py, run
  by the restart on node 0 before training); node 0's parts come from their replicas;
- ``shrunk``: a data-parallel job (one pipeline stage, ZeRO stage 1) started without
  restarts loses rank 0 (node 0) after KILL_AT; the benchmark restarts it on one node with
  the job's checkpoints: the shared directory, or node 1's directory (its own parts and
  node 0's replicas) for node_local.

Measured per run (the protocols of docs/design/measurement-protocols.md: restart downtime from the journal, over repeats):

- outcome: ``recovered`` when every launcher exited 0 and the restart's recovery.jsonl
  line (the last in the restarted rank 0's directory) is a recompute or a prediction;
  method, c, f and the resume iteration from that line;
- committed_before_failure: the newest iteration of a commit record written before the
  restarted job's first iteration, in every node's directory (and the records of a
  deleted directory, listed before it went; not the replicas', which carry rank 0's
  decision ahead of the commit); ``progress_lost``: resume below it;
- restart_s: from the killed rank's journal line of KILL_AT (its last before the kill) to
  the first line its restart journals (the journals' wall times), as bench_ftcost's
  downtime. For ``shrunk`` it includes the benchmark's own reaction: the failed launchers'
  exit and the start of the one-node launcher.

Summaries over ``--repeats`` (3; ``--quick`` 1): restart_s median, mean and its Student-t
95 % interval; per-run values in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import pathlib
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from benchmarks.common.jobs import tail  # noqa: E402  (first: it sets the jobs' environment)

from benchmarks.common.lose_node_dir import commit_records  # noqa: E402
from benchmarks.common.paths import ROOT, with_default_outputs  # noqa: E402
from benchmarks.common.processes import (JOB_ENV, NoLoopbackSsh, elastic_env, elastic_launch, finish,  # noqa: E402
                                         free_port, kill_tagged, loopback_ssh, start, tiny_config)

from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal  # noqa: E402
from cpsr_ds.runtime.faults import kill_marker  # noqa: E402
from benchmarks.common.lag import median_ci, summarize  # noqa: E402
from cpsr_ds.recovery import read_reports  # noqa: E402

LAYOUTS = ("shared", "node_local")
LAUNCHES = ("torchrun", "ssh")
FAILURES = ("killed", "dir_lost", "shrunk")
ITERATIONS = 16
INTERVAL = 4
KILL_AT = 10
ATTEMPT_TIMEOUT_S = 420
BIN = os.path.dirname(sys.executable)
TRAIN = os.path.join(ROOT, "examples", "gpt", "train_gpt.py")
LOSE_DIR = os.path.join(ROOT, "benchmarks", "common", "lose_node_dir.py")
RESILIENT = os.path.join(ROOT, "launch", "resilient.sh")
RECOVERED = ("recompute", "predict")


@dataclass(frozen=True)
class Scenario:
    layout: str
    launch: str
    failure: str

    @property
    def name(self) -> str:
        return f"{self.layout}-{self.launch}-{self.failure}"

    @property
    def not_applicable(self) -> Optional[str]:
        if self.failure == "dir_lost" and self.layout == "shared":
            return "one shared directory: no node's directory to lose"
        return None

    @property
    def shrunk(self) -> bool:
        return self.failure == "shrunk"

    @property
    def killed_rank(self) -> int:
        """Shrunk: rank 0 goes, and the one rank left is rank 0 again; else node 1's rank."""
        return 0 if self.shrunk else 1

    @property
    def stages(self) -> int:
        """Shrunk: data parallel, so that one rank can hold the whole model; else two pipeline stages."""
        return 1 if self.shrunk else 2

    @property
    def zero_stage(self) -> int:
        return 1 if self.shrunk else 0


def scenarios(layouts=LAYOUTS, launches=LAUNCHES, failures=FAILURES) -> list[Scenario]:
    """Every combination, failure kinds innermost; not applicable ones too (reported as n/a)."""
    return [Scenario(*combo) for combo in itertools.product(layouts, launches, failures)]


# ---------------------------------------------------------------- measurement from the records


def failure_time(entries, kill_at: int) -> float:
    """The wall time of the killed rank's journal line of ``kill_at``: its last before the kill."""
    line = next((e for e in entries if e.iteration == kill_at), None)
    if line is None:
        raise ValueError(f"the killed rank's journal has no line of iteration {kill_at}")
    return line.wall_time


def restart_time(entries, failed_at: float) -> float:
    """The wall time of the first line journaled after ``failed_at`` (by the restarted job: the killed rank
    journaled nothing after its kill)."""
    line = next((e for e in entries if e.wall_time > failed_at), None)
    if line is None:
        raise ValueError("the restarted job journaled no iteration")
    return line.wall_time


def committed_before(records: list[dict], t: float) -> Optional[int]:
    """The newest iteration among the commit records written before ``t``."""
    return max((r["iteration"] for r in records if r["written"] < t), default=None)


def outcome(codes_ok: bool, report, committed: Optional[int]) -> dict:
    """One run's outcome from its launchers' exit, the restart's recovery report and the newest commit before it."""
    recovered = codes_ok and report is not None and report.method in RECOVERED
    resume = None if report is None else report.resume_iteration
    return {"outcome": "recovered" if recovered else ("launcher failed" if not codes_ok else "not recovered"),
            "method": None if report is None else report.method,
            "c": None if report is None else report.checkpoint, "f": None if report is None else report.reached,
            "resume": resume, "committed_before_failure": committed,
            "progress_lost": committed is not None and (resume is None or resume < committed)}


def summary(scenario: Scenario, runs: list[dict], skipped: Optional[str] = None) -> dict:
    """The scenario's record: outcome over its runs, per-run values, restart_s median and 95 % interval."""
    record = {"layout": scenario.layout, "launch": scenario.launch, "failure": scenario.failure}
    reason = scenario.not_applicable or skipped
    if reason is not None:
        return {**record, "outcome": "n/a" if scenario.not_applicable else "skipped", "reason": reason,
                "repeats": 0, "runs": []}
    failed = [r for r in runs if r["outcome"] != "recovered"]
    measured = [r["restart_s"] for r in runs if r.get("restart_s") is not None]
    return {**record, "outcome": "recovered" if not failed else f"{len(failed)} of {len(runs)} not recovered",
            **{key: [r[key] for r in runs] for key in ("method", "c", "f", "resume", "committed_before_failure")},
            "progress_lost": any(r["progress_lost"] for r in runs),
            "restart_s": summarize(measured, ["unmeasured"] * (len(runs) - len(measured))),
            "repeats": len(runs), "runs": runs}


# ---------------------------------------------------------------- running a scenario


@dataclass
class Run:
    """One run's directories and launch settings."""

    scenario: Scenario
    base: str
    ssh_bin: Optional[str]

    def node_dir(self, node: int) -> str:
        return os.path.join(self.base, "run" if self.scenario.layout == "shared" else f"node{node}")

    def config(self, name: str, fault: bool = True) -> str:
        """The job's DeepSpeed config, written as ``name``; ``fault``: with the kill (a restart on fewer nodes
        has none: its rank 0 may use a directory without the fault's marker)."""
        faults = {"kill_rank": self.scenario.killed_rank, "kill_at_iteration": KILL_AT} if fault else {}
        config = tiny_config(self.node_dir(0), stages=self.scenario.stages, zero_stage=self.scenario.zero_stage,
                             faults=faults)
        # Every commit record stays, for committed_before_failure.
        config["cpsr"]["checkpoint"].update(interval=INTERVAL, keep_last=100, storage=self.scenario.layout)
        path = os.path.join(self.base, f"{name}.json")
        with open(path, "w") as f:
            json.dump(config, f)
        return path

    @property
    def lost_record(self) -> str:
        return os.path.join(self.base, "lost_commits.json")

    def script(self) -> list[str]:
        """The worker's command after the interpreter: train_gpt.py, behind lose_node_dir.py for dir_lost."""
        if self.scenario.failure != "dir_lost":
            return [TRAIN]
        marker = kill_marker(self.node_dir(self.scenario.killed_rank), KILL_AT, self.scenario.killed_rank)
        return [LOSE_DIR, self.node_dir(0), marker, self.lost_record, TRAIN]

    def train_args(self, config: str) -> list[str]:
        return ["--deepspeed_config", config, "--train-iters", str(ITERATIONS), "--eval-interval", "1000",
                "--valid-sequences", "16"]

    def dir_arg(self, node: str) -> list[str]:
        """Node-local: ``node``'s own directory (its number, or pdsh's ``%n``)."""
        return [] if self.scenario.layout == "shared" else ["--checkpoint-dir", os.path.join(self.base, f"node{node}")]

    def attempt(self, name: str, nodes: list[int], restarts: int, args: list[str]) -> list[int]:
        """One launch of the job on ``nodes`` by the scenario's launch path; the launchers' exit codes."""
        port, env = free_port(), dict(os.environ, **JOB_ENV)
        if self.scenario.launch == "torchrun":
            env = elastic_env(env)
            procs = [start([*elastic_launch(len(nodes), 1, rank, port, f"{name}-{port}", restarts), *self.script(),
                            *args, *self.dir_arg(str(node))], os.path.join(self.base, f"{name}-node{node}.log"), env)
                     for rank, node in enumerate(nodes)]
            return finish(procs, ATTEMPT_TIMEOUT_S)
        hostfile = os.path.join(self.base, f"{name}-hostfile")
        with open(hostfile, "w") as f:
            f.write("".join(f"node{node} slots=1\n" for node in nodes))
        tag = uuid.uuid4().hex
        # The interpreter's bin/ last, as in tests/jobs/test_launch.py: another ninja there would rebuild DeepSpeed's op.
        path = f"{self.ssh_bin}:{os.environ['PATH']}:{BIN}"
        env_file = os.path.join(self.base, f"{name}-deepspeed_env")
        with open(env_file, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in {**JOB_ENV, "PATH": path, "CPSR_LAUNCH_TEST": tag}.items()))
        env.update(PATH=path, DS_ENV_FILE=env_file)
        # Several hosts: pdsh puts each node's rank for %n; one host: DeepSpeed launches it locally.
        node = "%n" if len(nodes) > 1 else str(nodes[0])
        command = [RESILIENT, "--max-restarts", str(restarts), "--", os.path.join(BIN, "deepspeed"),
                   "--hostfile", hostfile, "--master_addr", "127.0.0.1", "--master_port", str(port),
                   *self.script(), *args, *self.dir_arg(node)]
        try:
            return finish([start(command, os.path.join(self.base, f"{name}-head.log"), env)], ATTEMPT_TIMEOUT_S)
        finally:
            kill_tagged(tag)

    def execute(self) -> bool:
        """The scenario's launches; whether the last one's launchers all exited 0."""
        args = self.train_args(self.config("ds_config"))
        if not self.scenario.shrunk:
            return self.attempt("job", [0, 1], 2, args) == [0] * (1 if self.scenario.launch == "ssh" else 2)
        first = self.attempt("job", [0, 1], 0, args)
        if all(code == 0 for code in first):
            raise RuntimeError(f"{self.scenario.name}: the job finished although rank 0 was to be killed")
        survivor = 0 if self.scenario.layout == "shared" else 1
        return self.attempt("shrunk", [survivor], 0, self.train_args(self.config("ds_config_shrunk", fault=False))) == [0]

    def restarted_dir(self) -> str:
        """Rank 0's directory in the restarted job, where its recovery.jsonl is."""
        return self.node_dir(1 if self.scenario.shrunk else 0)

    def measure(self, codes_ok: bool) -> dict:
        """The run's outcome and restart time from its records (every commit record counts where the restart's
        first iteration is not known)."""
        records = commit_records(self.base)
        if os.path.exists(self.lost_record):
            with open(self.lost_record) as f:
                records += json.load(f)
        try:
            report = read_reports(self.restarted_dir())[-1]
        except (OSError, IndexError):
            report = None
        # The killed rank's journal, before the failure and in the restarted job.
        killed = self.scenario.killed_rank
        restart_dir = self.restarted_dir() if self.scenario.shrunk else self.node_dir(killed)
        try:
            failed_at = failure_time(read_journal(journal_path(self.node_dir(killed), killed)), KILL_AT)
            restarted_at = restart_time(read_journal(journal_path(restart_dir, killed)), failed_at)
        except (OSError, ValueError) as err:
            return {**outcome(codes_ok, report, committed_before(records, math.inf)), "restart_s": None,
                    "problem": str(err)}
        return {**outcome(codes_ok, report, committed_before(records, restarted_at)),
                "restart_s": restarted_at - failed_at}


def run_scenario(scenario: Scenario, base: str, ssh_bin: Optional[str]) -> dict:
    os.makedirs(base, exist_ok=True)
    run = Run(scenario, base, ssh_bin)
    started = time.monotonic()
    codes_ok = run.execute()
    result = {**run.measure(codes_ok), "wall_s": time.monotonic() - started, "dir": base}
    if result["outcome"] != "recovered":
        logs = sorted(n for n in os.listdir(base) if n.endswith(".log"))
        result["log_tail"] = tail("".join(open(os.path.join(base, n), errors="replace").read() for n in logs), 1500)
    return result


# ---------------------------------------------------------------- the table


def _values(values: list) -> str:
    distinct = list(dict.fromkeys("-" if v is None else str(v) for v in values))
    return "/".join(distinct)


def print_table(records: list[dict]) -> None:
    head = (f"{'layout':<10} {'launch':<8} {'failure':<8} {'outcome':<20} {'method':<9} {'c':>5} {'f':>5} "
            f"{'resume':>6} {'commit<fail':>11} {'lost':>5} {'restart s (median, 95% CI)':>28} {'n':>2}")
    print(head)
    print("-" * len(head))
    for r in records:
        if not r["repeats"]:
            print(f"{r['layout']:<10} {r['launch']:<8} {r['failure']:<8} {r['outcome']:<20} {r['reason']}")
            continue
        restart = median_ci(r["restart_s"], digits=1)
        print(f"{r['layout']:<10} {r['launch']:<8} {r['failure']:<8} {r['outcome']:<20} {_values(r['method']):<9} "
              f"{_values(r['c']):>5} {_values(r['f']):>5} {_values(r['resume']):>6} "
              f"{_values(r['committed_before_failure']):>11} {'yes' if r['progress_lost'] else 'no':>5} "
              f"{restart:>28} {r['repeats']:>2}")


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one run per scenario")
    p.add_argument("--repeats", type=int, help="runs per scenario (default 3; --quick: 1)")
    p.add_argument("--json", help="write the results here (default, where no output is "
                   "named: into benchmarks/results/NAME/)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "bench_multinode"),
                   help="the runs' directories and logs (emptied first)")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--launches", nargs="+", choices=LAUNCHES, default=list(LAUNCHES))
    p.add_argument("--failures", nargs="+", choices=FAILURES, default=list(FAILURES))
    p.add_argument("--note", default="", help="what else ran on the machine meanwhile, for the record")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def run_all(args, ssh_bin: Optional[str], no_ssh: Optional[str]) -> list[dict]:
    records = []
    for scenario in scenarios(args.layouts, args.launches, args.failures):
        skipped = no_ssh if scenario.launch == "ssh" else None
        runs = []
        if scenario.not_applicable is None and skipped is None:
            for k in range(args.repeats):
                runs.append(run_scenario(scenario, os.path.join(args.out_dir, scenario.name, f"run{k}"), ssh_bin))
                r = runs[-1]
                print(f"  {scenario.name} run {k}: {r['outcome']}, {r['method']} c={r['c']} f={r['f']} "
                      f"resume={r['resume']} committed before={r['committed_before_failure']} "
                      f"restart {r['restart_s'] if r['restart_s'] is None else round(r['restart_s'], 1)} s "
                      f"({r['wall_s']:.0f} s)", flush=True)
        records.append(summary(scenario, runs, skipped))
    return records


def main(argv=None) -> None:
    args = with_default_outputs(parse_args(argv), "bench_multinode")
    shutil.rmtree(args.out_dir, ignore_errors=True)
    os.makedirs(args.out_dir)
    started = time.monotonic()
    print(f"bench_multinode: two nodes on 127.0.0.1, {ITERATIONS} iterations, checkpoint every {INTERVAL}, "
          f"kill after {KILL_AT}, {args.repeats} run(s) per scenario" + (f"; {args.note}" if args.note else ""), flush=True)
    servers = contextlib.ExitStack()
    ssh_bin = no_ssh = None
    if "ssh" in args.launches:
        ssh_dir = pathlib.Path(args.out_dir) / "ssh"
        ssh_dir.mkdir()
        try:
            ssh_bin = str(servers.enter_context(loopback_ssh(ssh_dir)) / "bin")
        except NoLoopbackSsh as reason:
            no_ssh = str(reason)
    with servers:
        records = run_all(args, ssh_bin, no_ssh)
    print()
    print_table(records)
    total = time.monotonic() - started
    print(f"\n{sum(r['repeats'] for r in records)} runs in {total:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"iterations": ITERATIONS, "interval": INTERVAL, "kill_at": KILL_AT, "repeats": args.repeats,
                       "wall_s": total, "note": args.note, "scenarios": records},
                      f, indent=1)


if __name__ == "__main__":
    main()
