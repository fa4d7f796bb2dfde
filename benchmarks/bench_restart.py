"""Restart to first step beside its floor: each source of state, each state size, on the CPU.

    python -m benchmarks.bench_restart [--quick] [--repeats N] [--json PATH] [--out-dir DIR] [--resume]
        [--sizes tiny 1 4] [--sources host_snapshot survivor storage] [--launchers torchrun deepspeed]

Without --json it writes benchmarks/results/bench_restart/bench_restart.json (``_quick`` with --quick).

A case is a state size, a source and a launcher. Sizes: ``tiny`` (the tiny GPT of the job tests) and GPTs of 4
layers whose parameters and Adam moments (12 bytes a parameter, fp32) come to about N GiB (``--quick``: tiny and
0.25 GiB). Two pipeline stages, one process each; rank 1 is SIGKILLed after iteration KILL_AT (``cpsr.faults``).
Launchers:

- ``torchrun``: torch's elastic agent with ``--max-restarts 1`` (and a rendezvous store per round,
  runtime/elastic.py) restarts the workers itself; the agent, its imports done, stays;
- ``deepspeed``: DeepSpeed's per-node launcher, as the job tests launch it, launched again on the same
  directories once the failed job has ended (what launch/resilient.sh does).

Where the state comes from:

- ``host_snapshot``: ``checkpoint.memory_interval`` 1, survivor dumps off, no checkpoint before the kill: every
  rank's snapshot in shared memory (with a checkpoint every INTERVAL, the one of KILL_AT - 1 is often newer than
  the newest snapshot both ranks hold, the killed rank's last one cut off, and the restart is one from storage);
- ``survivor``: survivor dumps on: rank 0's own dump in shared memory, rank 1's state from its checkpoint;
- ``storage``: neither: the newest checkpoint, from the page cache (just written; nothing here can drop it).

Measured per run:

- restart_s: under torchrun from the kill (the fault's marker file) to the killed rank's first journaled iteration
  after it, the agent's noticing the failure and stopping the other worker included; under deepspeed from the
  relaunch to rank 0's first journaled iteration, the launcher's own start included, the failed job's end not;
- seconds: rank 0's breakdown from its recovery.jsonl line (cpsr_ds/runtime/restart_time.py);
- the floor, in the same run: ``imports_s``, from starting a bare interpreter to its having imported what the
  training script imports (``import examples.gpt.train_gpt``; its exit not counted), and ``read_s``, one plain read of the bytes the restart reads from the same
  place (every rank's newest snapshot, rank 0's dump and rank 1's checkpoint files, or the checkpoint's files), one
  reader, in 16 MiB blocks; under deepspeed both just before the restart; under torchrun, which restarts at once,
  the imports before the launch and the read after the job, of the same kind of files, as large, then newest;
- ratio: restart_s / (imports_s + read_s).

Summaries over ``--repeats`` (3; ``--quick`` 1): median and the mean's Student-t 95 % interval. Each run is
appended to ``--out-dir``/runs.jsonl as it ends; ``--resume`` keeps that file and skips the runs it holds. One job
runs at a time; its directories and shared memory are removed after each run.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

from benchmarks.common.jobs import tail  # noqa: E402  (first: it sets the jobs' environment)

from benchmarks.common.lag import median_ci, summarize  # noqa: E402
from benchmarks.common.paths import ROOT, with_default_outputs  # noqa: E402
from benchmarks.common.processes import (JOB_ENV, TEST_MODEL, elastic_env, elastic_launch, finish,  # noqa: E402
                                         free_port, local_launch, remove_shm_buffers, start, tiny_config)
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal  # noqa: E402
from cpsr_ds.recovery import read_reports  # noqa: E402
from cpsr_ds.runtime.faults import kill_marker  # noqa: E402

SOURCES = ("host_snapshot", "survivor", "storage")
LAUNCHERS = ("torchrun", "deepspeed")
SIZES = ("tiny", "1", "4")
QUICK_SIZES = ("tiny", "0.25")
KILL_AT = 5
INTERVAL = 2
ITERATIONS = KILL_AT + 2
LAYERS = 4
BYTES_PER_PARAMETER = 12  # fp32 parameter, Adam's two moments
BLOCK = 16 << 20
JOB_TIMEOUT_S = 900
TRAIN = os.path.join(ROOT, "examples", "gpt", "train_gpt.py")
IMPORTS = "import examples.gpt.train_gpt"


# ---------------------------------------------------------------- pure parts


def model_for(size: str) -> dict:
    """The GPT block of a size: the tiny GPT, or LAYERS layers whose hidden size (a multiple of 64) puts the
    parameters and Adam moments nearest ``size`` GiB (12 L h^2 parameters; the 256-token vocabulary is negligible)."""
    if size == "tiny":
        return dict(TEST_MODEL)
    params = float(size) * 2**30 / BYTES_PER_PARAMETER
    hidden = max(64, round(math.sqrt(params / (12 * LAYERS)) / 64) * 64)
    return {"num_layers": LAYERS, "hidden_size": hidden, "num_attention_heads": 4, "seq_length": 64}


def state_gib(model: dict) -> float:
    """Parameters and Adam moments of the GPT's blocks, GiB."""
    return 12 * model["num_layers"] * model["hidden_size"] ** 2 * BYTES_PER_PARAMETER / 2**30


