"""Fault campaign: the faults of the reliability issue, repeated with randomised timing, against invariants.

Every trial trains the tiny GPT through the product's entry point (``launch/train_gpt.py``,
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

    python benchmarks/chaos.py [--trials N] [--faults a,b] [--seed S] [--json PATH] [--out-dir DIR]

Each job runs in a child forked from this process (imports done once), so a trial
costs seconds. ``full_disk`` needs root to mount a tmpfs; without it that fault is
reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import shutil
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jobs import Child, Hang, free_port, tail  # noqa: E402  (first: it sets the jobs' environment)

import torch  # noqa: E402
import train_gpt  # noqa: E402
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo  # noqa: E402

from cpsr_ds.__main__ import inspect_report  # noqa: E402
from cpsr_ds.checkpoint import store  # noqa: E402
from cpsr_ds.checkpoint.factory import create_engine  # noqa: E402
from cpsr_ds.checkpoint.fileformat import MAGIC, PAGE, align, new_hasher, read_snapshot  # noqa: E402
from cpsr_ds.checkpoint.journal import journal_path, read_journal  # noqa: E402
from cpsr_ds.config import CheckpointConfig  # noqa: E402

import pickle  # noqa: E402
import struct  # noqa: E402

FAULTS = ("nonfinite", "journal", "clock", "metadata", "damaged_data", "full_disk", "rank_write", "two_jobs")
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}
INTERVAL = 5


class Violation(Exception):
    """An invariant a user relies on was broken."""


# ---------------------------------------------------------------- running jobs

def write_config(run_dir: str, cpsr: dict | None = None, scheduler: dict | None = None) -> str:
    config = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": scheduler or {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.002,
                                                                  "warmup_num_steps": 5}},
        "pipeline": {"stages": 1},
        "gpt": dict(MODEL),
        "cpsr": {"checkpoint": {"dir": run_dir, "interval": INTERVAL, "keep_last": 4}, "predictor": {"history": 3},
                 **(cpsr or {})},
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


def job(trial_dir: str, config: str, iters: int, name: str, clock_offset_s: float = 0.0) -> Child:
    return Child(os.path.join(trial_dir, f"{name}.log"), train, config, iters, clock_offset_s)


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
    latest = store.read_latest(run_dir)
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
        if store.MANIFEST_RE.match(name):
            man_path = os.path.join(tag_dir, name)
            with open(man_path) as f:
                man = json.load(f)
            if rel in man["files"]:
                hasher = new_hasher(man["checksum"])
                with open(path, "rb") as f:
                    hasher.update(f.read())
                man["files"][rel].update(size=os.path.getsize(path), digest=hasher.hexdigest())
                store.write_json_atomic(man_path, man)


def valid_tags(run_dir: str) -> list[tuple[int, str]]:
    return sorted((c.iteration, c.tag) for c in store.list_checkpoints(run_dir) if c.valid)


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
    target = (os.path.join(run_dir, store.LATEST) if damage.startswith("latest") else
              os.path.join(tag_dir, store.COMMIT) if damage.startswith("commit") else
              os.path.join(tag_dir, store.manifest_name(0)))
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
        while store.read_latest(run_dir) is None and child.poll() is None:
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
    found = {c.iteration: c for c in store.list_checkpoints(ckpt_dir)}
    if found.get(blocked) is not None and found[blocked].committed:
        raise Violation(f"checkpoint {blocked} committed although rank {rank}'s file is missing")
    latest = store.read_latest(ckpt_dir)
    if blocked < steps:
        if latest != f"global_step{steps}" or not found[steps].valid:
            raise Violation(f"latest is {latest}; the last checkpoint {steps} should be committed and valid")
    elif latest is not None and not found[store.tag_iteration(latest)].valid:
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=13, help="trials per fault")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of: " + ", ".join(FAULTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here (e.g. benchmarks/results/chaos.json)")
    p.add_argument("--out-dir", default="/tmp/cpsr-chaos")
    args = p.parse_args(argv)
    faults = args.faults.split(",")
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        p.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    if "full_disk" in faults and not can_mount():
        print("full_disk: skipped, mounting a tmpfs needs root")
        faults.remove("full_disk")
    shutil.rmtree(args.out_dir, ignore_errors=True)
    results = {name: {"trials": 0, "violations": 0, "cases": []} for name in faults}
    t_start = time.time()
    for i in range(args.trials):
        for name in faults:
            rng = random.Random(f"{args.seed}-{name}-{i}")
            trial_dir = os.path.join(args.out_dir, f"{name}-{i:03d}")
            os.makedirs(trial_dir)
            t0 = time.monotonic()
            try:
                what = globals()[f"fault_{name}"](rng, trial_dir)
                violation = None
            except (Violation, Hang) as err:
                what, violation = "", str(err)
            except Exception as err:
                what, violation = "", f"campaign error: {type(err).__name__}: {err}"
                traceback.print_exc()
            r = results[name]
            r["trials"] += 1
            r["violations"] += violation is not None
            r["cases"].append({"trial": i, "what": what, "violation": violation,
                               "seconds": round(time.monotonic() - t0, 1)})
            print(f"{name:<13} {i:3d} {'VIOLATION: ' + violation if violation else 'ok: ' + what}", flush=True)
            if violation is None:
                shutil.rmtree(trial_dir, ignore_errors=True)
    seconds = time.time() - t_start
    print(f"\n{'fault':<14}{'trials':>7}{'violations':>12}")
    for name, r in results.items():
        print(f"{name:<14}{r['trials']:>7}{r['violations']:>12}")
    total_trials = sum(r["trials"] for r in results.values())
    total_violations = sum(r["violations"] for r in results.values())
    print(f"{'all':<14}{total_trials:>7}{total_violations:>12}   ({seconds:.0f} s)")
    if args.json:
        out = {"trials": {k: r["trials"] for k, r in results.items()},
               "violations": {k: r["violations"] for k, r in results.items()},
               "total_trials": total_trials, "total_violations": total_violations,
               "seconds": round(seconds), "seed": args.seed,
               "command": "python benchmarks/chaos.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "cases": {k: r["cases"] for k, r in results.items()}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if total_violations else 0


if __name__ == "__main__":
    sys.exit(main())
