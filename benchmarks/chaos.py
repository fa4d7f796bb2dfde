"""Fault campaign: the faults of the reliability issue, repeated with randomised timing, against invariants.

Every trial trains the tiny GPT through the product's entry point (``examples/gpt/train_gpt.py``,
one process, DeepSpeed's pipeline engine on the CPU), injects one fault at a random
moment or into a random file, restarts the job where the fault calls for it, and checks
what a user must be able to rely on. A broken invariant is a violation; a job that
does not finish in time is one too (a hang). Faults, keyed as in the JSON:

- ``nonfinite``: NaN or Inf written into a random tensor of a random retained
  checkpoint, the file re-checksummed so that it verifies; or a non-finite loss in
  the journal. The restart must not resume from a non-finite state and must not
  commit one.
- ``journal``: implausible lines (far-future or huge iterations, garbage, binary) appended to
  random ranks' journals. The restart must resume at or before the true failure point,
  finish, and not hang.
- ``clock``: a later attempt's wall clock shifted by up to two hours either way.
  ``latest`` must follow the newest iteration and retention keep the newest ones.
- ``metadata``: the newest checkpoint's manifest or commit record cut short or replaced
  by a wrong JSON value, or ``latest`` made binary, empty, a directory or a dangling
  name. ``inspect`` must not crash; the restart must load an undamaged checkpoint.
- ``damaged_data``: a checkpoint's metadata deleted and a random file truncated at a
  random length, for the ``cpsr`` and ``torch`` strategies. The restart must not load it.
- ``full_disk``: a 12 MB tmpfs (about 7 checkpoints) filled at a random moment and freed later. Training
  must keep its speed, given-up checkpoints must not stay, checkpointing must resume.
- ``rank_write``: one rank's file of a random checkpoint blocked by a directory in its
  way (two ranks' engines in one process). Flushing must not wait for the commit
  timeout; ``latest`` must stay valid and later checkpoints commit.
- ``two_jobs``: a second job started on the same run directory at a random moment, while the
  first lives or after it was killed. Exactly one job may own the directory at a time; the
  refused one must say which directory and who owns it; the journal must not interleave.

Faults of a shared machine, with a second local user (uid 65534) where we are root:

- ``planted_root``: the survivor root made first by the other user (0777 or 0755), or a symlink
  of theirs in its place. The job refuses it with an error naming the path, owner and mode,
  or uses nothing in it: never writes its dumps there, never runs the code of a planted dump
  (its pickled header would make a marker file; checksum and manifest valid), never resumes
  one, never dies with a raw PermissionError.
- ``planted_tag``: a DeepSpeed-format tag whose pickle holds a malicious global, named by
  ``latest``: neither ``python -m cpsr_ds inspect`` nor the restart runs it.
- ``modes``: survivor dumps and host snapshots written under umask 022, 002 or 000: every
  file under the survivor root 0600, every directory 0700, the lock file 0600.
- ``foreign_lock``: the other user's process holds a read-only flock on the lock file of a run
  whose job died: the restart starts, or refuses naming another user's process, never the dead job.
- ``copied_run``: ``cp -r run runB`` after a kill; B restarted (alone, before or after A) never
  resumes A's survivor dump or host snapshot as exact.

Invalid state and failed restarts:

- ``invalid_state``: a survivor dump or host snapshot with one ``exp_avg_sq`` negated or a
  tensor of the wrong size, re-checksummed, or a NaN in a landed layer file of the checkpoint
  in flight with its progress line re-digested, under ``recovery.mode`` auto or recompute: the
  restart trains on finite losses to within ``LOSS_BOUND`` of the failure-free run's final loss.
- ``crash_loop``: a wrong-shape landed layer file of the checkpoint in flight, a predictor
  summary with an extra field or a list payload: the first restart falls back and finishes.
- ``clean_end``: a PP = 2 job (two processes under DeepSpeed's launcher) trains to its end:
  the launcher exits 0 and both ranks exit successfully.
- ``rbr_exact``: dropout on, a kill after a checkpoint, a recompute restart, with ``torch_adam``
  or DeepSpeed's default Adam: the recomputed losses are the failure-free run's, bit for bit.
- ``config``: a top-level key close to ``cpsr`` warns naming it; a read-only ``checkpoint.dir``
  stops with an error naming ``checkpoint.dir`` and the path; a NUL byte in
  ``checkpoint.survivor_dir`` is refused by the config check naming the key.

    python -m benchmarks.chaos [--trials N] [--faults a,b] [--seed S] [--json PATH] [--resume] [--out-dir DIR]

Each job runs in a child forked from this process (imports done once), so a trial
costs seconds; ``clean_end`` starts real processes through DeepSpeed's launcher, which a
clean end's teardown needs. ``full_disk`` and the read-only ``checkpoint.dir`` need root to
mount, ``planted_root`` and ``foreign_lock`` root to act as the second user; without it they
are reported as skipped, with the reason. The JSON (default benchmarks/results/chaos/chaos.json) is rewritten
after every trial; ``--resume`` keeps its trials and runs the rest.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import errno
import fcntl
import glob
import io
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Iterator

from benchmarks.common.jobs import JOB_TIMEOUT_S, Child, Hang, tail  # noqa: E402  (first: it sets the jobs' environment)

import torch  # noqa: E402
from benchmarks.common.paths import ROOT, result_path  # noqa: E402
from benchmarks.common.processes import free_port  # noqa: E402
from examples.gpt import train_gpt  # noqa: E402
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo  # noqa: E402

from cpsr_ds.runtime import rundir  # noqa: E402
from cpsr_ds.cli import inspect_report, main as cli_main  # noqa: E402
from cpsr_ds.checkpoint.storage import catalog, ondisk, progress_record, records
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.checkpoint.capture import dumps, run_id  # noqa: E402
from cpsr_ds.checkpoint.engines.factory import create_engine  # noqa: E402
from cpsr_ds.checkpoint.storage.fileformat import MAGIC, PAGE, align, new_hasher, read_snapshot  # noqa: E402
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal  # noqa: E402
from cpsr_ds.config import CheckpointConfig  # noqa: E402
from cpsr_ds.recovery.sources import host_snapshot as host_source, summaries, survivor as survivor_source  # noqa: E402

import pickle  # noqa: E402
import struct  # noqa: E402

FAULTS = ("nonfinite", "journal", "clock", "metadata", "damaged_data", "full_disk", "rank_write", "two_jobs",
          "planted_root", "planted_tag", "modes", "foreign_lock", "copied_run", "invalid_state", "crash_loop",
          "clean_end", "rbr_exact", "config")
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}
INTERVAL = 5
# How far a restart's final loss may be from the failure-free run's (relative) after resuming a valid state.
LOSS_BOUND = 0.05


class Violation(Exception):
    """An invariant a user relies on was broken."""


# ---------------------------------------------------------------- running jobs

def write_config(run_dir: str, cpsr: dict | None = None, scheduler: dict | None = None, stages: int = 1,
                 dropout: float = 0.0, torch_adam: bool = True, typo: str | None = None,
                 keep_block: bool = False) -> str:
    """The job's DeepSpeed config file. ``typo``: the ``cpsr`` block under that top-level key instead (and
    an empty ``cpsr`` block beside it with ``keep_block``)."""
    block = {"checkpoint": checkpoint_block(run_dir), "predictor": {"history": 3}, **(cpsr or {})}
    config = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01, "torch_adam": torch_adam}},
        "scheduler": scheduler or {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.002,
                                                                  "warmup_num_steps": 5}},
        "pipeline": {"stages": stages},
        "gpt": {**MODEL, **({"hidden_dropout": dropout, "attention_dropout": dropout} if dropout else {})},
        **({typo: block, **({"cpsr": {"checkpoint": checkpoint_block(run_dir)}} if keep_block else {})} if typo
           else {"cpsr": block}),
    }
    path = f"{run_dir}.config-{free_port()}.json"
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def train(config: str, iters: int, clock_offset_s: float = 0.0) -> None:
    if clock_offset_s:
        # A wall clock that is off by the offset, for everything in this process.
        real_time, real_time_ns = time.time, time.time_ns
        time.time = lambda: real_time() + clock_offset_s
        time.time_ns = lambda: real_time_ns() + int(clock_offset_s * 1e9)
    train_gpt.main(["--deepspeed_config", config, "--train-iters", str(iters), "--valid-sequences", "4",
                    "--log-interval", "1000", "--eval-interval", "100000"])


def train_under_umask(umask: int, config: str, iters: int) -> None:
    os.umask(umask)
    train(config, iters)


def job(trial_dir: str, config: str, iters: int, name: str, clock_offset_s: float = 0.0,
        umask: int | None = None) -> Child:
    log = os.path.join(trial_dir, f"{name}.log")
    if umask is not None:
        return Child(log, train_under_umask, umask, config, iters)
    return Child(log, train, config, iters, clock_offset_s)


def run(trial_dir: str, config: str, iters: int, name: str, clock_offset_s: float = 0.0) -> Child:
    """Run a job to its end; a failed job is a violation."""
    child = job(trial_dir, config, iters, name, clock_offset_s)
    code = child.wait()
    if code != 0:
        raise Violation(f"job {name} failed with exit code {code}: {tail(child.output())}")
    return child


# ---------------------------------------------------------------- invariants

def floating(obj, path=""):
    """(key path, tensor) of every floating tensor in a loaded state."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from floating(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from floating(v, f"{path}.{i}" if path else str(i))