def case_name(size: str, source: str, launcher: str) -> str:
    return f"{size}-{source}-{launcher}"


def done_runs(path: str) -> dict[str, list[dict]]:
    """The runs already in ``path`` (runs.jsonl), by case; none where it does not exist."""
    runs: dict[str, list[dict]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in filter(str.strip, f):
                run = json.loads(line)
                runs.setdefault(run["case"], []).append(run)
    return runs


def floor_s(imports_s: float, read_s: float | None) -> float | None:
    """The floor; None where the read is unmeasured (:func:`timed_read`)."""
    return None if read_s is None else imports_s + read_s


def ratio(restart_s: float | None, floor: float | None) -> float | None:
    return None if restart_s is None or floor is None else restart_s / floor


def first_after_kill(entries, kill_at: int) -> int:
    """The index of the restart's first line in the killed rank's journal ``entries`` (file order): the line after
    its first line of ``kill_at``, the iteration after which it was killed."""
    k = next((i for i, e in enumerate(entries) if e.iteration == kill_at), None)
    if k is None or k + 1 >= len(entries):
        raise ValueError(f"the journal has no restart after iteration {kill_at}")
    return k + 1


def summary(size: str, source: str, launcher: str, runs: list[dict]) -> dict:
    """The case's record: medians and 95 % intervals of restart, floor, ratio and each part of the breakdown."""
    def of(key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return summarize(values, ["unmeasured"] * (len(runs) - len(values)))
    parts = list(dict.fromkeys(p for r in runs for p in (r.get("seconds") or {})))
    seconds = {p: summarize([r["seconds"][p] for r in runs if p in (r.get("seconds") or {})], []) for p in parts}
    return {"size": size, "source": source, "launcher": launcher, "repeats": len(runs),
            "state_gib": runs[0]["state_gib"] if runs else None,
            "sources_used": sorted({json.dumps(r.get("sources")) for r in runs}),
            "methods": sorted({str(r.get("method")) for r in runs}),
            **{key: of(key) for key in ("restart_s", "imports_s", "read_s", "floor_s", "ratio", "bytes_read")},
            "seconds": seconds}


# ---------------------------------------------------------------- one run


@dataclass
class Run:
    size: str
    source: str
    launcher: str
    base: str

    @property
    def run_dir(self) -> str:
        return os.path.join(self.base, "run")

    @property
    def shm(self) -> str:
        return os.path.join("/dev/shm", f"cpsr-bench-restart-{os.getuid()}-{os.path.basename(self.base)}")

    def config(self) -> dict:
        config = tiny_config(self.run_dir, stages=2)
        config["gpt"] = model_for(self.size)
        if self.size != "tiny":
            config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2)
        checkpoint = config["cpsr"]["checkpoint"]
        checkpoint.update(interval=INTERVAL, survivor_dir=self.shm, survivor=self.source == "survivor")
        if self.source == "host_snapshot":
            checkpoint.update(memory_interval=1, interval=ITERATIONS + 1)
        return config

    def launch(self, name: str, config_path: str, *args: str) -> tuple[int, float]:
        """One launch of both ranks; its exit code and the wall time it started at."""
        port = free_port()
        script = [TRAIN, "--deepspeed_config", config_path, "--valid-sequences", "16", "--eval-interval", "1000",
                  "--train-iters", str(ITERATIONS), *args]
        env = dict(os.environ, **JOB_ENV)
        if self.launcher == "torchrun":
            env = elastic_env(env)
            command = [*elastic_launch(1, 2, 0, port, f"bench-restart-{port}", max_restarts=1), *script]
        else:
            command = [*local_launch(2, port), *script]
        started = time.time()
        (code,) = finish([start(command, os.path.join(self.base, f"{name}.log"), env)], JOB_TIMEOUT_S)
        remove_shm_buffers(port)
        return code, started

    def source_files(self, checkpoint: int | None) -> list[str]:
        """The files the restart reads its state from: in shared memory every rank's newest snapshot or rank 0's
        dump, and on storage the checkpoint's files (all of them, or for survivor those of rank 1's stage)."""
        shm = sorted(glob.glob(os.path.join(self.shm, "*", "rank*")))
        if self.source == "host_snapshot":
            newest = {}
            for d in shm:
                rank = os.path.basename(d).split(".")[0]
                if rank not in newest or os.path.getmtime(d) > os.path.getmtime(newest[rank]):
                    newest[rank] = d
            dirs = list(newest.values())
        else:
            dirs = [d for d in shm if "." not in os.path.basename(d)] if self.source == "survivor" else []
            if checkpoint is not None:
                dirs.append(os.path.join(self.run_dir, f"global_step{checkpoint}"))
        return [os.path.join(root, n) for d in dirs for root, _, names in os.walk(d) for n in names]

    def newest_checkpoint(self) -> int | None:
        committed = sorted(int(p.rpartition("global_step")[2]) for p in glob.glob(os.path.join(self.run_dir, "global_step*")))
        return committed[-1] if committed else None

    def execute(self) -> dict:
        os.makedirs(self.base, exist_ok=True)
        config_path = os.path.join(self.base, "ds_config.json")
        with open(config_path, "w") as f:
            json.dump(self.config(), f)
        kill = ("--kill-rank", "1", "--kill-at-iteration", str(KILL_AT))
        if self.launcher == "torchrun":
            imports_s = timed_imports()
            code, _ = self.launch("restart", config_path, *kill)
            read_s, nbytes = timed_read(self.source_files(self.newest_checkpoint()))
            return {**self.measure(code, self.restart_s_torchrun()), "imports_s": imports_s, "read_s": read_s,
                    "bytes_read": nbytes, "floor_s": floor_s(imports_s, read_s)}
        code, _ = self.launch("failed", config_path, *kill)
        if code == 0:
            raise RuntimeError(f"{self.base}: the job finished although rank 1 was to be killed")
        files = self.source_files(self.newest_checkpoint())
        imports_s = timed_imports()
        read_s, nbytes = timed_read(files)
        code, started = self.launch("restart", config_path)
        first = next((e.wall_time for e in read_journal(journal_path(self.run_dir, 0)) if e.wall_time > started), None)
        return {**self.measure(code, None if first is None else first - started), "imports_s": imports_s,
                "read_s": read_s, "bytes_read": nbytes, "floor_s": floor_s(imports_s, read_s)}

    def restart_s_torchrun(self) -> float | None:
        """From the kill (its marker file) to the killed rank's first journaled iteration after it."""
        marker = kill_marker(self.run_dir, KILL_AT, 1)
        try:
            entries = read_journal(journal_path(self.run_dir, 1))
            return entries[first_after_kill(entries, KILL_AT)].wall_time - os.path.getmtime(marker)
        except (OSError, ValueError):
            return None

    def measure(self, code: int, restart_s: float | None) -> dict:
        try:
            report = read_reports(self.run_dir)[-1]
        except (OSError, IndexError):
            report = None
        out = {"exit": code, "method": None if report is None else report.method,
               "sources": None if report is None else report.sources,
               "seconds": None if report is None else report.seconds, "restart_s": restart_s}
        if code != 0 or report is None:
            out["log_tail"] = tail(open(os.path.join(self.base, "restart.log"), errors="replace").read(), 1500)
        return out

    def clean(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


def timed_imports() -> float:
    """Seconds from starting a bare interpreter to its having imported what the training script imports (the
    wall clock, which the child reads once its imports are done: its exit, which a restart does not wait for,
    left out)."""
    started = time.time()
    done = subprocess.run([sys.executable, "-c", f"{IMPORTS}; import time; print(repr(time.time()))"], cwd=ROOT,
                          env=dict(os.environ, **JOB_ENV), check=True, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1]) - started


def timed_read(files: list[str]) -> tuple[float | None, int]:
    """Seconds one plain read of ``files`` takes, and the bytes read; None where there are none (under torchrun
    the files are looked for after the job, whose checkpoints of that size may all have been persisting when it
    ended): the floor is then unmeasured, not a read of nothing."""
    if not files:
        return None, 0
    buffer, total = bytearray(BLOCK), 0
    started = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return time.perf_counter() - started, total


def run_case(size: str, source: str, launcher: str, repeat: int, out_dir: str) -> dict:
    name = case_name(size, source, launcher)
    run = Run(size, source, launcher, os.path.join(out_dir, f"{name}-{repeat}-{uuid.uuid4().hex[:6]}"))
    started = time.monotonic()
    try:
        result = run.execute()
    finally:
        run.clean()
    result.update(case=name, size=size, source=source, launcher=launcher, repeat=repeat,
                  state_gib=state_gib(model_for(size)), wall_s=time.monotonic() - started)
    result["ratio"] = ratio(result["restart_s"], result["floor_s"])
    return result


# ---------------------------------------------------------------- the table


def print_table(records: list[dict]) -> None:
    head = (f"{'size':<5} {'GiB':>5} {'source':<13} {'launcher':<9} {'method':<9} {'restart s':>22} {'floor s':>8} {'import':>6} "
            f"{'read':>6} {'ratio':>18} {'n':>2}  breakdown (median s)")
    print(head)
    print("-" * len(head))
    for r in records:
        parts = " ".join(f"{p}={s['median']:.2f}" for p, s in r["seconds"].items() if s["median"] is not None)
        med = lambda key: "-" if r[key]["median"] is None else f"{r[key]['median']:.2f}"  # noqa: E731
        print(f"{r['size']:<5} {r['state_gib'] or 0:>5.2f} {r['source']:<13} {r['launcher']:<9} {'/'.join(r['methods']):<9} "
              f"{median_ci(r['restart_s']):>22} {med('floor_s'):>8} {med('imports_s'):>6} {med('read_s'):>6} "
              f"{median_ci(r['ratio']):>18} {r['repeats']:>2}  {parts}")


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="sizes tiny and 0.25 GiB, one run per case")
    p.add_argument("--repeats", type=int, help="runs per case (default 3; --quick: 1)")
    p.add_argument("--sizes", nargs="+", help="tiny or GiB of state (default tiny 1 4; --quick: tiny 0.25)")
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    p.add_argument("--launchers", nargs="+", choices=LAUNCHERS, default=list(LAUNCHERS))
    p.add_argument("--json", help="write the results here (default, where none is named: benchmarks/results/NAME/)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "bench_restart"),
                   help="the runs' directories, and runs.jsonl with every finished run")
    p.add_argument("--resume", action="store_true", help="keep --out-dir's runs.jsonl and skip the runs it holds")
    p.add_argument("--note", default="", help="what else ran on the machine meanwhile, for the record")
    args = p.parse_args(argv)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    args.sizes = args.sizes or list(QUICK_SIZES if args.quick else SIZES)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    for size in args.sizes:
        if size != "tiny":
            try:
                if float(size) <= 0:
                    raise ValueError
            except ValueError:
                p.error(f"--sizes: {size!r} is neither tiny nor a positive number of GiB")
    return args


