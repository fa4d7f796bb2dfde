"""The asynchronous checkpoint engine: round trips, buffers, non-finite state, failing storage, SIGKILLs."""

import errno
import json
import logging
import math
import os
import random
import signal
import subprocess
import threading
import time

import pytest
import torch
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from cpsr_ds.checkpoint.storage import catalog, ondisk, records
from cpsr_ds.checkpoint.storage.filesystem import describe_error
from cpsr_ds.checkpoint.engines.checkfreq import CheckFreqEngine
from cpsr_ds.checkpoint.engines.factory import create_engine
from cpsr_ds.checkpoint.storage.fileformat import CheckpointError
from cpsr_ds.checkpoint.engines.snapshot import HostBuffers, snapshot_file
from support.checkpoints import (MODEL, assert_same, checkpoint, config, engines, hung_storage,  # noqa: F401 (fixtures)
                                 nested_state, optim, states)


@pytest.mark.parametrize("strategy", ["checkfreq", "pccheck", "cpsr"])
def test_round_trip_through_save_commit_load(tmp_path, engines, strategy):
    d = str(tmp_path)
    eng = engines(d, strategy=strategy)
    assert eng.is_decoupled() and not eng.preserves_storage_sharing()
    st = states()
    tag = checkpoint(eng, d, 3, st)
    assert eng.flush(30)
    assert records.read_latest(d) == tag == catalog.select_checkpoint(d)
    assert_same(eng.load(os.path.join(d, tag, MODEL), map_location=torch.device("cpu")), st["model"])
    assert_same(eng.load(os.path.join(d, tag, optim(0))), st["optim"])


def test_save_captures_state_at_save_time(tmp_path, engines):
    d = str(tmp_path)
    eng = engines(d)
    st = states()
    expected = st["optim"]["fp32"].clone()
    tag = checkpoint(eng, d, 1, st)
    st["optim"]["fp32"].add_(1.0)  # the optimizer step after commit
    st["optim"]["step"] = 8
    assert eng.flush(30)
    got = eng.load(os.path.join(d, tag, optim(0)))
    assert torch.equal(got["fp32"], expected) and got["step"] == 7


def test_buffers_are_reused_for_same_shapes(tmp_path, engines):
    d = str(tmp_path)
    eng = engines(d, strategy="checkfreq")
    assert isinstance(eng, CheckFreqEngine)
    st = states()
    checkpoint(eng, d, 1, st)
    eng.flush(30)
    (buffers,) = eng._pool._free
    first = {k: v.data_ptr() for k, v in buffers._arenas.items()}
    for step in (2, 3):
        checkpoint(eng, d, step, states())
        eng.flush(30)
    assert buffers.allocations == 2
    assert {k: v.data_ptr() for k, v in buffers._arenas.items()} == first


def test_latest_moves_only_when_every_rank_is_durable(tmp_path, engines):
    d = str(tmp_path)
    rank0, rank1 = engines(d, 0, 2), engines(d, 1, 2)
    checkpoint(rank0, d, 1, states(), rank=0)
    checkpoint(rank1, d, 1, states(), rank=1)
    assert rank1.flush(30) and rank0.flush(30)
    assert records.read_latest(d) == "global_step1"
    checkpoint(rank0, d, 2, states(), rank=0)
    rank1.create(CheckpointCommitInfo(tag="global_step2", save_dir=d, save_latest=True))
    time.sleep(0.3)
    assert records.read_latest(d) == "global_step1"
    rank1.save(states()["optim"], os.path.join(d, "global_step2", optim(1)))
    rank1.commit(rank1.get_commit_info())
    assert rank1.flush(30) and rank0.flush(30)
    assert records.read_latest(d) == "global_step2"


def test_committed_checkpoints_beyond_keep_last_are_deleted(tmp_path, engines):
    d = str(tmp_path)
    eng = engines(d, keep_last=2)
    for step in range(1, 5):
        checkpoint(eng, d, step, states(n=100))
    assert eng.flush(30)
    assert sorted(os.listdir(d)) == ["global_step3", "global_step4", "latest"]


def test_load_refuses_a_corrupt_or_unlisted_file(tmp_path, engines):
    d = str(tmp_path)
    eng = engines(d)
    tag = checkpoint(eng, d, 1, states())
    assert eng.flush(30)
    path = os.path.join(d, tag, optim(0))
    with open(path, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"garbage!")
    with pytest.raises(CheckpointError, match=optim(0) + ": checksum mismatch"):
        eng.load(path)
    torch.save({}, os.path.join(d, tag, "stray.pt"))
    with pytest.raises(CheckpointError, match="stray.pt: listed in no rank manifest"):
        eng.load(os.path.join(d, tag, "stray.pt"))