def data_files(tag_dir: str) -> list[str]:
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(tag_dir) for f in fs
                  if not f.startswith((".", "cpsr_")) and f.endswith(".pt"))


def nonfinite_tensor(tag_dir: str) -> str | None:
    """The first tensor of a checkpoint holding NaN or Inf, read independently of the product's checks."""
    for path in data_files(tag_dir):
        state = read_snapshot(path)
        for key, t in floating(state):
            if not torch.isfinite(t.float()).all():
                return f"{os.path.basename(path)}:{key}"
    return None


def check_directory(run_dir: str) -> dict:
    """What must hold after every finished attempt; returns inspect's report."""
    try:
        report = inspect_report(run_dir)
    except Exception as err:
        raise Violation(f"inspect crashed: {type(err).__name__}: {err}") from None
    valid = [c for c in report["checkpoints"] if c["valid"]]
    if not valid:
        raise Violation("no valid checkpoint left")
    latest = records.read_latest(run_dir)
    rows = {c["tag"]: c for c in report["checkpoints"]}
    if latest not in rows or not rows[latest]["valid"]:
        raise Violation(f"latest names {latest!r}, which is not a valid checkpoint")
    newest = max(valid, key=lambda c: c["iteration"])
    if rows[latest]["iteration"] != newest["iteration"]:
        raise Violation(f"latest names iteration {rows[latest]['iteration']}, the newest valid is {newest['iteration']}")
    for c in valid:
        bad = nonfinite_tensor(os.path.join(run_dir, c["tag"]))
        if bad:
            raise Violation(f"checkpoint {c['tag']} reported valid holds non-finite values ({bad})")
    return report


def journal_iterations(run_dir: str) -> list[int]:
    return [e.iteration for e in read_journal(journal_path(run_dir, 0))]


def check_finished(run_dir: str, iters: int) -> None:
    done = journal_iterations(run_dir)
    if not done or done[-1] != iters:
        raise Violation(f"the job did not train to {iters}: journal ends at {done[-1] if done else None}")


def last_report(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "recovery.jsonl")) as f:
        return json.loads(f.read().splitlines()[-1])


def restart(trial_dir: str, config: str, run_dir: str, iters: int) -> dict:
    """Restart the job and train to ``iters``: it must leave a sound directory and finish. Its recovery report."""
    run(trial_dir, config, iters, "restart")
    check_directory(run_dir)
    check_finished(run_dir, iters)
    return last_report(run_dir)


# ---------------------------------------------------------------- faults