def main(argv=None) -> None:
    args = with_default_outputs(parse_args(argv), "bench_restart")
    os.makedirs(args.out_dir, exist_ok=True)
    log = os.path.join(args.out_dir, "runs.jsonl")
    if not args.resume and os.path.exists(log):
        os.remove(log)
    done = done_runs(log)
    started = time.monotonic()
    print(f"bench_restart: 2 pipeline stages, kill rank 1 after {KILL_AT}, checkpoint every {INTERVAL}, "
          f"{args.repeats} run(s) per case, load {os.getloadavg()[0]:.1f}" + (f"; {args.note}" if args.note else ""),
          flush=True)
    records = []
    for size, source, launcher in ((z, s, la) for z in args.sizes for s in args.sources for la in args.launchers):
        name = case_name(size, source, launcher)
        runs = done.get(name, [])[:args.repeats]
        for k in range(len(runs), args.repeats):
            run = run_case(size, source, launcher, k, args.out_dir)
            with open(log, "a") as f:
                f.write(json.dumps(run) + "\n")
            runs.append(run)
            print(f"  {name} run {k}: {run['method']} {run['sources']} restart {run['restart_s']} s, floor "
                  f"{'unmeasured' if run['floor_s'] is None else format(run['floor_s'], '.2f')} s "
                  f"({run['bytes_read'] / 2**20:.0f} MiB), load {os.getloadavg()[0]:.1f}",
                  flush=True)
        records.append(summary(size, source, launcher, runs))
    print()
    print_table(records)
    total = time.monotonic() - started
    print(f"\n{sum(r['repeats'] for r in records)} runs in {total:.0f} s, load at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kill_at": KILL_AT, "interval": INTERVAL, "repeats": args.repeats, "wall_s": total,
                       "load_avg": os.getloadavg(), "note": args.note, "cases": records}, f, indent=1)


if __name__ == "__main__":
    main()