def test_checkpoint_of_deepspeeds_torch_engine_loads(tmp_path, engines):
    d = str(tmp_path)
    torch_engine = create_engine(config(d, strategy="torch"), 0, 1)
    assert isinstance(torch_engine, TorchCheckpointEngine)
    st = states()
    os.makedirs(os.path.join(d, "global_step5"))
    torch_engine.save(st["model"], os.path.join(d, "global_step5", MODEL))
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("global_step5")
    assert catalog.select_checkpoint(d) == "global_step5"
    assert_same(engines(d).load(os.path.join(d, "global_step5", MODEL)), st["model"])


def test_profiled_interval_follows_measured_costs(tmp_path, engines):
    d = str(tmp_path)
    eng = engines(d, strategy="checkfreq", interval=17)
    assert eng.interval(0.5) == 17
    checkpoint(eng, d, 1, states())
    eng.flush(30)
    assert eng.stats.last_stall_s > 0 and eng.stats.last_persist_s > 0
    assert eng.interval(1e-6) > 17
    assert engines(d, strategy="cpsr", interval=17).interval(1e-6) == 17


@pytest.mark.parametrize("strategy", ["torch", "checkfreq", "pccheck"])
def test_with_interval_auto_the_budget_rule_starts_once_a_checkpoint_is_measured(tmp_path, engines, strategy):
    d = str(tmp_path)
    eng = engines(d, strategy=strategy, interval="auto", overhead_budget=0.5)
    assert eng.interval(0.5) is None and eng.stats.outcome("global_step1") is None
    tag = checkpoint(eng, d, 1, states())
    if strategy != "torch":  # torch's save is durable when commit returns
        assert eng.flush(30)
    nbytes, persist_s = eng.stats.outcome(tag)
    assert nbytes > 0 and eng.stats.last_stall_s > 0
    assert (persist_s == 0) == (strategy == "torch")
    # The stall within half of the iteration time: a stall of 100 iterations needs 200 between checkpoints.
    assert eng.interval(eng.stats.last_stall_s / 100) >= 200
    assert engines(d, strategy="cpsr", interval="auto").interval(1.0) is None


@pytest.mark.parametrize("strategy", ["checkfreq", "pccheck", "cpsr"])
def test_records_carry_iteration_and_attempt(tmp_path, engines, strategy):
    d = str(tmp_path)
    eng = engines(d, keywords={"attempt": 3, "min_keep": 2}, strategy=strategy)
    tag = checkpoint(eng, d, 20, states())
    assert eng.flush(30) and records.read_latest(d) == tag
    for name in (ondisk.manifest_name(0), ondisk.COMMIT):
        with open(os.path.join(d, tag, name)) as f:
            record = json.load(f)
        assert (record["iteration"], record["attempt"]) == (20, 3), name


# ---------------------------------------------------------------- non-finite state

def test_snapshot_names_its_nonfinite_tensors_by_key_path():
    state = nested_state()
    state["module"]["w"][2, 3] = math.inf
    state["optimizer"]["state"][0]["exp_avg"][1] = math.nan
    state["pair"][0][0, 1] = -math.inf
    snap = snapshot_file("f.pt", state, HostBuffers(pin=False), None)
    snap.copy(None)
    assert snap.nonfinite() == ["module.w", "optimizer.state.0.exp_avg", "pair.0"]
    clean = snapshot_file("g.pt", nested_state(), HostBuffers(pin=False), None)
    clean.copy(None)
    assert clean.nonfinite() == []


def test_checkpoint_with_a_nonfinite_tensor_is_never_committed(tmp_path, engines, caplog):
    d = str(tmp_path)
    rank0, rank1 = engines(d, 0, 2), engines(d, 1, 2)

    def both(step, rank1_state):
        checkpoint(rank0, d, step, states(), rank=0)
        checkpoint(rank1, d, step, rank1_state, rank=1)
        assert rank1.flush(30) and rank0.flush(30)

    both(1, states())
    poisoned = states()
    poisoned["optim"]["fp32"][123] = math.nan
    with caplog.at_level(logging.ERROR):
        both(2, poisoned)
    assert records.read_latest(d) == "global_step1"
    assert not os.path.exists(os.path.join(d, "global_step2"))
    assert "global_step2" in caplog.text and f"{optim(1)}: fp32" in caplog.text
    both(3, states())
    assert records.read_latest(d) == "global_step3"


# ---------------------------------------------------------------- storage failures