def tamper_snapshot(path: str, rng: random.Random) -> str:
    """Write NaN or Inf into a random element of a random floating tensor; returns the tensor's spec."""
    with open(path, "r+b") as f:
        head = f.read(16)
        assert head[:8] == MAGIC, path
        (hlen,) = struct.unpack("<Q", head[8:16])
        _, specs = pickle.loads(f.read(hlen))
        base = align(16 + hlen, PAGE)
        candidates = [s for s in specs if s.dtype in ("float32", "bfloat16", "float16") and s.nbytes]
        spec = rng.choice(candidates)
        dtype = getattr(torch, spec.dtype)
        element = torch.tensor([rng.choice([float("nan"), float("inf"), -float("inf")])], dtype=dtype)
        size = element.element_size()
        f.seek(base + spec.offset + size * rng.randrange(spec.nbytes // size))
        f.write(element.view(torch.uint8).numpy().tobytes())
    return f"{spec.dtype}{list(spec.shape)}"


def rechecksum(tag_dir: str, path: str) -> None:
    """Make the manifest vouch for ``path`` as it is now."""
    rel = os.path.relpath(path, tag_dir)
    for name in os.listdir(tag_dir):
        if ondisk.MANIFEST_RE.match(name):
            man_path = os.path.join(tag_dir, name)
            with open(man_path) as f:
                man = json.load(f)
            if rel in man["files"]:
                hasher = new_hasher(man["checksum"])
                with open(path, "rb") as f:
                    hasher.update(f.read())
                man["files"][rel].update(size=os.path.getsize(path), digest=hasher.hexdigest())
                fs.write_json_atomic(man_path, man)


def valid_tags(run_dir: str) -> list[tuple[int, str]]:
    return sorted((c.iteration, c.tag) for c in catalog.list_checkpoints(run_dir) if c.valid)


def fault_nonfinite(rng: random.Random, trial_dir: str) -> str:
    run_dir = os.path.join(trial_dir, "run")
    mode = rng.choice(["predict", "auto"])
    config = write_config(run_dir, {"recovery": {"mode": mode}})
    first = rng.randrange(18, 40)
    run(trial_dir, config, first, "first")
    tags = valid_tags(run_dir)
    if rng.random() < 0.25:
        # A non-finite loss in the journal, as a diverging step would leave.
        with open(journal_path(run_dir, 0), "a") as f:
            f.write(f"{first + 1},nan,{time.time()!r}\n")
        what = "nan loss in the journal"
    else:
        iteration, tag = tags[-1] if rng.random() < 0.6 else rng.choice(tags)
        path = rng.choice(data_files(os.path.join(run_dir, tag)))
        spec = tamper_snapshot(path, rng)
        rechecksum(os.path.join(run_dir, tag), path)
        what = f"non-finite value in {tag}/{os.path.basename(path)} ({spec})"
    restart(trial_dir, config, run_dir, first + 10)
    losses = [e.loss for e in read_journal(journal_path(run_dir, 0))[-10:]]
    if not all(torch.isfinite(torch.tensor(losses))):
        raise Violation(f"training resumed from a non-finite state: losses {losses}")
    return f"{what}, mode {mode}"


def fault_journal(rng: random.Random, trial_dir: str) -> str:
    run_dir = os.path.join(trial_dir, "run")
    config = write_config(run_dir, {"recovery": {"mode": rng.choice(["predict", "auto", "recompute"])}})
    first = rng.randrange(18, 40)
    run(trial_dir, config, first, "first")
    f_true = journal_iterations(run_dir)[-1]
    lines = [
        f"1000000,2.9,{time.time()!r}\n",
        f"99999999999,2.9,{time.time()!r}\n",
        f"{f_true + rng.randrange(2, 500)},2.5,{time.time()!r}\n",
        f"{-rng.randrange(1, 100)},2.5,{time.time()!r}\n",
        "garbage,,\n",
        f"{f_true + 1},2.5",  # a cut line
    ]
    injected = rng.sample(lines, rng.randrange(1, 4))
    binary = rng.random() < 0.3
    with open(journal_path(run_dir, 0), "ab") as f:
        for line in injected:
            f.write(line.encode())
        if binary:
            f.write(bytes(rng.randrange(256) for _ in range(40)))
    t0 = time.monotonic()
    report = restart(trial_dir, config, run_dir, first + 8)
    if report["reached"] is not None and report["reached"] > f_true:
        raise Violation(f"recovery believed the job reached {report['reached']}, it reached {f_true}")
    if report["resume_iteration"] > f_true:
        raise Violation(f"resumed at {report['resume_iteration']}, past the true failure point {f_true}")
    return f"appended {[line.split(',')[0] for line in injected]}{' + binary' if binary else ''}; " \
           f"restart took {time.monotonic() - t0:.1f} s"


def fault_clock(rng: random.Random, trial_dir: str) -> str:
    run_dir = os.path.join(trial_dir, "run")
    config = write_config(run_dir)
    first = rng.randrange(15, 30)
    run(trial_dir, config, first, "first")
    offset = rng.choice([-1, 1]) * rng.uniform(60, 7200)
    second = first + rng.randrange(15, 30)
    run(trial_dir, config, second, "skewed", clock_offset_s=offset)
    report = check_directory(run_dir)
    iterations = sorted(c["iteration"] for c in report["checkpoints"] if c["valid"])
    expected = [i for i in range(INTERVAL, second + 1, INTERVAL)][-4:]
    if iterations != expected:
        raise Violation(f"retained checkpoints {iterations}, expected the newest four {expected}")
    return f"clock shifted by {offset:+.0f} s on the attempt from {first} to {second}"


METADATA_DAMAGE = {
    "manifest cut": lambda p, rng: _cut(p, rng),
    "manifest []": lambda p, rng: _write(p, b"[]"),
    "manifest without files": lambda p, rng: _edit(p, lambda m: m.pop("files")),
    "manifest files a number": lambda p, rng: _edit(p, lambda m: m.update(files=3)),
    "manifest a directory": lambda p, rng: (os.unlink(p), os.mkdir(p)),
    "commit cut": lambda p, rng: _cut(p, rng),
    "commit a string": lambda p, rng: _write(p, b'"x"'),
    "commit without iteration": lambda p, rng: _edit(p, lambda m: m.pop("iteration", None)),
    "latest binary": lambda p, rng: _write(p, bytes(rng.randrange(256) for _ in range(32))),
    "latest empty": lambda p, rng: _write(p, b""),
    "latest a directory": lambda p, rng: (os.unlink(p), os.mkdir(p)),
    "latest dangling": lambda p, rng: _write(p, b"global_step999999"),
}


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _cut(path: str, rng: random.Random) -> None:
    with open(path, "rb") as f:
        data = f.read()
    _write(path, data[:rng.randrange(1, len(data))])


def _edit(path: str, change) -> None:
    with open(path) as f:
        obj = json.load(f)
    change(obj)
    _write(path, json.dumps(obj).encode())


def fault_metadata(rng: random.Random, trial_dir: str) -> str:
    run_dir = os.path.join(trial_dir, "run")
    config = write_config(run_dir, {"recovery": {"mode": rng.choice(["predict", "auto", "recompute"])}})
    first = rng.randrange(4, 8) * INTERVAL
    run(trial_dir, config, first, "first")
    tags = valid_tags(run_dir)
    newest, tag = tags[-1]
    damage = rng.choice(sorted(METADATA_DAMAGE))
    tag_dir = os.path.join(run_dir, tag)
    target = (os.path.join(run_dir, ondisk.LATEST) if damage.startswith("latest") else
              os.path.join(tag_dir, ondisk.COMMIT) if damage.startswith("commit") else
              os.path.join(tag_dir, ondisk.manifest_name(0)))
    METADATA_DAMAGE[damage](target, rng)
    try:
        report = inspect_report(run_dir)
    except Exception as err:
        raise Violation(f"inspect crashed on '{damage}': {type(err).__name__}: {err}") from None
    usable = report["usable"]
    metadata_intact = damage.startswith("latest")
    expected = tag if metadata_intact else tags[-2][1]
    if usable != expected:
        raise Violation(f"'{damage}': inspect would load {usable}, expected {expected}")
    resumed = restart(trial_dir, config, run_dir, first + 7)
    if resumed["checkpoint"] is not None and resumed["checkpoint"] > (newest if metadata_intact else tags[-2][0]):
        raise Violation(f"'{damage}': the restart loaded checkpoint {resumed['checkpoint']}")
    return f"{damage} of {tag}"


def fault_damaged_data(rng: random.Random, trial_dir: str) -> str:
    run_dir = os.path.join(trial_dir, "run")
    strategy = rng.choice(["cpsr", "torch"])
    config = write_config(run_dir, {"checkpoint": {"dir": run_dir, "interval": INTERVAL, "keep_last": 4,
                                                   "strategy": strategy}})
    first = rng.randrange(4, 8) * INTERVAL
    run(trial_dir, config, first, "first")
    tags = valid_tags(run_dir)
    newest, tag = tags[-1] if rng.random() < 0.7 else tags[-2]
    tag_dir = os.path.join(run_dir, tag)
    drop_metadata = rng.random() < 0.6
    if drop_metadata:
        for name in os.listdir(tag_dir):
            if name.startswith("cpsr_"):
                os.unlink(os.path.join(tag_dir, name))
    path = rng.choice(data_files(tag_dir))
    size = os.path.getsize(path)
    os.truncate(path, rng.randrange(0, size))
    usable = inspect_report(run_dir)["usable"]
    if usable == tag:
        raise Violation(f"inspect would load the damaged {tag}")
    resumed = restart(trial_dir, config, run_dir, first + 7)
    if resumed["checkpoint"] == newest and tag == tags[-1][1]:
        raise Violation(f"the restart loaded the damaged checkpoint {tag}")
    return f"{strategy}: {tag}/{os.path.basename(path)} cut from {size} bytes" + \
           (", metadata deleted" if drop_metadata else "")


@contextlib.contextmanager
def small_tmpfs(path: str, size: str):
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def fill(path: str, nbytes: int) -> None:
    """Write up to ``nbytes`` into ``path``; the job writing beside it may fill the disk first."""
    with open(path, "wb", buffering=0) as f:
        try:
            for _ in range(max(0, nbytes) >> 16):
                f.write(bytes(1 << 16))
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise


def fault_full_disk(rng: random.Random, trial_dir: str) -> str:
    mount = os.path.join(trial_dir, "disk")
    with small_tmpfs(mount, "12m"):
        run_dir = os.path.join(mount, "run")
        config = write_config(run_dir, {"checkpoint": {"dir": run_dir, "interval": 2, "keep_last": 3,
                                                       "retry_backoff_s": 1.0}, "predictor": {"history": 2}})
        iters = 700
        child = job(trial_dir, config, iters, "full")
        while records.read_latest(run_dir) is None and child.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.3, 1.5))
        filler = os.path.join(mount, "filler")
        free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
        # Full to the last byte (the journal's appends fail too), or nearly (checkpoints fail).
        fill(filler, free if rng.random() < 0.4 else free - rng.randrange(0, 512 << 10))
        full_from = time.time()
        time.sleep(rng.uniform(1.5, 3.0))
        os.unlink(filler)
        full_to = time.time()
        code = child.wait()
        if code != 0:
            raise Violation(f"job failed with exit code {code}: {tail(child.output())}")
        entries = read_journal(journal_path(run_dir, 0))
        before = [e for e in entries if e.wall_time < full_from]
        during = [e for e in entries if full_from + 0.2 <= e.wall_time <= full_to]
        rate = lambda es: (len(es) - 1) / (es[-1].wall_time - es[0].wall_time) if len(es) > 2 else None  # noqa: E731
        if not before or entries[-1].wall_time <= full_to:
            raise Exception("the job did not train through the whole time the disk was full: make it longer")
        r_before, r_during = rate(before[-40:]), rate(during) or 0.0
        if r_during < 0.5 * r_before:
            raise Violation(f"training slowed from {r_before:.0f} to {r_during:.0f} it/s while the disk was full")
        report = check_directory(run_dir)
        leftovers = [c["tag"] for c in report["checkpoints"] if not c["committed"]]
        if leftovers:
            raise Violation(f"given-up checkpoints left on the disk: {leftovers}")
        last_full = max((e.iteration for e in entries if e.wall_time <= full_to), default=0)
        newest = max(c["iteration"] for c in report["checkpoints"] if c["valid"])
        if newest <= last_full:
            raise Violation(f"checkpointing did not resume: newest {newest}, disk freed at iteration {last_full}")
        check_finished(run_dir, iters)
        return f"full for {full_to - full_from:.1f} s: {r_before:.0f} it/s before, {r_during:.0f} during"


