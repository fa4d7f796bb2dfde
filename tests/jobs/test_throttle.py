"""checkpoint.write_mbps: the storage write-rate limit, per process, waited on in the writer thread only."""

import os
import threading
import time

import pytest
import torch

from cpsr_ds.checkpoint.storage import records
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.checkpoint.engines import throttle
from cpsr_ds.checkpoint.engines.throttle import MB, Throttle
from cpsr_ds.config import CPSRConfig, ConfigError
from support.checkpoints import checkpoint, engines, states  # noqa: F401 (a fixture)


RATE_MBPS = 2.0
FLOATS = 1_000_000  # the optimizer file: 4 MB, 2 s at RATE_MBPS


class FakeClock:
    """Time that passes only by sleeping."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_bucket_passes_bytes_at_the_rate_after_one_burst():
    clock = FakeClock()
    bucket = Throttle(1e6, clock=clock, sleep=clock.sleep)
    assert bucket.burst == 50_000
    for _ in range(100):
        bucket.take(50_000)
    assert clock.now == pytest.approx(5.0 - 0.05)
    clock.now += 10.0  # idle time fills the bucket up to one burst only
    bucket.take(150_000)
    assert clock.now == pytest.approx(15.0 - 0.05 + 0.1)


def test_threads_share_one_rate():
    bucket = Throttle(4 * MB)
    start = time.perf_counter()
    writers = [threading.Thread(target=lambda: [bucket.take(100_000) for _ in range(10)]) for _ in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    assert time.perf_counter() - start >= 0.9 * 4e6 / (4 * MB)


def test_one_throttle_per_process_and_rate():
    assert throttle.shared(None) is None
    assert throttle.shared(3.5) is throttle.shared(3.5) is not throttle.shared(7.0)
    assert throttle.shared(3.5).bytes_per_s == 3.5e6


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "fast"])
def test_write_mbps_must_be_a_positive_finite_number(value):
    with pytest.raises(ConfigError, match="cpsr.checkpoint.write_mbps"):
        CPSRConfig.parse_block({"checkpoint": {"write_mbps": value}})
    assert CPSRConfig.parse_block({"checkpoint": {"write_mbps": 250}}).checkpoint.write_mbps == 250.0
    assert CPSRConfig.parse_block({}).checkpoint.write_mbps is None


def test_write_atomic_keeps_the_bytes_and_the_rate(tmp_path):
    data = os.urandom(1_500_001)  # not whole pages: the last piece goes buffered
    path = str(tmp_path / "f")
    start = time.perf_counter()
    size, digest = fs.write_atomic(path, [data], "xxh3_64", direct=True, throttle=Throttle(1 * MB))
    elapsed = time.perf_counter() - start
    assert size == len(data) and open(path, "rb").read() == data
    assert digest == fs.write_atomic(str(tmp_path / "g"), [data], "xxh3_64")[1]
    assert 0.9 * 1.5 <= elapsed < 1.5 * 3 + 2


def written_bytes(d: str, tag: str) -> int:
    return sum(entry["size"] for man in records.read_manifests(os.path.join(d, tag)).values()
               for entry in man["files"].values())


def persist_timed(eng, d: str, step: int) -> tuple[float, float, int]:
    """(seconds in create/save/commit, seconds until committed, bytes written) of one checkpoint."""
    st = states(n=FLOATS)
    start = time.perf_counter()
    tag = checkpoint(eng, d, step, st)
    training = time.perf_counter() - start
    assert eng.flush(60.0)
    return training, time.perf_counter() - start, written_bytes(d, tag)


@pytest.mark.parametrize("strategy", ["checkfreq", "pccheck", "cpsr"])
def test_the_writer_persists_at_write_mbps_while_training_goes_on(tmp_path, engines, strategy):  # noqa: F811
    d = str(tmp_path)
    eng = engines(d, strategy=strategy, write_mbps=RATE_MBPS)
    training, persisted, nbytes = persist_timed(eng, d, 1)
    expected = nbytes / (RATE_MBPS * MB)
    assert expected >= 2.0
    assert 0.9 * expected <= persisted < 2 * expected + 3
    assert training < 0.25 * expected, "create, save and commit waited for the throttled writer"
    assert records.read_latest(d) == "global_step1"
    if strategy != "cpsr":  # pccheck's two checkpoints in flight share the rate: no more often than one is written
        assert eng.interval(expected / 10) >= 10


def test_checkpoints_persisting_at_once_share_the_rate(tmp_path, engines):  # noqa: F811
    """Two engines of one process (a pccheck and a cpsr job's, each writing its own directory) at once."""
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    engs = [engines(dirs[0], strategy="pccheck", write_mbps=RATE_MBPS),
            engines(dirs[1], strategy="cpsr", write_mbps=RATE_MBPS)]
    start = time.perf_counter()
    tags = [checkpoint(eng, d, 1, states(n=FLOATS)) for eng, d in zip(engs, dirs)]
    assert all(eng.flush(60.0) for eng in engs)
    elapsed = time.perf_counter() - start
    expected = sum(written_bytes(d, tag) for d, tag in zip(dirs, tags)) / (RATE_MBPS * MB)
    assert 0.9 * expected <= elapsed < 2 * expected + 3


def test_null_write_mbps_is_unlimited(tmp_path, engines):  # noqa: F811
    d = str(tmp_path)
    eng = engines(d, strategy="cpsr", write_mbps=None)
    _, persisted, nbytes = persist_timed(eng, d, 1)
    assert persisted < 0.5 * nbytes / (RATE_MBPS * MB)


def test_the_torch_engine_writes_at_write_mbps(tmp_path, engines):  # noqa: F811
    """Its writes are synchronous: save() itself takes the time the rate allows."""
    d = str(tmp_path)
    eng = engines(d, strategy="torch", write_mbps=RATE_MBPS)
    st = {"model": {"w": torch.randn(FLOATS)}, "optim": {"fp32": torch.randn(FLOATS // 2)}}
    start = time.perf_counter()
    tag = checkpoint(eng, d, 1, st)
    elapsed = time.perf_counter() - start
    expected = written_bytes(d, tag) / (RATE_MBPS * MB)
    assert 0.9 * expected <= elapsed < 2 * expected + 3
    assert records.read_latest(d) == tag