@pytest.fixture
def failing_storage(monkeypatch):
    """Make writes into one directory fail with a chosen errno, counting the attempts."""
    real_write, real_open = os.write, os.open
    state = {"dir": None, "errno": None, "attempts": 0}

    def inside(path):
        return state["errno"] is not None and os.path.abspath(path).startswith(state["dir"])

    def write(fd, data):
        if state["errno"] == errno.ENOSPC and inside(os.readlink(f"/proc/self/fd/{fd}")):
            state["attempts"] += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    def open_(path, flags, *args, **kw):
        if state["errno"] == errno.EACCES and flags & os.O_WRONLY and inside(path):
            state["attempts"] += 1
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "open", open_)
    return state


@pytest.mark.parametrize("code,cause", [(errno.ENOSPC, "ENOSPC No space left on device"),
                                        (errno.EACCES, "EACCES Permission denied")])
def test_storage_failure_does_not_stop_training_and_keeps_latest(tmp_path, engines, failing_storage, caplog,
                                                                 code, cause):
    d = str(tmp_path)
    eng = engines(d)
    checkpoint(eng, d, 1, states())
    assert eng.flush(30) and records.read_latest(d) == "global_step1"
    failing_storage.update(dir=d, errno=code)
    with caplog.at_level(logging.WARNING):
        checkpoint(eng, d, 2, states())  # must not raise on the training side
        assert eng.flush(30)
    assert failing_storage["attempts"] == 3  # first try + 2 retries
    assert "retrying" in caplog.text and cause in caplog.text and "giving up" in caplog.text
    assert records.read_latest(d) == "global_step1" == catalog.select_checkpoint(d)
    assert eng.stats.failed == 1
    failing_storage.update(errno=None)
    checkpoint(eng, d, 3, states())
    assert eng.flush(30) and records.read_latest(d) == "global_step3"


def checkpoints_timed(eng, d, steps, st):
    """Checkpoint at each of ``steps`` as a training loop does; returns the seconds each spent in the engine."""
    took = []
    for step in steps:
        t0 = time.perf_counter()
        checkpoint(eng, d, step, st)
        took.append(time.perf_counter() - t0)
        time.sleep(0.05)  # the iteration
    return took


def test_failing_storage_never_blocks_training_and_frees_space(tmp_path, engines, failing_storage, caplog):
    d = str(tmp_path)
    eng = engines(d, keywords={"min_keep": 1}, keep_last=10, retry_backoff_s=0.5)
    for step in (1, 2, 3):
        checkpoint(eng, d, step, states())
    assert eng.flush(30) and records.read_latest(d) == "global_step3"
    failing_storage.update(dir=d, errno=errno.ENOSPC)
    with caplog.at_level(logging.WARNING):
        took = checkpoints_timed(eng, d, range(4, 10), states())
        assert eng.flush(30)
    # Each failed checkpoint backs off 0.5 + 1.0 s before it is given up.
    assert max(took) < 0.1, took
    assert eng.stats.skipped >= 1 and eng.stats.skipped + eng.stats.failed == 6
    assert "skipped" in caplog.text
    assert "deleted global_step1, global_step2 to free space" in caplog.text
    assert sorted(os.listdir(d)) == ["global_step3", "latest"]
    failing_storage.update(errno=None)
    checkpoint(eng, d, 10, states())
    assert eng.flush(30) and records.read_latest(d) == "global_step10"


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs, a disk that really fills up (needs the right to mount)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield str(disk)
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_full_disk_frees_old_checkpoints_and_goes_on(small_disk, engines, caplog):
    d = small_disk
    eng = engines(d, keywords={"min_keep": 2}, keep_last=10, retry_backoff_s=0.2)
    st = states(n=300_000)  # 1.2 MB a checkpoint: six fit
    with caplog.at_level(logging.WARNING):
        took = checkpoints_timed(eng, d, range(1, 16), st)
        assert eng.flush(30)
    assert max(took) < 0.1, took
    assert "to free space" in caplog.text
    checkpoint(eng, d, 16, st)
    assert eng.flush(30) and records.read_latest(d) == "global_step16"
    found = catalog.list_checkpoints(d)
    assert len(found) >= 2 and all(c.valid for c in found), [(c.tag, c.problems) for c in found]


# ---------------------------------------------------------------- one rank gives up

def test_describe_error_names_both_paths_of_a_rename():
    err = OSError(errno.EISDIR, "Is a directory", "/ckpt/t/.f.tmp7", None, "/ckpt/t/f")
    assert describe_error(err) == "EISDIR Is a directory: /ckpt/t/.f.tmp7 -> /ckpt/t/f"