def two_ranks_checkpointing(ckpt_dir: str, blocked_step: int, blocked_rank: int, steps: int, result: str) -> None:
    """Child: rank 0 and 1 engines of one job; one rank's file of one checkpoint cannot be renamed into place."""
    cfg = CheckpointConfig(dir=ckpt_dir, interval=1, keep_last=3, retries=1, retry_backoff_s=0.05,
                           commit_timeout_s=600.0)
    engines = [create_engine(cfg, r, 2) for r in range(2)]
    model = {"w": torch.randn(20_000)}
    timing = {}
    for step in range(1, steps + 1):
        tag = f"global_step{step}"
        if step == blocked_step:
            os.makedirs(os.path.join(ckpt_dir, tag, f"zero_pp_rank_{blocked_rank}_mp_rank_00_optim_states.pt"))
        for rank, eng in enumerate(engines):
            eng.create(CheckpointCommitInfo(tag=tag, save_dir=ckpt_dir, save_latest=True))
            eng.save({"x": torch.randn(50_000), "step": step},
                     os.path.join(ckpt_dir, tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
            if rank == 0:
                eng.save(model, os.path.join(ckpt_dir, tag, "mp_rank_00_model_states.pt"))
            eng.commit(eng.get_commit_info())
        # Checkpoints requested while a write is being retried are skipped by design; the next
        # one comes after the retry (0.05 s), at a random moment.
        time.sleep(random.uniform(0.06, 0.2))
    t0 = time.monotonic()
    for eng in reversed(engines):
        eng.flush(timeout_s=None)
    timing["flush_s"] = time.monotonic() - t0
    for eng in engines:
        eng.cleanup()
    with open(result, "w") as f:
        json.dump(timing, f)


def fault_rank_write(rng: random.Random, trial_dir: str) -> str:
    ckpt_dir = os.path.join(trial_dir, "run")
    os.makedirs(ckpt_dir)
    steps = rng.randrange(3, 7)
    blocked = rng.randrange(1, steps + 1)
    rank = rng.randrange(2)
    result = os.path.join(trial_dir, "timing.json")
    child = Child(os.path.join(trial_dir, "engines.log"), two_ranks_checkpointing, ckpt_dir, blocked, rank, steps,
                  result)
    if child.wait(timeout_s=120) != 0:
        raise Violation(f"engines failed: {tail(child.output())}")
    with open(result) as f:
        flush_s = json.load(f)["flush_s"]
    if flush_s > 10:
        raise Violation(f"flush waited {flush_s:.1f} s for a commit that could not complete")
    found = {c.iteration: c for c in catalog.list_checkpoints(ckpt_dir)}
    if found.get(blocked) is not None and found[blocked].committed:
        raise Violation(f"checkpoint {blocked} committed although rank {rank}'s file is missing")
    latest = records.read_latest(ckpt_dir)
    if blocked < steps:
        if latest != f"global_step{steps}" or not found[steps].valid:
            raise Violation(f"latest is {latest}; the last checkpoint {steps} should be committed and valid")
    elif latest is not None and not found[ondisk.tag_iteration(latest)].valid:
        raise Violation(f"latest {latest} is not valid")
    output = child.output()
    if f"rank {rank}" not in output or "global_step" not in output:
        raise Violation(f"the log does not name rank {rank} and the blocked checkpoint: {tail(output)}")
    return f"rank {rank}'s file of checkpoint {blocked} of {steps} blocked; flush took {flush_s:.2f} s"


def fault_two_jobs(rng: random.Random, trial_dir: str) -> str:
    run_dir = os.path.join(trial_dir, "run")
    config = write_config(run_dir)
    iters = 800  # long enough that the first job still runs when the second starts
    first = job(trial_dir, config, iters, "first")
    kill_first = rng.random() < 0.3
    delay = rng.uniform(0.0, 4.0)
    time.sleep(delay)
    if kill_first:
        first.kill()
    second = job(trial_dir, config, iters, "second")
    codes = {"first": first.wait(), "second": second.wait()}
    if kill_first:
        if codes["second"] != 0:
            raise Violation(f"a killed job's directory stayed locked: {tail(second.output())}")
    else:
        refused = [name for name, code in codes.items() if code != 0]
        if len(refused) != 1:
            raise Violation(f"exit codes {codes}: exactly one of two concurrent jobs must be refused")
        text = (first if refused == ["first"] else second).output()
        if run_dir not in text:
            raise Violation(f"the refused job's error does not name the run directory: {tail(text)}")
    iterations = journal_iterations(run_dir)
    for a, b in zip(iterations, iterations[1:]):
        if b != a + 1 and b > a:
            raise Violation(f"the journal jumps from {a} to {b}: two writers")
    check_directory(run_dir)
    check_finished(run_dir, iters)
    return f"second job after {delay:.1f} s" + (", first killed" if kill_first else "") + f"; exit codes {codes}"


# ---------------------------------------------------------------- faults of a shared machine and of invalid state

SECOND_USER = 65534  # nobody: the other local user of the security faults
MARKER = "PLANTED-CODE-RAN"  # made by planted code, in the trial's directory, if it runs


class Plant:
    """A pickled object whose unpickling creates ``marker``: planted code, harmless but visible."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def need_second_user() -> str | None:
    """Why the faults of another local user cannot run here, or None."""
    return None if os.geteuid() == 0 else "acting as a second user (uid 65534) needs root"


def chown_tree(path: str, uid: int = SECOND_USER) -> None:
    """Give ``path`` (not following a link) and everything below it to ``uid``."""
    os.lchown(path, uid, uid)
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(top, name), uid, uid)


def checkpoint_block(run_dir: str, **settings) -> dict:
    return {"dir": run_dir, "interval": INTERVAL, "keep_last": 4, **settings}


def reached(run_dir: str, child: Child, iteration: int) -> bool:
    """Wait until the job's journal reaches ``iteration`` and a checkpoint is committed (True) or the job ends
    before (False)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while journal_end(run_dir) < iteration or records.read_latest(run_dir) is None:
        if child.poll() is not None:
            return False
        if time.monotonic() > deadline:
            child.kill()
            raise Hang(f"hang: the job did not reach iteration {iteration} within {JOB_TIMEOUT_S} s")
        time.sleep(0.02)
    return True


def wait_for_iteration(run_dir: str, child: Child, iteration: int) -> None:
    """Until the job's journal reaches ``iteration``; a job that ends before is a violation."""
    if not reached(run_dir, child, iteration):
        raise Violation(f"the job ended (exit code {child.code}) before iteration {iteration}: "
                        f"{tail(child.output())}")


def journal_end(run_dir: str) -> int:
    """The last iteration in rank 0's journal; 0 before it exists."""
    try:
        done = journal_iterations(run_dir)
    except FileNotFoundError:
        return 0
    return done[-1] if done else 0


def stop(child: Child, signum: int) -> None:
    """End a running job by ``signum`` (SIGTERM: a survivor dump first; SIGKILL: none)."""
    os.kill(child.pid, signum)
    child.wait()


def interrupted(trial_dir: str, config: str, run_dir: str, rng: random.Random, signum: int,
                umask: int | None = None, name: str = "first") -> int:
    """A job stopped by ``signum`` at a random iteration after its first checkpoint; that iteration or later."""
    at = rng.randrange(INTERVAL + 2, 4 * INTERVAL)
    child = job(trial_dir, config, 10 * at, name, umask=umask)
    wait_for_iteration(run_dir, child, at)
    stop(child, signum)
    return journal_iterations(run_dir)[-1]


def dump_dirs(root: str) -> list[str]:
    """The survivor dumps and host snapshots under a survivor root: directories holding a manifest."""
    return sorted(top for top, _, files in os.walk(root) if any(ondisk.MANIFEST_RE.match(f) for f in files))


def rewrite_dump(directory: str, change) -> None:
    """Replace the dump in ``directory`` with ``change(contents)``'s, written and checksummed as the product does."""
    (rank, man), = records.read_manifests(directory).items()
    contents = read_snapshot(os.path.join(directory, dumps.STATE_FILE))
    manifest = {k: v for k, v in man.items() if k not in ("tag", "checksum", "failed", "files")}
    dumps.write_dump(directory, change(contents), manifest, man["checksum"])


def rewrite_snapshot(path: str, obj, algorithm: str, scratch: str) -> dict:
    """Replace the snapshot file ``path`` with one of ``obj`` in the product's format; its manifest entry."""
    tmp = tempfile.mkdtemp(prefix="rewrite-", dir=scratch)
    dumps.write_dump(os.path.join(tmp, "d"), obj, {"rank": 0, "world_size": 1}, algorithm)
    entry = records.read_manifests(os.path.join(tmp, "d"))[0]["files"][dumps.STATE_FILE]
    os.replace(os.path.join(tmp, "d", dumps.STATE_FILE), path)
    shutil.rmtree(tmp)
    return entry


def report_sources(run_dir: str) -> set[str]:
    """Where the last restart took each rank's state from."""
    return set((last_report(run_dir).get("sources") or {}).values())


def check_no_marker(trial_dir: str, when: str) -> None:
    if os.path.exists(os.path.join(trial_dir, MARKER)):
        raise Violation(f"planted code ran ({when}): the planted pickle's marker file exists")


def fault_planted_root(rng: random.Random, trial_dir: str) -> str:
    """Another user made the survivor root first (0777 or 0755), or a symlink in its place: the job refuses it
    naming path, owner and mode, or uses nothing in it; planted code never runs, a planted dump is never resumed."""
    shm = os.path.join(trial_dir, "shm")
    os.makedirs(shm)
    os.chmod(shm, 0o1777)  # as /dev/shm
    root = os.path.join(shm, "cpsr-survivors-0")
    variant = rng.choice(["dir 0777", "dir 0755", "symlink"])
    planted_in = plant_root(root, variant)
    mode = None if variant == "symlink" else os.stat(root).st_mode & 0o777
    run_dir = os.path.join(trial_dir, "run")
    config = write_config(run_dir, {"checkpoint": checkpoint_block(run_dir, survivor_dir=root,
                                                                   memory_interval=rng.choice([None, 2])),
                                    "recovery": {"mode": rng.choice(["auto", "predict"])}})  # both read dumps
    at = rng.randrange(INTERVAL + 2, 4 * INTERVAL)
    first = job(trial_dir, config, 10 * at, "first")
    if not reached(run_dir, first, at):  # refused at start
        refused(first, "the job", root, variant, mode)
        return f"{variant}: refused at start"
    stop(first, signal.SIGTERM)
    problems = []
    mine = [d for d in dump_dirs(planted_in) if os.stat(d).st_uid != SECOND_USER]
    if mine:
        problems.append(f"the job wrote its dumps or snapshots into another user's {planted_in} ({mine[0]})")
    planted = plant_dump(planted_in, run_dir, os.path.join(trial_dir, MARKER), rng)
    again = job(trial_dir, config, journal_end(run_dir) + 5, "restart")
    code = again.wait()
    if os.path.exists(os.path.join(trial_dir, MARKER)):
        problems.append("the restart ran planted code (the planted pickle's marker file exists)")
    if code != 0:
        refused(again, "the restart", root, variant, mode, problems)
    elif planted and report_sources(run_dir) & {survivor_source.SOURCE, host_source.SOURCE}:
        problems.append(f"the restart resumed state planted by another user in {planted_in} "
                        f"(sources {sorted(report_sources(run_dir))})")
    if problems:
        raise Violation(f"{variant}: " + "; ".join(problems))
    return f"{variant}: restart exit code {code}" + ("" if planted else ", nothing planted")


def plant_root(root: str, variant: str) -> str:
    """Make ``root`` as another user would: a directory of ``variant``'s mode, or a symlink to one of its own;
    the directory that then receives what is written under ``root``."""
    if variant == "symlink":
        target = os.path.join(os.path.dirname(root), "elsewhere")
        os.mkdir(target)
        os.chmod(target, 0o777)
        chown_tree(target)
        os.symlink(target, root)
        os.lchown(root, SECOND_USER, SECOND_USER)
        return target
    os.mkdir(root)
    os.chmod(root, 0o777 if variant == "dir 0777" else 0o755)
    chown_tree(root)
    return root


def refused(child: Child, who: str, root: str, variant: str, mode: int | None, problems: list | None = None) -> None:
    """``child`` stopped: a violation unless it stopped with an error naming the root's path, owner and mode
    (a symlink: the path), never a raw PermissionError. With ``problems``, the violation is added to them."""
    text = child.output()
    missing = [] if root in text else [f"the path {root}"]
    if mode is not None:
        if str(SECOND_USER) not in text and "nobody" not in text:
            missing.append(f"the owner (uid {SECOND_USER})")
        if f"{mode:o}" not in text:
            missing.append(f"the mode {mode:o}")
    found = []
    if "PermissionError" in text:
        found.append(f"{who} died with a raw PermissionError")
    if child.code == 0 or missing:
        found.append(f"{who} stopped (exit code {child.code}) without an error naming {', '.join(missing)}: "
                     f"{tail(text)}")
    if problems is not None:
        problems.extend(found)
    elif found:
        raise Violation(f"{variant}: " + "; ".join(found))


def plant_dump(root: str, run_dir: str, marker: str, rng: random.Random) -> bool:
    """As another user: every dump and host snapshot of the run under ``root`` replaced (rank 0's dump made where
    there is none) with one whose header runs code and whose weights are moved, checksum and manifest valid;
    whether the run's identity was known."""
    try:
        with open(os.path.join(run_dir, run_id.RUN_ID)) as f:
            run = json.load(f)["run"]
    except (OSError, ValueError, KeyError):
        return False
    scale = rng.choice([1.0, 1.01, -1.0])

    def planted(contents: dict) -> dict:
        state = {k: t * scale if k.startswith("param/") else t for k, t in contents["state"].items()}
        return {**contents, "state": state, "planted": Plant(marker)}

    found = dump_dirs(os.path.join(root, run))
    for directory in found:
        rewrite_dump(directory, planted)
    if not found:
        manifest = {"rank": 0, "world_size": 1, "attempt": rundir.recorded_attempt(run_dir), "run": run, "stage": 0,
                    "iteration": journal_end(run_dir), "reason": "SIGTERM received", "written_ns": time.time_ns()}
        dumps.write_dump(dumps.dump_dir(root, run, 0),
                            planted({"state": {}, "fragments": {}, "counters": {}, "weights": None}), manifest,
                            "xxh3_64")
    chown_tree(os.path.join(root, run))
    return True


def fault_planted_tag(rng: random.Random, trial_dir: str) -> str:
    """A DeepSpeed-format tag with a malicious pickle global, named by ``latest``."""
    run_dir = os.path.join(trial_dir, "run")
    config = write_config(run_dir, {"recovery": {"mode": rng.choice(["auto", "predict", "recompute"])}})
    first = rng.randrange(3, 7) * INTERVAL + rng.randrange(INTERVAL)
    run(trial_dir, config, first, "first")
    iteration = (first // INTERVAL + rng.randrange(0, 3)) * INTERVAL
    tag = f"global_step{iteration}"
    tag_dir = os.path.join(run_dir, tag)
    shutil.rmtree(tag_dir, ignore_errors=True)
    os.makedirs(tag_dir)
    name = rng.choice(["mp_rank_00_model_states.pt", "layer_01-model_00-model_states.pt",
                       "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
    marker = os.path.join(trial_dir, MARKER)
    torch.save({"module": Plant(marker), "iteration": iteration}, os.path.join(tag_dir, name))
    with open(os.path.join(run_dir, ondisk.LATEST), "w") as f:
        f.write(tag)
    if need_second_user() is None:
        chown_tree(tag_dir)
    inspect = Child(os.path.join(trial_dir, "inspect.log"), inspect_main, run_dir)
    inspect.wait()
    check_no_marker(trial_dir, f"python -m cpsr_ds inspect with {tag}/{name} planted")
    if "Traceback" in inspect.output():
        raise Violation(f"inspect crashed on the planted {tag}: {tail(inspect.output())}")
    again = job(trial_dir, config, first + 5, "restart")
    code = again.wait()
    check_no_marker(trial_dir, f"restart with {tag}/{name} planted")
    if code != 0 and tag not in again.output():
        raise Violation(f"the restart failed (exit code {code}) on the planted {tag} without naming it: "
                        f"{tail(again.output())}")
    return f"{tag}/{name} planted, latest names it; inspect exit code {inspect.code}, restart exit code {code}"


def inspect_main(run_dir: str) -> None:
    sys.exit(cli_main(["inspect", run_dir]))


def fault_modes(rng: random.Random, trial_dir: str) -> str:
    """Survivor dumps and host snapshots under a permissive umask: 0600 files, 0700 directories, lock 0600."""
    umask = rng.choice([0o022, 0o000, 0o002])
    root = os.path.join(trial_dir, "shm", "cpsr-survivors-0")
    os.makedirs(os.path.dirname(root))
    run_dir = os.path.join(trial_dir, "run")
    config = write_config(run_dir, {"checkpoint": checkpoint_block(run_dir, survivor_dir=root,
                                                                   memory_interval=rng.randrange(1, 6))})
    signum = rng.choice([signal.SIGTERM, signal.SIGKILL])
    interrupted(trial_dir, config, run_dir, rng, signum, umask=umask)
    if not dump_dirs(root):
        raise Violation("the job left neither survivor dump nor host snapshot")
    wrong = [(path, mode) for path, mode, want in tree_modes(root) if mode != want]
    lock = os.path.join(run_dir, rundir.LOCK)
    lock_mode = os.stat(lock).st_mode & 0o777
    if lock_mode != 0o600:
        wrong.append((lock, lock_mode))
    if wrong:
        shown = ", ".join(f"{os.path.relpath(p, trial_dir)} {m:04o}" for p, m in wrong[:4])
        raise Violation(f"umask {umask:03o}: {len(wrong)} path(s) readable or writable by others "
                        f"(files must be 0600, directories 0700): {shown}")
    return f"umask {umask:03o}, {signal.Signals(signum).name}: {len(dump_dirs(root))} dump(s), all private"


def tree_modes(root: str) -> Iterator[tuple[str, int, int]]:
    """(path, mode, the mode it must have) of ``root`` and everything below it."""
    yield root, os.stat(root).st_mode & 0o777, 0o700
    for top, dirs, files in os.walk(root):
        for name in dirs:
            path = os.path.join(top, name)
            yield path, os.lstat(path).st_mode & 0o777, 0o700
        for name in files:
            path = os.path.join(top, name)
            yield path, os.lstat(path).st_mode & 0o777, 0o600


def hold_shared_lock(path: str, ready: int) -> None:
    """Child, as another user: a read-only shared flock on ``path``, held until killed; tells ``ready`` b"1" when
    held, b"0" when the file cannot be opened."""
    os.setgroups([])
    os.setgid(SECOND_USER)
    os.setuid(SECOND_USER)
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        os.write(ready, b"0")
        return
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.write(ready, b"1")
    while True:
        time.sleep(60)


def fault_foreign_lock(rng: random.Random, trial_dir: str) -> str:
    """Another user's process holds a read-only flock on the lock file of a run whose job died."""
    run_dir = os.path.join(trial_dir, "run")
    config = write_config(run_dir, {"checkpoint": checkpoint_block(run_dir, survivor=rng.random() < 0.5)})
    signum = rng.choice([signal.SIGKILL, signal.SIGTERM])
    at = rng.randrange(INTERVAL + 2, 3 * INTERVAL)
    first = job(trial_dir, config, 10 * at, "first")
    wait_for_iteration(run_dir, first, at)
    dead_pid = first.pid
    stop(first, signum)
    read, write = os.pipe()
    holder = Child(os.path.join(trial_dir, "holder.log"), hold_shared_lock, os.path.join(run_dir, rundir.LOCK), write)
    os.close(write)
    held = os.read(read, 1) == b"1"  # b"" where the holder died
    os.close(read)
    try:
        again = job(trial_dir, config, journal_iterations(run_dir)[-1] + 5, "restart")
        code = again.wait()
    finally:
        holder.kill()
    text = again.output()
    if code != 0:
        if f"pid {dead_pid}" in text or f"pid={dead_pid}" in text:
            raise Violation(f"the restart refused, blaming its own dead job (pid {dead_pid}) for a lock held by "
                            f"uid {SECOND_USER}: {tail(text)}")
        if str(SECOND_USER) not in text and "nobody" not in text and "another user" not in text:
            raise Violation(f"the restart failed (exit code {code}) without naming the other user's process: "
                            f"{tail(text)}")
        return f"{signal.Signals(signum).name}; restart refused naming the other user"
    check_finished(run_dir, journal_iterations(run_dir)[-1])
    return f"{signal.Signals(signum).name}; lock {'held' if held else 'not readable'} by uid {SECOND_USER}; " \
           "restart ran"


def fault_copied_run(rng: random.Random, trial_dir: str) -> str:
    """``cp -r run runB`` after a kill: B must not resume A's survivor dump or host snapshot as exact."""
    root = os.path.join(trial_dir, "shm", "cpsr-survivors-0")
    os.makedirs(os.path.dirname(root))
    run_a, run_b = os.path.join(trial_dir, "run"), os.path.join(trial_dir, "runB")
    memory = rng.random() < 0.5
    extra = {"memory_interval": rng.randrange(1, 4)} if memory else {}
    mode = rng.choice(["auto", "recompute"])
    configs = {d: write_config(d, {"checkpoint": checkpoint_block(d, survivor_dir=root, **extra),
                                   "recovery": {"mode": mode}}) for d in (run_a, run_b)}
    signum = signal.SIGKILL if memory and rng.random() < 0.5 else signal.SIGTERM
    reached = interrupted(trial_dir, configs[run_a], run_a, rng, signum)
    subprocess.run(["cp", "-r", run_a, run_b], check=True)
    order = rng.choice([["B"], ["B", "A"], ["A", "B"]])
    for which in order:
        directory = run_b if which == "B" else run_a
        run(trial_dir, configs[directory], reached + 5, f"restart{which}")
        if which == "B":
            sources = report_sources(run_b)
            exact = sources & {survivor_source.SOURCE, host_source.SOURCE}
            if exact:
                raise Violation(f"the copy runB resumed run A's {sorted(exact)} as exact (restarts {order})")
    return f"{signal.Signals(signum).name}{', host snapshots' if memory else ''}, mode {mode}; restarts {order}"


def failure_free_loss(trial_dir: str, cpsr: dict, iters: int) -> float:
    """The last loss of the failure-free run of the trial's job to ``iters``."""
    ref_dir = os.path.join(trial_dir, "reference")
    blocks = {**cpsr, "checkpoint": {**cpsr["checkpoint"], "dir": ref_dir, "survivor": False,
                                     "memory_interval": None}}
    run(trial_dir, write_config(ref_dir, blocks), iters, "reference")
    return read_journal(journal_path(ref_dir, 0))[-1].loss


def check_losses(run_dir: str, reference: float, since: int) -> float:
    """The restart trained on finite losses to within the usual bound of the failure-free run; its last loss."""
    losses = [e.loss for e in read_journal(journal_path(run_dir, 0)) if e.iteration > since]
    if not losses or not all(math.isfinite(x) for x in losses):
        raise Violation(f"training resumed an invalid state: losses after the restart {losses[:6]}...")
    if abs(losses[-1] - reference) > LOSS_BOUND * reference:
        raise Violation(f"final loss {losses[-1]:.4f} against {reference:.4f} failure-free (bound "
                        f"{LOSS_BOUND:.0%}): an invalid state was resumed")
    return losses[-1]


def negate_second_moment(contents: dict, rng: random.Random) -> tuple[dict, str]:
    key = rng.choice(sorted(k for k in contents["state"] if k.startswith("exp_avg_sq/")))
    return {**contents, "state": {**contents["state"], key: -contents["state"][key]}}, f"{key} negated"


def wrong_shape(contents: dict, rng: random.Random) -> tuple[dict, str]:
    key = rng.choice(sorted(contents["state"]))
    t = contents["state"][key].reshape(-1)
    bad = torch.cat([t, t[:rng.randrange(1, t.numel() + 1)]]) if rng.random() < 0.5 else t[:rng.randrange(t.numel())]
    return {**contents, "state": {**contents["state"], key: bad}}, f"{key} {list(contents['state'][key].shape)} " \
                                                                  f"made {list(bad.shape)}"


def fault_invalid_state(rng: random.Random, trial_dir: str) -> str:
    """A finite but invalid dump, host snapshot or landed layer file, checksums made to match."""
    mode = rng.choice(["auto", "recompute"])
    source = rng.choice(["survivor dump", "host snapshot", "in flight"])
    if source == "in flight":
        return invalid_in_flight(rng, trial_dir, mode)
    root = os.path.join(trial_dir, "shm", "cpsr-survivors-0")
    os.makedirs(os.path.dirname(root))
    run_dir = os.path.join(trial_dir, "run")
    extra = {"memory_interval": rng.randrange(1, 4)} if source == "host snapshot" else {}
    cpsr = {"checkpoint": checkpoint_block(run_dir, survivor_dir=root, **extra), "recovery": {"mode": mode}}
    config = write_config(run_dir, cpsr)
    signum = signal.SIGKILL if source == "host snapshot" else signal.SIGTERM
    reached = interrupted(trial_dir, config, run_dir, rng, signum)
    damage = negate_second_moment if rng.random() < 0.6 else wrong_shape
    targets = [d for d in dump_dirs(root) if (".memory" in d) == (source == "host snapshot")]
    if not targets:
        raise Violation(f"no {source} was written")
    what = []
    for directory in targets:
        rewrite_dump(directory, lambda c: record(what, damage(c, rng)))
    iters = reached + rng.randrange(5, 15)
    reference = failure_free_loss(trial_dir, cpsr, iters)
    run(trial_dir, config, iters, "restart")
    final = check_losses(run_dir, reference, reached)
    return f"{source}: {what[0]}, mode {mode}; sources {sorted(report_sources(run_dir))}, final loss " \
           f"{final:.4f} vs {reference:.4f}"


def record(what: list, result: tuple[dict, str]) -> dict:
    what.append(result[1])
    return result[0]


def in_flight(rng: random.Random, trial_dir: str, cpsr: dict) -> tuple[str, str, int]:
    """A job whose newest checkpoint is made one cut short after its layer files landed (as a failure during its
    persist leaves it); (config, that checkpoint's directory, the iteration the job reached)."""
    run_dir = cpsr["checkpoint"]["dir"]
    config = write_config(run_dir, cpsr)
    reached = rng.randrange(3, 7) * INTERVAL + rng.randrange(1, INTERVAL)
    run(trial_dir, config, reached, "first")
    (_, before), (_, tag) = valid_tags(run_dir)[-2:]
    tag_dir = os.path.join(run_dir, tag)
    for rank, manifest in records.read_manifests(tag_dir).items():
        layers = [rel for rel in manifest["files"] if rel.startswith("layer_")]
        for k, rel in enumerate(layers):
            progress_record.record_progress(tag_dir, rank, rel, manifest["files"][rel], manifest["attempt"],
                                  manifest["checksum"], first=k == 0)
        for rel in set(manifest["files"]) - set(layers):
            os.unlink(os.path.join(tag_dir, rel))
        os.unlink(os.path.join(tag_dir, ondisk.manifest_name(rank)))
    os.unlink(os.path.join(tag_dir, ondisk.COMMIT))
    with open(os.path.join(run_dir, ondisk.LATEST), "w") as f:
        f.write(before)
    return config, tag_dir, reached


def damage_landed_layer(rng: random.Random, trial_dir: str, tag_dir: str, change) -> str:
    """Rewrite a random landed layer file of the checkpoint in flight with ``change(state)`` and re-digest its
    progress line; what was done."""
    progress = os.path.join(tag_dir, ondisk.progress_name(0))
    with open(progress) as f:
        lines = [json.loads(line) for line in f]
    line = rng.choice(lines)
    path = os.path.join(tag_dir, line["file"])
    state, what = change(read_snapshot(path))
    line.update(rewrite_snapshot(path, state, line["checksum"], trial_dir))
    line.pop("nonfinite", None)
    with open(progress, "w") as f:
        f.writelines(json.dumps(entry) + "\n" for entry in lines)
    return f"{line['file']}: {what}"


def nan_in(state: dict, rng: random.Random) -> tuple[dict, str]:
    key = rng.choice(sorted(k for k, t in state.items() if torch.is_tensor(t) and t.is_floating_point()))
    t = state[key].clone()
    t.view(-1)[rng.randrange(t.numel())] = float("nan")
    return {**state, key: t}, f"NaN in {key}"


def shape_wrong(state: dict, rng: random.Random) -> tuple[dict, str]:
    key = rng.choice(sorted(k for k, t in state.items() if torch.is_tensor(t) and t.is_floating_point()))
    t = state[key].reshape(-1)
    return {**state, key: torch.cat([t, t[:1]])}, f"{key} {list(state[key].shape)} made [{t.numel() + 1}]"


def invalid_in_flight(rng: random.Random, trial_dir: str, mode: str) -> str:
    run_dir = os.path.join(trial_dir, "run")
    cpsr = {"checkpoint": checkpoint_block(run_dir), "recovery": {"mode": mode}}
    config, tag_dir, reached = in_flight(rng, trial_dir, cpsr)
    what = damage_landed_layer(rng, trial_dir, tag_dir, lambda state: nan_in(state, rng))
    iters = reached + rng.randrange(5, 15)
    reference = failure_free_loss(trial_dir, cpsr, iters)
    run(trial_dir, config, iters, "restart")
    final = check_losses(run_dir, reference, reached)
    return f"in flight {os.path.basename(tag_dir)}/{what}, mode {mode}; final loss {final:.4f} vs {reference:.4f}"


def fault_crash_loop(rng: random.Random, trial_dir: str) -> str:
    """A source that cannot be read at restart: the first restart must fall back and finish."""
    run_dir = os.path.join(trial_dir, "run")
    variant = rng.choice(["wrong-shape layer file in flight", "summary with an extra field", "summary a list"])
    if variant.startswith("wrong-shape"):
        cpsr = {"checkpoint": checkpoint_block(run_dir), "recovery": {"mode": "auto"}}
        config, tag_dir, reached = in_flight(rng, trial_dir, cpsr)
        what = damage_landed_layer(rng, trial_dir, tag_dir, lambda state: shape_wrong(state, rng))
    else:
        config = write_config(run_dir, {"recovery": {"mode": "predict"}, "predictor": {"name": "trend",
                                                                                       "history": 3}})
        reached = rng.randrange(4, 8) * INTERVAL + rng.randrange(1, INTERVAL)
        run(trial_dir, config, reached, "first")
        what = damage_summary(run_dir, variant, rng)
    run(trial_dir, config, reached + 5, "restart")  # a failed first restart is the violation
    check_finished(run_dir, reached + 5)
    return f"{variant}: {what}"


def damage_summary(run_dir: str, variant: str, rng: random.Random) -> str:
    """Rewrite the newest predictor summary (valid SHA-256) with an extra field, or as a list."""
    found = sorted(glob.glob(os.path.join(run_dir, summaries.SUMMARIES_DIR, "rank*", "*.pt")))
    if not found:
        raise Violation("the job wrote no predictor summary")
    path = found[-1]
    with open(path, "rb") as f:
        payload = f.read().partition(b"\n")[2]
    summary = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    extra = {rng.choice(["extra", "version", "slope2"]): rng.randrange(1, 4)}
    if variant == "summary a list":
        changed, where = list(summary.values()), "the payload"
    elif isinstance(summary.get("held_out"), dict) and rng.random() < 0.7:
        changed, where = {**summary, "held_out": {**summary["held_out"], **extra}}, "held_out"
    else:
        changed, where = {**summary, **extra}, "the top level"
    with open(path, "wb") as f:
        f.write(b"".join(summaries.encode(changed)))
    return f"{os.path.relpath(path, run_dir)} ({where})"


def fault_clean_end(rng: random.Random, trial_dir: str) -> str:
    """A PP = 2 job (two processes, DeepSpeed's launcher) that trains to its end: every rank exits 0."""
    run_dir = os.path.join(trial_dir, "run")
    config = write_config(run_dir, {"checkpoint": checkpoint_block(run_dir, interval=rng.randrange(2, 6))},
                          stages=2)
    iters = rng.randrange(8, 25)
    log = os.path.join(trial_dir, "launcher.log")
    # DeepSpeed's per-node launcher, as ``deepspeed --num_gpus 2`` runs it on one node (without the runner's
    # own interpreter start): it starts both ranks and logs how each exits.
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    command = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", os.path.join(ROOT, "examples", "gpt", "train_gpt.py"),
               "--deepspeed_config", config, "--train-iters", str(iters), "--valid-sequences", "4",
               "--log-interval", "1000", "--eval-interval", "100000"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=JOB_TIMEOUT_S,
                                  cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            raise Hang(f"hang: the PP = 2 job did not end within {JOB_TIMEOUT_S} s (log {log})") from None
    with open(log, errors="replace") as f:
        text = f.read()
    clean = text.count("exits successfully")
    if code != 0 or clean != 2:
        raise Violation(f"a clean end of a PP = 2 job: launcher exit code {code}, {clean} of 2 ranks exited 0: "
                        f"{tail(text)}")
    for rank in (0, 1):
        done = [e.iteration for e in read_journal(journal_path(run_dir, rank))]
        if not done or done[-1] != iters:
            raise Violation(f"rank {rank} did not train to {iters}: journal ends at {done[-1] if done else None}")
    return f"{iters} iterations, checkpoint interval {config_interval(config)}: both ranks exited 0"


def config_interval(config: str) -> int:
    with open(config) as f:
        return json.load(f)["cpsr"]["checkpoint"]["interval"]


def fault_rbr_exact(rng: random.Random, trial_dir: str) -> str:
    """Dropout on, a kill after a checkpoint, a recompute restart: the recomputed losses are the failure-free
    run's, bit for bit."""
    torch_adam = rng.random() < 0.5
    dropout = rng.choice([0.1, 0.2])
    kill = rng.randrange(INTERVAL + 1, 4 * INTERVAL)
    iters = kill + rng.randrange(3, 10)
    losses = {}
    for name in ("reference", "run"):
        run_dir = os.path.join(trial_dir, name)
        faults = {"kill_at_iteration": kill} if name == "run" else {}
        config = write_config(run_dir, {"checkpoint": checkpoint_block(run_dir, survivor=False),
                                        "recovery": {"mode": "recompute"}, "faults": faults},
                              dropout=dropout, torch_adam=torch_adam)
        if name == "run":
            if job(trial_dir, config, iters, "killed").wait() == 0:
                raise Exception("the fault did not kill the job")
        run(trial_dir, config, iters, name)
        losses[name] = {e.iteration: e.loss for e in read_journal(journal_path(run_dir, 0))}
    resumed = last_report(os.path.join(trial_dir, "run"))["resume_iteration"]
    differ = [(i, losses["run"][i], losses["reference"][i]) for i in range(resumed + 1, iters + 1)
              if losses["run"][i] != losses["reference"][i]]
    optimizer = "torch_adam" if torch_adam else "DeepSpeed's default Adam"
    if differ:
        i, got, want = differ[0]
        raise Violation(f"{optimizer}, dropout {dropout}: recomputed losses differ from the failure-free run's at "
                        f"{len(differ)} of {iters - resumed} iterations, first at {i}: {got!r} vs {want!r}")
    return f"{optimizer}, dropout {dropout}, killed after {kill}, recomputed from {resumed}: bit-exact"


CONFIG_TYPOS = ("cspr", "CPSR", "cpsr_", "cpssr", "pcsr")


def fault_config(rng: random.Random, trial_dir: str) -> str:
    """Bad configuration: a misspelt block, an unwritable checkpoint.dir, a NUL byte in survivor_dir."""
    variant = rng.choice(["typo", "read-only dir", "NUL in survivor_dir"])
    run_dir = os.path.join(trial_dir, "run")
    if variant == "typo":
        key = rng.choice(CONFIG_TYPOS)
        config = write_config(run_dir, typo=key, keep_block=rng.random() < 0.3)
        child = job(trial_dir, config, rng.randrange(2, 6), "typo")
        child.wait()
        if not re.search(rf"(?<![\w./-]){re.escape(key)}(?![\w])", child.output()):
            raise Violation(f"top-level key {key!r} beside 'cpsr' gave no warning naming it: {tail(child.output())}")
        return f"top-level key {key!r}: named, exit code {child.code}"
    if variant == "read-only dir":
        if not can_mount():
            return "read-only dir: skipped, a read-only mount needs root"
        os.makedirs(run_dir)
        with read_only(run_dir):
            child = job(trial_dir, write_config(run_dir), 5, "read_only")
            code = child.wait()
        text = child.output()
        if code == 0 or not names_key(text, "checkpoint.dir", run_dir):
            raise Violation(f"a read-only checkpoint.dir: exit code {code}, the error must name checkpoint.dir and "
                            f"{run_dir}: {tail(text)}")
        return "read-only checkpoint.dir: refused, named"
    root = os.path.join(trial_dir, "shm")
    cut = rng.randrange(len(root) + 1)
    bad = root[:cut] + "\0" + root[cut:]
    child = job(trial_dir, write_config(run_dir, {"checkpoint": checkpoint_block(run_dir, survivor_dir=bad)}), 5,
                "nul")
    code = child.wait()
    text = child.output()
    started = journal_end(run_dir) > 0
    if code == 0 or started or not names_key(text, "checkpoint.survivor_dir"):
        raise Violation(f"a NUL byte in checkpoint.survivor_dir: exit code {code}, training started {started}; "
                        f"the config check must refuse it naming the key: {tail(text)}")
    return f"NUL at {cut} of survivor_dir: refused naming the key"


def names_key(text: str, key: str, also: str = "") -> bool:
    """Whether a line of ``text`` names the config key ``key`` (``cpsr.`` before it or not, but not a traceback's
    source line such as ``cfg.checkpoint.dir``) and ``also``."""
    pattern = re.compile(rf"(?<![\w.])(?:cpsr\.)?{re.escape(key)}(?!\w)")
    return any(pattern.search(line) and also in line for line in text.splitlines())


@contextlib.contextmanager
def read_only(path: str):
    subprocess.run(["mount", "--bind", path, path], check=True, capture_output=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", path, path], check=True, capture_output=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


# ---------------------------------------------------------------- the campaign

def can_mount() -> bool:
    probe = f"/tmp/chaos-mount-probe-{os.getpid()}"
    try:
        with small_tmpfs(probe, "1m"):
            return True
    except (subprocess.CalledProcessError, OSError):
        return False
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def skip_reason(name: str) -> str | None:
    """Why fault ``name`` cannot run on this machine, or None."""
    if name == "full_disk":
        return None if can_mount() else "mounting a tmpfs needs root"
    if name in ("planted_root", "foreign_lock"):
        return need_second_user()
    return None


def run_trial(name: str, seed: int, i: int, out_dir: str) -> dict:
    """One trial of fault ``name``; its case record (a violation is recorded, never raised)."""
    rng = random.Random(f"{seed}-{name}-{i}")
    trial_dir = os.path.join(out_dir, f"{name}-{i:03d}")
    shutil.rmtree(trial_dir, ignore_errors=True)
    os.makedirs(trial_dir)
    t0, cpu0 = time.monotonic(), cpu_seconds()
    try:
        what = globals()[f"fault_{name}"](rng, trial_dir)
        violation = None
    except (Violation, Hang) as err:
        what, violation = "", str(err)
    except Exception as err:
        what, violation = "", f"campaign error: {type(err).__name__}: {err}"
        traceback.print_exc()
    print(f"{name:<13} {i:3d} {'VIOLATION: ' + violation if violation else 'ok: ' + what}", flush=True)
    if violation is None:
        shutil.rmtree(trial_dir, ignore_errors=True)
    return {"trial": i, "what": what, "violation": violation, "seconds": round(time.monotonic() - t0, 1),
            "cpu_seconds": round(cpu_seconds() - cpu0, 1)}


def cpu_seconds() -> float:
    """CPU time of this process and of its children that ended: a trial's cost whatever else loads the machine."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def summary(cases: dict, skipped: dict, seconds: float, seed: int, command: str) -> dict:
    """The campaign's JSON: per fault its trials, violations, skipped trials (and why) and mean seconds."""
    per = {name: {"trials": len(cs), "violations": sum(c["violation"] is not None for c in cs),
                  "skipped": skipped.get(name, {}).get("trials", 0), "skip_reason": skipped.get(name, {}).get("reason"),
                  "mean_seconds": mean(c["seconds"] for c in cs),
                  "mean_cpu_seconds": mean(c.get("cpu_seconds", 0.0) for c in cs)}
           for name, cs in {**{n: [] for n in skipped}, **cases}.items()}
    return {"faults": per,
            "trials": {k: r["trials"] for k, r in per.items()},
            "violations": {k: r["violations"] for k, r in per.items()},
            "total_trials": sum(r["trials"] for r in per.values()),
            "total_violations": sum(r["violations"] for r in per.values()),
            "total_skipped": sum(r["skipped"] for r in per.values()),
            "seconds": round(seconds), "seed": seed, "command": command, "cases": cases}


def mean(values) -> float | None:
    values = list(values)
    return round(sum(values) / len(values), 1) if values else None


def write_json(path: str, result: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=12, help="trials per fault (12 x 18 faults: 216)")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of: " + ", ".join(FAULTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=result_path("chaos", "json"), help="write the results here after every trial "
                   "(default: benchmarks/results/chaos/chaos.json)")
    p.add_argument("--resume", action="store_true", help="keep the trials the --json file already holds and run "
                   "the rest (a campaign that was cut short)")
    p.add_argument("--out-dir", default="/tmp/cpsr-chaos")
    args = p.parse_args(argv)
    faults = args.faults.split(",")
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        p.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    command = "python -m benchmarks.chaos " + " ".join(argv if argv is not None else sys.argv[1:])
    earlier = {}
    if args.resume and os.path.exists(args.json):
        with open(args.json) as f:
            earlier = json.load(f)
    else:
        shutil.rmtree(args.out_dir, ignore_errors=True)
    skipped = {}
    for name in faults:
        reason = skip_reason(name)
        if reason:
            print(f"{name}: skipped, {reason}")
            skipped[name] = {"trials": args.trials, "reason": reason}
    cases = {name: [c for c in earlier.get("cases", {}).get(name, []) if c["trial"] < args.trials]
             for name in faults if name not in skipped}
    seconds = earlier.get("seconds", 0)
    t_start = time.time()
    for i in range(args.trials):
        for name, done in cases.items():
            if any(c["trial"] == i for c in done):
                continue
            done.append(run_trial(name, args.seed, i, args.out_dir))
            if args.json:
                write_json(args.json, summary(cases, skipped, seconds + time.time() - t_start, args.seed, command))
    result = summary(cases, skipped, seconds + time.time() - t_start, args.seed, command)
    print(f"\n{'fault':<14}{'trials':>7}{'violations':>12}{'skipped':>9}{'s/trial':>9}{'cpu s/trial':>13}")
    for name, r in result["faults"].items():
        print(f"{name:<14}{r['trials']:>7}{r['violations']:>12}{r['skipped']:>9}{r['mean_seconds'] or 0:>9.1f}"
              f"{r['mean_cpu_seconds'] or 0:>13.1f}")
    print(f"{'all':<14}{result['total_trials']:>7}{result['total_violations']:>12}{result['total_skipped']:>9}"
          f"   ({result['seconds']} s)")
    if args.json:
        write_json(args.json, result)
    return 1 if result["total_violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