def test_a_rank_that_gives_up_tells_the_committer_at_once(tmp_path, engines, caplog):
    d = str(tmp_path)
    rank0, rank1 = engines(d, 0, 2, commit_timeout_s=600.0), engines(d, 1, 2, commit_timeout_s=600.0)

    def both(step):
        checkpoint(rank0, d, step, states(), rank=0)
        # Rank 0's part is on storage before rank 1 starts, as when rank 1's storage is the slow one.
        manifest = os.path.join(d, f"global_step{step}", ondisk.manifest_name(0))
        deadline = time.monotonic() + 10
        while not os.path.exists(manifest) and time.monotonic() < deadline:
            time.sleep(0.01)
        checkpoint(rank1, d, step, states(), rank=1)
        return rank1.flush(10) and rank0.flush(10)

    assert both(5)
    blocked = os.path.join(d, "global_step10", optim(1))
    os.makedirs(blocked)  # only rank 1's rename fails
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR):
        assert both(10)
    assert time.monotonic() - t0 < 5
    assert "rank 1" in caplog.text and f"-> {blocked}" in caplog.text
    assert records.read_latest(d) == "global_step5"
    assert not os.path.exists(os.path.join(d, "global_step10"))
    assert both(15) and records.read_latest(d) == "global_step15"


def test_cleanup_waits_for_hung_storage_at_most_commit_timeout_s(tmp_path, engines, hung_storage, caplog):
    d = str(tmp_path)
    eng = engines(d, commit_timeout_s=0.5)
    hung_storage()
    checkpoint(eng, d, 1, states())
    closing = threading.Thread(target=eng.cleanup, daemon=True)
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR):
        closing.start()
        closing.join(10)
    took = time.monotonic() - t0
    assert not closing.is_alive() and took < 5
    assert "global_step1" in caplog.text and "abandoned" in caplog.text


def test_another_thread_waits_for_the_checkpoints_in_flight_without_sealing_the_open_one(tmp_path, engines,
                                                                                         hung_storage):
    d = str(tmp_path)
    eng = engines(d, strategy="pccheck")  # two in flight: the next checkpoint opens while the first persists
    release = hung_storage()
    checkpoint(eng, d, 1, states())
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(eng.wait_persisted(timeout_s=30)), daemon=True)
    waiter.start()
    assert not eng.wait_persisted(timeout_s=0.05)  # the persist hangs
    # The training loop opens the next checkpoint meanwhile: the waiting thread leaves it open.
    eng.create(CheckpointCommitInfo(tag="global_step2", save_dir=d, save_latest=True))
    assert eng._job is not None and waiter.is_alive()
    release()
    waiter.join(30)
    assert waited == [True] and eng._job is not None


# ---------------------------------------------------------------- SIGKILL during persist

def _persist_forever(d, seed, strategy):
    """Child process: two ranks checkpointing as fast as they can, until killed."""
    # OpenMP's thread pools do not survive fork(): a parallel op here could abort the child.
    torch.set_num_threads(1)
    random.seed(seed)
    cfg = config(d, keep_last=2, chunk_mb=1, max_in_flight=2, strategy=strategy)
    rank0 = create_engine(cfg, 0, 2)
    rank1 = create_engine(cfg, 1, 2)
    step = int(time.time() * 1000) % 10**9  # later runs continue with larger tags
    while True:
        step += 1
        st = states(n=random.choice([10_000, 300_000, 1_000_000]))
        checkpoint(rank0, d, step, st, rank=0)
        checkpoint(rank1, d, step, st, rank=1)


# cpsr persists one checkpoint at a time; pccheck keeps several in flight, overlapping copy and write.
@pytest.mark.parametrize("strategy", ["cpsr", "pccheck"])
def test_sigkill_at_random_points_never_leaves_latest_invalid(tmp_path, strategy):
    d = str(tmp_path)
    rng = random.Random(1234)
    committed = set()
    deadline = time.monotonic() + 15
    kills = 0
    while time.monotonic() < deadline and kills < 40:
        pid = os.fork()
        if pid == 0:
            try:
                _persist_forever(d, kills, strategy)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        kills += 1
        latest = records.read_latest(d)
        if latest is None:
            continue
        found = {c.tag: c for c in catalog.list_checkpoints(d)}
        assert latest in found, f"latest names {latest}, which is gone"
        assert found[latest].valid, f"latest {latest} invalid after kill {kills}: {found[latest].problems}"
        committed.add(latest)
    assert kills >= 10
    assert len(committed) >= 3, "kills should land after some commits, too"
